#!/usr/bin/env python3
"""Benchmark the API dump of a ``torch.compile``d model: what seeing inside the compiled graph costs.

One small CNN training step, compiled, timed in one process under:

* ``aot_eager``                         -- the baseline (plain backend, no dump);
* ``determ_aot_eager trace``            -- the determ backend tracing every FX node, no dump;
* ``determ_aot_eager trace + tensors``  -- the same storing every node tensor (``save_tensors``), no dump;
* ``aot_eager + dump (stats)``          -- the dump on, the compiled model an opaque region;
* ``determ_aot_eager + dump (stats)``   -- the dump on, every FX node an entry (fingerprints, statistics);
* ``determ_aot_eager + dump (tensor)``  -- the same with node tensors stored (``save_tensors``) and copied
  into the dump.

Printed: the fastest step time of each (after a warm-up step that compiles), its ratio to the
baseline, dump entries per step and bytes written.

Usage: python scripts/bench_dump_compiled.py [--steps 5] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from determ_backend import dump  # noqa: E402


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _step(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> None:
    F.cross_entropy(model(x), t).backward()
    model.zero_grad(set_to_none=True)


def _time(fn: Callable[[], None], steps: int) -> float:
    fn()  # warm-up: compiles
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _run(backend: str, work: Path, steps: int, batch: int, dump_mode: Optional[str],
         save_tensors: bool = False) -> Dict[str, float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    opts = {"dir": str(work / "determ"), "save_tensors": save_tensors} if backend.startswith("determ") else None
    model = torch.compile(CNN(), backend=backend, options=opts)
    x, t = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    if dump_mode is None:
        return {"step": _time(lambda: _step(model, x, t), steps)}
    tag = f"{backend}_{dump_mode}"
    dump.set_dump_path(work, dump_tag=tag)
    dump.register_hook(model, dump.acc_cmp_dump)
    dump.set_dump_switch("ON", summary_only=dump_mode == "stats")
    try:
        best = _time(lambda: _step(model, x, t), steps)
    finally:
        dump.set_dump_switch("OFF")
        dump.remove_hooks()
    d = dump.read_dump(work / tag / "rank0" / "dump.pkl")
    data = work / tag / "rank0" / "dump" / "tensors.bin"
    return {"step": best, "entries": len(d.entries) / (steps + 1),
            "bytes": (d.path.stat().st_size + (data.stat().st_size if data.exists() else 0)) / (steps + 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    ap.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("determ_backend").setLevel(logging.ERROR)
    configs = [("aot_eager", "aot_eager", None, False), ("determ_aot_eager trace", "determ_aot_eager", None, False),
               ("determ_aot_eager trace + tensors", "determ_aot_eager", None, True),
               ("aot_eager + dump (stats)", "aot_eager", "stats", False),
               ("determ_aot_eager + dump (stats)", "determ_aot_eager", "stats", False),
               ("determ_aot_eager + dump (tensor)", "determ_aot_eager", "tensor", True)]
    with tempfile.TemporaryDirectory() as tmp:
        results = {label: _run(backend, Path(tmp), args.steps, args.batch, mode, save)
                   for label, backend, mode, save in configs}
    base = results["aot_eager"]["step"]
    print(f"{'configuration':36s} {'step ms':>9s} {'x base':>7s} {'entries/step':>13s} {'bytes/step':>11s}")
    for label, r in results.items():
        entries = f"{r['entries']:.0f}" if "entries" in r else "-"
        size = f"{r['bytes'] / 1e3:.0f} kB" if "bytes" in r else "-"
        print(f"{label:36s} {r['step'] * 1e3:9.2f} {r['step'] / base:7.2f} {entries:>13s} {size:>11s}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DETERM_TRACE", "1")
    sys.exit(main())
