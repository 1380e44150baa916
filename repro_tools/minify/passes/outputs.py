"""Output pruning: keep a smaller set of outputs (nodes feeding only dropped outputs die with them)."""

from __future__ import annotations

from dataclasses import replace

from repro_tools.minify.reducer import Reducer

__all__ = ["prune_outputs"]


def prune_outputs(r: Reducer) -> bool:
    outs = list(r.view.outputs_of(r.current))
    progress, parts = False, 2
    while len(outs) > 1:
        step = -(-len(outs) // parts)
        chunks = [outs[i:i + step] for i in range(0, len(outs), step)]
        for chunk in chunks:
            if r.consider(replace(r.current, outputs=tuple(chunk))):
                outs, parts, progress = list(r.view.outputs_of(r.current)), 2, True
                break
        else:
            if parts >= len(outs):
                break
            parts = min(len(outs), parts * 2)
    return progress
