#!/usr/bin/env python
"""Cost of the eager tools on a model's forward (under no_grad) and on a training step.

Times, in one process and interleaved round-robin (a round runs every variant ``--steps``
steps), a plain step and the same step under ``HashMode``, ``HashDebugTrace`` (text log +
JSONL), PyTorch's ``DebugMode`` with tensor hashes (``hash_tensor`` and ``norm``), and an
md5-on-host tracer like the original ``HashDebugTrace``.  ``HashMode`` is a fresh mode per step
(in a training step every parameter and optimizer state is hashed as an input first);
``HashMode (left on)`` is one mode enabled around every step, so only the values a step
produces are hashed.

Shapes: ``small`` is the MLP of width 256, batch 64, depth 4; ``large`` is the MLP of width 1024,
batch 256, depth 4 (``--width``, ``--batch``, ``--depth`` change it; ``--model transformer``
makes it a small transformer encoder on ``--seq`` tokens instead, in both modes).  Modes:
``forward`` is the model's forward under ``torch.no_grad()``; ``train`` is forward +
cross-entropy + backward + an optimizer step (SGD with momentum, or ``--optimizer adamw``).

Prints one table per (shape, mode): each variant's median ms/step and its ratio, the median over
rounds of (variant / the plain step of the same round); then PASS/FAIL per (shape, mode) for the
targets: ``HashMode`` <= 2x plain, ``HashMode``'s overhead (ratio - 1) <= 0.6x ``DebugMode hash_tensor``'s,
and ``HashDebugTrace`` <= 3x plain.  ``--memory-steps N`` then runs N training steps of the small
shape with one ``HashMode(keep_records=False)`` enabled for the whole run, sampling the process
RSS every N/10 steps: PASS if it ends at most 32 MiB above its value after the first tenth.  ``--long-steps N``
runs N small training steps with one ``HashMode`` left on against N plain ones, in ten alternating chunks, and
counts the full garbage collections each side paid for (the short rounds never reach one): PASS if the median
chunk ratio is within the HashMode target.
Exit 0 when everything passes, 1 otherwise.  Results go to stdout, progress to stderr.

    .venv/bin/python scripts/bench_eager_tools.py [--shape small|large|both] [--mode forward|train|both]
        [--rounds 7] [--steps 3] [--threads 1] [--memory-steps 0] [--long-steps 0] [--only VARIANT ...]
        [--model mlp|transformer] [--width 1024] [--depth 4] [--batch 256] [--seq 32]   # the large shape
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _bench_common import debug_mode_hashing, memory_check, print_table, ratio_to, time_rounds
from determ_backend.modes.core import HashDebugTrace, HashMode

SMALL = {"model": "mlp", "width": 256, "batch": 64, "depth": 4}
CLASSES = 10
DEBUG_MODE_FACTOR, TRACE_LIMIT, MEMORY_LIMIT_MIB = 0.6, 3.0, 32.0


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
        self.head = torch.nn.Linear(width, CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True,
                                                 dropout=0.0)
        self.body = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, CLASSES)

    def forward(self, x):
        return self.head(self.body(x).mean(1))


def shapes(args) -> Dict[str, Dict[str, object]]:
    """shape name -> its model kind and sizes."""
    return {"small": dict(SMALL),
            "large": {"model": args.model, "width": args.width, "batch": args.batch, "depth": args.depth}}


def describe(shape: Dict[str, object], seq: int) -> str:
    tokens = f", seq {seq}" if shape["model"] == "transformer" else ""
    return f"{shape['model']} width {shape['width']} depth {shape['depth']} batch {shape['batch']}{tokens}"


def make_step(shape: Dict[str, object], mode: str, args) -> Callable[[], None]:
    """One step of a fresh model: its forward under no_grad, or a training step."""
    torch.manual_seed(0)
    width, depth, batch = shape["width"], shape["depth"], shape["batch"]
    if shape["model"] == "mlp":
        model = MLP(width, depth)
        x = torch.randn(batch, width)
    else:
        model = TinyTransformer(width, depth)
        x = torch.randn(batch, args.seq, width)
    if mode == "forward":
        def forward():
            with torch.no_grad():
                model(x)

        return forward
    y = torch.randint(0, CLASSES, (batch,))
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


def variants(log: Path, left_on: HashMode, debug_mode: bool) -> Dict[str, Callable[[], object]]:
    """name -> factory of a context manager per step (None = plain step)."""
    out: Dict[str, Callable[[], object]] = {
        "plain": lambda: None,
        "HashMode": lambda: HashMode(),
        "HashMode (left on)": lambda: _region(left_on),
        "HashDebugTrace": lambda: HashDebugTrace(log_path=log),
        "md5-on-host tracer": lambda: Md5HostTracer(),
    }
    if debug_mode:
        out["DebugMode hash_tensor"] = lambda: debug_mode_hashing("hash_tensor")
        out["DebugMode norm"] = lambda: debug_mode_hashing("norm")
    return out


def under(step: Callable[[], None], factory: Callable[[], object]) -> Callable[[], None]:
    """``step`` run inside a fresh context from ``factory`` (none for the plain step)."""
    def run_step():
        ctx = factory()
        if ctx is None:
            step()
        else:
            with ctx:
                step()

    return run_step


def _picked(choice: str, both: Tuple[str, str]) -> Tuple[str, ...]:
    return both if choice == "both" else (choice,)


def checks(ratios: Dict[str, float], target: float) -> List[Tuple[str, Optional[bool]]]:
    """(what, passed) for the targets of one (shape, mode); passed None: not measured."""
    out: List[Tuple[str, Optional[bool]]] = []
    if "HashMode" in ratios:
        r = ratios["HashMode"]
        out.append((f"HashMode <= {target:g}x plain ({r:.2f}x)", r <= target))
        ref = ratios.get("DebugMode hash_tensor")
        if ref is None:
            out.append(("HashMode vs DebugMode hash_tensor: not measured (no DebugMode in this torch, or --only)",
                        None))
        else:  # costs compared: what each adds to the plain step (on the large shape both ratios are near 1)
            limit = DEBUG_MODE_FACTOR * (ref - 1)
            out.append((f"HashMode's overhead <= {DEBUG_MODE_FACTOR:g}x DebugMode hash_tensor's "
                        f"(+{r - 1:.2f} vs +{ref - 1:.2f}: limit +{limit:.2f})", r - 1 <= limit))
    if "HashDebugTrace" in ratios:
        r = ratios["HashDebugTrace"]
        out.append((f"HashDebugTrace <= {TRACE_LIMIT:g}x plain ({r:.2f}x)", r <= TRACE_LIMIT))
    return out


def long_run(step: Callable[[], None], n: int, target: float) -> bool:
    """``n`` training steps with one ``HashMode(keep_records=False)`` left on, against the plain step, in ten
    alternating chunks of each (the mode is disabled for the plain chunks, so both see the same heap and the
    same collector).  Short rounds never reach the collector's full collections, which a long run pays for every
    object its tools keep long enough to reach the oldest generation; counted here per side."""
    from tqdm import tqdm

    chunk = max(1, n // 10)
    full = {"plain": [0, 0.0], "HashMode": [0, 0.0]}
    side, started = ["plain"], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                full[side[0]][0] += 1
                full[side[0]][1] += time.perf_counter() - started[0]

    mode = HashMode(keep_records=False)
    ratios: List[float] = []
    times: Dict[str, List[float]] = {"plain": [], "HashMode": []}
    gc.callbacks.append(on_gc)
    try:
        for _ in tqdm(range(10), desc="long run chunks", file=sys.stderr):
            pair = {}
            for name in ("plain", "HashMode"):
                side[0] = name
                if name == "HashMode":
                    mode.enable()
                try:
                    t0 = time.perf_counter()
                    for _ in range(chunk):
                        step()
                    pair[name] = (time.perf_counter() - t0) / chunk
                finally:
                    if name == "HashMode":
                        mode.disable()
                times[name].append(pair[name])
            ratios.append(pair["HashMode"] / pair["plain"])
    finally:
        gc.callbacks.remove(on_gc)
        mode.close()
    r = statistics.median(ratios)
    print(f"\n== long run: small/train, {10 * chunk} steps each side in 10 alternating chunks; one "
          f"HashMode(keep_records=False) left on")
    for name in ("plain", "HashMode"):
        count, secs = full[name]
        print(f"{name:10s} {statistics.median(times[name]) * 1e3:8.2f} ms/step  full collections {count} "
              f"({secs * 1e3:.0f} ms)")
    ok = r <= target
    print(f"{'PASS' if ok else 'FAIL'} long run: HashMode left on <= {target:g}x plain ({r:.2f}x, median of chunk "
          f"ratios)")
    return ok


def run(args) -> int:
    torch.set_num_threads(args.threads)
    probe = debug_mode_hashing("hash_tensor")  # enters the mode: close it at once
    if probe is not None:
        probe.close()
    else:
        print(f"note: torch {torch.__version__} has no DebugMode tensor hashing; its variants are skipped",
              file=sys.stderr)
    sizes = shapes(args)
    combos = [(s, m) for s in _picked(args.shape, ("small", "large")) for m in _picked(args.mode, ("forward", "train"))]
    verdicts: List[bool] = []
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as modes:
        cases: Dict[Tuple[str, str, str], Callable[[], None]] = {}
        for shape, mode in combos:
            left_on = HashMode(keep_records=False)
            modes.callback(left_on.close)
            step = make_step(sizes[shape], mode, args)
            for name, factory in variants(Path(d) / f"{shape}-{mode}.log", left_on, probe is not None).items():
                if not args.only or name == "plain" or name in args.only:
                    cases[(shape, mode, name)] = under(step, factory)
        print(f"warming up {len(cases)} variants ...", file=sys.stderr)
        for case in cases.values():  # first-call costs out of the measurement
            for _ in range(2):
                case()
        times = time_rounds(cases, args.rounds, args.steps)

        print(f"optimizer={args.optimizer} threads={args.threads} rounds={args.rounds} steps/round={args.steps} "
              f"torch={torch.__version__}")
        for shape, mode in combos:
            here = {name: t for (s, m, name), t in times.items() if (s, m) == (shape, mode)}
            ratios = {name: ratio_to(t, here["plain"]) for name, t in here.items()}
            what = "forward under no_grad" if mode == "forward" else f"training step ({args.optimizer})"
            print_table(f"{shape}/{mode}: {describe(sizes[shape], args.seq)}; {what}",
                        [(name, statistics.median(t), ratios[name], "plain" if name != "plain" else "")
                         for name, t in here.items()])
            for what, ok in checks(ratios, args.target):
                print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {shape}/{mode}: {what}")
                if ok is not None:
                    verdicts.append(ok)

        if args.memory_steps:
            step = make_step(sizes["small"], "train", args)
            mode = HashMode(trace_path=os.path.join(d, "memory.jsonl"), keep_records=False)  # written as it goes
            modes.callback(mode.close)
            mode.enable()  # once, for the whole run
            try:
                step()
                verdicts.append(memory_check(step, args.memory_steps,
                                             f"small/train with one HashMode(trace_path=..., keep_records=False) left on "
                                             f"({describe(sizes['small'], args.seq)})", MEMORY_LIMIT_MIB))
            finally:
                mode.disable()
        if args.long_steps:
            verdicts.append(long_run(make_step(sizes["small"], "train", args), args.long_steps, args.target))
    failed = verdicts.count(False)
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(verdicts) - failed} of {len(verdicts)} checks passed")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["small", "large", "both"], default="both",
                   help="small: MLP width 256 batch 64 depth 4; large: --model at --width/--batch/--depth "
                        "(default both)")
    p.add_argument("--mode", choices=["forward", "train", "both"], default="both",
                   help="forward under no_grad, or a training step (default both)")
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp",
                   help="large shape: model kind (default mlp; the small shape is always the MLP)")
    p.add_argument("--width", type=int, default=1024, help="large shape: hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="large shape: hidden layers / blocks (default 4)")
    p.add_argument("--batch", type=int, default=256, help="large shape: batch size (default 256)")
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
    p.add_argument("--memory-steps", type=int, default=0, metavar="N",
                   help="N training steps (small shape) with one HashMode(keep_records=False) left on, checking "
                        "that the RSS stays flat (default 0: skip)")
    p.add_argument("--long-steps", type=int, default=0, metavar="N",
                   help="N training steps (small shape) with one HashMode left on against N plain steps, in "
                        "alternating chunks, counting full garbage collections (default 0: skip)")
    args = p.parse_args(argv)
    for name in ("width", "depth", "batch", "seq", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive integer")
    if args.memory_steps < 0:
        p.error("--memory-steps: expected a non-negative integer")
    if args.long_steps < 0:
        p.error("--long-steps: expected a non-negative integer")
    if args.model == "transformer" and args.width % 4:
        p.error("--width: expected a multiple of 4 for the transformer (4 heads)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
