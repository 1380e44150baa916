"""The one-pass CPU fingerprint kernel (``_native_fp.c``): build, load, call.

On first use the C source shipped next to this file is compiled with the system C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a shared library cached under
``$DETERM_CACHE_DIR`` (default ``~/.cache/determ``), keyed by the source, the flags
and the CPU (it is tuned with ``-march=native``); later processes just load it.  The
build writes to a temporary file and renames it, so concurrent first uses are safe.
When no compiler is found, the build fails, or ``DETERM_NATIVE=0`` is set,
:func:`available` is False and callers use the torch path, which gives bit-identical
fingerprints.

The kernel reads each tensor once: fingerprint row sums and, optionally, statistics
(min, max, sum, sum of squares, NaN and inf counts) of the same 16 KiB row while it
is in L1 -- instead of five passes of stock torch ops.  Tensors of 2 MiB and more are
split by rows over OpenMP threads (``torch.get_num_threads()`` of them, or
``DETERM_NATIVE_THREADS``); the library links ``libgomp.so.1``, which resolves to the
copy torch already loaded, so it shares torch's thread pool instead of competing with
it.  Results do not depend on the split.  ctypes releases the GIL during the call.
Nothing happens at import.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from determ_backend.config import parse_bool
from determ_backend.errors import ConfigError

__all__ = ["available", "fingerprint", "SUPPORTED"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native_fp.c")
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing"]
_TUNE = "-march=native"  # the library is built on, and cached for, this machine's CPU (dropped if refused)
_OPENMP = "-fopenmp"  # libgomp.so.1: the one torch already loaded, so its thread pool is shared (dropped if refused)

# dtype -> kind code of _native_fp.c (statistics are computed for these; any other dtype of a
# whole number of bytes is still hashed natively, with kind 0 = no statistics)
SUPPORTED = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int8: 5, torch.uint8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}
for _name, _code in (("uint16", 11), ("uint32", 12), ("uint64", 13)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SUPPORTED[getattr(torch, _name)] = _code


def _compiler() -> Optional[str]:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("DETERM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "determ")
    return Path(root) / "native"


def _cpu_signature() -> bytes:
    """What -march=native depends on: a home directory shared by different machines gets one build each."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines))).encode()
    except OSError:
        return f"{platform.machine()}|{platform.processor()}".encode()


def _library_path() -> Path:
    """Where this source, built with these flags for this CPU, is cached."""
    tag = hashlib.blake2b(b"|".join([_SOURCE.read_bytes(), " ".join(_FLAGS + [_TUNE, _OPENMP]).encode(), _cpu_signature(),
                                     sys.platform.encode()]), digest_size=8).hexdigest()
    return _cache_dir() / f"determ_fp_{tag}.so"


def _build(cc: str, lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".so.tmp", dir=lib.parent)
    os.close(fd)
    try:
        for flags in ([*_FLAGS, _TUNE, _OPENMP], [*_FLAGS, _TUNE], _FLAGS):
            proc = subprocess.run([cc, *flags, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            raise OSError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its entry point typed; OSError when it does not load."""
    lib = ctypes.CDLL(str(path))
    try:
        fn = lib.determ_fp
    except AttributeError as e:
        raise OSError(f"{path}: {e}") from None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def _build_and_load(path: Path) -> Optional[ctypes.CDLL]:
    """Load the cached build; build it first when missing, rebuild it once when the cached file does not load."""
    cc = _compiler()
    if path.exists():
        try:
            return _load(path)
        except OSError as e:
            if cc is None:
                raise
            log.info("cached native kernel %s does not load (%s); rebuilding it", path, e)
    elif cc is None:
        log.info("no C compiler found: fingerprints use the torch path")
        return None
    _build(cc, path)
    return _load(path)


@functools.lru_cache(maxsize=None)
def _cached_lib() -> Optional[ctypes.CDLL]:
    try:
        return _build_and_load(_library_path())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native fingerprint kernel unavailable (%s); using the torch path", e)
        return None


@functools.lru_cache(maxsize=8)
def _enabled(raw: str) -> bool:
    return parse_bool(raw, "DETERM_NATIVE")


def _lib() -> Optional[ctypes.CDLL]:
    if not _enabled(os.environ.get("DETERM_NATIVE", "1")):  # read per call (tests flip it), parsed once per value
        return None
    return _cached_lib()


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return _lib() is not None


def _threads() -> int:
    """Threads per large tensor: ``DETERM_NATIVE_THREADS`` (a positive integer), else torch's intra-op thread count."""
    text = os.environ.get("DETERM_NATIVE_THREADS", "").strip()
    if not text:
        return max(1, torch.get_num_threads())
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"DETERM_NATIVE_THREADS={text!r}: expected a positive integer")
    return n


class _Out(ctypes.Structure):
    _fields_ = [("hash", ctypes.c_uint64), ("stats", ctypes.c_double * 6)]


def fingerprint(t: torch.Tensor, weights: torch.Tensor, key: int,
                stats: bool) -> Optional[Tuple[int, Optional[List[float]]]]:
    """``(hash, [min, max, sum, sumsq, nan, inf] | None)`` of ``t``, or None when the kernel is not built
    (or could not allocate scratch memory).  ``t``: a contiguous, strided, non-quantized CPU tensor
    without conj/neg bits, of a dtype in :data:`SUPPORTED` when ``stats`` -- the caller
    (:func:`determ_backend.fingerprint.core.fingerprint_now`) checks that.  ``weights``: the int64 row
    weights on CPU; ``key``: the dtype/shape key."""
    lib = _lib()
    if lib is None:
        return None
    kind = SUPPORTED.get(t.dtype, 0)
    n = t.numel()
    out = _Out()
    base = ctypes.addressof(out)
    rc = lib.determ_fp(t.data_ptr() if n else None, n * t.element_size(), kind, n, weights.data_ptr(),
                       key & 0xFFFFFFFFFFFFFFFF, _threads(), base,
                       base + _Out.stats.offset if stats else None)
    if rc != 0:  # scratch allocation failed: the torch path will try
        return None
    return out.hash, (list(out.stats) if stats else None)
