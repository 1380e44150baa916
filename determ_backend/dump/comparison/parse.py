"""Reading a dump back: :func:`read_dump` and ptdbg's ``parse(pkl_file, name_prefix)``.

A dump index (``dump.pkl``, ``api_stack_dump.pkl``...) is JSON Lines: a header
``{"format": "determ-dump", ...}``, one entry per recorded call and a footer
``{"end": true, "count": N}``.  It is never unpickled; a ptdbg/msprobe pickle
index is refused with a clear message.  Payloads are read with
:func:`.writer.read_payload`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.dump.capture.writer import INDEX_FORMAT, PAYLOAD_FILE, read_payload

__all__ = ["Dump", "read_dump", "find_index", "parse", "rank_dirs", "check_path", "check_rank", "read_header"]

log = logging.getLogger(__name__)


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
        return read_payload(self.data_dir, t)

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


def _check_header(p: Path, first: bytes) -> Dict[str, Any]:
    if first[:1] == b"\x80":
        raise TraceFormatError(f"{p}: a pickle index (ptdbg/msprobe?); determ never unpickles files -- dump again "
                               f"with determ_backend.dump")
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
        raise TraceFormatError(f"{p}: not a determ dump index (line 1 has no {INDEX_FORMAT!r} header)")
    return header


def read_dump(path: Union[str, Path], allow_partial: bool = False) -> Dump:
    """Load an index; raises :class:`TraceFormatError` naming the file (and line) when it is missing,
    truncated or corrupt.  ``allow_partial``: accept an index whose writer died (no footer)."""
    p = find_index(path)
    entries: List[Dict[str, Any]] = []
    footer: Dict[str, Any] = {}
    with open(p, "rb") as f:
        header = _check_header(p, f.readline())
        for lineno, raw in enumerate(f, start=2):
            if footer:
                raise TraceFormatError(f"{p}:{lineno}: data after the end line")
            try:
                d = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if allow_partial:
                    break
                raise TraceFormatError(f"{p}:{lineno}: corrupt or truncated line") from None
            if not isinstance(d, dict):
                raise TraceFormatError(f"{p}:{lineno}: expected a JSON object")
            if d.get("end") is True:
                footer = d
                if d.get("count") != len(entries):
                    raise TraceFormatError(f"{p}: end line says {d.get('count')} entries, found {len(entries)}")
                continue
            if "name" not in d:
                raise TraceFormatError(f"{p}:{lineno}: entry without a name")
            entries.append(d)
    if not footer and not allow_partial:
        raise TraceFormatError(f"{p}: truncated dump index (no end line: the dump was not switched off, or the "
                               f"process died)")
    if footer.get("complete") is False:
        what = (f"the index was cut ({footer['cut']}) after {len(entries)} entries" if footer.get("cut")
                else "writing its tensor payloads failed (disk full?); tensors stored before that are readable, "
                     "later ones compare on their statistics")
        log.warning("%s: incomplete dump: %s", p, what)
    data_dir = p.parent / p.name[: -len(".pkl")]
    return Dump(p, header, entries, footer, data_dir if data_dir.is_dir() else None)


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
    p = find_index(path)
    with open(p, "rb") as f:
        return _check_header(p, f.readline())


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
