"""Reading a dump back: :func:`read_dump` and ptdbg's ``parse(pkl_file, name_prefix)``.

A dump index (``dump.pkl``, ``api_stack_dump.pkl``, or a name the user chose:
``npu_dump.pkl``, ``Overflow_info_<time>.pkl``...) is a JSON Lines stream of
format ``determ-dump`` (:data:`~determ_backend.dump.capture.writer.DUMP_STREAM`),
read by the stream's rules (:func:`determ_backend.trace.jsonl.read_stream`: a
missing footer, a cut last line, a footer cut on a full disk).  It is never
unpickled; a ptdbg/msprobe pickle index is refused with a clear message.  Payloads
are read from the dump's pack ``tensors.bin`` in the data directory named after
the index (``npu_dump.pkl`` -> ``npu_dump/``), or one the caller names, through the
one tensor store (:meth:`determ_backend.trace.store.TensorStore.read_span`); writing
a dump is :mod:`determ_backend.dump.capture`.

What compare and parse read is :func:`open_dump`: also a dump whose writer was
killed (no footer, maybe a cut last line), up to its last complete entry, with one
warning -- the entries before a kill are exactly what a user needs to compare.
"""

from __future__ import annotations

import json
import re
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.trace.stream import TRACE_NAME, rank_subdirs
from determ_backend.dump.capture.session import INDEX_SUFFIX
from determ_backend.dump.capture.writer import DUMP_STREAM, PAYLOAD_FILE
from determ_backend.trace import jsonl
from determ_backend.trace.store import TensorStore, fingerprint_key

__all__ = ["Dump", "read_dump", "open_dump", "find_index", "parse", "rank_dirs", "check_path", "check_rank",
           "check_rank_folders", "read_header", "data_dir_of", "holds_index"]

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
    def partial(self) -> bool:
        """The writer stopped without closing the index (killed): the entries end at the last complete one,
        and payloads written after it may be missing."""
        return not self.footer

    @property
    def has_payloads(self) -> bool:
        return self.data_dir is not None and (self.data_dir / PAYLOAD_FILE).is_file()

    def tensor(self, t: Dict[str, Any]) -> torch.Tensor:
        """A tensor entry's payload (raises :class:`TraceFormatError` if it is not stored)."""
        if "payload" not in t:
            raise TraceFormatError(f"{self.path}: {t.get('name', 'tensor')} has no stored payload (statistics-only dump)")
        if not self.has_payloads:
            where = (self.data_dir or data_dir_of(self.path)) / PAYLOAD_FILE
            raise TraceFormatError(f"{where}: tensor payload file missing (was the dump written in statistics mode?)")
        if "dtype" not in t or not isinstance(t.get("shape"), list):
            raise TraceFormatError(f"{self.path}: {t.get('name', 'a tensor')} has a payload but no dtype and shape")
        store = TensorStore(self.data_dir, pack=PAYLOAD_FILE)
        name = t.get("name", "a tensor")
        v = store.read_span(t["payload"], _dtype_from_str(t["dtype"]), t["shape"], name)
        recorded = t.get("hash")
        # the payload was written from the snapshot its fingerprint was taken of: bytes changed since (a damaged or
        # edited file) would otherwise be compared as the run's values
        if isinstance(recorded, str) and v.numel() and fingerprint_key(v) != recorded:
            call = next((e.get("name") for e in self.entries
                         if any(x is t for x in (e.get("inputs") or []) + (e.get("outputs") or []))), None)
            where = f"{call} {name}" if call else name
            raise TraceFormatError(f"{store.pack_path}: the stored payload of {where} does not match its recorded "
                                   f"fingerprint {recorded} (the file was changed or damaged)")
        return v

    def by_name(self, name: str) -> Optional[Dict[str, Any]]:
        return next((e for e in self.entries if e.get("name") == name), None)


def check_path(value: Any, what: str) -> Path:
    """``value`` as a Path; a :class:`ConfigError` naming ``what`` when it is not a str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")
    return Path(value)


def find_index(path: Union[str, Path], several: str = "pass the index file itself") -> Path:
    """An index file, or a rank directory holding exactly one ``*.pkl`` file: the index may be named after the
    user's file (``myDump.pkl``, ``Overflow_info_<time>.pkl``), so any ``.pkl`` there is a candidate.
    ``several``: how the caller's user names one when a directory holds several."""
    p = check_path(path, "dump index path")
    if not p.exists():
        raise TraceFormatError(f"{path}: no such dump index or directory")
    if p.is_dir():
        found = sorted(f for f in p.glob(f"*{INDEX_SUFFIX}") if f.is_file())
        if not found and ((p / TRACE_NAME).is_file() or (p / "report.json").is_file()):
            raise TraceFormatError(f"{path}: a determ run directory (a trace), not an API dump; compare two traces "
                                   f"with `repro-tools diff`")
        if len(found) != 1:
            if not found:
                # an msprobe dump_path: step<N>/rank<R>/dump.pkl (or rank<R>/ directly) below it
                inner = sorted(str(q.relative_to(p)) for pattern in (f"step*/rank*/*{INDEX_SUFFIX}",
                                                                       f"rank*/*{INDEX_SUFFIX}") for q in p.glob(pattern)
                               if q.is_file())[:3]
                hint = (f"; the indexes below it are in its step/rank folders ({', '.join(inner)}): pass one of "
                        f"those, or the folder holding it" if inner else "; pass the index file itself")
                raise TraceFormatError(f"{path}: no *{INDEX_SUFFIX} index{hint}")
            raise TraceFormatError(f"{path}: several indexes ({', '.join(f.name for f in found)}); {several}")
        p = found[0]
    return p


def holds_index(path: Path) -> bool:
    """Whether ``path`` is a directory holding an index file (``*.pkl``) of its own -- a rank directory, not the
    ``<dump_tag>`` directory of rank folders."""
    return path.is_dir() and any(f.is_file() for f in path.glob(f"*{INDEX_SUFFIX}"))


def data_dir_of(index: Path) -> Path:
    """The data directory a dump's writer puts beside its index: the index's name without ``.pkl``."""
    return index.with_suffix("")


def _entry(p: Path, lineno: int, d: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(d.get("name"), str):
        raise TraceFormatError(f"{p}:{lineno}: entry without a name")
    for key in ("inputs", "outputs"):
        items = d.get(key, [])
        if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
            raise TraceFormatError(f"{p}:{lineno}: entry {d['name']}: {key!r} must be a list of objects, got "
                                   f"{json.dumps(items)[:60]}")
    for key in ("op", "dir", "source"):
        if key in d and not isinstance(d[key], str):
            raise TraceFormatError(f"{p}:{lineno}: entry {d['name']}: {key!r} must be a string, got "
                                   f"{json.dumps(d[key])[:60]}")
    for t in d.get("inputs", []) + d.get("outputs", []):  # what the verdicts read: checked as a trace's records are
        h = t.get("hash")
        if h is not None and not (isinstance(h, str) and _HEX.fullmatch(h)):
            raise TraceFormatError(f"{p}:{lineno}: entry {d['name']}: {t.get('name', 'a tensor')}'s hash must be "
                                   f"hexadecimal, got {json.dumps(h)[:40]}")
        st = t.get("stats")
        if st is not None and not (isinstance(st, dict) and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in st.values())):
            raise TraceFormatError(f"{p}:{lineno}: entry {d['name']}: {t.get('name', 'a tensor')}'s stats must map "
                                   f"names to numbers, got {json.dumps(st)[:60]}")
    return d


_HEX = re.compile(r"[0-9a-fA-F]+")


def read_dump(path: Union[str, Path], allow_partial: bool = False,
              data_dir: Optional[Union[str, Path]] = None) -> Dump:
    """Load an index; raises :class:`TraceFormatError` naming the file (and line) when it is missing,
    truncated or corrupt.  ``allow_partial``: accept an index whose writer died (no footer; a cut last line
    is dropped), with one warning.  An index cut on a full disk, or whose payloads could not all be written,
    is read with one warning.  ``data_dir``: where its ``tensors.bin`` lies, when not beside the index
    (moved, or ptdbg's ``npu_dump_data_dir``); it must exist."""
    p = find_index(path)
    s = jsonl.read_stream(p, DUMP_STREAM, allow_partial, _entry)
    if s.footer.get("complete") is False and not s.cut:
        log.warning("%s: incomplete dump: writing its tensor payloads failed (disk full?); tensors stored before "
                    "that are readable, later ones compare on their statistics", p)
    if not s.footer:
        log.warning("%s: incomplete dump: its writer stopped without closing it (killed?); reading the %d entries "
                    "up to the last complete one", p, len(s.records))
    if data_dir is not None:
        d = check_path(data_dir, "dump data directory")
        if not d.is_dir():
            raise TraceFormatError(f"{data_dir}: no such dump data directory")
    else:
        d = data_dir_of(p)
    return Dump(p, s.header, s.records, s.footer, d if d.is_dir() else None)


def open_dump(path: Union[str, Path], data_dir: Optional[Union[str, Path]] = None) -> Dump:
    """The dump as compare and parse read it: :func:`read_dump` accepting a dump whose writer was killed
    (one warning), except one this very process is still writing -- a :class:`TraceFormatError` saying to
    switch it off first."""
    p = find_index(path)
    from determ_backend.dump.capture.control import dump_open  # the writer's side: which dumps are on

    if dump_open(p):
        raise TraceFormatError(f"{p}: this dump is still switched on; call set_dump_switch('OFF') (or stop() the "
                               f"PrecisionDebugger) before reading it")
    return read_dump(p, allow_partial=True, data_dir=data_dir)


def rank_dirs(root: Union[str, Path]) -> Dict[int, Path]:
    """``{rank: path}`` of the ``rank<N>`` directories directly under ``root``."""
    p = check_path(root, "dump directory")
    if p.is_file():
        raise TraceFormatError(f"{root}: not a directory (expected the dump directory holding rank0, rank1, ...)")
    if not p.is_dir():
        raise TraceFormatError(f"{root}: no such dump directory")
    return rank_subdirs(p)


def check_rank(path: Path, header: Dict[str, Any], rank: int) -> None:
    """A :class:`TraceFormatError` when index ``path`` (its ``header``), found in folder ``rank<rank>``,
    was written by another rank (a dump copied into the wrong folder would pass every replica check)."""
    said = header.get("rank")
    if said is not None and said != rank:
        raise TraceFormatError(f"{path}: its header says rank {said}, but it is in folder rank{rank} "
                               f"(copied from another rank?)")


def check_rank_folders(root: Union[str, Path], found: Dict[int, Tuple[Path, Dict[str, Any]]]) -> None:
    """The rank folders of ``root`` (``{folder rank: (its index, the index's header)}``): each index written by its
    folder's rank (:func:`check_rank`), and every rank of the run there; a :class:`TraceFormatError` when the folders
    are not every rank of the run their headers name (``world_size``; of the ranks the dump was told to cover, when
    they say so: ``ranks``): a rank whose folder is gone would pass every replica check and every rank-by-rank
    comparison unseen."""
    for rank, (path, header) in found.items():
        check_rank(path, header, rank)
    headers = {rank: header for rank, (_, header) in found.items()}
    worlds = {h.get("world_size") for h in headers.values()}
    world = worlds.pop() if len(worlds) == 1 else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return  # not said, or said differently (each folder's own header is checked on its own)
    due = set(range(world))
    for h in headers.values():  # a dump told to cover some ranks (msprobe's ``rank`` key): only those are due
        chosen = h.get("ranks")
        if isinstance(chosen, list) and all(isinstance(r, int) for r in chosen):
            due &= set(chosen)
    missing = sorted(due - set(headers))
    if missing:
        raise TraceFormatError(f"{root}: holds rank folders {sorted(headers)}, but their dumps say the run had "
                               f"{world} ranks: {', '.join(f'rank{r}' for r in missing)} missing")


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
    dump = open_dump(pkl_file)
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
