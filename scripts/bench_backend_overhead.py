#!/usr/bin/env python
"""Steady-state time per training step of the determ backends vs the backends they wrap.

A small transformer (a few blocks) runs forward + backward + SGD step.  Every
variant is measured in this one process, interleaved round-robin so machine noise
hits all of them alike; results are ratios to the wrapped backend.

    .venv/bin/python scripts/bench_backend_overhead.py [--steps 20] [--layers 4] [--no-inductor]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from _bench_common import debug_mode_hashing
from determ_backend.backends import run as run_mod


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


def _model(args):
    torch.manual_seed(0)
    return _Transformer(512, args.d_model, 4, args.layers, args.seq)


def _step_fn(model, compiled, tokens):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = compiled(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--no-inductor", action="store_true", help="skip the inductor variants (slow cold compiles)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = tempfile.mkdtemp(prefix="determ_bench_")
    tokens = torch.randint(0, 512, (args.batch, args.seq))
    variants = {
        "eager": lambda m: m,
        "aot_eager": lambda m: torch.compile(m, backend="aot_eager"),
        "determ_aot_eager[trace off]": lambda m: torch.compile(m, backend="determ_aot_eager", options={"trace": False, "dir": out}),
        "determ_aot_eager[trace on]": lambda m: torch.compile(m, backend="determ_aot_eager", options={"dir": out, "run_id": "aot"}),
        "determ_aot_eager[trace on, no stats]": lambda m: torch.compile(m, backend="determ_aot_eager", options={"dir": out, "run_id": "aot_ns", "stats": False}),
    }
    if not args.no_inductor:
        variants.update({
            "inductor": lambda m: torch.compile(m, backend="inductor"),
            "determ_inductor[trace off]": lambda m: torch.compile(m, backend="determ_inductor", options={"trace": False, "dir": out}),
            "determ_inductor[trace on]": lambda m: torch.compile(m, backend="determ_inductor", options={"dir": out, "run_id": "ind"}),
        })
    steps = {}
    for name, make in variants.items():
        print(f"compiling {name} ...", file=sys.stderr)
        model = _model(args)
        steps[name] = _step_fn(model, make(model), tokens)
        for _ in range(args.warmup):
            steps[name]()
    dbg = debug_mode_hashing("hash_tensor")
    times = {name: [] for name in steps}
    if dbg is not None:
        times["eager + DebugMode(hash_tensor)"] = []
        dbg.close()
    for _ in range(args.steps):
        for name, step in steps.items():
            t = time.perf_counter(); step(); times[name].append(time.perf_counter() - t)
        if dbg is not None:
            ctx = debug_mode_hashing("hash_tensor")
            with ctx:
                t = time.perf_counter(); steps["eager"](); times["eager + DebugMode(hash_tensor)"].append(time.perf_counter() - t)
    run_mod.finish_all()
    med = {k: statistics.median(v) for k, v in times.items()}
    base = {"aot_eager": med["aot_eager"], "inductor": med.get("inductor"), "eager": med["eager"]}
    print(f"{'variant':42} {'ms/step':>9} {'ratio':>7}  baseline")
    results = {}
    for name, t in med.items():
        ref = "inductor" if "inductor" in name and not name.startswith("determ_aot") else ("aot_eager" if "aot_eager" in name else "eager")
        ratio = t / base[ref]
        results[name] = ratio
        print(f"{name:42} {t * 1e3:9.2f} {ratio:7.3f}  {ref}")
    targets = [(n, 1.05 if "off" in n else 1.5) for n in results if n.startswith("determ_") and "no stats" not in n]
    for n, limit in targets:
        print(f"{'PASS' if results[n] <= limit else 'FAIL'} {n} <= {limit}x ({results[n]:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
