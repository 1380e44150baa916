#!/usr/bin/env python3
"""Snapshot the eager tools' output, and compare two snapshots: does a change to the recorder keep its traces?

``write DIR`` runs a fixed set of eager workloads and writes what HashMode and HashDebugTrace make of them:

* scenarios: the MLP and transformer encoder of ``bench_eager_tools.py`` (small), each in a forward (no
  grad) and in an AdamW training step, under HashMode (default, and statistics with three frames),
  HashDebugTrace, and one HashMode left on over two steps; and a script of views, in-place ops, ``out=``, ``split``, ``.item()``,
  dtype casts and ``index_add_`` under HashDebugTrace;
* families: each architecture of ``tests/real_models.py`` (small Hugging Face models, built offline), a
  forward and backward under HashMode (parameters named) and under HashDebugTrace.

``compare A B`` compares the two directories file by file after normalizing what legitimately differs
between two checkouts or processes (object addresses, each snapshot's repository root) and lists the
files that differ; exit 1 when any does, or when a file is in one snapshot only.

determ is imported from the environment, not from this script's checkout, so an older commit can be
snapshotted with this script:

    git worktree add /path/to/old <commit>
    PYTHONPATH=/path/to/old .venv/bin/python scripts/trace_snapshot.py write /path/to/snap-old
    .venv/bin/python scripts/trace_snapshot.py write /path/to/snap-new
    .venv/bin/python scripts/trace_snapshot.py compare /path/to/snap-old /path/to/snap-new
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
# real_models and the bench's models; appended, so determ still comes from the environment
sys.path += [str(ROOT / "tests"), str(ROOT / "scripts")]

import torch  # noqa: E402

META = "snapshot.json"
_ADDRESS = re.compile(rb"0x[0-9a-f]+")


def _step(kind: str, train: bool) -> Callable[[], None]:
    """A small model's step from ``bench_eager_tools.py`` (width 64, depth 2; AdamW when training)."""
    from bench_eager_tools import make_step  # imported after determ, which it takes from the environment too

    shape = {"model": "mlp" if kind == "mlp" else "transformer", "width": 64, "depth": 2,
             "batch": 16 if kind == "mlp" else 4}
    return make_step(shape, "train" if train else "forward", argparse.Namespace(seq=8, optimizer="adamw"))


def _ops_script() -> None:
    x = torch.randn(8, 8)
    y = x.t().contiguous()
    z = x.clone()
    z.add_(1)
    v = z[2:4]
    v.mul_(2)
    a, b = torch.split(x, 4)
    s = x.sum().item()
    w = x.to(torch.float64)
    torch.add(x, 1, out=z)
    q = torch.zeros(8, 8).index_add_(0, torch.arange(8), x)
    del y, a, b, s, w, q


def _cases(out: Path, families: List[str], scenarios: bool) -> Dict[str, Callable[[], None]]:
    from determ_backend.modes.core import HashDebugTrace, HashMode

    cases: Dict[str, Callable[[], None]] = {}
    if scenarios:
        for kind in ("mlp", "encoder"):
            for train in (False, True):
                name = f"{kind}_{'train' if train else 'forward'}"

                def run(name=name, kind=kind, train=train):
                    step = _step(kind, train)
                    with HashMode(trace_path=out / f"{name}_hashmode.jsonl"):
                        step()
                    with HashMode(trace_path=out / f"{name}_stats.jsonl", stats=True, stack_depth=3):
                        step()
                    with HashDebugTrace(log_path=out / f"{name}_hdt.log"):
                        step()
                    mode = HashMode(trace_path=out / f"{name}_left_on.jsonl", keep_records=False)
                    for _ in range(2):
                        mode.enable()
                        step()
                        mode.disable()
                    mode.close()

                cases[name] = run

        def ops():
            with HashDebugTrace(log_path=out / "ops_hdt.log"):
                _ops_script()

        cases["ops"] = ops
    if families:
        import real_models

        for family in families:
            def run_family(family=family):
                model, inputs = real_models.build(family)
                with HashMode(trace_path=out / f"{family}_hashmode.jsonl", module=model):
                    real_models.loss_of(model(**inputs)).backward()
                with HashDebugTrace(log_path=out / f"{family}_hdt.log", module=model):
                    real_models.loss_of(model(**inputs)).backward()

            cases[family] = run_family
    return cases


def write(out: Path, families: List[str], scenarios: bool) -> int:
    from tqdm import tqdm

    import determ_backend

    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    cases = _cases(out, families, scenarios)
    for name, run in tqdm(cases.items(), desc="snapshot", unit="case", file=sys.stderr):
        run()
    meta = {"root": str(ROOT), "determ": str(Path(determ_backend.__file__).resolve().parents[1]),
            "prefix": sys.prefix, "torch": torch.__version__, "cases": list(cases)}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    files = sorted(p.name for p in out.iterdir() if p.name != META)
    print(f"{len(files)} files from {len(cases)} cases in {out} (determ from {meta['determ']})")
    return 0


def _normalized(path: Path, roots: List[Tuple[str, bytes]]) -> bytes:
    """``path``'s bytes with object addresses and the snapshot's roots replaced: its environment (the installed
    packages' files, which may lie inside one checkout and not the other) first, then its repository roots."""
    data = _ADDRESS.sub(b"ADDR", path.read_bytes())
    for root, token in roots:
        data = data.replace(root.encode(), token)
    return data


def _roots(snapshot: Path) -> List[str]:
    try:
        meta = json.loads((snapshot / META).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"trace_snapshot: {snapshot}: not a snapshot directory ({META} unreadable: {e})")
    prefix = [(meta["prefix"], b"PREFIX")] if meta.get("prefix") else []
    return prefix + [(r, b"ROOT") for r in sorted({meta["root"], meta["determ"]}, key=len, reverse=True)]


def compare(a: Path, b: Path) -> int:
    roots_a, roots_b = _roots(a), _roots(b)
    names_a = {p.name for p in a.iterdir() if p.name != META}
    names_b = {p.name for p in b.iterdir() if p.name != META}
    differ = [n for n in sorted(names_a & names_b) if _normalized(a / n, roots_a) != _normalized(b / n, roots_b)]
    only = sorted(names_a ^ names_b)
    for n in differ:
        print(f"differs: {n}")
    for n in only:
        print(f"only in {a if n in names_a else b}: {n}")
    same = len(names_a & names_b) - len(differ)
    print(f"{same} of {len(names_a | names_b)} files identical (addresses and repository roots normalized)")
    return 1 if differ or only else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="run the workloads and write their traces and logs to DIR")
    w.add_argument("dir", type=Path)
    w.add_argument("--families", default="all",
                   help="comma-separated families of tests/real_models.py, 'all' (default) or 'none'")
    w.add_argument("--no-scenarios", action="store_true", help="leave out the MLP/encoder/ops scenarios")
    c = sub.add_parser("compare", help="compare two snapshot directories")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args(argv)
    if args.command == "compare":
        return compare(args.a, args.b)
    if args.families == "none":
        families: List[str] = []
    else:
        import real_models

        if args.families == "all":
            families = sorted(real_models.FAMILIES) if real_models.available() else []
            if not families:
                print("note: transformers is not installed: no families", file=sys.stderr)
        else:
            families = [f for f in args.families.split(",") if f]
            unknown = [f for f in families if f not in real_models.FAMILIES]
            if unknown:
                p.error(f"--families: unknown {', '.join(unknown)}; expected some of {', '.join(sorted(real_models.FAMILIES))}")
    return write(args.dir, families, not args.no_scenarios)


if __name__ == "__main__":
    sys.exit(main())
