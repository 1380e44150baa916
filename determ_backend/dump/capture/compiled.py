"""The FX nodes of compiled graphs in a dump, from the determ backends' trace records.

While a dump is on, :class:`CompiledGraphs` listens to every batch of trace
records the determ backends write (:func:`determ_backend.backends.run.subscribe`; one
batch per compiled graph call, forward or backward) and writes one entry per
computed FX node into the dump, named after the region call it ran in
(:mod:`.regions`)::

    Compiled_Net_0.aot_forward.addmm_forward
    Compiled_Net_0.aot_backward.mm_1_backward
    Compiled_Net_0.graph1.aot_forward.relu_forward   (the region's second graph)

An entry has the node's op, source line, its output (``output``) and the tensors
it consumed (``input.0``...; parameters marked ``param``, views followed to the
tensor they view), each with the backend's fingerprint and statistics -- so
the compare's root-cause rule applies to nodes as to API calls -- plus
``region`` and ``fx`` (graph, stage, call, node, kind) for pairing
(:mod:`.compiled_compare`).  In tensor mode the node tensors are copied into
the dump when the backend stored them (``options={"save_tensors": True}`` or
``DETERM_SAVE_TENSORS=1``); otherwise they compare by fingerprint and
statistics.  In overflow-check mode only nodes whose output holds nan/inf while
their inputs are finite are written.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from determ_backend.compare.verdict import is_float
from determ_backend.trace.store import TensorStore
from determ_backend.trace.stream import Record, is_module_place
from determ_backend.dump.capture.apis import ApiInfo
from determ_backend.dump.capture.hooks import ApiRecorder, busy, guard
from determ_backend.dump.capture.regions import RegionCall, Regions

__all__ = ["CompiledGraphs", "node_direction"]

log = logging.getLogger(__name__)

_NODE_KINDS = ("node",)
_FP_CACHE = 4096


def node_direction(stage: str) -> str:
    return "backward" if stage.endswith("backward") else "forward"


def _run_dir(run_id: Optional[str], rank: int) -> Optional[Path]:
    """The output directory of the determ run that wrote a record (where its tensors are stored)."""
    from determ_backend.backends.run import find_run

    found = find_run(run_id, rank) if run_id is not None else None
    return found.dir if found is not None else None


def _is_literal(name: str) -> bool:
    try:
        ast.literal_eval(name)
    except (ValueError, SyntaxError):
        return False
    return True


def _nonfinite(r: Record) -> bool:
    st = r.stats or {}
    return any(st.get(k, 0) is None or (st.get(k) or 0) > 0 for k in ("nan", "inf"))


class CompiledGraphs:
    """Record listener of one dump: trace records of compiled graphs -> dump entries."""

    def __init__(self, recorder: ApiRecorder, regions: Regions):
        self.rec, self.regions = recorder, regions
        self._fps: Dict[str, Any] = {}
        self._warned = False

    def __call__(self, records: List[Record]) -> None:
        rec = self.rec
        if not records or busy() or not rec.active or rec.session.closed:
            return
        with guard():
            self._batch(records)

    # ---- one graph call -------------------------------------------------------------------------
    def _region(self, r0: Record, direction: str) -> Optional[RegionCall]:
        if direction == "forward":
            region = self.regions.current()
            if region is not None:
                self.regions.by_graph[r0.graph] = region
            return region
        return self.regions.by_graph.get(r0.graph)

    def _batch(self, records: List[Record]) -> None:
        r0 = records[0]
        direction = node_direction(r0.stage)
        region = self._region(r0, direction)
        if region is not None:
            prefix, index, call = region.graph_prefix(r0.graph, r0.stage)
            region_call = region.call
        else:  # a compiled graph run outside any region (another thread): its entries stand alone
            region_call, index, call = f"Compiled_{r0.graph}_{r0.call}", 0, 0
            prefix = f"{region_call}.{r0.stage}"
        by_name = {r.node: r for r in records}
        # a node whose own line is inside torch (nn.Sequential, nn.Linear...) gets the user line that called the
        # region, as an eager API call inside such a module gets the user line that called the module
        call_site = region.source if region is not None else None
        written = 0
        for r in records:
            if r.kind not in _NODE_KINDS:
                continue
            name = f"{prefix}.{r.node}"
            if self.rec.overflow is not None:
                if not self._overflows(r, by_name):
                    continue
            elif not self._selected(name, r, region_call, direction):
                continue
            entry = self._entry(r, by_name, name, region_call, direction, index, call)
            if "source" not in entry and call_site:
                entry["source"] = call_site
            if self.rec.overflow is not None:
                self._write_overflow(entry)
            else:
                self.rec.session.write(entry)
                written += 1
        if region is not None:
            region.nodes[direction] += written

    def _selected(self, name: str, r: Record, region_call: str, direction: str) -> bool:
        info = ApiInfo("Compiled", r.op.split(".")[1] if r.op.startswith("aten.") else r.op)
        return self.rec.selector.select_node(name, region_call, info, direction)

    def _overflows(self, r: Record, by_name: Dict[str, Record]) -> bool:
        """Overflow check: does the node's output hold nan/inf while its inputs are finite?"""
        if not self.rec.overflow.enabled or not _nonfinite(r):
            return False
        return not any(isinstance(s, str) or _nonfinite(s) for s in self._sources(r, by_name))

    def _write_overflow(self, entry: Dict[str, Any]) -> None:
        ovf, source = self.rec.overflow, entry.get("source")
        entry["overflow"] = ovf.count + 1
        self.rec.session.write(entry)
        log.warning("overflow: %s produced nan/inf from finite inputs (at %s)", entry["name"], source or "?")
        if ovf.hit(entry["name"], source):
            ovf.enabled = False
            self.rec.session.close()
            raise ovf.stop_error(entry["name"], source, self.rec.session.index_path)

    # ---- entries --------------------------------------------------------------------------------
    def _sources(self, r: Record, by_name: Dict[str, Record]) -> List[Union[Record, str]]:
        """The records whose data ``r`` consumed, views followed to the tensor they view, in order; the name of
        an input no record stands for (an inductor buffer the planner could not attribute) instead of its
        record; literal arguments (``False``, ``2``) are left out."""
        out: List[Union[Record, str]] = []
        todo = list(reversed(r.inputs))
        seen = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            src = by_name.get(name)
            if src is None:
                if not _is_literal(name):
                    out.append(name)
            elif src.kind == "view":
                todo.extend(reversed(src.inputs))
            else:
                out.append(src)
        return out

    def _entry(self, r: Record, by_name: Dict[str, Record], name: str, region_call: str, direction: str,
               index: int, call: int) -> Dict[str, Any]:
        keeps = self.rec.settings.keeps
        outs = [d for d in [self._tensor(r, "output")] if d is not None] if keeps("output") else []
        ins: List[Dict[str, Any]] = []
        if keeps("input"):
            for src in self._sources(r, by_name):
                if isinstance(src, str):  # compared as unknown: the node cannot be shown to have matching inputs
                    ins.append({"name": f"input.{len(ins)}", "node": src, "unresolved": True})
                    continue
                d = self._tensor(src, f"input.{len(ins)}", param=src.kind == "param")
                if d is not None:
                    ins.append(d)
        entry: Dict[str, Any] = {"name": f"{name}_{direction}", "op": r.op, "dir": direction}
        if r.source and not is_module_place(r.source):  # a module's place: the user's line that called the model
            entry["source"] = r.source                    # is filled in below, and the place goes in the stack
        entry["inputs"], entry["outputs"] = ins, outs
        if self.rec.settings.with_stack:
            entry["stack"] = [r.source] if r.source else []
        entry["region"] = region_call
        entry["fx"] = {"graph": r.graph, "graph_index": index, "stage": r.stage, "call": call, "node": r.node,
                       "kind": r.kind}
        return entry

    def _tensor(self, r: Record, name: str, param: bool = False) -> Optional[Dict[str, Any]]:
        if r.dtype is None or (self.rec.settings.filter_switch == "ON" and not is_float(r.dtype)):
            return None
        d: Dict[str, Any] = {"name": name, "dtype": f"torch.{r.dtype}", "shape": list(r.shape or [])}
        if param:
            d["param"] = True
        d["node"] = r.node
        if self.rec.task == "stack":
            return d
        fp = self._payload(r) if self.rec.session.tensors else None
        if fp is not None:
            d["_fp"] = fp
            return d
        if r.hash is not None:
            d["hash"] = r.hash
        if r.stats is not None:
            d["stats"] = r.stats
        return d

    def _payload(self, r: Record) -> Any:
        """The dump's fingerprint future for the tensor the backend stored for ``r`` (None if not stored)."""
        if not r.payload:
            self._warn_once()
            return None
        fp = self._fps.get(r.payload)
        if fp is None:
            root = _run_dir(r.run, r.rank)
            store = TensorStore(root / "tensors") if root is not None else None
            if store is None or r.payload not in store:
                self._warn_once()
                return None
            if len(self._fps) >= _FP_CACHE:
                self._fps.clear()
            fp = self._fps[r.payload] = self.rec.session.pipeline.tensor(store.get(r.payload))
        return fp

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("determ dump: the tensors of compiled graphs' FX nodes are not stored (compile with "
                        "options={'save_tensors': True} or set DETERM_SAVE_TENSORS=1 to compare them by value); "
                        "they are dumped with fingerprints and statistics")
