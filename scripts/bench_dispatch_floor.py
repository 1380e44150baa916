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
* ``Python mode + C++ bookkeeping``: the mode handing each op, once it ran, to one C++ call that does
  a sketch of what the recorder does per op -- the first user frame (a walk with a per-code cache), each
  input's producer by tensor identity, version counter and a storage weak pointer (first-seen inputs
  read and entered), each output read and entered, the running autograd node, a record as a C++
  struct. It names nothing and builds no Python records: a sketch of a recorder kept in C++, not a
  replacement for determ's;
* ``HashMode``: the real thing, fresh per step.

The rows between ``Python mode + read`` and ``HashMode`` are determ's per-op bookkeeping (names,
producer links, records) and the garbage collections its objects trigger; the C++ rows are the floor a
recorder below the Python dispatcher, or kept in C++ behind the Python mode, would start from. Skips
(exit 0) when the extension cannot be built (no C++ compiler or ninja).

Usage: python scripts/bench_dispatch_floor.py [--mode forward|train|both] [--rounds 11] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <frameobject.h>
#include <string>
#include <unordered_map>
#include <vector>

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

// -- the C++ bookkeeping sketch ------------------------------------------------------------------
struct Entry { int64_t rec; int64_t version; c10::weak_intrusive_ptr<c10::StorageImpl> storage; };
struct Rec { PyObject* op; uint64_t hash; int32_t first_input, n_inputs; PyCodeObject* code; int line; int64_t node; };
static std::unordered_map<const void*, Entry> producers;
static std::vector<Rec> recs;
static std::vector<int64_t> input_recs;
static std::unordered_map<PyCodeObject*, bool> internal_codes;  // the codes are kept alive: no pointer reuse
static std::vector<std::string> internal_roots;

static uint64_t read_words(const at::Tensor& t) {
    if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous()) return 0;
    const uint64_t* p = static_cast<const uint64_t*>(t.const_data_ptr());
    size_t n = t.nbytes() / 8;
    uint64_t a = 0, b = 0;
    for (size_t i = 0; i < n; i++) { a += p[i]; b ^= p[i]; }
    return a ^ (b << 1);
}

static bool is_internal(PyCodeObject* code) {
    auto it = internal_codes.find(code);
    if (it != internal_codes.end()) return it->second;
    const char* name = PyUnicode_AsUTF8(code->co_filename);
    bool internal = false;
    for (const auto& root : internal_roots)
        if (name && strncmp(name, root.c_str(), root.size()) == 0) { internal = true; break; }
    Py_INCREF(code);
    internal_codes.emplace(code, internal);
    return internal;
}

static int64_t new_rec(PyObject* op, uint64_t hash, int32_t first, int32_t n, PyCodeObject* code, int line) {
    auto node = torch::autograd::get_current_node();
    recs.push_back(Rec{op, hash, first, n, code, line, node ? (int64_t)node->sequence_nr() : -1});
    return (int64_t)recs.size() - 1;
}

static void enter(const at::Tensor& t, int64_t rec) {
    producers.insert_or_assign(static_cast<const void*>(t.unsafeGetTensorImpl()),
                               Entry{rec, t._version(), t.storage().getWeakStorageImpl()});
}

static void add_input(PyObject* a, PyCodeObject* code, int line) {
    if (!THPVariable_Check(a)) return;
    const at::Tensor& t = THPVariable_Unpack(a);
    auto it = producers.find(t.unsafeGetTensorImpl());
    if (it != producers.end() && it->second.version == t._version() && !it->second.storage.expired()) {
        input_recs.push_back(it->second.rec);
        return;
    }
    int64_t r = new_rec(nullptr, read_words(t), 0, 0, code, line);
    enter(t, r);
    input_recs.push_back(r);
}

static void add_inputs(PyObject* a, PyCodeObject* code, int line) {
    if (PyList_Check(a) || PyTuple_Check(a)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        for (Py_ssize_t i = 0; i < n; i++) add_input(PySequence_Fast_ITEMS(a)[i], code, line);
    } else {
        add_input(a, code, line);
    }
}

void sketch_roots(std::vector<std::string> roots) { internal_roots = std::move(roots); }

void sketch_op(py::handle func, py::tuple args, py::dict kwargs, py::handle out) {
    PyFrameObject* f = PyEval_GetFrame();
    Py_XINCREF(f);
    PyCodeObject* code = nullptr;
    int line = 0;
    while (f != nullptr) {
        PyCodeObject* c = PyFrame_GetCode(f);
        bool internal = is_internal(c);
        Py_DECREF(c);  // internal_codes holds it
        if (!internal) {
            code = c;
            line = PyFrame_GetLineNumber(f);
            Py_DECREF(f);
            break;
        }
        PyFrameObject* back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    int32_t first = (int32_t)input_recs.size();
    for (auto a : args) add_inputs(a.ptr(), code, line);
    for (auto kv : kwargs) add_inputs(kv.second.ptr(), code, line);
    int32_t n = (int32_t)input_recs.size() - first;
    auto output = [&](PyObject* x) {
        if (!THPVariable_Check(x)) return;
        const at::Tensor& t = THPVariable_Unpack(x);
        enter(t, new_rec(func.ptr(), read_words(t), first, n, code, line));
    };
    PyObject* o = out.ptr();
    if (PyTuple_Check(o) || PyList_Check(o)) {
        Py_ssize_t k = PySequence_Fast_GET_SIZE(o);
        for (Py_ssize_t i = 0; i < k; i++) output(PySequence_Fast_ITEMS(o)[i]);
    } else {
        output(o);
    }
}

int64_t sketch_reset() {
    int64_t n = (int64_t)recs.size();
    recs.clear();
    input_recs.clear();
    producers.clear();
    return n;
}
"""


def build():
    """The callback extension, or None (with the reason on stderr) when it cannot be built here."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("determ_dispatch_floor", cpp_sources=_SOURCE, functions=["start", "stop", "counts", "sketch_roots", "sketch_op", "sketch_reset"],
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


class _SketchMode(_compat.TorchDispatchMode):
    """Runs the op, then hands it to the C++ bookkeeping sketch; its records are dropped when it exits."""

    def __init__(self, ext):
        super().__init__()
        self.ext = ext
        self.records = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ext.sketch_op(func, args, kwargs, out)
        return out

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.records = self.ext.sketch_reset()


def _internal_roots() -> list:
    """Where code that is not the user's lives, for the sketch's frame walk: the roots determ's own frame filter
    skips (torch, determ, the standard library), and this script."""
    from determ_backend._frames import FrameFilter

    return [*FrameFilter().roots, os.path.abspath(__file__)]


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
    out["Python mode + C++ bookkeeping"] = under(lambda: _SketchMode(ext))
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
    ext.sketch_roots(_internal_roots())
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
        sketch = _SketchMode(ext)
        with sketch:
            step()
        print(f"the C++ callback saw {after[0] - before[0]} ops a step and read {(after[1] - before[1]) / 2**20:.1f} MiB; "
              f"the C++ bookkeeping sketch made {sketch.records} records a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
