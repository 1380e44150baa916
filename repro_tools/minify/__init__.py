"""The minifier: localize, then shrink a failing graph to a minimal repro.

:mod:`.minifier` (the driver), :mod:`.reducer` (current candidate, cache, budget),
:mod:`.passes` (one file per pass), :mod:`.subgraph` (candidates), :mod:`.oracles`
("does it still fail the same way?"), :mod:`.isolate` (oracle queries in a worker
process), :mod:`.repro_files` (its repro files and the oracle they describe), :mod:`.compilers`
(the compiler under test), :mod:`.accuracy` (``same()``),
:mod:`.inductor_values` (per-node compiled values) and :mod:`.analyze` (where inside a
repro's graph it goes wrong).  The command line is :mod:`repro_tools.cli.minify`.
"""

from repro_tools.minify.minifier import MinifyResult, minify, minify_repro
from repro_tools.minify.oracles import OracleSpec

__all__ = ["minify", "minify_repro", "MinifyResult", "OracleSpec"]
