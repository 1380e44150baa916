"""Helpers the benchmark scripts share: PyTorch's own tools they measure determ against, and the measuring.

Owns the reference tools only benchmarks use -- PyTorch's ``DebugMode`` with
tensor-hash logging (``bench_eager_tools.py``, ``bench_backend_overhead.py``), its
FX delta-debugging minifier and cold inductor caches (``bench_minifier.py``).
They reach private torch APIs, as :mod:`determ_backend._torch_compat` does for the
project itself; nothing in ``determ_backend`` or ``repro_tools`` imports this module.
Also the measuring the overhead benchmarks share: interleaved rounds of step timings
(:func:`time_rounds`, :func:`ratio_to`, :func:`print_table`) and the process RSS over a
long run (:func:`rss_bytes`, :func:`memory_check`).
Imported by name from the scripts' directory (``python scripts/bench_*.py``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, TypeVar

__all__ = ["debug_mode_hashing", "fx_minifier", "fresh_inductor_cache",
           "time_rounds", "ratio_to", "print_table", "rss_bytes", "memory_check"]

K = TypeVar("K", bound=Hashable)
MiB = 1 << 20


def debug_mode_hashing(hash_fn: str = "hash_tensor"):
    """PyTorch's ``DebugMode`` with tensor-hash logging, as a context manager (None if unavailable)."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return None
    stack = contextlib.ExitStack()
    stack.enter_context(DebugMode())
    stack.enter_context(DebugMode.log_tensor_hashes(hash_fn=hash_fn))
    return stack


def fx_minifier(gm, inputs, module_fails, **kwargs):
    """PyTorch's own delta-debugging minifier (``torch._functorch.fx_minifier.minifier``), the baseline."""
    from torch._functorch.fx_minifier import minifier as _minifier

    return _minifier(gm, inputs, module_fails, **kwargs)


def fresh_inductor_cache():
    """Context manager: a temporary inductor cache directory and cleared in-memory caches (a cold start)."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def time_rounds(cases: Mapping[K, Callable[[], None]], rounds: int, steps: int) -> Dict[K, List[float]]:
    """Seconds per step of every case, one value per round.

    A round runs each case ``steps`` times, in the mapping's order (round-robin), so load
    drifting over the run hits every case alike.  A tqdm bar over the rounds goes to stderr.
    """
    from tqdm import tqdm

    times: Dict[K, List[float]] = {k: [] for k in cases}
    for _ in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        for key, step in cases.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[key].append((time.perf_counter() - t0) / steps)
    return times


def ratio_to(times: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of (time / the baseline's time in the same round)."""
    return statistics.median(t / b for t, b in zip(times, base))


def print_table(title: str, rows: Sequence[Tuple[str, float, float, str]]) -> None:
    """One result table on stdout: rows of (variant, seconds per step, ratio, baseline name)."""
    width = max([len("variant")] + [len(r[0]) for r in rows])
    print(f"\n== {title}")
    print(f"{'variant':{width}} {'ms/step':>9} {'ratio':>8}  baseline   "
          "(ratio: median over rounds of variant / baseline)")
    for name, sec, ratio, base in rows:
        print(f"{name:{width}} {sec * 1e3:9.2f} {ratio:7.3f}x  {base or '-'}")


def rss_bytes() -> int:
    """This process's resident set size: ``/proc/self/statm``, else the peak RSS from ``getrusage``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def memory_check(step: Callable[[], None], n: int, what: str, limit_mib: float = 32.0,
                 label: Optional[str] = None) -> bool:
    """Run ``step`` ``n`` times, sampling the RSS every ``n // 10`` steps; True if it stays flat.

    Prints the samples and a PASS/FAIL line: the RSS at the end may be at most ``limit_mib`` above
    the RSS after the first tenth of the run (warm-up allocations and caches are done by then).
    """
    from tqdm import tqdm

    every = max(1, n // 10)
    source = "/proc/self/statm" if os.path.exists("/proc/self/statm") else "getrusage maxrss (peak)"
    samples: List[Tuple[int, int]] = []
    for i in tqdm(range(1, n + 1), desc="memory steps", file=sys.stderr):
        step()
        if i % every == 0 or i == n:
            gc.collect()
            samples.append((i, rss_bytes()))
    label = label or "memory"
    print(f"\n== {label}: {what}; {n} steps, RSS ({source}) every {every} steps")
    print(f"{'step':>8} {'RSS MiB':>10} {'vs first':>10}")
    first = samples[0][1]
    for i, rss in samples:
        print(f"{i:8d} {rss / MiB:10.1f} {(rss - first) / MiB:+10.1f}")
    growth = (samples[-1][1] - first) / MiB
    ok = growth <= limit_mib
    print(f"{'PASS' if ok else 'FAIL'} {label}: RSS {growth:+.1f} MiB from step {samples[0][0]} to step {n} "
          f"(limit +{limit_mib:g} MiB: memory stays flat)")
    return ok
