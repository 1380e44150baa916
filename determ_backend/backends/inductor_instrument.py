"""Instrumenting inductor's generated wrapper code, so every buffer a compiled
graph materializes is fingerprinted right after the kernel that writes it.

Inductor's own intermediate hooks fire only for some kernels (none on the C++
CPU backend), so we rewrite the ``call`` function of the generated Python
wrapper: after each kernel launch (``cpp_fused_*``, ``triton_*.run``,
``extern_kernels.*(..., out=buf)``, fallback ``bufN = aten.*(...)``) a call
``_determ_capture(i, bufN)`` is inserted; graph inputs are captured after the
argument unpacking and outputs before ``return``.  An output that is a variable whose
value was captured and that nothing since can have written (the planner forgets a
variable at any statement that might write it: anything but a kernel reading it) is
recorded with that capture's fingerprint (``_determ_same``) instead of being read
again -- a training graph returns its parameters and saved activations.  The kernels
themselves are untouched, so the numerics are bit-identical.

Buffers are named by the FX node whose value they hold: inductor records, for the
buffer a node was lowered to, that node as its ``origin_node``.  A buffer with no
origin node is not known to hold a node's value (the undivided sum of a ``mean``
whose 1/N is fused into its consumer, a partial reduction, an input an extern kernel
needed materialized): it is named after the node it was most likely computed for,
labelled ``extra.holds = "partial"`` (``extra.of``: that node), fingerprinted like any
other, and never judged as a node's value.
Inductor's scheduler knows each buffer's origin nodes; :func:`_torch_compat.capture_buffer_origins`
snapshots them at codegen time and we keep them in a sidecar file keyed by
the FX-graph cache key, so cache hits are named too.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import re
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat
from determ_backend.backends.extract import ancestors
from determ_backend.backends.instrument import node_source, op_name, written_inputs
from determ_backend.backends.recorder import NodeInfo, Recorder
from determ_backend.trace.stream import atomic_write_text

__all__ = ["InstrumentedCall", "instrument_compiled", "compile_with_origins", "save_origins", "load_origins"]

log = logging.getLogger(__name__)

_TRITON_DEF = re.compile(r"^(\w+) = async_compile\.triton\('\w+', '''.*?def \w+\(([^)]*)\)", re.M | re.S)
_ALLOC = re.compile(r"^(buf\d+) = (?:empty_strided_\w+|empty_strided|torch\.empty\w*)\(\((.*?)\),")
_WAIT_KERNEL = "torch.ops._c10d_functional.wait_tensor.default"
_WAIT = re.compile(rf"^({re.escape(_WAIT_KERNEL)})\((\w+)\)$")
_NOT_KERNEL = ("empty_strided", "reinterpret_tensor", "torch.empty", "alloc_from_pool", "assert_", "torch._C")


def _origins_dir() -> Path:
    return Path(_torch_compat.inductor_cache_dir()) / "determ_origins"


def save_origins(key: Optional[str], origins: Dict[str, Any]) -> None:
    if key and origins:
        atomic_write_text(_origins_dir() / f"{key}.json", json.dumps(origins))


def load_origins(key: Optional[str]) -> Dict[str, Any]:
    if not key:
        return {}
    p = _origins_dir() / f"{key}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def compile_with_origins(fx_g: fx.GraphModule, inputs, **kwargs) -> Tuple[Any, Dict[str, Any]]:
    """``compile_fx_inner`` plus each buffer's origin FX nodes: captured at codegen, or on a
    cache hit (no codegen) read from the sidecar saved with the entry."""
    sink: list = []
    with _torch_compat.capture_buffer_origins(sink):
        compiled = _torch_compat.compile_fx_inner(fx_g, inputs, **kwargs)
    _, key, _ = _torch_compat.compiled_source(compiled)
    origins: Dict[str, Any] = {}
    for o in sink:
        origins.update(o)
    if origins:
        save_origins(key, origins)
    else:
        origins = load_origins(key)
    return compiled, origins


def _split_args(s: str) -> List[str]:
    """Top-level comma split of a call's argument text."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _is_out(arg: str) -> bool:
    """``out=...``: the argument an extern kernel writes, not one it reads."""
    return arg.replace(" ", "").startswith("out=")


def _base_name(arg: str) -> Optional[str]:
    arg = arg.split("=", 1)[1].strip() if re.match(r"^\w+\s*=", arg) else arg
    m = re.match(r"^(?:reinterpret_tensor\()?([A-Za-z_]\w*)(?![\w.(])", arg.strip())
    return m.group(1) if m and m.group(1) not in ("True", "False", "None") else None


_CPP_BLOCK = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r\'\'\'", re.M)
# the entry point of a C++ kernel; a template kernel (flex attention, a GEMM) defines helpers named kernel_* before it
_CPP_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(([^)]*)\)')


def _only_read(body: str, param: str) -> bool:
    """Whether the kernel ``body`` reads ``param`` and never writes through it: every occurrence is a load,
    ``loadu(p + i)``, ``tl.load(p + i)`` or ``= p[i];`` (an ``in_out_ptr`` that a fused kernel ends up only reading,
    its store fused away: inductor's relu bug injection leaves the relu's own buffer unwritten).  Any other use (a
    store, an alias ``auto out_ptr0 = in_out_ptr0;``, a call) counts as a write."""
    name = re.escape(param)
    uses = [m.start() for m in re.finditer(rf"\b{name}\b", body)]
    return bool(uses) and all(
        body[max(0, k - 8):k].endswith(("loadu(", "load(")) or
        (body[max(0, k - 2):k] == "= " and re.match(rf"{name}\[[^\]]*\]\s*;", body[k:]) is not None)
        for k in uses)


def _written_through_alias(body: str, param: str) -> bool:
    """Whether the kernel ``body`` leaves in ``param`` another buffer's value, not its own node's: the memory was lent
    to an intermediate buffer (``auto out_ptr0 = in_out_ptr0;``, a ``mean``'s undivided sum) and nothing stores into
    it directly afterwards; or the last thing stored into it directly is a reduction's raw accumulator
    (``tmp_acc0_vec.store(in_out_ptr0 + x)``, a ``var``'s undivided sum of squares)."""
    name = re.escape(param)
    stores = [(m.start(), m.group(1)) for m in re.finditer(rf"(\w+)\.store\(\s*{name}\b", body)]
    stores += [(m.start(), m.group(1)) for m in re.finditer(rf"\b{name}\[[^\]]*\]\s*=(?!=)\s*([^;]+);", body)]
    if stores:
        last = max(stores)[1].strip()
        return re.fullmatch(r"(?:static_cast<\w+>\()?tmp_acc\d+(?:_vec)?\)?", last) is not None
    return re.search(rf"=\s*{name}\s*;", body) is not None


def _kernel_outputs(src: str) -> Dict[str, Tuple[List[int], List[int], List[int]]]:
    """Kernel name -> (positions it writes, positions it only writes, positions it writes only through an alias)
    from the kernel signatures and bodies (an ``in_out_ptr`` the body only reads is no output)."""
    out: Dict[str, Tuple[List[int], List[int], List[int]]] = {}
    kernels = []  # (name, parameters as written, body)
    for m in _CPP_BLOCK.finditer(src):
        end = src.find("\'\'\')", m.end())
        block = src[m.end():end if end >= 0 else len(src)]
        entry = _CPP_ENTRY.search(block) or re.search(r"\bkernel\(([^)]*)\)", block)
        if entry is not None:
            kernels.append((m.group(1), entry.group(1), block[entry.end():]))
    for m in _TRITON_DEF.finditer(src):
        end = src.find("\'\'\')", m.end())
        kernels.append((m.group(1), m.group(2), src[m.end():end if end >= 0 else len(src)]))
    for name, params, body in kernels:
        raw = [p.strip() for p in params.split(",")]
        ps = [p.replace("*", " ").split()[-1].split(":")[0].strip() if p else "" for p in raw]
        # a template kernel names its pointers itself (``float* output``): a pointer to non-const memory is written
        named_out = [p and not p.startswith(("in_ptr", "in_out_ptr", "out_ptr")) and "*" in r and "const" not in r
                     for p, r in zip(ps, raw)]
        out[name] = ([i for i, p in enumerate(ps) if p.startswith("out_ptr") or named_out[i]
                      or (p.startswith("in_out_ptr") and not _only_read(body, p))],
                     [i for i, p in enumerate(ps) if p.startswith("out_ptr") or named_out[i]],
                     [i for i, p in enumerate(ps) if p.startswith("in_out_ptr") and _written_through_alias(body, p)])
    return out


def _call_body(src: str) -> Tuple[List[str], int, str]:
    """Lines of the wrapper's ``call`` function, their indentation, and its signature line."""
    lines = src.splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith("def call(") and stripped.rstrip().endswith(":"):
            indent = len(line) - len(stripped)
            body = [line]
            for nxt in lines[i + 1:]:
                if nxt.strip() and (len(nxt) - len(nxt.lstrip())) <= indent:
                    break
                body.append(nxt)
            return body, indent, stripped
    raise ValueError("no `def call(` in the generated wrapper")


class _Planner:
    """Walks the call body and decides what to capture where."""

    def __init__(self, gm: fx.GraphModule, origins: Dict[str, Any], kernels: Dict[str, List[int]],
                 display: Dict[str, str]):
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        self.origins, self.kernels, self.display = origins, kernels, display
        self.claimed = {o["origin"] for o in origins.values() if o.get("origin")}
        self.extern_readers: Dict[str, set] = {}  # variable -> ops of the extern/fallback kernels that read it
        self.infos: List[NodeInfo] = []
        self.writer: Dict[str, str] = {}  # variable -> record id of its current value
        self.fresh: set = set()  # variables holding freshly allocated (never written) memory
        self.base: Dict[str, str] = {}  # variable -> the allocation whose memory it views (``reinterpret_tensor``)
        # allocation -> records written into its memory through views since it was last written whole (the parts
        # of a ``cat`` that kernels write in place): a read of the allocation reads them
        self.parts: Dict[str, Dict[str, str]] = {}  # allocation -> {view variable: the record that last wrote it}
        self.scalars: set = set()  # variables holding sizes and other numbers (SymInt graph inputs): no records
        self.used: Dict[str, int] = {}
        self.pending_comment: List[str] = []
        self.fx_of: Dict[int, fx.Node] = {}  # capture index -> the FX node its buffer holds or was computed for
        self._ancestors: Dict[str, set] = {}
        # variable -> the capture point whose value it still holds, for as long as that is certain: any
        # statement that might write the variable (or its memory through another name) forgets it
        self.current: Dict[str, int] = {}
        # buffer -> the origins of the buffers that write into it in place (a copy_ into a view of a zero fill)
        self.writes_into: Dict[str, List[str]] = {}
        for m in origins.values():
            for target in m.get("mutates") or ():
                self.writes_into.setdefault(target, []).extend(m.get("origins") or ())
        self.write_count: Dict[str, int] = {}  # variable -> kernel launches of the call that write it
        self.writes_seen: Dict[str, int] = {}  # variable -> those met so far
        self.input_writers = written_inputs(gm)  # graph input -> the node whose value is written back into it

    def _unique(self, name: str) -> str:
        k = self.used.get(name, 0)
        self.used[name] = k + 1
        return name if k == 0 else f"{name}#{k}"

    def _claim(self, buf: str) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
        """``(node whose value the buffer holds, None)`` when inductor lowered that node to exactly this
        buffer (its ``origin_node``); else ``(None, node it was most likely computed for)``: a partial
        result such as the undivided sum of a ``mean`` whose division is fused into the consumer, or an
        input an extern kernel needed materialized.  The guess prefers origins no other buffer holds."""
        o = self.origins.get(buf) or {}
        writer = self.input_writers.get(buf)
        if writer is not None and self.writes_seen.get(buf, 0) == self.write_count.get(buf, 0):
            # the last launch writing graph input ``buf`` (whole, or a slice of it, an index_put into it): after it,
            # buf holds what the graph writes back into it, the value of its last in-place write
            return writer, None
        mutation = self._mutated_in_kernel(buf)
        if mutation is not None:
            return None, mutation
        if o.get("origin") in self.nodes:
            return self.nodes[o["origin"]], None
        cands = [n for n in (o.get("origins") or []) if n in self.nodes]
        # an input an extern or fallback kernel needed materialized lists that kernel's node among its origins:
        # the buffer was computed for it, not by it
        readers = self.extern_readers.get(buf, ())
        cands = [n for n in cands if not any(_is_op(op_name(self.nodes[n]), r) for r in readers)] or cands
        cands = [n for n in cands if n not in self.claimed] or cands
        if not cands:
            cands = [n for n in self.pending_comment if n in self.nodes]
        if not cands:
            return None, None
        return None, self.nodes[max(cands, key=lambda n: self.order[n])]

    def _mutated_in_kernel(self, buf: str) -> Optional[fx.Node]:
        """The node an in-place write into ``buf`` was computed for, when the launch writing ``buf`` now also does that
        write (a ``copy_`` into a view of a zero fill, lowered in place and fused with the fill: after the kernel the
        buffer holds neither the fill nor any one node's value, so it is recorded as partial): the latest of the
        write's origins the graph holds, when this is the last launch that writes ``buf`` (an earlier one wrote the
        fill alone); None when no such write exists."""
        if self.writes_seen.get(buf, 0) != self.write_count.get(buf, 0):
            return None
        cands = [n for n in self.writes_into.get(buf, ()) if n in self.nodes]
        return self.nodes[max(cands, key=lambda n: self.order[n])] if cands else None

    def resolve(self, variables: List[str]) -> tuple:
        """Record ids of the current values of ``variables`` (call before updating any writer).  A fresh
        allocation passed to an in/out argument holds no value yet, so it is no input; memory written through
        views of it (``reinterpret_tensor``) holds what those writes wrote; sizes are no inputs."""
        out: List[str] = []
        for v in variables:
            if v in self.scalars:
                continue
            got = ([self.writer[v]] if v in self.writer else []) + list(self.parts.get(v, {}).values())
            if not got and v in self.base:  # a view of memory written whole, or through other views
                b = self.base[v]
                got = ([self.writer[b]] if b in self.writer else []) + list(self.parts.get(b, {}).values())
            if not got and v not in self.fresh:
                got = [self.display.get(v, v)]
            out.extend(x for x in got if x not in out)
        return tuple(out)

    def track(self, stripped: str) -> bool:
        """Follow allocations and aliases (``bufA = bufB; del bufB``, ``reinterpret_tensor``, tuple items)
        so later reads resolve to the record that wrote the memory; True if ``stripped`` was one."""
        m = _FRESH.match(stripped)
        if m:
            self.fresh.add(m.group(1))
            self.writer.pop(m.group(1), None)
            self.current.pop(m.group(1), None)
            self.base.pop(m.group(1), None)
            self.parts.pop(m.group(1), None)
            return True
        alias = _ALIAS.match(stripped)
        m = alias or _REINTERPRET.match(stripped)
        if m and m.group(2) in self.scalars:  # ``s77 = arg0_1``: a size
            self.scalars.add(m.group(1))
            return True
        if m:
            dst, src = m.group(1), m.group(2)
            self.base[dst] = self.base.get(src, src)
            held = self.current.pop(src, None)  # the memory now has another name: keep one, the new one
            self.current.pop(dst, None)
            if held is not None and alias:  # a plain rename holds the same value; a reinterpreted view does not
                self.current[dst] = held
            if src in self.writer:
                self.writer[dst] = self.writer[src]
            elif src in self.fresh:
                self.fresh.add(dst)
            else:
                return False
            return True
        m = _ITEM.match(stripped)
        if m:
            self.current.pop(m.group(1), None)
        if m and m.group(2) in self.writer:
            self.writer[m.group(1)] = f"{self.writer[m.group(2)]}.{m.group(3)}"
            return True
        return False

    def root(self, var: str) -> str:
        return self.base.get(var, var)

    def unwritten_reads(self, writes: List[Tuple[str, str, List[str]]]) -> List[str]:
        """The variables one statement's kernels read (``writes``: :func:`_kernel_writes`) that hold memory allocated
        and never written, whole or through a view: not those whose memory the same statement writes (the parts of
        a ``cat`` that the launch which reads the whole also writes)."""
        written = {self.root(w) for w, _, _ in writes}
        found: List[str] = []
        for _, _, ins in writes:
            for v in ins:
                r = self.root(v)
                if (v in self.fresh and v not in self.writer and r not in self.writer and not self.parts.get(r)
                        and r not in written and v not in found):
                    found.append(v)
        return found

    def add(self, var: str, kernel: str, inputs: tuple, kind: str = "node", lent: bool = False) -> int:
        """A record of what ``kernel`` wrote into ``var``.  ``lent``: the kernel wrote ``var``'s memory only as
        another buffer's (:func:`_written_through_alias`), so it holds no value of the node it is named after."""
        if kind == "node":
            self.writes_seen[var] = self.writes_seen.get(var, 0) + 1
        node, part_of = self._claim(var) if kind == "node" else (None, None)
        if kernel == _WAIT_KERNEL:  # the collective's value, final once waited on: the wait node's, whole
            node, part_of = self._wait_node(var) or node, None
        if lent and node is not None:
            node, part_of = None, node
        if node is not None:
            info = NodeInfo(node=self._unique(node.name), op=op_name(node), kind=kind, source=node_source(node),
                            inputs=inputs, extra={"buffer": var, "kernel": kernel})
        elif part_of is not None:
            info = NodeInfo(node=self._unique(part_of.name), op=op_name(part_of), kind=kind,
                            source=node_source(part_of), inputs=inputs,
                            extra={"buffer": var, "kernel": kernel, "holds": "partial", "of": part_of.name})
        else:
            name = self.display.get(var, var)
            info = NodeInfo(node=self._unique(name), op=kernel, kind=kind,
                            inputs=inputs, extra={"buffer": var, "kernel": kernel, "holds": "partial"}
                            if kind == "node" else None)
        self.writer[var] = info.node
        self.parts.pop(var, None)  # written whole: what views wrote before is overwritten
        if var in self.base:  # a view written again holds its last write only
            self.parts.setdefault(self.base[var], {})[var] = info.node
        self.infos.append(info)
        if node is not None or part_of is not None:
            self.fx_of[len(self.infos) - 1] = node if node is not None else part_of
        return len(self.infos) - 1

    def _wait_node(self, buf: str) -> Optional[fx.Node]:
        """The ``wait_tensor`` node whose statement waits on ``buf``: its origin, or one its comment names."""
        names = [(self.origins.get(buf) or {}).get("origin")] + list(self.pending_comment)
        return next((self.nodes[n] for n in names if n in self.nodes and op_name(self.nodes[n]).startswith(
            "_c10d_functional.wait_tensor")), None)

    def forget(self, stripped: str, keep: Sequence[str] = ()) -> None:
        """``stripped`` may write any variable it names (other than ``keep``, read-only there): those no longer
        certainly hold their captured values, and an allocation it names is no longer known to hold nothing (an
        in-place fallback, ``aten.randint.low_out(..., out=buf1)``).  Size and alignment assertions and ``del``
        write nothing."""
        if stripped.startswith(_WRITES_NOTHING):
            return
        if self.fresh:
            self.fresh.difference_update(set(_IDENT.findall(stripped)).difference(keep))
        if not self.current:
            return
        for name in set(_IDENT.findall(stripped)).intersection(self.current):
            if name not in keep:
                del self.current[name]

    def ancestors(self, n: fx.Node) -> set:
        """Names of the FX nodes ``n`` depends on."""
        if n.name not in self._ancestors:
            self._ancestors[n.name] = ancestors(n)
        return self._ancestors[n.name]

    def producers_first(self, indices: List[int]) -> List[int]:
        """Positions in ``indices`` (the buffers one launch writes, in argument order) in an order where a buffer
        comes after the siblings its node depends on: the records then follow the graph (a consumer recorded
        before the buffer it reads took that input for one not seen yet, and the nan check named it)."""
        order = list(range(len(indices)))
        nodes = {k: self.fx_of.get(i) for k, i in enumerate(indices)}
        if sum(n is not None for n in nodes.values()) < 2:
            return order
        out: List[int] = []
        while order:
            for k in order:
                n = nodes[k]
                up = self.ancestors(n) if n is not None else set()
                if not any(nodes[j] is not None and nodes[j].name in up for j in order if j != k):
                    break
            else:  # a cycle cannot be (nodes of a graph): keep the launch's order
                return out + order
            order.remove(k)
            out.append(k)
        return out

    def link_siblings(self, indices: List[int]) -> None:
        """One kernel launch that writes several buffers computes them in one body: a buffer whose node
        depends on a sibling's node reads that sibling's value inside the kernel (a pooling fused after the
        relu it pools), although it never appears among the launch's arguments."""
        nodes = [(i, self.fx_of[i]) for i in indices if i in self.fx_of]
        for i, n in nodes:
            up = self.ancestors(n)
            extra = tuple(self.infos[j].node for j, m in nodes if j != i and m.name in up)
            if extra:
                info = self.infos[i]
                self.infos[i] = dataclasses.replace(
                    info, inputs=tuple(info.inputs) + tuple(x for x in extra if x not in info.inputs))


_COMMENT = re.compile(r"# Topologically Sorted Source Nodes: \[([^\]]*)\]")
_ALIAS = re.compile(r"^(\w+) = (\w+)(?:; del \w+.*)?$")
_REINTERPRET = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"^(\w+) = (\w+)\[(\d+)\]$")
_FRESH = re.compile(r"^(\w+) = (?:empty_strided\w*|torch\.empty\w*|alloc_from_pool)\(")


class InstrumentedCall:
    """The rewritten ``call`` plus the capture plan (NodeInfo per capture point)."""

    def __init__(self, source: str, infos: List[NodeInfo], signature: str, reused: frozenset = frozenset()):
        self.source, self.infos, self.signature = source, infos, signature
        self.reused = reused  # capture points an output reuses (``_determ_same``)


_IDENT = re.compile(r"[A-Za-z_]\w*")
_WRITES_NOTHING = ("assert_size_stride(", "assert_alignment(", "del ", "#")


def plan_call(src: str, gm: fx.GraphModule, origins: Dict[str, Any], display: Dict[str, str]) -> InstrumentedCall:
    """Rewrite the wrapper's ``call`` so it captures inputs, every kernel output and the outputs."""
    body, indent, sig = _call_body(src)
    pl = _Planner(gm, origins, _kernel_outputs(src), display)
    for line in body[1:]:
        for var, op in _extern_reads(line.strip(), pl.kernels):
            pl.extern_readers.setdefault(var, set()).add(op)
        for var, _, _ in _kernel_writes(line.strip(), pl.kernels):
            pl.write_count[var] = pl.write_count.get(var, 0) + 1
    out: List[str] = [body[0][indent:]]
    reused: set = set()
    unpacked = False
    mutated = pl.input_writers  # graph inputs the graph writes in place: their last write is a symptom
    last_write: Dict[str, int] = {}
    for line in body[1:]:
        text = line[indent:] if line.strip() else line
        stripped = line.strip()
        pad = line[: len(line) - len(line.lstrip())][indent:]
        m = _COMMENT.search(stripped)
        if m:
            pl.pending_comment = [x.strip() for x in m.group(1).split(",") if x.strip()]
        if not unpacked and re.match(r"^[\w, ]+ = args$", stripped):
            unpacked = True
            names = [n.strip() for n in stripped.split("=")[0].split(",") if n.strip()]
            out.append(text)
            out.append(f"{pad}_determ_begin()")
            pl.scalars.update(n for n in names if _holds_number(pl.nodes.get(n)))
            for n in names:
                if n in pl.scalars:
                    continue
                i = pl.add(n, "input", (), kind="param" if n in display else "input")
                out.append(f"{pad}_determ_capture({i}, {n})")
                pl.current[n] = i
            continue
        if stripped.startswith("return "):
            expr = stripped[len("return "):]
            elems = _split_args(expr.strip()[1:-1]) if expr.strip().startswith("(") else [expr]
            out.append(f"{pad}_determ_out = {expr}")
            for k, e in enumerate(elems):
                b = _base_name(e)
                if b and b != "None":
                    i = pl.add(f"output.{k}", "output", pl.resolve([b]), kind="output")
                    target = f"_determ_out[{k}]" if expr.strip().startswith("(") else "_determ_out"
                    held = pl.current.get(b) if e.strip() == b else None
                    if held is not None:  # the very value captured at `held`: its fingerprint, not a second read
                        out.append(f"{pad}_determ_same({i}, {held}, {target})")
                        reused.add(held)
                    else:
                        out.append(f"{pad}_determ_capture({i}, {target})")
            out.append(f"{pad}return _determ_out")
            continue
        out.append(text)
        if pl.track(stripped):
            continue
        writes = _kernel_writes(stripped, pl.kernels)
        # memory allocated and never written that a kernel reads holds whatever was there: recorded as it is read
        # (the determinism check then names the uninitialized read, not the kernel that consumes it)
        for v in pl.unwritten_reads(writes):
            i = pl.add(v, "uninitialized", ())
            out.insert(len(out) - 1, f"{pad}_determ_capture({i}, {v})")
            pl.fresh.discard(v)
        resolved = [pl.resolve(inputs) for _, _, inputs in writes]
        # a generated or extern kernel writes exactly its output arguments; anything else may write what it names
        pure = bool(writes) and (writes[0][1] in pl.kernels or writes[0][1].startswith("extern_kernels."))
        pl.forget(stripped, keep=[n for _, _, ins in writes for n in ins] if pure else ())
        lent = _lent_writes(stripped, pl.kernels)
        added = [pl.add(var, kernel, ins, lent=var in lent) for (var, kernel, _), ins in zip(writes, resolved)]
        for (var, _, _), i in zip(writes, added):
            if pl.root(var) in mutated:
                last_write[pl.root(var)] = i
        if len(added) > 1:
            pl.link_siblings(added)
        for k in pl.producers_first(added):
            var, i = writes[k][0], added[k]
            out.append(f"{pad}_determ_capture({i}, {var})")
            pl.current[var] = i
        if writes:
            pl.pending_comment = []
    _name_last_writes(pl.infos)
    for var, i in last_write.items():
        pl.infos[i] = dataclasses.replace(pl.infos[i], extra=dict(pl.infos[i].extra or {},
                                                                  writes_input=display.get(var, var)))
    return InstrumentedCall("\n".join(out) + "\n", pl.infos, sig, frozenset(reused))


def _holds_number(node: Optional[fx.Node]) -> bool:
    """Whether a graph input is a number (a SymInt size under dynamic shapes), not a tensor: it gets no record."""
    if node is None or node.op != "placeholder":
        return False
    val = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _name_last_writes(infos: List[NodeInfo]) -> None:
    """A buffer that several kernels write in turn holds its node's value after the last one (a zero fill, then
    an accumulation): that write gets the node's name, the earlier ones ``name#k`` labelled partial.  Inputs
    that read the buffer in between are renamed with them (they read what was there then)."""
    writes: Dict[str, List[int]] = {}
    for i, info in enumerate(infos):
        ex = info.extra or {}
        base = info.node.split("#", 1)[0]
        # a later write guessed to be part of the node the buffer was first claimed for (an embedding gradient
        # accumulated by a kernel that is not the buffer's origin node, after the zero fill that was) is that
        # node's last write too
        if info.kind == "node" and (not ex.get("holds") or (ex.get("holds") == "partial" and ex.get("of") == base
                                                            and base in writes)):
            writes.setdefault(base, []).append(i)
    rename: Dict[str, str] = {}
    for base, idx in writes.items():
        if len(idx) < 2 or infos[idx[0]].node != base or len({(infos[i].extra or {}).get("buffer") for i in idx}) != 1:
            continue
        names = [infos[i].node for i in idx]
        for k, i in enumerate(idx):
            new = base if k == len(idx) - 1 else f"{base}#{k + 1}"
            rename[names[k]] = new
            extra = dict(infos[i].extra or {})
            if new != base:
                extra.update(holds="partial", of=base)
            else:
                extra.pop("holds", None)
                extra.pop("of", None)
            infos[i] = dataclasses.replace(infos[i], node=new, extra=extra)
    if rename:
        for i, info in enumerate(infos):
            if any(x in rename for x in info.inputs):
                infos[i] = dataclasses.replace(info, inputs=tuple(rename.get(x, x) for x in info.inputs))


def _kernel_writes(stripped: str, kernels: Dict[str, Tuple[List[int], List[int]]]) -> List[Tuple[str, str, List[str]]]:
    """``[(variable written, kernel name, input variables)]`` for one statement of the call body."""
    m = re.match(r"^(\w+)(?:\.run)?\((.*)\)$", stripped)
    if m and m.group(1) in kernels:
        args = [a for a in _split_args(m.group(2)) if not re.match(r"^\w+\s*=", a)]
        writes, pure = kernels[m.group(1)][:2]
        names = [_base_name(a) for a in args]
        ins = [n for k, n in enumerate(names) if n and k not in pure and not n.isdigit()]
        return [(names[k], m.group(1), ins) for k in writes if k < len(names) and names[k]]
    m = _WAIT.match(stripped)
    if m:  # an asynchronous collective's buffer holds its value once waited on (``all_reduce_`` writes it in flight)
        return [(m.group(2), m.group(1), [m.group(2)])]
    m = re.match(r"^(buf\d+) = ([\w.]+)\((.*)\)$", stripped)
    if m and not any(m.group(2).startswith(k) for k in _NOT_KERNEL):
        # keyword tensors are inputs too (``attn_mask=buf0`` of a fallback attention); scalars name no variable
        ins = [n for n in (_base_name(a) for a in _split_args(m.group(3)) if not _is_out(a)) if n]
        return [(m.group(1), m.group(2), ins)]
    m = re.match(r"^([\w.]+)\((.*)\)$", stripped)
    if m and not any(m.group(1).startswith(k) for k in _NOT_KERNEL):
        # an extern kernel or a fallback writing ``out=`` (``extern_kernels.mm(..., out=buf0)``; the seeds of random
        # kernels, ``aten.randint.low_out(..., out=buf1)``)
        args = _split_args(m.group(2))
        outs = [_base_name(a.split("=", 1)[1].strip()) for a in args if _is_out(a)]
        ins = [n for n in (_base_name(a) for a in args if not _is_out(a)) if n]
        return [(o, m.group(1), ins) for o in outs if o]
    return []


def _lent_writes(stripped: str, kernels: Dict[str, Tuple[List[int], List[int], List[int]]]) -> set:
    """The variables one statement's generated kernel writes only through an alias (:func:`_written_through_alias`)."""
    m = re.match(r"^(\w+)(?:\.run)?\((.*)\)$", stripped)
    if not m or m.group(1) not in kernels or not kernels[m.group(1)][2]:
        return set()
    names = [_base_name(a) for a in _split_args(m.group(2)) if not re.match(r"^\w+\s*=", a)]
    return {names[k] for k in kernels[m.group(1)][2] if k < len(names) and names[k]}


def _extern_reads(stripped: str, kernels) -> List[Tuple[str, str]]:
    """``[(variable read, op)]`` of an extern or fallback kernel call (``extern_kernels.mm`` reads as ``aten.mm``,
    ``torch.ops.aten.x.default`` as ``aten.x.default``); nothing for generated kernels and other statements."""
    found = []
    for _, kernel, ins in _kernel_writes(stripped, kernels):
        if kernel.startswith("extern_kernels."):
            op = "aten." + kernel.split(".", 1)[1]
        elif kernel.startswith("torch.ops."):
            op = kernel[len("torch.ops."):]
        else:
            continue
        found.extend((v, op) for v in ins)
    return found


def _is_op(name: str, op: str) -> bool:
    """Whether the FX op ``name`` (``aten.mm.default``) is ``op`` (``aten.mm`` or ``aten.mm.default``)."""
    return name == op or name.startswith(op + ".")


def instrument_compiled(compiled, gm: fx.GraphModule, recorder_factory, origins: Dict[str, Any],
                        display: Dict[str, str]) -> Optional[Recorder]:
    """Swap ``compiled``'s callable for an instrumented copy; returns its recorder (None if not possible)."""
    src, key, current = _torch_compat.compiled_source(compiled)
    func = getattr(current, "__func__", current)
    if not any(n.op == "call_function" for n in gm.graph.nodes):  # it only hands on its inputs: nothing to trace
        return None
    if src is None or not hasattr(func, "__globals__") or getattr(func, "__name__", "") != "call":
        log.warning("determ: inductor output has no instrumentable wrapper; this graph is not traced")
        return None
    try:
        plan = plan_call(src, gm, origins, display)
        ast.parse(plan.source)
    except (ValueError, SyntaxError) as e:
        log.warning("determ: could not instrument inductor wrapper (%s); this graph is not traced", e)
        return None
    recorder = recorder_factory(plan.infos)
    recorder.reused = plan.reused
    glb = dict(func.__globals__)
    glb.update(_determ_capture=recorder.capture, _determ_begin=recorder.begin_call, _determ_same=recorder.capture_same)
    ns: Dict[str, Any] = {}
    exec(compile(plan.source, f"<determ instrumented {key or 'inductor'}>", "exec"), glb, ns)
    new = ns["call"]
    bound = types.MethodType(new, current.__self__) if hasattr(current, "__self__") else new
    _torch_compat.set_compiled_callable(compiled, bound)
    return recorder
