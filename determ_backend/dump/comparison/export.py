"""Exporting a dump's tensors as ``.npy`` files, named as ptdbg names them.

ptdbg/msprobe users inspect single tensors with numpy (``np.load`` of
``Functional_conv2d_0_forward_input.0.npy``); our payloads live packed in one
``tensors.bin``, so :func:`export_npy` writes one file per stored tensor:
``<entry name>_<tensor name>.npy``.  A dump of several ranks (the ``<tag>``
directory holding ``rank<N>/``) goes to ``<out>/rank<N>/``.  numpy has no bfloat16
(nor float8, complex32): those are written widened to float32 (complex64), and the
export says so once per dtype.  Every file is written atomically.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from determ_backend.dump.capture.writer import PAYLOAD_FILE
from determ_backend.dump.comparison.parse import Dump, check_path, data_dir_of, find_index, holds_index, open_dump, rank_dirs
from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.trace.stream import atomic_path

__all__ = ["export_npy", "ExportResult", "dump_sources"]

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    """What :func:`export_npy` wrote."""

    out: Path
    files: List[Path] = field(default_factory=list)
    widened: Dict[str, int] = field(default_factory=dict)
    """Tensors written in a wider dtype, by their own dtype name (``torch.bfloat16``: 3)."""
    skipped: int = 0
    """Tensors past the end of a dump that was cut or whose writer was killed."""


def dump_sources(path: Union[str, Path]) -> List[Tuple[Optional[int], Path]]:
    """``[(rank, index)]`` of ``path``: an index file or rank directory (rank None), or a directory of
    ``rank<N>`` folders (each one's index)."""
    p = check_path(path, "dump path")
    if p.is_dir() and not holds_index(p):
        ranks = rank_dirs(p)
        if ranks:
            return [(rank, find_index(d)) for rank, d in ranks.items()]
    return [(None, find_index(p))]


def _stored(d: Dump) -> List[Tuple[str, dict]]:
    """``[(file stem, tensor entry)]`` of every tensor whose payload the dump stores.  An entry name seen again (a
    second backward pass through one graph, ``retain_graph``) has its files suffixed ``_<k>`` (its k-th time after
    the first): no file overwrites another."""
    out = []
    seen: Dict[str, int] = collections.Counter()
    for e in d.entries:
        k = seen[e["name"]]
        seen[e["name"]] += 1
        for io_ in ("inputs", "outputs"):
            for t in e.get(io_, []):
                if "payload" in t:
                    out.append((f"{e['name']}_{t.get('name')}{f'_{k}' if k else ''}".replace("/", "_"), t))
    return out


def _to_numpy(t: torch.Tensor) -> Tuple[np.ndarray, Optional[torch.dtype]]:
    """The array, and the dtype it was widened to when numpy cannot hold ``t``'s own (else None)."""
    t = t.detach().cpu()
    try:
        return t.numpy(), None
    except TypeError:  # "Got unsupported ScalarType BFloat16"
        wider = torch.complex64 if t.is_complex() else torch.float32 if t.is_floating_point() else None
        if wider is None:
            raise TraceFormatError(f"{t.dtype} has no numpy dtype to export to") from None
        return t.to(wider).numpy(), wider


def _save(path: Path, arr: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)


def _take_back(files: List[Path], made: List[Path]) -> None:
    """A failed export leaves nothing of its own: the files it created, then the folders it created (deepest first),
    when they hold nothing else.  Files it replaced keep their new contents: the old ones are gone either way."""
    for f in files:
        f.unlink(missing_ok=True)
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:  # not empty (someone else's files) or already gone
            pass


def export_npy(path: Union[str, Path], out: Union[str, Path]) -> ExportResult:
    """Write every stored tensor of the dump at ``path`` as ``<out>/[rank<N>/]<entry>_<tensor>.npy``.

    Every dump is checked before anything is written: a statistics-only dump (``summary_only``) or one
    whose ``tensors.bin`` is gone is a one-line :class:`TraceFormatError`."""
    dst = check_path(out, "export: output directory")
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"export: {dst} is not a directory")
    dumps: List[Tuple[Optional[int], Dump, List[Tuple[str, dict]]]] = []
    for rank, index in dump_sources(path):
        d = open_dump(index)
        stored = _stored(d)
        if not stored:
            raise TraceFormatError(f"{index}: a statistics-only dump (summary_only / task 'statistics'): it stores no "
                                   f"tensor payloads to export")
        if not d.has_payloads:
            raise TraceFormatError(f"{(d.data_dir or data_dir_of(d.path)) / PAYLOAD_FILE}: tensor payload file "
                                   f"missing; {index.name} needs it to export tensors")
        dumps.append((rank, d, stored))
    result = ExportResult(dst)
    widened: Dict[Tuple[torch.dtype, torch.dtype], int] = collections.Counter()
    made: List[Path] = []  # the folders this export created, taken back with its new files when it fails
    new_files: List[Path] = []  # the files it created (not those it replaced)
    try:
        for rank, d, stored in dumps:
            folder = dst / f"rank{rank}" if rank is not None else dst
            made += [p for p in (folder, *folder.parents) if not p.exists()][::-1]
            folder.mkdir(parents=True, exist_ok=True)
            for stem, t in stored:
                try:
                    value = d.tensor(t)
                except TraceFormatError:
                    if d.cut or d.partial:  # bytes past the end of a dump that stopped early: nothing to export
                        result.skipped += 1
                        continue
                    raise
                arr, wider = _to_numpy(value)
                if wider is not None:
                    widened[(value.dtype, wider)] += 1
                target = folder / f"{stem}.npy"
                if not target.exists():
                    new_files.append(target)  # a file of an earlier export it replaces is not its own to take back
                _save(target, arr)
                result.files.append(target)
    except BaseException:
        _take_back(new_files, made)
        raise
    for (own, wide), n in widened.items():
        name, wide_name = str(own).replace("torch.", ""), str(wide).replace("torch.", "")
        log.warning("export: numpy has no %s: wrote %d %s tensor%s as %s", name, n, name, "" if n == 1 else "s",
                    wide_name)
        result.widened[str(own)] = n
    if result.skipped:
        log.warning("export: %d tensors lie past the end of a dump that stopped early and were not exported",
                    result.skipped)
    return result
