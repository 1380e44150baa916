"""The one-pass CPU fingerprint kernel (``_native_fp.c``): build, load, call.

On first use the C source shipped next to this file is compiled with the system C
compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a shared library cached under
``$DETERM_CACHE_DIR`` (default ``~/.cache/determ``), keyed by the source, the flags,
the Python ABI and the CPU (it is tuned with ``-march=native``); later processes just
load it.  The build writes to a temporary file and renames it, so concurrent first
uses are safe.  Where Python's headers are installed the library is also a CPython
extension module, called directly (a few hundred nanoseconds a call); otherwise it is
called through ctypes (a few microseconds).  When no compiler is found, the build
fails, or ``DETERM_NATIVE=0`` is set, :func:`available` is False and callers use the
torch path, which gives bit-identical fingerprints.

The kernel reads each tensor once: fingerprint row sums and, optionally, statistics
(min, max, sum, sum of squares, NaN and inf counts) from the same loaded words --
instead of five passes of stock torch ops.  Tensors of 2 MiB and more are split by
rows over OpenMP threads (``torch.get_num_threads()`` of them, or
``DETERM_NATIVE_THREADS``); the library links ``libgomp.so.1``, which resolves to the
copy torch already loaded, so it shares torch's thread pool instead of competing with
it.  Results do not depend on the split.  Large tensors are hashed without the GIL.
Settings are read by :func:`kernel` -- once per batch of tensors, not per tensor.
Nothing happens at import.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from determ_backend.config import parse_bool
from determ_backend.errors import ConfigError

__all__ = ["available", "kernel", "Kernel", "SUPPORTED"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native_fp.c")
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing"]
_TUNE = "-march=native"  # the library is built on, and cached for, this machine's CPU (dropped if refused)
_OPENMP = "-fopenmp"  # libgomp.so.1: the one torch already loaded, so its thread pool is shared (dropped if refused)
_MODULE = "determ_fp"  # the extension module's name (PyInit_determ_fp)

# dtype -> kind code of _native_fp.c (statistics are computed for these; any other dtype of a
# whole number of bytes is still hashed natively, with kind 0 = no statistics)
SUPPORTED = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int8: 5, torch.uint8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}
for _name, _code in (("uint16", 11), ("uint32", 12), ("uint64", 13)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SUPPORTED[getattr(torch, _name)] = _code

# fingerprint(data_ptr, nbytes, kind, numel, key, threads, stats) -> (hash, stats vector | None) | None
_Call = Callable[[int, int, int, int, int, int, bool], Optional[Tuple[int, Optional[tuple]]]]


class Kernel(NamedTuple):
    """The loaded kernel and the settings it runs with, looked up once (see :func:`kernel`)."""

    call: _Call
    threads: int


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


def _python_include() -> Optional[str]:
    """Where ``Python.h`` is, or None (then the library is built for ctypes alone)."""
    inc = sysconfig.get_paths().get("include")
    return inc if inc and os.path.exists(os.path.join(inc, "Python.h")) else None


def _library_path() -> Path:
    """Where this source, built with these flags for this CPU and this Python, is cached."""
    abi = f"{sysconfig.get_config_var('EXT_SUFFIX')}|{_python_include()}"
    tag = hashlib.blake2b(b"|".join([_SOURCE.read_bytes(), " ".join(_FLAGS + [_TUNE, _OPENMP]).encode(), _cpu_signature(),
                                     sys.platform.encode(), abi.encode()]), digest_size=8).hexdigest()
    return _cache_dir() / f"determ_fp_{tag}.so"


def _build(cc: str, lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".so.tmp", dir=lib.parent)
    os.close(fd)
    inc = _python_include()
    ext = ["-DDETERM_PYEXT", f"-I{inc}"] if inc else []
    try:
        # each fallback drops one thing a compiler may refuse: Python's headers, then -march, then OpenMP
        tries = [[*ext, *_FLAGS, _TUNE, _OPENMP], [*_FLAGS, _TUNE, _OPENMP], [*_FLAGS, _TUNE], _FLAGS]
        for flags in tries if ext else tries[1:]:
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


def _ctypes_call(lib: ctypes.CDLL) -> _Call:
    """The kernel called through ctypes (no Python headers at build time): the extension's interface."""
    fn = lib.determ_fp
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def call(ptr: int, nbytes: int, kind: int, numel: int, key: int, threads: int, stats: bool):
        out = (ctypes.c_double * 8)()  # [hash bits, min, max, mean, l2, nan, inf, numel]
        base = ctypes.addressof(out)
        if fn(ptr or None, nbytes, kind, numel, key & 0xFFFFFFFFFFFFFFFF, threads, base, base + 8 if stats else None):
            return None
        return ctypes.c_uint64.from_buffer(out).value, (tuple(out[1:]) if stats else None)

    return call


class _Loaded(NamedTuple):
    call: _Call
    walk: Optional[Callable]  # first_listed_not(frame, internal) of the extension module; None through ctypes
    lines: Optional[Callable] = None  # trace_lines(call, rows) of the extension module; None through ctypes
    recorder: Optional[tuple] = None  # (setup_recorder, op_begin, op_end) of the extension module; None through ctypes


def _load(path: Path) -> _Loaded:
    """The kernel at ``path``, its row weights set; OSError when it does not load."""
    from determ_backend.fingerprint._words import row_weights

    lib = ctypes.CDLL(str(path))  # raises OSError on a file that is not a loadable library
    try:
        init = lib.determ_fp_init
        lib.determ_fp  # noqa: B018 -- present in every build
    except AttributeError as e:
        raise OSError(f"{path}: {e}") from None
    init.argtypes, init.restype = [ctypes.c_void_p], None
    init(row_weights("cpu").data_ptr())
    if not hasattr(lib, f"PyInit_{_MODULE}"):
        return _Loaded(_ctypes_call(lib), None)
    try:
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        log.info("native kernel %s does not import as a module (%s); calling it through ctypes", path, e)
        return _Loaded(_ctypes_call(lib), None)
    recorder = (module.setup_recorder, module.op_begin, module.op_end) if hasattr(module, "op_begin") else None
    return _Loaded(module.fingerprint, getattr(module, "first_listed_not", None), getattr(module, "trace_lines", None),
                   recorder)


def _build_and_load(path: Path) -> Optional[_Loaded]:
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
def _cached() -> Optional[_Loaded]:
    try:
        return _build_and_load(_library_path())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native fingerprint kernel unavailable (%s); using the torch path", e)
        return None


@functools.lru_cache(maxsize=8)
def _enabled(raw: str) -> bool:
    return parse_bool(raw, "DETERM_NATIVE")


@functools.lru_cache(maxsize=8)
def _parse_threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"DETERM_NATIVE_THREADS={text!r}: expected a positive integer")
    return n


def _loaded() -> Optional[_Loaded]:
    """The loaded library, or None when ``DETERM_NATIVE`` switches it off or it is not built (read at each call:
    the setting may change between runs)."""
    if not _enabled(os.environ.get("DETERM_NATIVE", "1")):
        return None
    return _cached()


def kernel() -> Optional[Kernel]:
    """The kernel with this moment's settings (``DETERM_NATIVE``, ``DETERM_NATIVE_THREADS``, torch's thread
    count), or None when it is switched off or not built.  Batchers look it up once and reuse it."""
    loaded = _loaded()
    if loaded is None:
        return None
    text = os.environ.get("DETERM_NATIVE_THREADS", "").strip()
    return Kernel(loaded.call, _parse_threads(text) if text else max(1, torch.get_num_threads()))


def line_encoder() -> Optional[Callable]:
    """``trace_lines(call, rows, dumps)``: a graph call's trace lines, as
    :meth:`~determ_backend.trace.stream.RecordTemplate.line` writes them, in one C loop (``dumps``: orjson's,
    for the statistics); None when the kernel is off, not built, or loaded through ctypes (then each line is
    encoded in Python)."""
    loaded = _loaded()
    return None if loaded is None else loaded.lines


def frame_walker() -> Optional[Callable]:
    """``first_listed_not(frame, internal)``: from ``frame`` outwards, the first frame whose code object's
    ``id`` the dict ``internal`` does not map to True (None past the outermost), walked in C; None when the
    kernel is off, not built, or loaded through ctypes (then walk in Python)."""
    loaded = _loaded()
    return None if loaded is None else loaded.walk


def recorder_ops() -> Optional[tuple]:
    """``(setup_recorder, op_begin, op_end)``: the eager modes' per-op recorder for its common case, in C
    (:func:`determ_backend.modes._record.recorder_ops` sets it up and says what it does); None when the kernel is
    off, not built, or loaded through ctypes (then the recorder is all Python)."""
    loaded = _loaded()
    return None if loaded is None else loaded.recorder


def available() -> bool:
    """True when the kernel is on, built and loaded (builds it on the first call)."""
    return kernel() is not None
