"""The one content-addressed tensor store: safetensors files whose tensors are named by content keys.

Owns how determ keeps tensor values on disk, for every producer, and reads them
back.  The safetensors framing (8-byte header length, JSON header, raw bytes) is
written and read here by hand: no pickle, no dependency.  Three layouts of the
same shards:

* loose files ``<root>/<key>.safetensors``, one tensor each (:class:`TensorStore`
  ``put``/``get``): a run's ``tensors/`` directory (``save_tensors``, read by
  ``repro-tools diff`` and the dump of compiled graphs), a repro script's
  ``repro_store/`` (storages as ``U8`` bytes);
* tensor files, several named tensors in one safetensors file
  (:func:`save_tensor_file`, :func:`load_tensor_file`): each distinct tensor once,
  named by its key, and ``names`` in the header's metadata mapping the producer's
  names (with their strides) to keys -- observer references
  ``<name>.safetensors``, the minifier's ``inputs.pt``/``observed.pt``;
* packs, shards appended to one file (:class:`PackWriter`), for producers that
  write many small tensors fast -- the API dump's ``<prefix>dump/tensors.bin``, one
  shard per batch.  A reader finds a tensor by the ``[offset, nbytes]`` span of its
  data that the producer recorded (:meth:`TensorStore.read_span`; packs written
  before shards, raw bytes back to back, read the same way) or by its key through
  the shards' headers (:meth:`TensorStore.get`).

A key is 8 to 64 lowercase hex digits naming the content: the determ fingerprint
(``format_hash(hash_tensor(t))``, a function of dtype, shape and bits: traces,
dumps, tensor files) or, for repro stores, :func:`checksum_key` of the bytes,
which the standalone repro runtime (:mod:`repro_tools.repro._inputs`, its own tiny
reader) verifies.  The same key is stored once per store.  Writes are atomic
(loose and tensor files: a temp file and a rename) or whole-shard (packs are cut
back to their last whole shard when a write fails).

Older files stay readable: ``<key>.pt`` files (``torch.save`` of one tensor) and
``torch.save`` lists through :func:`load_legacy`, which uses
``torch.load(weights_only=True)`` -- nothing else is ever unpickled.

The JSON Lines streams that reference these tensors are :mod:`.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from determ_backend.errors import TraceFormatError
from determ_backend.fingerprint import hash_tensor
from determ_backend.trace.jsonl import open_fresh, write_all
from determ_backend.trace.stream import atomic_path, format_hash, resolve_trace_path

__all__ = ["TensorStore", "PackWriter", "save_tensor_file", "load_tensor_file", "is_safetensors", "load_legacy",
           "checksum_key", "fingerprint_key", "check_key", "store_for", "TENSORS_DIR", "STORE_FORMAT"]

STORE_FORMAT = "determ-tensors"
TENSORS_DIR = "tensors"
"""A run's loose tensor store, next to its ``trace.jsonl``."""

_SUFFIX = ".safetensors"
_LEGACY_SUFFIX = ".pt"
_CHECKSUM_LEN = 40
_FINGERPRINT_META = "determ_fingerprint"  # a loose file's metadata: the fingerprint of the data written
_MAX_HEADER = 100 << 20
_KEY = re.compile(r"[0-9a-f]{8,64}")

_ST_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16")):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _ST_DTYPES[_name] = getattr(torch, _attr)
_ST_NAMES: Dict[torch.dtype, str] = {v: k for k, v in _ST_DTYPES.items()}


def check_key(key: Any) -> str:
    """``key`` if it is a content key (8 to 64 lowercase hex digits), else a :class:`TraceFormatError`:
    a key names a file, so an empty one, a path or one leaving the store is refused before any file is opened."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise TraceFormatError(f"tensor store key {key!r} is not a content key (expected 8 to 64 lowercase hex "
                               f"digits)")
    return key


def checksum_key(t: torch.Tensor) -> str:
    """The sha256 checksum prefix (40 hex digits) of ``t``'s bytes (dtype and shape do not enter it)."""
    return hashlib.sha256(_raw(t)[2]).hexdigest()[:_CHECKSUM_LEN]


def fingerprint_key(t: torch.Tensor) -> str:
    """The determ fingerprint of ``t`` as a key (16 hex digits; dtype and shape enter it)."""
    return format_hash(hash_tensor(t))


def _torch_dtype(name: str) -> Optional[torch.dtype]:
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


# ---------------------------------------------------------------------- the safetensors framing

def _raw(t: torch.Tensor) -> Tuple[torch.dtype, List[int], memoryview]:
    """``(dtype, shape, bytes)`` of a dense tensor, its bytes in row-major order on the host."""
    if t.layout != torch.strided or t.is_quantized:
        raise TraceFormatError(f"a {t.layout} {t.dtype} tensor cannot be stored (dense tensors only)")
    c = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return c.dtype, list(c.shape), memoryview(c.reshape(-1).view(torch.uint8).numpy())


def _header(items: Sequence[Tuple[str, torch.dtype, List[int], int]], metadata: Optional[Mapping[str, str]]
            ) -> bytes:
    """The 8-byte length and JSON header of a shard holding ``items`` ``(key, dtype, shape, nbytes)`` back to back.
    A dtype safetensors has no name for is stored as ``U8`` with its item bytes as a last dimension, its torch name
    in the metadata's ``torch_dtypes``."""
    h: Dict[str, Any] = {}
    other: Dict[str, str] = {}
    off = 0
    for key, dtype, shape, n in items:
        st = _ST_NAMES.get(dtype)
        if st is None:
            st, shape = "U8", [*shape, dtype.itemsize]
            other[key] = str(dtype).replace("torch.", "")
        h[key] = {"dtype": st, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    meta = {"format": STORE_FORMAT, **(metadata or {})}
    if other:
        meta["torch_dtypes"] = json.dumps(other, separators=(",", ":"))
    h["__metadata__"] = meta
    raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _encode(items: Sequence[Tuple[str, torch.Tensor]], metadata: Optional[Mapping[str, str]] = None
            ) -> Tuple[bytes, List[memoryview]]:
    raws = [(check_key(k),) + _raw(t) for k, t in items]
    return _header([(k, dt, sh, len(mv)) for k, dt, sh, mv in raws], metadata), [mv for *_, mv in raws]


@dataclass(frozen=True)
class _Entry:
    """Where one stored tensor lies in its file: absolute byte span, dtype and shape."""

    begin: int
    end: int
    dtype: torch.dtype
    shape: Tuple[int, ...]


def _corrupt(p: Path, why: str) -> TraceFormatError:
    return TraceFormatError(f"{p}: corrupt tensor store file ({why})")


def _read_shard(f: BinaryIO, p: Path, start: int, size: int) -> Tuple[Dict[str, _Entry], Dict[str, str], int]:
    """The entries and metadata of the shard at byte ``start`` of file ``f`` (``size`` bytes), and where it ends."""
    f.seek(start)
    head = f.read(8)
    if len(head) < 8:
        raise _corrupt(p, f"no shard header at byte {start}")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - start - 8, _MAX_HEADER):
        raise _corrupt(p, f"not a safetensors header at byte {start}")
    try:
        h = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError):
        raise _corrupt(p, f"unreadable safetensors header at byte {start}") from None
    if not isinstance(h, dict):
        raise _corrupt(p, "the safetensors header is not a JSON object")
    meta = h.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(p, "bad __metadata__")
    try:
        other = json.loads(meta.get("torch_dtypes", "{}"))
    except ValueError:
        raise _corrupt(p, "bad torch_dtypes metadata") from None
    data0 = start + 8 + n
    end = data0
    entries: Dict[str, _Entry] = {}
    for key, e in h.items():
        try:
            dtype, shape, (b, e_) = _ST_DTYPES[e["dtype"]], e["shape"], e["data_offsets"]
            ok = type(b) is int and type(e_) is int and 0 <= b <= e_ and all(type(s) is int and s >= 0 for s in shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(p, f"bad header entry {key!r}")
        if key in other:
            dtype = _torch_dtype(other[key])
            if dtype is None or not shape or shape[-1] != dtype.itemsize:
                raise _corrupt(p, f"bad torch dtype of {key!r}")
            shape = shape[:-1]
        wrong = _size_problem(shape, dtype, e_ - b)
        if wrong:
            raise _corrupt(p, f"{key!r} {wrong}")
        entries[key] = _Entry(data0 + b, data0 + e_, dtype, tuple(shape))
        end = max(end, data0 + e_)
    if end > size:
        raise TraceFormatError(f"{p}: truncated tensor store file: its data needs {end} bytes, the file has {size}")
    return entries, meta, end


def _size_problem(shape: Sequence[int], dtype: torch.dtype, nbytes: int) -> Optional[str]:
    """Why ``nbytes`` bytes cannot hold a ``dtype`` tensor of ``shape`` (None when they can)."""
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        return f"has a bad shape {list(shape)!r}"
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != nbytes:
        return f"holds {nbytes} bytes, its dtype and shape need {numel * dtype.itemsize}"
    return None


def _load(f: BinaryIO, e: _Entry, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    n = e.end - e.begin
    if n == 0:
        return torch.empty(e.shape, dtype=e.dtype, device=device)
    buf = torch.empty(n, dtype=torch.uint8)
    f.seek(e.begin)
    if f.readinto(memoryview(buf.numpy())) != n:
        raise TraceFormatError(f"{getattr(f, 'name', 'tensor store file')}: truncated tensor data")
    t = buf.view(e.dtype).reshape(e.shape)
    return t if str(device) == "cpu" else t.to(device)


def _write_file(path: Path, items: Sequence[Tuple[str, torch.Tensor]], metadata: Optional[Mapping[str, str]] = None
                ) -> None:
    header, data = _encode(items, metadata)
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            write_all(fd, [header, *data])
        finally:
            os.close(fd)


def is_safetensors(path: Union[str, Path]) -> bool:
    """Does file ``path`` start like a safetensors file (a header length, then a JSON object)?"""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= size - 8


def load_legacy(path: Union[str, Path]) -> Any:
    """A file ``torch.save`` wrote (determ before safetensors): ``torch.load(weights_only=True)`` onto the CPU,
    so nothing but tensors and plain containers is unpickled.  Raises what torch raises."""
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------- the store

class TensorStore:
    """Tensors keyed by content under ``root``: loose files ``<key>.safetensors`` (and ``<key>.pt`` written
    by an earlier determ, read only), plus, when ``pack`` names one, the shards of pack file ``root/pack``."""

    def __init__(self, root: Union[str, Path], pack: Optional[str] = None):
        self.root = Path(root)
        self.pack_path: Optional[Path] = self.root / pack if pack else None
        self._pack_keys: Optional[Dict[str, _Entry]] = None

    def path(self, key: str) -> Path:
        """The loose file of ``key``."""
        return self.root / f"{check_key(key)}{_SUFFIX}"

    def put(self, key: str, t: torch.Tensor) -> str:
        """Store ``t`` under ``key`` as a loose file (atomically), unless the key is stored already."""
        p = self.path(key)
        if not (p.is_file() or p.with_suffix(_LEGACY_SUFFIX).is_file()):
            # the fingerprint of the bytes written, checked when they are read: a key is not always the fingerprint
            # of the tensor stored under it (a trace record's hash may be derived, not read)
            _write_file(p, [(key, t)], {_FINGERPRINT_META: fingerprint_key(t)})
        return key

    def __contains__(self, key: Any) -> bool:
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            return False
        p = self.path(key)
        return p.is_file() or p.with_suffix(_LEGACY_SUFFIX).is_file() or key in self._pack_index()

    def get(self, key: str, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """The tensor stored under ``key``; a one-line :class:`TraceFormatError` when it is missing or corrupt."""
        p = self.path(key)
        if p.is_file():
            with open(p, "rb") as f:
                entries, meta, _ = _read_shard(f, p, 0, os.fstat(f.fileno()).st_size)
                e = entries.get(key) or (next(iter(entries.values())) if len(entries) == 1 else None)
                if e is None:
                    raise _corrupt(p, f"it holds no tensor {key!r}")
                t = _load(f, e, "cpu")
            written = meta.get(_FINGERPRINT_META)
            if written is not None and t.numel() and fingerprint_key(t) != written:
                raise _corrupt(p, f"its data does not match the fingerprint {written} written with it (the file was "
                                  f"changed or damaged)")
            return t if str(device) == "cpu" else t.to(device)
        legacy = p.with_suffix(_LEGACY_SUFFIX)
        if legacy.is_file():
            try:
                t = load_legacy(legacy)
            except Exception as e:  # torch raises many types for corrupt files
                raise TraceFormatError(f"{legacy}: corrupt tensor payload ({type(e).__name__})") from None
            if not isinstance(t, torch.Tensor):
                raise TraceFormatError(f"{legacy}: payload is not a tensor")
            return t if str(device) == "cpu" else t.to(device)
        e = self._pack_index().get(key)
        if e is None:
            raise TraceFormatError(f"{p}: tensor payload missing from the store")
        with open(self.pack_path, "rb") as f:
            return _load(f, e, device)

    # ---- packs ---------------------------------------------------------------------------------
    def open_pack(self, append: bool = False, index: Optional[Dict[str, Tuple[int, int]]] = None) -> "PackWriter":
        """A :class:`PackWriter` on this store's pack file."""
        if self.pack_path is None:
            raise TraceFormatError(f"{self.root}: this tensor store has no pack file")
        self._pack_keys = None
        return PackWriter(self.pack_path, append=append, index=index)

    def _pack_index(self) -> Dict[str, _Entry]:
        """Key -> entry of every shard in the pack ({} without a pack, or for a pack of raw bytes written
        before shards, which is read by spans only)."""
        if self._pack_keys is None:
            self._pack_keys = {}
            if self.pack_path is not None and self.pack_path.is_file():
                self._pack_keys = _scan_pack(self.pack_path)
        return self._pack_keys

    def read_span(self, span: Sequence[int], dtype: torch.dtype, shape: Sequence[int], name: str = "a tensor",
                  device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """The tensor whose bytes lie at ``span`` ``[offset, nbytes]`` of the pack file, as a producer recorded it."""
        path = self.pack_path
        try:
            off, n = (int(x) for x in span)
        except (TypeError, ValueError):
            raise TraceFormatError(f"{path}: bad payload span {span!r} of {name}") from None
        try:
            size = path.stat().st_size
        except (FileNotFoundError, AttributeError):
            raise TraceFormatError(f"{path}: tensor pack file missing") from None
        if off < 0 or n < 0 or off + n > size:
            raise TraceFormatError(f"{path}: truncated payload file: {name} needs bytes [{off}, {off + n}) but the "
                                   f"file has {size} bytes")
        wrong = _size_problem(list(shape), dtype, n)
        if wrong:
            raise TraceFormatError(f"{path}: {name} {wrong}")
        with open(path, "rb") as f:
            return _load(f, _Entry(off, off + n, dtype, tuple(shape)), device)


def _scan_pack(path: Path) -> Dict[str, _Entry]:
    """Entries of every whole shard of a pack, first shard first (a raw pack of earlier dumps has none)."""
    out: Dict[str, _Entry] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                entries, _, pos = _read_shard(f, path, pos, size)
            except TraceFormatError:
                break  # raw bytes (a pack written before shards), or a shard cut by a full disk
            for k, e in entries.items():
                out.setdefault(k, e)
    return out


class PackWriter:
    """Appends shards to a pack file: :meth:`put_many` stores each key not stored yet, one shard per call.

    ``index`` (key -> ``(offset, nbytes)`` of the data in the file) is shared with the caller, so a pack closed
    and opened again with ``append=True`` still stores each key once.  A failed write cuts the file back to its
    last whole shard and raises the ``OSError``."""

    def __init__(self, path: Union[str, Path], append: bool = False,
                 index: Optional[Dict[str, Tuple[int, int]]] = None):
        self.path = Path(path)
        self.index: Dict[str, Tuple[int, int]] = {} if index is None else index
        if not append:
            self.index.clear()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = (os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if append
                                   else open_fresh(self.path, os.O_APPEND))
        self._end = os.fstat(self._fd).st_size if append else 0
        self.size = sum(n for _, n in self.index.values())
        """Tensor bytes stored (each key once; shard headers not counted)."""

    def put_many(self, items: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[int, int]]:
        """The ``(offset, nbytes)`` span of each item's data in the file; keys not stored yet go into one new shard."""
        new: Dict[str, torch.Tensor] = {}
        for key, t in items:
            if key not in self.index and key not in new:
                new[key] = t
        if new:
            header, data = _encode(list(new.items()))
            start = self._end
            try:
                write_all(self._fd, [header, *data])
            except OSError:
                try:
                    os.ftruncate(self._fd, start)  # whole shards only
                except OSError:
                    pass
                raise
            pos = start + len(header)
            for key, mv in zip(new, data):
                self.index[key] = (pos, len(mv))
                pos += len(mv)
            self.size += pos - start - len(header)
            self._end = pos
        return [self.index[k] for k, _ in items]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------- tensor files

def save_tensor_file(path: Union[str, Path], named: Mapping[str, torch.Tensor],
                     metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``named`` tensors into one safetensors file, atomically: each distinct tensor once, named by its
    fingerprint; the metadata's ``names`` maps every name to its key (and its strides when they are not
    row-major: dense strides are kept, as ``torch.save`` kept them)."""
    items: Dict[str, torch.Tensor] = {}
    names: Dict[str, Dict[str, Any]] = {}
    for name, t in named.items():
        c = t.detach().cpu().clone()
        key = fingerprint_key(c)
        items.setdefault(key, c)
        names[name] = {"key": key} if c.is_contiguous() else {"key": key, "stride": list(c.stride())}
    _write_file(Path(path), list(items.items()), {**(metadata or {}), "names": json.dumps(names)})


def load_tensor_file(path: Union[str, Path]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(tensors by name, metadata)`` of a file :func:`save_tensor_file` wrote; a safetensors file without
    ``names`` (another tool's, or an observer file of an earlier determ) gives its tensors under their own names."""
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise TraceFormatError(f"{p}: no such tensor file") from None
    with f:
        entries, meta, _ = _read_shard(f, p, 0, os.fstat(f.fileno()).st_size)
        stored = {k: _load(f, e) for k, e in entries.items()}
    if "names" not in meta:
        return stored, meta
    try:
        names = json.loads(meta["names"])
        out, handed = {}, set()
        for name, spec in names.items():
            t = stored[spec["key"]]
            if "stride" in spec:
                t = torch.empty_strided(t.shape, spec["stride"], dtype=t.dtype).copy_(t)
            elif spec["key"] in handed:  # equal content stored once, but every name gets a tensor of its own
                t = t.clone()
            handed.add(spec["key"])
            out[name] = t
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        raise _corrupt(p, "bad names metadata") from None
    return out, meta


def store_for(trace: Union[str, Path]) -> Optional[TensorStore]:
    """The loose tensor store of a trace (``tensors/`` next to its ``trace.jsonl``; ``trace`` may be the file or
    its run directory), or None when ``trace`` is no trace file or has no store."""
    try:
        root = resolve_trace_path(trace).parent / TENSORS_DIR
    except TraceFormatError:
        return None
    return TensorStore(root) if root.is_dir() else None
