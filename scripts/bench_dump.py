#!/usr/bin/env python3
"""Benchmark the API dump: determ (tensor and statistics modes) vs msprobe vs plain ``torch.save``.

The same small CNN and training steps are run undumped, dumped by determ in
tensor mode and in statistics mode, and -- when a Python with
``mindstudio-probe`` is given in ``DETERM_MSPROBE_PYTHON`` -- dumped by msprobe
(task ``tensor`` and ``statistics``, level L1) in a subprocess.  The ceiling is
``torch.save`` of the same tensors (every input and output of every API call,
one file per tensor as msprobe writes them; one file per step is printed too).

Throughput is ptdbg's definition: tensor bytes dumped / (dumped step time -
undumped step time).  For determ the bytes are the logical bytes covered
(duplicates included; each distinct tensor is written once); bytes actually
written are printed next to it.  The first dumped step (hook installation) is
not timed.  Targets: determ tensor >= 3x msprobe tensor and >= 0.7x the
torch.save ceiling; determ statistics overhead <= half of msprobe's.

Usage: python scripts/bench_dump.py [--steps 5] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_SRC = r'''
import time, torch, torch.nn as nn, torch.nn.functional as F

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 16 * 16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

def build(batch):
    torch.manual_seed(0)
    net = CNN()
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, 3, 64, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
    return net, data

def train_step(net, data):
    x, t = data
    net.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), t).backward()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(p.grad, alpha=-0.01)

def timed_steps(net, data, n):
    """[(wall seconds, process CPU seconds -- all threads)] per step."""
    out = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(net, data)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out
'''

MSPROBE_SRC = MODEL_SRC + r'''
import json, os, sys
task, out, steps, batch, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
net, data = build(batch)
timed_steps(net, data, 1)
base = timed_steps(net, data, steps)  # a plain step: before msprobe is imported (its import patches torch)
from msprobe.pytorch import PrecisionDebugger
cfg = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "L1", "async_dump": False,
       task: {"scope": [], "list": [], "data_mode": ["all"]}}
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f)
dbg = PrecisionDebugger(config_path=os.path.join(out, "config.json"))
times = []
for i in range(steps + 1):
    t0, c0 = time.perf_counter(), time.process_time()
    dbg.start()
    train_step(net, data)
    dbg.stop()
    dbg.step()
    times.append((time.perf_counter() - t0, time.process_time() - c0))
first = None
sizes = {}
for root, _, files in os.walk(out):
    for fn in files:
        p = os.path.join(root, fn)
        step = next((s for s in p.split(os.sep) if s.startswith("step") and s[4:].isdigit()), None)
        sizes[step] = sizes.get(step, 0) + os.path.getsize(p)
timed_bytes = sum(v for k, v in sizes.items() if k not in (None, "step0"))
print(json.dumps({"base": base, "dump": times[1:], "bytes": timed_bytes}))
'''


def _median(xs):
    return statistics.median(xs)


def _logical_bytes(index_path: Path) -> tuple:
    from determ_backend.dump import read_dump

    d = read_dump(index_path)
    import torch

    total, tensors = 0, []
    for e in d.entries:
        for t in e.get("inputs", []) + e.get("outputs", []):
            if "dtype" in t:
                n = 1
                for s in t["shape"]:
                    n *= s
                total += n * getattr(torch, t["dtype"].replace("torch.", "")).itemsize
                if "payload" in t:
                    tensors.append(t)
    return total, d, tensors


def bench_determ(ns, mode: str, work: Path) -> dict:
    import torch

    from determ_backend import dump

    scope = {}
    exec(MODEL_SRC, scope)
    net, data = scope["build"](ns.batch)
    scope["timed_steps"](net, data, 1)
    base = scope["timed_steps"](net, data, ns.steps)
    dump.set_dump_path(work, dump_tag=f"determ_{mode}")
    dump.set_dump_switch("ON", summary_only=(mode == "statistics"))
    scope["timed_steps"](net, data, 1)  # first dumped step: hook set-up, not timed
    times = scope["timed_steps"](net, data, ns.steps)
    t0, c0 = time.perf_counter(), time.process_time()
    dump.set_dump_switch("OFF")
    flush = (time.perf_counter() - t0, time.process_time() - c0)  # finishing the files counts, spread over the steps
    times = [(w + flush[0] / len(times), c + flush[1] / len(times)) for w, c in times]
    dump.remove_hooks()
    rank = work / f"determ_{mode}" / "rank0"
    logical, d, tensors = _logical_bytes(rank / "dump.pkl")
    written = sum(p.stat().st_size for p in rank.rglob("*") if p.is_file())
    frac = ns.steps / (ns.steps + 1)
    return {"base": base, "dump": times, "logical": logical * frac, "written": written * frac, "dump_obj": d,
            "tensors": tensors, "torch": torch}


def bench_torch_save(det: dict, work: Path, steps_frac: float) -> dict:
    torch = det["torch"]
    d = det["dump_obj"]
    tensors = [d.tensor(t).clone() for t in det["tensors"]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = work / "torch_save"
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        torch.save(t, out / f"{i}.pt")
    per_file = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.save({str(i): t for i, t in enumerate(tensors)}, out / "all.pt")
    one_file = time.perf_counter() - t0
    shutil.rmtree(out)
    return {"bytes": nbytes, "per_file_gbs": nbytes / per_file / 1e9, "one_file_gbs": nbytes / one_file / 1e9}


def bench_msprobe(ns, task: str, work: Path):
    py = os.environ.get("DETERM_MSPROBE_PYTHON")
    if not py:
        return None, "DETERM_MSPROBE_PYTHON not set"
    chk = subprocess.run([py, "-c", "import msprobe.pytorch"], capture_output=True, text=True)
    if chk.returncode != 0:
        return None, f"msprobe not importable with {py}"
    out = work / f"msprobe_{task}"
    out.mkdir(parents=True)
    r = subprocess.run([py, "-c", MSPROBE_SRC, task, str(out), str(ns.steps), str(ns.batch), str(ns.threads)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return None, f"msprobe run failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def _overhead(res: dict, which: int) -> tuple:
    """Fastest undumped and dumped step (least disturbed by other load): ``(base, overhead per step)``;
    ``which``: 0 wall time, 1 process CPU time (all threads: the fairest measure on a shared machine)."""
    b = min(x[which] for x in res["base"])
    d = min(x[which] for x in res["dump"])
    return b, d - b


def _merge(results: dict, name: str, res: dict) -> None:
    old = results.get(name)
    if old is None:
        results[name] = res
    else:
        old["base"] += res["base"]
        old["dump"] += res["dump"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed dumped steps (default 5)")
    ap.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every process (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all tools; the fastest step is kept (default 3)")
    ns = ap.parse_args(argv)
    import torch

    torch.set_num_threads(ns.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_dump_"))
    try:
        results, ceiling, skipped = {}, None, {}
        for r in range(ns.rounds):  # rounds interleave the tools; the fastest step of all rounds is kept
            for mode in ("tensor", "statistics"):
                _merge(results, f"determ {mode}", bench_determ(ns, mode, work / f"r{r}"))
            c = bench_torch_save(results["determ tensor"], work / f"r{r}", 1.0)
            ceiling = c if ceiling is None else {k: max(v, c[k]) for k, v in ceiling.items()}
            for task in ("tensor", "statistics"):
                res, why = bench_msprobe(ns, task, work / f"r{r}")
                if res is None:
                    skipped[task] = why
                else:
                    res["logical"] = res["written"] = res["bytes"]
                    _merge(results, f"msprobe {task}", res)
            if r:
                shutil.rmtree(work / f"r{r}", ignore_errors=True)
        for task, why in skipped.items():
            print(f"msprobe {task}: skipped ({why})")
        print(f"model: small CNN, batch {ns.batch}, {ns.steps} timed steps, torch threads {ns.threads}, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print("fastest step over all rounds; overhead = dumped / plain step - 1; GB/s = MB per step / overhead "
              "seconds per step; CPU = process CPU time of all threads")
        print(f"{'tool':20} {'step ms':>8} {'dumped ms':>10} {'overhead':>9} {'CPU ovh':>8} {'MB/step':>8} "
              f"{'written MB/step':>16} {'GB/s':>6} {'CPU GB/s':>9}")
        summary = {}
        for name, res in results.items():
            b, per_step = _overhead(res, 0)
            cb, cper = _overhead(res, 1)
            mb = res["logical"] / ns.steps / 1e6
            wmb = res["written"] / ns.steps / 1e6
            tensor = "tensor" in name
            gbs = mb / 1e3 / max(per_step, 1e-9) if tensor else float("nan")
            cgbs = mb / 1e3 / max(cper, 1e-9) if tensor else float("nan")
            summary[name] = {"overhead": per_step / b, "cpu_overhead": cper / cb, "gbs": gbs, "cpu_gbs": cgbs}
            print(f"{name:20} {b * 1e3:8.1f} {(b + per_step) * 1e3:10.1f} {per_step / b:8.2f}x {cper / cb:7.2f}x "
                  f"{mb:8.1f} {wmb:16.1f} {gbs:6.2f} {cgbs:9.2f}")
        print(f"{'torch.save ceiling':20} per-file {ceiling['per_file_gbs']:.2f} GB/s, one file per step "
              f"{ceiling['one_file_gbs']:.2f} GB/s ({ceiling['bytes'] / 1e6:.1f} MB: every dumped tensor, duplicates included)")
        ok = True
        dt, dct = summary["determ tensor"]["gbs"], summary["determ tensor"]["cpu_gbs"]
        checks = [("determ tensor >= 0.7x torch.save ceiling (per-file)", dt >= 0.7 * ceiling["per_file_gbs"],
                   f"{dt:.2f} vs {0.7 * ceiling['per_file_gbs']:.2f} GB/s")]
        if "msprobe tensor" in summary:
            mt, mct = summary["msprobe tensor"]["gbs"], summary["msprobe tensor"]["cpu_gbs"]
            checks.append(("determ tensor >= 3x msprobe tensor (wall)", dt >= 3 * mt, f"{dt:.2f} vs {3 * mt:.2f} GB/s"))
            checks.append(("determ tensor >= 3x msprobe tensor (CPU)", dct >= 3 * mct, f"{dct:.2f} vs {3 * mct:.2f} GB/s"))
        if "msprobe statistics" in summary:
            for kind, key in (("wall", "overhead"), ("CPU", "cpu_overhead")):
                ds, ms = summary["determ statistics"][key], summary["msprobe statistics"][key]
                checks.append((f"determ statistics overhead <= 0.5x msprobe's ({kind})", ds <= 0.5 * ms,
                               f"{ds:.2f}x vs {0.5 * ms:.2f}x"))
        for label, passed, detail in checks:
            ok &= passed
            print(f"{'PASS' if passed else 'FAIL'}  {label}: {detail}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
