#!/usr/bin/env python3
"""Where the eager tools' cost floor lies: op interception in Python against op interception in C++.

On the small shape of ``bench_eager_tools.py`` (MLP width 256, batch 64: ~120 ops a training step on
64-256 KiB tensors) this times, side by side with a plain step:

* ``C++ op callback``: a RecordFunction callback (torch's C++ profiler hook, built here with
  ``torch.utils.cpp_extension``) that sees every op and does nothing -- what intercepting ops costs
  below the Python dispatcher;
* ``C++ op callback + read``: the same callback reading every output tensor once (a vectorized sum of its
  words). RecordFunction sees every dispatcher call, the nested ones too (``linear`` and the ``t`` and
  ``addmm`` it runs), so it reads more bytes than a dispatch mode would: an upper bound of the read cost;
* ``Python null mode``: a ``__torch_dispatch__`` mode that only calls the op;
* ``Python mode + read``: that mode reading every output with determ's native fingerprint kernel;
* ``HashMode``: the real thing, fresh per step.

The rows between ``Python mode + read`` and ``HashMode`` are determ's per-op bookkeeping (names,
producer links, records) and the garbage collections its objects trigger; the C++ rows are the floor a
recorder below the Python dispatcher would start from. Skips (exit 0) when the extension cannot be
built (no C++ compiler or ninja).

Usage: python scripts/bench_dispatch_floor.py [--mode forward|train|both] [--rounds 11] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _bench_common import print_table, ratio_to, time_rounds  # noqa: E402
from bench_eager_tools import SMALL, describe, make_step  # noqa: E402
from determ_backend import _torch_compat as _compat  # noqa: E402
from determ_backend.fingerprint import _native  # noqa: E402
from determ_backend.fingerprint.core import fingerprint_now  # noqa: E402
from determ_backend.modes.core import HashMode  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>

static at::CallbackHandle handle = 0;
static bool reading = false;
static uint64_t ops = 0, bytes = 0, sink = 0;

static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction&) { return nullptr; }

static void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
    ops++;
    if (!reading) return;
    for (const auto& v : fn.outputs()) {
        if (!v.isTensor()) continue;
        const at::Tensor& t = v.toTensor();
        if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous()) continue;
        const uint64_t* p = static_cast<const uint64_t*>(t.const_data_ptr());
        size_t n = t.nbytes() / 8;
        uint64_t s = 0;
        for (size_t i = 0; i < n; i++) s += p[i];
        sink += s;
        bytes += t.nbytes();
    }
}

void start(bool read) {
    reading = read;
    handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_enter, on_exit).needsOutputs(read)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void stop() { at::removeCallback(handle); }

std::vector<uint64_t> counts() { return {ops, bytes, sink}; }
"""


def build():
    """The callback extension, or None (with the reason on stderr) when it cannot be built here."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("determ_dispatch_floor", cpp_sources=_SOURCE, functions=["start", "stop", "counts"],
                           extra_cflags=["-O3", "-march=native"])
    except Exception as e:  # no compiler, no ninja, headers missing: nothing to measure
        print(f"SKIP: the C++ op callback could not be built ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
              file=sys.stderr)
        return None


class _NullMode(_compat.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _ReadMode(_compat.TorchDispatchMode):
    """Calls the op, then reads each output tensor once with determ's native kernel."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                fingerprint_now(t, False, self.kernel, False)
        return out


def variants(step: Callable[[], None], ext) -> Dict[str, Callable[[], None]]:
    def callback(read: bool):
        def run():
            ext.start(read)
            try:
                step()
            finally:
                ext.stop()
        return run

    def under(factory):
        def run():
            with factory():
                step()
        return run

    kernel = _native.kernel()
    out = {"plain": step, "C++ op callback": callback(False), "C++ op callback + read": callback(True),
           "Python null mode": under(_NullMode)}
    if kernel is not None:
        out["Python mode + read"] = under(lambda: _ReadMode(kernel))
    out["HashMode"] = under(HashMode)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["forward", "train", "both"], default="both")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    ext = build()
    if ext is None:
        return 0
    torch.set_num_threads(args.threads)
    step_args = argparse.Namespace(seq=32, optimizer="sgd")
    for mode in (("forward", "train") if args.mode == "both" else (args.mode,)):
        step = make_step(dict(SMALL), mode, step_args)
        cases = variants(step, ext)
        for case in cases.values():
            case()
            case()
        times = time_rounds(cases, args.rounds, args.steps)
        what = "forward under no_grad" if mode == "forward" else "training step (sgd)"
        print_table(f"small/{mode}: {describe(dict(SMALL), 32)}; {what}",
                    [(name, statistics.median(t), ratio_to(t, times["plain"]), "plain" if name != "plain" else "")
                     for name, t in times.items()])
        before = ext.counts()
        cases["C++ op callback + read"]()
        after = ext.counts()
        print(f"the C++ callback saw {after[0] - before[0]} ops a step and read {(after[1] - before[1]) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
