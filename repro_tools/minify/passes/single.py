"""Single-node removal: try dropping each node alone (sinks first) until none can go: 1-minimal."""

from __future__ import annotations


from repro_tools.minify.reducer import Reducer

__all__ = ["remove_single_nodes"]


def remove_single_nodes(r: Reducer) -> bool:
    progress = False
    for name in sorted(r.current.keep, key=r.view.order.__getitem__, reverse=True):
        if name not in r.current.keep or len(r.current.keep) == 1:
            continue
        if r.consider(r.view.without(r.current, {name})):
            progress = True
    return progress
