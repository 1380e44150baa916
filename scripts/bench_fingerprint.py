#!/usr/bin/env python3
"""Benchmark determ's tensor fingerprint against the alternatives, as ratios to ``clone()``.

For a large float32 and bfloat16 tensor (256 MiB by default) it times, taking the
minimum over several repetitions in this one process:

- ``clone``            ``t.clone()``: one memory-bound copy, our practical floor;
- ``hash_tensor``      determ's order-aware 64-bit fingerprint;
- ``torch.hash_tensor``  torch's built-in order-blind XOR reduction (when this torch has it);
- ``xor int32``        an order-blind XOR over an int32 view, reduced with torch ops (the
                       method of the earlier determinism tools);
- ``host md5``         copy to the host and md5 the bytes (the ``HashDebugTrace`` method).

Targets: ``hash_tensor`` <= 1.5x ``clone`` and >= 5x faster than ``host md5``.  A last
line gives the per-tensor cost of fingerprinting small tensors, alone and batched.

``--traced`` adds what tracing meets: 512 KiB float32 tensors (a weight of the backends' small
benchmark) captured one by one as the recorders do (``FingerprintBatch``, with and without
statistics), next to torch's ``sum`` and ``clone`` of the same tensors, once in cache (the same
tensor again and again) and once from memory (cycling through 128 MiB of them), in GB/s; one
thread.

Usage: ``.venv/bin/python scripts/bench_fingerprint.py [--size-mib 256] [--reps 5] [--threads N] [--traced]``
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from determ_backend.fingerprint.core import FingerprintBatch, hash_tensor, hash_tensors

HASH_VS_CLONE_MAX = 1.5
MD5_VS_HASH_MIN = 5.0


def best_times(fns: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    """Minimum wall time of each ``fn()`` over ``reps`` rounds, after one warm-up round.

    The methods take turns within each round, so a burst of load from other
    processes on the machine hits them alike rather than one method's whole series.
    """
    best = {name: float("inf") for name in fns}
    for round_ in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def xor_int32(t: torch.Tensor) -> int:
    """Order-blind XOR of all 32-bit words of ``t``, by repeated halving with ``bitwise_xor``."""
    v = t.reshape(-1).view(torch.int32)
    while v.numel() > 1:
        half = v.numel() // 2
        folded = v[:half] ^ v[half: 2 * half]
        v = torch.cat([folded, v[2 * half:]]) if v.numel() % 2 else folded
    return int(v.item()) if v.numel() else 0


def host_md5(t: torch.Tensor) -> str:
    host = t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy()
    return hashlib.md5(host).hexdigest()


def torch_builtin_hash(t: torch.Tensor) -> Optional[Callable[[], object]]:
    """``torch.hash_tensor`` as this torch allows it, or None when absent/unsupported for the dtype."""
    fn = getattr(torch, "hash_tensor", None)
    if fn is None:
        return None
    try:
        fn(t[:8]).item()
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return lambda: fn(t).item()


def bench_large(dtype: torch.dtype, size_mib: int, reps: int) -> Dict[str, Optional[float]]:
    numel = size_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
    t = torch.randn(numel, dtype=torch.float32).to(dtype)
    builtin = torch_builtin_hash(t)
    fns: Dict[str, Callable[[], object]] = {"clone": lambda: t.clone(), "hash_tensor": lambda: hash_tensor(t)}
    if builtin is not None:
        fns["torch.hash_tensor"] = builtin
    fns["xor int32"] = lambda: xor_int32(t)
    fns["host md5"] = lambda: host_md5(t)
    times: Dict[str, Optional[float]] = dict(best_times(fns, reps))
    times.setdefault("torch.hash_tensor", None)
    return times


def print_table(dtype: torch.dtype, size_mib: int, times: Dict[str, Optional[float]]) -> List[str]:
    clone = times["clone"]
    print(f"\n{size_mib} MiB {str(dtype).replace('torch.', '')}  (threads={torch.get_num_threads()})")
    print(f"  {'method':<20}{'ms':>10}{'GB/s':>10}{'x clone':>10}")
    for name, secs in times.items():
        if secs is None:
            print(f"  {name:<20}{'n/a':>10}")
            continue
        gbs = size_mib * 2**20 / secs / 1e9
        print(f"  {name:<20}{secs * 1e3:>10.1f}{gbs:>10.2f}{secs / clone:>10.2f}")
    failures = []
    ratio = times["hash_tensor"] / clone
    speedup = times["host md5"] / times["hash_tensor"]
    ok1, ok2 = ratio <= HASH_VS_CLONE_MAX, speedup >= MD5_VS_HASH_MIN
    print(f"  {'PASS' if ok1 else 'FAIL'}: hash_tensor = {ratio:.2f}x clone (target <= {HASH_VS_CLONE_MAX}x)")
    print(f"  {'PASS' if ok2 else 'FAIL'}: hash_tensor is {speedup:.1f}x faster than host md5 (target >= {MD5_VS_HASH_MIN}x)")
    if not ok1:
        failures.append(f"{dtype}: hash {ratio:.2f}x clone")
    if not ok2:
        failures.append(f"{dtype}: only {speedup:.1f}x faster than md5")
    return failures


def bench_small(reps: int) -> None:
    one = torch.randn(10)
    batch = [torch.randn(10) for _ in range(256)]
    calls = 2000
    best = best_times({"single": lambda: [hash_tensor(one) for _ in range(calls)],
                       "batched": lambda: hash_tensors(batch)}, reps)
    single, batched = best["single"] / calls, best["batched"] / len(batch)
    print(f"\nsmall tensors: hash_tensor(10 elements) {single * 1e6:.1f} us/tensor; "
          f"hash_tensors(256 x 10 elements) {batched * 1e6:.1f} us/tensor")


def _each(fn: Callable[[torch.Tensor], object], ts: List[torch.Tensor]) -> None:
    for t in ts:  # each result dropped at once, as a traced step drops its buffers
        fn(t)


def bench_traced(reps: int) -> None:
    """512 KiB float32 tensors captured one at a time, in cache and from memory (see the module doc)."""
    torch.set_num_threads(1)
    size = 512 * 1024
    hot = [torch.randn(size // 4)]
    cold = [torch.randn(size // 4) for _ in range((128 << 20) // size)]

    def capture(stats: Optional[str], ts: List[torch.Tensor]) -> Callable[[], object]:
        def run():
            batch = FingerprintBatch(stats)
            for t in ts:
                batch.add(t)
            return batch.resolve()
        return run

    print(f"\ntraced tensors: 512 KiB float32, one thread, GB/s (min over {reps} rounds)")
    print(f"  {'method':<24}{'in cache':>10}{'from memory':>13}")
    for name, make in (("fingerprint + stats", lambda ts: capture("trace", ts)),
                       ("fingerprint", lambda ts: capture(None, ts)),
                       ("torch sum", lambda ts: lambda: _each(torch.sum, ts)),
                       ("torch clone", lambda ts: lambda: _each(torch.clone, ts))):
        hot_many = hot * len(cold)  # the same number of captures, of one tensor that stays in cache
        best = best_times({"hot": make(hot_many), "cold": make(cold)}, reps)
        rate = {k: size * len(cold) / v / 1e9 for k, v in best.items()}
        print(f"  {name:<24}{rate['hot']:>10.1f}{rate['cold']:>13.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Time determ's hash_tensor against clone, torch.hash_tensor, XOR and md5.")
    p.add_argument("--size-mib", type=int, default=256, help="size of each large test tensor in MiB (default 256)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per method; the minimum is reported (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--traced", action="store_true",
                   help="also time 512 KiB float32 tensors captured as tracing does, in cache and from memory")
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.reps < 1 or (args.threads is not None and args.threads < 1):
        p.error("--size-mib, --reps and --threads must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    failures: List[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        failures += print_table(dtype, args.size_mib, bench_large(dtype, args.size_mib, args.reps))
    bench_small(args.reps)
    if args.traced:
        bench_traced(args.reps)
    print("\nPASS" if not failures else "\nFAIL: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
