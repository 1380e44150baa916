"""Minifier passes: plain functions ``pass(reducer) -> bool`` (True when the candidate shrank).

One small file per kind of pass; each proposes candidates only through
:meth:`repro_tools.minify.reducer.Reducer.consider`, so the cache and the budget apply.

* :func:`localize_from_buffers` -- the same from the input check's own compile (inductor buffers);
* :func:`localize_culprit` -- one instrumented run, the first node with local error, its cut;
* :func:`truncate_suffix` -- binary search for the shortest failing prefix;
* :func:`prune_outputs` -- keep fewer outputs (dead code goes with them);
* :func:`remove_nodes_probdd` -- probabilistic delta debugging over nodes;
* :func:`consolidate_inputs` -- merge placeholders holding identical tensors;
* :func:`remove_single_nodes` -- one node at a time, for a 1-minimal result.
"""

from repro_tools.minify.passes.ddmin import remove_nodes_probdd
from repro_tools.minify.passes.inputs import consolidate_inputs
from repro_tools.minify.passes.localize import localize_culprit
from repro_tools.minify.passes.outputs import prune_outputs
from repro_tools.minify.passes.kernel_regions import localize_from_buffers
from repro_tools.minify.passes.single import remove_single_nodes
from repro_tools.minify.passes.truncate import truncate_suffix

__all__ = ["localize_from_buffers", "localize_culprit", "truncate_suffix", "prune_outputs", "remove_nodes_probdd", "consolidate_inputs",
           "remove_single_nodes", "FALLBACK"]

FALLBACK = (truncate_suffix, prune_outputs, remove_nodes_probdd, consolidate_inputs)
"""The general reducer, in order, for failures localization cannot see."""
