#!/usr/bin/env python
"""Steady-state time per step of the determ backends vs the backends they wrap.

Two shapes: ``small`` is a 6-block residual MLP (width 256, batch 64; each block is
``x + Linear(2d, d)(GELU(Linear(d, 2d)(LayerNorm(x))))``, then a 10-class head), ``large`` is
a small transformer (vocabulary 512, d_model 256, sequence 128, batch 8, 4 blocks).  Two modes:
``forward`` runs the model's forward under ``torch.no_grad()``, ``train`` runs forward +
cross-entropy loss + backward + an SGD step.  Per shape and mode the variants are eager,
aot_eager, determ_aot_eager with tracing off, on, on with ``DETERM_CHECK=nan``, and compiled with
``dynamic=True`` with tracing and with ``DETERM_CHECK=batch_invariance``, inductor,
determ_inductor likewise, and eager under PyTorch's ``DebugMode`` tensor hashing (skipped if this
torch has none).
Every variant has its own model and compile and is measured in this one process, interleaved
round-robin: a round runs each variant ``--steps`` steps, so machine noise hits all alike.  A
variant's ratio is the median over rounds of (its time / its baseline's time in the same round);
baselines: determ_aot_eager -> aot_eager, determ_inductor -> inductor, DebugMode -> eager, the
``nan`` check -> the same backend with tracing on.

Prints one table per (shape, mode), then PASS/FAIL per (shape, mode): a determ backend with
tracing on <= 1.5x the backend it wraps, with tracing off <= 1.05x, the ``nan`` check <= 1.05x
tracing alone, the ``batch_invariance`` check (determ_aot_eager compiled with ``dynamic=True``: two
extra traced executions, on the first half and the first row, plus a copy of the inputs and of the
call's traced values) <= 4x tracing with the same dynamic compile.  ``--memory-steps N`` then
runs N training steps of the small shape under determ_aot_eager with tracing on, sampling the
process RSS every N/10 steps: PASS if it ends at most 32 MiB above its value after the first
tenth.  Exit status 0 when everything passes, 1 otherwise.  Results go to stdout, progress to
stderr.  Traces go to a temporary directory (removed at the end) unless ``--out`` names one.

    .venv/bin/python scripts/bench_backend_overhead.py [--shape small|large|both] [--mode forward|train|both]
        [--rounds 7] [--steps 3] [--threads 1] [--no-inductor] [--memory-steps 0] [--out DIR]
        [--layers 4] [--d-model 256] [--seq 128] [--batch 8]     # the large shape
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from _bench_common import debug_mode_hashing, memory_check, print_table, ratio_to, time_rounds

SMALL_WIDTH, SMALL_BATCH, SMALL_BLOCKS, CLASSES, VOCAB = 256, 64, 6, 10, 512
TRACE_ON_LIMIT, TRACE_OFF_LIMIT, NAN_LIMIT, BATCH_LIMIT, MEMORY_LIMIT_MIB = 1.5, 1.05, 1.05, 4.0, 32.0
DEBUG_MODE = "eager + DebugMode(hash_tensor)"


class _ResBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class _ResMLP(torch.nn.Module):
    def __init__(self, d: int, blocks: int, classes: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ResBlock(d) for _ in range(blocks))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.ff1, self.ff2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(torch.nn.functional.gelu(self.ff1(self.ln2(x))))


class _Transformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


@dataclass
class _Shape:
    name: str
    describe: str
    model: Callable[[], torch.nn.Module]  # same seed every call: every variant starts from the same weights
    x: torch.Tensor
    y: torch.Tensor
    classes: int


def _shapes(args) -> Dict[str, _Shape]:
    g = torch.Generator().manual_seed(1)

    def small():
        torch.manual_seed(0)
        return _ResMLP(SMALL_WIDTH, SMALL_BLOCKS, CLASSES)

    def large():
        torch.manual_seed(0)
        return _Transformer(VOCAB, args.d_model, 4, args.layers, args.seq)

    return {
        "small": _Shape("small", f"residual MLP, {SMALL_BLOCKS} blocks, width {SMALL_WIDTH}, batch {SMALL_BATCH}",
                        small, torch.randn(SMALL_BATCH, SMALL_WIDTH, generator=g),
                        torch.randint(0, CLASSES, (SMALL_BATCH,), generator=g), CLASSES),
        "large": _Shape("large", f"transformer, {args.layers} blocks, d_model {args.d_model}, seq {args.seq}, "
                                 f"batch {args.batch}, vocab {VOCAB}",
                        large, torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
                        torch.randint(0, VOCAB, (args.batch, args.seq), generator=g), VOCAB),
    }


def _step_fn(shape: _Shape, mode: str, model: torch.nn.Module, fn: Callable) -> Callable[[], None]:
    """One step of ``fn`` (``model`` or its compiled form): forward under no_grad, or a training step."""
    x, y = shape.x, shape.y
    if mode == "forward":
        def step():
            with torch.no_grad():
                fn(x)

        return step
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(fn(x).reshape(-1, shape.classes), y.reshape(-1))
        loss.backward()
        opt.step()

    return train_step


# name, backend (None: the eager model), determ run-id tag (None: not a determ backend), tracing (a string:
# tracing on with that DETERM_CHECK), baseline
_VARIANTS: List[Tuple[str, Optional[str], Optional[str], object, Optional[str]]] = [
    ("eager", None, None, False, None),
    ("aot_eager", "aot_eager", None, False, None),
    ("determ_aot_eager[trace off]", "determ_aot_eager", "aot-off", False, "aot_eager"),
    ("determ_aot_eager[trace on]", "determ_aot_eager", "aot-on", True, "aot_eager"),
    ("determ_aot_eager[trace+nan]", "determ_aot_eager", "aot-nan", "nan", "determ_aot_eager[trace on]"),
    ("determ_aot_eager[trace, dynamic]", "determ_aot_eager", "aot-dyn", "dynamic", "aot_eager"),
    ("determ_aot_eager[trace+batch_invariance]", "determ_aot_eager", "aot-bi", "batch_invariance",
     "determ_aot_eager[trace, dynamic]"),
    ("inductor", "inductor", None, False, None),
    ("determ_inductor[trace off]", "determ_inductor", "ind-off", False, "inductor"),
    ("determ_inductor[trace on]", "determ_inductor", "ind-on", True, "inductor"),
    ("determ_inductor[trace+nan]", "determ_inductor", "ind-nan", "nan", "determ_inductor[trace on]"),
]


def _compiled(model: torch.nn.Module, backend: Optional[str], tag: Optional[str], trace: object, out: str,
              run_id: str) -> Callable:
    if backend is None:
        return model
    if tag is None:
        return torch.compile(model, backend=backend)
    options = {"dir": out, "run_id": run_id} if trace else {"trace": False, "dir": out, "run_id": run_id}
    if isinstance(trace, str) and trace != "dynamic":
        options["check"] = trace
    # batch_invariance needs a dynamic batch size; its baseline is tracing with the same dynamic compile
    dynamic = trace in ("dynamic", "batch_invariance") or None
    return torch.compile(model, backend=backend, options=options, dynamic=dynamic)


def _with_debug_mode(step: Callable[[], None]) -> Callable[[], None]:
    def step_under_debug_mode():
        with debug_mode_hashing("hash_tensor"):  # a fresh mode per step: its op log does not pile up
            step()

    return step_under_debug_mode


def _raise_recompile_limit(n: int) -> None:
    # every variant compiles the same forward code objects; past the limit dynamo silently runs eagerly
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), n))


def _build(args, shapes: Dict[str, _Shape], out: str) -> Tuple[Dict[Tuple[str, str, str], Callable[[], None]],
                                                              Dict[str, Optional[str]]]:
    """(shape, mode, variant) -> a warmed-up step, and variant -> its baseline."""
    variants = [v for v in _VARIANTS if not (args.no_inductor and v[1] and "inductor" in v[1])]
    baselines = {name: base for name, _, _, _, base in variants}
    has_debug_mode = False
    probe = debug_mode_hashing("hash_tensor")  # enters the mode: close it at once
    if probe is not None:
        probe.close()
        has_debug_mode = True
        baselines[DEBUG_MODE] = "eager"
    else:
        print(f"note: torch {torch.__version__} has no DebugMode tensor hashing; '{DEBUG_MODE}' skipped",
              file=sys.stderr)
    cases: Dict[Tuple[str, str, str], Callable[[], None]] = {}
    for shape_name in _picked(args.shape):
        shape = shapes[shape_name]
        for mode in _picked(args.mode, ("forward", "train")):
            for name, backend, tag, trace, _ in variants:
                print(f"building {shape_name}/{mode} {name} ...", file=sys.stderr)
                model = shape.model()
                fn = _compiled(model, backend, tag, trace, out, f"{shape_name}-{mode}-{tag}")
                cases[(shape_name, mode, name)] = _step_fn(shape, mode, model, fn)
            if has_debug_mode:
                model = shape.model()
                cases[(shape_name, mode, DEBUG_MODE)] = _with_debug_mode(_step_fn(shape, mode, model, model))
    for key, step in cases.items():  # warm-up: compiles and first-call costs out of the measurement
        print(f"warming up {'/'.join(key)} (compiles on its first step) ...", file=sys.stderr)
        for _ in range(args.warmup):
            step()
    return cases, baselines


def _picked(choice: str, both: Tuple[str, str] = ("small", "large")) -> Tuple[str, ...]:
    return both if choice == "both" else (choice,)


def _report(args, shapes: Dict[str, _Shape], times: Dict[Tuple[str, str, str], List[float]],
            baselines: Dict[str, Optional[str]]) -> List[bool]:
    print(f"threads={args.threads} rounds={args.rounds} steps/round={args.steps} torch={torch.__version__}")
    verdicts: List[bool] = []
    for shape_name in _picked(args.shape):
        for mode in _picked(args.mode, ("forward", "train")):
            here = {name: t for (s, m, name), t in times.items() if (s, m) == (shape_name, mode)}
            ratios, rows = {}, []
            for name, t in here.items():
                base = baselines[name]
                ratios[name] = ratio_to(t, here[base]) if base else 1.0
                rows.append((name, statistics.median(t), ratios[name], base or ""))
            what = "forward under no_grad" if mode == "forward" else "forward + cross-entropy + backward + SGD step"
            print_table(f"{shape_name}/{mode}: {shapes[shape_name].describe}; {what}", rows)
            for name, ratio in ratios.items():
                if not name.startswith("determ_") or name.endswith(", dynamic]"):  # a baseline, not a target
                    continue
                limit = (NAN_LIMIT if "+nan" in name else BATCH_LIMIT if "+batch" in name
                         else TRACE_ON_LIMIT if "trace on" in name else TRACE_OFF_LIMIT)
                ok = ratio <= limit
                verdicts.append(ok)
                print(f"{'PASS' if ok else 'FAIL'} {shape_name}/{mode}: {name} <= {limit:g}x {baselines[name]} "
                      f"({ratio:.3f}x)")
    return verdicts


def _memory(args, shapes: Dict[str, _Shape], out: str) -> bool:
    shape = shapes["small"]
    model = shape.model()
    fn = torch.compile(model, backend="determ_aot_eager", options={"dir": out, "run_id": "memory-aot-on"})
    step = _step_fn(shape, "train", model, fn)
    print("compiling the memory run (small/train, determ_aot_eager[trace on]) ...", file=sys.stderr)
    step()
    return memory_check(step, args.memory_steps, f"small/train under determ_aot_eager[trace on] ({shape.describe})",
                        MEMORY_LIMIT_MIB)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["small", "large", "both"], default="both",
                   help="small: residual MLP width 256 batch 64; large: the transformer (default both)")
    p.add_argument("--mode", choices=["forward", "train", "both"], default="both",
                   help="forward under no_grad, or a training step (default both)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians are reported (default 7)")
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine, parallel regions stall on "
                        "descheduled threads and distort the ratios)")
    p.add_argument("--no-inductor", action="store_true", help="skip the inductor variants (slow cold compiles)")
    p.add_argument("--memory-steps", type=int, default=0, metavar="N",
                   help="after the timing, N training steps (small shape) under determ_aot_eager with tracing "
                        "on, checking that the RSS stays flat (default 0: skip)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the determ runs write their traces (default: a temporary directory, removed)")
    p.add_argument("--layers", type=int, default=4, help="large shape: transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=256, help="large shape: model width (default 256)")
    p.add_argument("--seq", type=int, default=128, help="large shape: sequence length (default 128)")
    p.add_argument("--batch", type=int, default=8, help="large shape: batch size (default 8)")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "threads", "layers", "d_model", "seq", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer")
    for name in ("warmup", "memory_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')}: expected a non-negative integer")
    if args.d_model % 4:
        p.error("--d-model: expected a multiple of 4 (the transformer has 4 heads)")

    from determ_backend.backends import run as run_mod

    torch.set_num_threads(args.threads)
    _raise_recompile_limit(64)
    shapes = _shapes(args)
    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="determ_bench_"))
        try:
            cases, baselines = _build(args, shapes, out)
            times = time_rounds(cases, args.rounds, args.steps)
            verdicts = _report(args, shapes, times, baselines)
            if args.memory_steps:
                verdicts.append(_memory(args, shapes, out))
        finally:
            run_mod.finish_all()  # closes the traces before their directory goes
    failed = verdicts.count(False)
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(verdicts) - failed} of {len(verdicts)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
