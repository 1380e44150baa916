#!/usr/bin/env python
"""Cost of the eager tools on one training step (forward + backward + optimizer step).

Times, in one process and interleaved round by round, a plain step and the same step under
``HashMode``, ``HashDebugTrace`` (text log + JSONL), PyTorch's ``DebugMode`` with tensor hashes
(``hash_tensor`` and ``norm``), and an md5-on-host tracer like the original ``HashDebugTrace``.
Prints each median step time and its ratio to the plain step, then PASS/FAIL for the targets:
``HashMode`` <= 2x a plain step and faster than ``DebugMode`` hashing.  Exit 0 on PASS, 1 on FAIL.
``HashMode`` is a fresh mode per step (every parameter and optimizer state is hashed
as an input first); ``HashMode (left on)`` is one mode enabled around every step, so
only the values a step produces are hashed.

    .venv/bin/python scripts/bench_eager_tools.py [--model mlp|transformer] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from _bench_common import debug_mode_hashing
from determ_backend.modes.core import HashDebugTrace, HashMode


class Md5HostTracer(TorchDispatchMode):
    """Reference: copy every op output to the host and md5 it (what the original HashDebugTrace did)."""

    def __init__(self):
        super().__init__()
        self.hashes: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                self.hashes.append(hashlib.md5(data).hexdigest())
        return out


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layers: List[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True,
                                                 dropout=0.0)
        self.body = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(1))


def make_step(args) -> Callable[[], None]:
    torch.manual_seed(0)
    if args.model == "mlp":
        model = MLP(args.width, args.depth)
        x = torch.randn(args.batch, args.width)
    else:
        model = TinyTransformer(args.width, args.depth)
        x = torch.randn(args.batch, args.seq, args.width)
    y = torch.randint(0, 10, (args.batch,))
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


@contextlib.contextmanager
def _region(mode: HashMode) -> Iterator[None]:
    mode.enable()
    try:
        yield
    finally:
        mode.disable()  # flushes: the step's fingerprints are all computed


def variants(tmp: Path) -> Dict[str, Callable[[], object]]:
    """name -> factory of a context manager per step (None = plain step)."""
    left_on = HashMode(keep_records=False)
    out: Dict[str, Callable[[], object]] = {
        "plain": lambda: None,
        "HashMode": lambda: HashMode(),
        "HashMode (left on)": lambda: _region(left_on),
        "HashDebugTrace": lambda: HashDebugTrace(log_path=tmp / "trace.log"),
        "md5-on-host tracer": lambda: Md5HostTracer(),
    }
    probe = debug_mode_hashing("hash_tensor")  # enters the mode: close it at once
    if probe is not None:
        probe.close()
        out["DebugMode hash_tensor"] = lambda: debug_mode_hashing("hash_tensor")
        out["DebugMode norm"] = lambda: debug_mode_hashing("norm")
    return out


def timed(step: Callable[[], None], factory: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        ctx = factory()
        if ctx is None:
            step()
        else:
            with ctx:
                step()
    return (time.perf_counter() - t0) / n


def run(args) -> int:
    torch.set_num_threads(args.threads)
    step = make_step(args)
    with tempfile.TemporaryDirectory() as d:
        kinds = variants(Path(d))
        if args.only:
            kinds = {k: v for k, v in kinds.items() if k == "plain" or k in args.only}
        for factory in kinds.values():  # warm-up: first-call costs out of the measurement
            timed(step, factory, 2)
        times: Dict[str, List[float]] = {k: [] for k in kinds}
        for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
            for name, factory in kinds.items():
                times[name].append(timed(step, factory, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    # ratio: median over rounds of (variant / plain of the same round), robust to load drifting between rounds
    ratios = {k: statistics.median(t / p for t, p in zip(v, times["plain"])) for k, v in times.items()}
    print(f"model={args.model} width={args.width} depth={args.depth} batch={args.batch} "
          f"optimizer={args.optimizer} threads={args.threads} torch={torch.__version__}")
    print(f"{'variant':24} {'ms/step':>9} {'ratio':>7}   (ratio: median over rounds of variant / plain)")
    for k, v in med.items():
        print(f"{k:24} {v * 1e3:9.2f} {ratios[k]:7.2f}x")
    if "HashMode" not in med:
        return 0
    ratio = ratios["HashMode"]
    checks = [(f"HashMode <= {args.target:g}x plain step ({ratio:.2f}x)", ratio <= args.target)]
    for ref in ("DebugMode hash_tensor", "DebugMode norm"):
        if ref in ratios:
            checks.append((f"HashMode faster than {ref} ({ratio:.2f}x vs {ratios[ref]:.2f}x)", ratio < ratios[ref]))
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return 0 if all(ok for _, ok in checks) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp", help="model kind (default mlp)")
    p.add_argument("--width", type=int, default=1024, help="hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="number of hidden layers / blocks (default 4)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--seq", type=int, default=32, help="sequence length for the transformer (default 32)")
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round (default 3)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported (default 7)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="optimizer of the training step: SGD with momentum (default) or AdamW")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine, parallel regions stall on "
                        "descheduled threads and distort the ratios)")
    p.add_argument("--only", action="append", default=None, metavar="VARIANT",
                   help="time only this variant (and the plain step); repeatable")
    p.add_argument("--target", type=float, default=2.0, help="HashMode target ratio (default 2.0)")
    args = p.parse_args(argv)
    for name in ("width", "depth", "batch", "seq", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive integer")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
