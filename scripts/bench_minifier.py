#!/usr/bin/env python3
"""Benchmark: determ's minifier vs PyTorch's fx_minifier on the same graphs with the same oracle.

Graphs of about 50, 200 and 800 nodes (MLP- and transformer-like, forward and
forward+backward, traced to aten with make_fx) carry one injected culprit: a
single erf node that a test compiler lowers wrongly (accuracy), refuses to
compile (compile error) or makes nondeterministic; in the full run also a real
inductor bug (``cpp.inject_relu_bug_TESTING_ONLY="accuracy"`` on the only relu).
Both minifiers run in this process, one after the other, asking the same oracle;
the process is warmed up first and every run of either minifier starts with cold
inductor caches, except that the input graph was compiled once before (untimed), as
by the failing run that produced the repro: in the level-4 flows both minifiers run
right after that compile, and a launcher run on the same machine finds it in the
on-disk cache.  ``--cold-input`` makes the input's compile cold as well (a repro
minified on another machine).  Each minifier runs ``--repeat`` times, interleaved,
and its fastest run counts (sub-second and g++-bound runs are noisy).  Printed per case: queries,
seconds and final node count for both, the ratios, and PASS/FAIL against the
targets on accuracy cases (<= 1/5 of the queries, <= 1/3 of the wall time, final
repro no larger); other cases must end no larger.

    .venv/bin/python scripts/bench_minifier.py --quick
    .venv/bin/python scripts/bench_minifier.py            # all sizes + real inductor cases
    .venv/bin/python scripts/bench_minifier.py --isolate --only inductor   # both as shipped, isolated
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from _bench_common import fresh_inductor_cache, fx_minifier  # noqa: E402
from repro_tools.minify.minifier import minify  # noqa: E402
from repro_tools.minify.isolate import Worker  # noqa: E402
from repro_tools.minify.oracles import InProcessRunner, OracleSpec  # noqa: E402

SQRT1_2 = 0.7071067811865476


def _act(h, kind):
    if kind == "erf":
        return h * 0.5 * (1.0 + torch.erf(h * SQRT1_2))
    if kind == "relu":
        return torch.relu(h)
    return h * 0.5 * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * h * h * h)))


def _trace(fwd, params, x, backward):
    if not backward:
        return make_fx(fwd)(x, *params), [x, *params]

    def fwd_bwd(x, *ps):
        ps = [p.detach().requires_grad_(True) for p in ps]
        out = fwd(x, *ps)
        return (out.detach(), *torch.autograd.grad(out.pow(2).mean(), ps))

    return make_fx(fwd_bwd)(x, *params), [x, *params]


def mlp(layers, backward, culprit="erf", width=16):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(width, width, generator=gen) / math.sqrt(width) for _ in range(layers)]
    x = torch.randn(8, width, generator=gen)

    def fwd(x, *ws):
        h = x
        for i, w in enumerate(ws):
            h = torch.nn.functional.layer_norm(_act(h @ w, culprit if i == layers // 2 else "tanh"), (width,))
        return h

    return _trace(fwd, params, x, backward)


def transformer(layers, backward, culprit="erf", d=16, heads=2, seq=8):
    gen = torch.Generator().manual_seed(0)
    shapes = [(d, 3 * d), (d, d), (d, 2 * d), (2 * d, d)]
    params = [torch.randn(*s, generator=gen) / math.sqrt(s[0]) for _ in range(layers) for s in shapes]
    x = torch.randn(2, seq, d, generator=gen)

    def fwd(x, *ps):
        h = x
        for i in range(layers):
            wqkv, wo, w1, w2 = ps[4 * i:4 * i + 4]
            a = torch.nn.functional.layer_norm(h, (d,))
            q, k, v = (a @ wqkv).split(d, dim=-1)
            q, k, v = (t.reshape(2, seq, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1)
            h = h + (att @ v).transpose(1, 2).reshape(2, seq, d) @ wo
            f = torch.nn.functional.layer_norm(h, (d,))
            h = h + _act(f @ w1, culprit if i == layers // 2 else "tanh") @ w2
        return h

    return _trace(fwd, params, x, backward)


def sized(builder, target, backward, culprit="erf"):
    """The builder's graph with the fewest layers reaching ~``target`` nodes."""
    layers = 1
    while True:
        gm, inputs = builder(layers, backward, culprit)
        if len(gm.graph.nodes) >= 0.85 * target or layers > 200:
            return gm, inputs
        layers += max(1, int(layers * (target / len(gm.graph.nodes) - 1) * 0.8))


BUGS = {  # kind, compiler, config
    "wrong_lowering": ("accuracy", "minifier_helpers:wrong_erf", {}),
    "compile_error": ("compile_error", "minifier_helpers:erf_compile_error", {}),
    "nondeterministic": ("nondeterminism", "minifier_helpers:noisy_erf", {}),
    "inductor_relu": ("accuracy", "inductor", {"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}),
}


def cases(quick):
    out = [("mlp", 50, False, b) for b in ("wrong_lowering", "compile_error", "nondeterministic")]
    out += [("transformer", 200, True, "wrong_lowering")]
    if quick:
        return out
    out += [("transformer", 200, False, b) for b in ("wrong_lowering", "compile_error", "nondeterministic")]
    out += [("mlp", 200, True, "wrong_lowering")]
    out += [("transformer", 800, True, b) for b in ("wrong_lowering", "compile_error", "nondeterministic")]
    out += [("mlp", 50, False, "inductor_relu"), ("transformer", 200, False, "inductor_relu")]
    return out


class _FreshProcessRunner:
    """PyTorch's isolated mode: a new process (torch import, cold compile) for every query."""

    def check(self, spec, gm, inputs):
        with Worker() as w:
            return w.check(spec, gm, inputs)


def _runners(mode):
    """(ours, baseline) runners for one minifier run."""
    if mode == "in-process":
        return InProcessRunner(), InProcessRunner()
    return Worker(), _FreshProcessRunner()


def run_fx_minifier(gm, inputs, spec, runner):
    calls = [0]

    def module_fails(g, inps):
        calls[0] += 1
        return runner.check(spec, g, inps).fails

    t0 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        res_gm, _ = fx_minifier(copy.deepcopy(gm), inputs, module_fails, dump_state=lambda g, i: None)
    return calls[0], time.perf_counter() - t0, len(res_gm.graph.nodes)


def run_case(model, target, backward, bug, mode, repeat, cold_input=False):
    kind, compiler, config = BUGS[bug]
    builder = {"mlp": mlp, "transformer": transformer}[model]
    gm, inputs = sized(builder, target, backward, "relu" if bug == "inductor_relu" else "erf")
    spec = OracleSpec(kind=kind, compiler=compiler, config=config)
    first = InProcessRunner().check(spec, gm, inputs)  # also warms this process up (imports, toolchain) for both
    fx_spec = spec.replace(expected=first.signature) if kind.endswith("error") else spec
    ours_runs, theirs_runs = [], []
    warm = (lambda: None) if cold_input or not compiler.startswith("inductor") else \
        (lambda: InProcessRunner().check(spec, gm, inputs))  # the failing run's compile of the input
    for _ in range(repeat):  # interleaved; the fastest of each counts (sub-second runs are noisy)
        with _cold_compile_caches(compiler):
            warm()
            ours_runner, _ = _runners(mode)
            t0 = time.perf_counter()
            try:
                res = minify(gm, inputs, spec, runner=ours_runner, progress=False)
            finally:
                ours_runner.close()
            ours_runs.append((res.summary["queries"], time.perf_counter() - t0, res.summary["nodes_after"]))
        with _cold_compile_caches(compiler):
            warm()
            theirs_runs.append(run_fx_minifier(gm, inputs, fx_spec, _runners(mode)[1]))
    if repeat > 1:
        print(f"  runs (s): ours {' '.join(f'{r[1]:.2f}' for r in ours_runs)}; "
              f"fx_minifier {' '.join(f'{r[1]:.2f}' for r in theirs_runs)}", file=sys.stderr, flush=True)
    best = lambda runs: min(runs, key=lambda r: r[1])  # noqa: E731
    return len(gm.graph.nodes), best(ours_runs), best(theirs_runs)


def _cold_compile_caches(compiler):
    """Each minifier starts with empty inductor caches (neither profits from the other's compiles)."""
    if not compiler.startswith("inductor"):
        return contextlib.nullcontext()
    torch.compiler.reset()
    return fresh_inductor_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a fast subset (about a minute)")
    p.add_argument("--isolate", action="store_true",
                   help="as shipped: ours asks one persistent worker process, fx_minifier a fresh process per "
                        "query (PyTorch's isolated mode); default: both in this process")
    p.add_argument("--only", help="run only cases whose name contains this text")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per minifier, interleaved, fastest counts (each inductor run starts with cold caches)")
    p.add_argument("--cold-input", action="store_true",
                   help="real inductor cases: the input graph's compile starts cold too (default: it was "
                        "compiled once before, untimed, as by the failing run that produced the repro)")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_minifier_inductor_"))
    mode = "isolated" if args.isolate else "in-process"
    print(f"torch {torch.__version__}; oracle runner: "
          f"{'ours: persistent worker, fx_minifier: fresh process per query' if args.isolate else 'in-process'}; "
          f"real inductor cases: {'all compiles cold' if args.cold_input else 'input compiled before, the rest cold'}")
    hdr = f"{'case':42} {'nodes':>5} | {'ours q':>6} {'s':>7} {'final':>5} | {'fx q':>5} {'s':>7} {'final':>5} | " \
          f"{'q ratio':>7} {'t ratio':>7} | verdict"
    print(hdr)
    print("-" * len(hdr))
    failed = 0
    for model, target, backward, bug in cases(args.quick):
        name = f"{model}~{target}-{'fwd_bwd' if backward else 'fwd'}-{bug}"
        if args.only and args.only not in name:
            continue
        nodes, (oq, ot, of), (fq, ft, ff) = run_case(model, target, backward, bug, mode, args.repeat, args.cold_input)
        qr, tr = oq / fq, ot / ft
        ok = of <= ff and (BUGS[bug][0] != "accuracy" or (qr <= 0.2 and tr <= 1 / 3))
        failed += not ok
        print(f"{name:42} {nodes:5d} | {oq:6d} {ot:7.2f} {of:5d} | {fq:5d} {ft:7.2f} {ff:5d} | "
              f"{qr:7.3f} {tr:7.3f} | {'PASS' if ok else 'FAIL'}", flush=True)
    print(f"targets: accuracy cases <= 0.2 query ratio and <= 0.333 time ratio; every case final <= fx_minifier's; "
          f"{'all PASS' if not failed else f'{failed} FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
