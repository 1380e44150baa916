"""Reading a dump back: :func:`read_dump` and ptdbg's ``parse(pkl_file, name_prefix)``.

A dump index (``dump.pkl``, ``api_stack_dump.pkl``...) is a JSON Lines stream of
format ``determ-dump`` (:data:`~determ_backend.dump.capture.writer.DUMP_STREAM`),
read by the stream's rules (:func:`determ_backend.trace.jsonl.read_stream`: a
missing footer, a cut last line, a footer cut on a full disk).  It is never
unpickled; a ptdbg/msprobe pickle index is refused with a clear message.  Payloads
are read from the dump's pack ``tensors.bin`` through the one tensor store
(:meth:`determ_backend.trace.store.TensorStore.read_span`); writing a dump is
:mod:`determ_backend.dump.capture`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.dump.capture.writer import DUMP_STREAM, PAYLOAD_FILE
from determ_backend.trace import jsonl
from determ_backend.trace.store import TensorStore

__all__ = ["Dump", "read_dump", "find_index", "parse", "rank_dirs", "check_path", "check_rank", "read_header"]

log = logging.getLogger(__name__)


def _dtype_from_str(s: str) -> torch.dtype:
    dt = getattr(torch, str(s).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise TraceFormatError(f"unknown dtype {s!r} in dump index")
    return dt


@dataclass
class Dump:
    """A loaded dump index."""

    path: Path
    header: Dict[str, Any]
    entries: List[Dict[str, Any]]
    footer: Dict[str, Any] = field(default_factory=dict)
    data_dir: Optional[Path] = None

    @property
    def cut(self) -> bool:
        """The writer ran out of room (disk full, size limit): the index or its payloads end early."""
        return self.footer.get("complete") is False

    @property
    def has_payloads(self) -> bool:
        return self.data_dir is not None and (self.data_dir / PAYLOAD_FILE).is_file()

    def tensor(self, t: Dict[str, Any]) -> torch.Tensor:
        """A tensor entry's payload (raises :class:`TraceFormatError` if it is not stored)."""
        if "payload" not in t:
            raise TraceFormatError(f"{self.path}: {t.get('name', 'tensor')} has no stored payload (statistics-only dump)")
        if not self.has_payloads:
            where = (self.data_dir or self.path.parent / self.path.name[: -len(".pkl")]) / PAYLOAD_FILE
            raise TraceFormatError(f"{where}: tensor payload file missing (was the dump written in statistics mode?)")
        if "dtype" not in t or not isinstance(t.get("shape"), list):
            raise TraceFormatError(f"{self.path}: {t.get('name', 'a tensor')} has a payload but no dtype and shape")
        store = TensorStore(self.data_dir, pack=PAYLOAD_FILE)
        return store.read_span(t["payload"], _dtype_from_str(t["dtype"]), t["shape"], t.get("name", "a tensor"))

    def by_name(self, name: str) -> Optional[Dict[str, Any]]:
        return next((e for e in self.entries if e.get("name") == name), None)


def check_path(value: Any, what: str) -> Path:
    """``value`` as a Path; a :class:`ConfigError` naming ``what`` when it is not a str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")
    return Path(value)


def find_index(path: Union[str, Path]) -> Path:
    """An index file, or a rank directory holding exactly one ``*dump.pkl``."""
    p = check_path(path, "dump index path")
    if not p.exists():
        raise TraceFormatError(f"{path}: no such dump index or directory")
    if p.is_dir():
        found = sorted(p.glob("*dump.pkl"))
        if len(found) != 1:
            what = "no *dump.pkl index" if not found else f"several indexes ({', '.join(f.name for f in found)})"
            raise TraceFormatError(f"{path}: {what}; pass the index file itself")
        p = found[0]
    return p


def _entry(p: Path, lineno: int, d: Dict[str, Any]) -> Dict[str, Any]:
    if "name" not in d:
        raise TraceFormatError(f"{p}:{lineno}: entry without a name")
    return d


def read_dump(path: Union[str, Path], allow_partial: bool = False) -> Dump:
    """Load an index; raises :class:`TraceFormatError` naming the file (and line) when it is missing,
    truncated or corrupt.  ``allow_partial``: accept an index whose writer died (no footer; a cut last line
    is dropped).  An index cut on a full disk, or whose payloads could not all be written, is read with one
    warning."""
    p = find_index(path)
    s = jsonl.read_stream(p, DUMP_STREAM, allow_partial, _entry)
    if s.footer.get("complete") is False and not s.cut:
        log.warning("%s: incomplete dump: writing its tensor payloads failed (disk full?); tensors stored before "
                    "that are readable, later ones compare on their statistics", p)
    data_dir = p.parent / p.name[: -len(".pkl")]
    return Dump(p, s.header, s.records, s.footer, data_dir if data_dir.is_dir() else None)


def rank_dirs(root: Union[str, Path]) -> Dict[int, Path]:
    """``{rank: path}`` of the ``rank<N>`` directories directly under ``root``."""
    p = check_path(root, "dump directory")
    if p.is_file():
        raise TraceFormatError(f"{root}: not a directory (expected the dump directory holding rank0, rank1, ...)")
    if not p.is_dir():
        raise TraceFormatError(f"{root}: no such dump directory")
    out: Dict[int, Path] = {}
    for d in p.iterdir():
        if d.is_dir() and d.name.startswith("rank") and d.name[4:].isdigit():
            out[int(d.name[4:])] = d
    return dict(sorted(out.items()))


def check_rank(path: Path, header: Dict[str, Any], rank: int) -> None:
    """A :class:`TraceFormatError` when index ``path`` (its ``header``), found in folder ``rank<rank>``,
    was written by another rank (a dump copied into the wrong folder would pass every replica check)."""
    said = header.get("rank")
    if said is not None and said != rank:
        raise TraceFormatError(f"{path}: its header says rank {said}, but it is in folder rank{rank} "
                               f"(copied from another rank?)")


def read_header(path: Union[str, Path]) -> Dict[str, Any]:
    """The header of an index (its first line only; the entries are not read)."""
    return jsonl.read_header(find_index(path), DUMP_STREAM)


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def describe_entry(e: Dict[str, Any]) -> Iterator[str]:
    for t in list(e.get("inputs", [])) + list(e.get("outputs", [])):
        label = f"{e['name']}_{t.get('name')}"
        if t.get("unresolved"):
            yield f"  [{label}][untraced input {t.get('node')}]"
        elif "dtype" in t:
            st = t.get("stats") or {}
            yield (f"  [{label}][dtype: {t['dtype']}][shape: {t['shape']}][max: {_fmt(st.get('max'))}]"
                   f"[min: {_fmt(st.get('min'))}][mean: {_fmt(st.get('mean'))}][l2: {_fmt(st.get('l2'))}]"
                   f"[hash: {t.get('hash', '-')}]")
        else:
            yield f"  [{label}][{t.get('type')}: {t.get('value')}]"


def parse(pkl_file: Union[str, Path], name_prefix: str) -> List[str]:
    """Print (and return) statistics and stack of the entries whose name starts with ``name_prefix``."""
    check_path(pkl_file, "parse: pkl_file")
    if not isinstance(name_prefix, str):
        raise ConfigError(f"parse: name_prefix must be a string such as 'Functional_linear_0_forward', got "
                          f"{type(name_prefix).__name__} {name_prefix!r}")
    dump = read_dump(pkl_file)
    hits = [e for e in dump.entries if e["name"].startswith(name_prefix)]
    if not hits:
        raise TraceFormatError(f"{dump.path}: no entry named {name_prefix!r}...")
    lines: List[str] = []
    for e in hits:
        lines.append(f"{e['name']}  (at {e.get('source') or '?'})")
        lines.append("Statistic Info:")
        lines.extend(describe_entry(e))
        if e.get("stack"):
            lines.append("Stack Info:")
            lines.extend(f"  {s}" for s in e["stack"])
    print("\n".join(lines))
    return lines
