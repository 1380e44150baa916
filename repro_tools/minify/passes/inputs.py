"""Input consolidation: placeholders that hold identical tensors become one placeholder."""

from __future__ import annotations

from dataclasses import replace

from repro_tools.minify.reducer import Reducer

__all__ = ["consolidate_inputs"]


def consolidate_inputs(r: Reducer) -> bool:
    if r.current.merge_inputs:
        return False
    merged = replace(r.current, merge_inputs=True)
    if r.view.size(merged) >= r.view.size(r.current):
        return False  # no duplicates: nothing to ask
    return r.consider(merged) and r.current.merge_inputs
