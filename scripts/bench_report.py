#!/usr/bin/env python3
"""Benchmark: the HTML report of large traces -- its size, the time to write it, the time a browser takes.

A chain of ``n`` steps of four ops each with a nondeterministic row sum near its end is compiled with
``determ_eager`` and the determinism check (a real run, a real finding), for about 2,000 and 10,000
traced nodes; ``report.html`` is written as the run writes it, then loaded ``--loads`` times in headless
Chromium (from ``file://``, until its script has drawn the plot, the neighbourhood and the first table
page).  Printed per size: nodes, page size, seconds to write the page, median load seconds, and PASS/FAIL
against the targets: a 2,000-node page loads in under 2 s, a 10,000-node page stays a few MB (<= 8 MB).
Needs chromium and chromedriver (``apt-get install chromium chromium-driver``) and selenium; exits 0 with
a note when they are missing.

    .venv/bin/python scripts/bench_report.py
    .venv/bin/python scripts/bench_report.py --sizes 2000 --loads 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402  (the browser helper skips through pytest)
import torch  # noqa: E402

from backend_helpers import DeepChain  # noqa: E402
from determ_backend.backends import run as run_mod  # noqa: E402
from repro_tools.report import write_run_report  # noqa: E402

LOAD_TARGET_S = 2.0  # for the 2,000-node page
SIZE_TARGET_MB = 8.0


def _run(nodes: int, out: Path) -> Path:
    torch.compiler.reset()
    torch.manual_seed(0)
    steps = max(1, nodes // 4)  # four records per step: two muls, the sin and the add
    f = torch.compile(DeepChain(steps, at=0.9), backend="determ_eager",
                      options={"dir": str(out), "run_id": f"n{nodes}", "check": "determinism", "report": False})
    f(torch.randn(4, 16))
    run_mod.finish_all()
    return out / f"n{nodes}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2000,10000", help="approximate traced-node counts (default 2000,10000)")
    ap.add_argument("--loads", type=int, default=3, help="page loads per size; the median counts (default 3)")
    args = ap.parse_args(argv)
    from browser_helpers import load, open_browser

    try:
        driver = open_browser()
    except pytest.skip.Exception as e:
        print(f"bench_report: skipped: {e.msg}")
        return 0
    ok = True
    print(f"{'nodes':>7} {'page MB':>8} {'write s':>8} {'load s':>7}  verdict")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size in (int(s) for s in args.sizes.split(",")):
                run_dir = _run(size, Path(tmp))
                t0 = time.perf_counter()
                page = write_run_report(run_dir)
                write_s = time.perf_counter() - t0
                nodes = sum(1 for _ in open(run_dir / "pairs-0.jsonl"))
                loads = [load(driver, page) for _ in range(args.loads)]
                drawn = len(driver.find_elements("css selector", "#plot circle.pt"))
                mb = page.stat().st_size / (1 << 20)
                load_s = statistics.median(loads)
                good = drawn == nodes and mb <= SIZE_TARGET_MB and (nodes > 4000 or load_s < LOAD_TARGET_S)
                ok &= good
                print(f"{nodes:>7} {mb:>8.2f} {write_s:>8.2f} {load_s:>7.2f}  {'PASS' if good else 'FAIL'}"
                      f"  (loads {', '.join(f'{s:.2f}' for s in loads)}; {drawn} points drawn)")
    finally:
        driver.quit()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
