"""``repro-tools compare NPU_DUMP BENCH_DUMP``: ptdbg's API-dump compare from the shell.

The same comparison as :func:`determ_backend.dump.compare` (or, with
``--distributed``, :func:`~determ_backend.dump.compare_distributed`): the CSV and the
advisor text go into OUT, the analysis (root cause) and the files' paths to stdout, so
a script or CI job can gate on the exit code without writing Python.
Exit 0: no divergence; 1: a divergence (in any rank), or the runs are not shown to agree (a dump cut short with
calls it never wrote, no call paired, nothing to judge); 2: bad input or usage.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from determ_backend.compare import DEFAULT_TOL
from determ_backend.dump.comparison.dumps import DumpComparison, compare, compare_distributed
from determ_backend.dump.comparison.parse import check_path, holds_index, rank_dirs
from determ_backend.errors import ConfigError
from repro_tools.cli.args import tol_arg

__all__ = ["register", "run_compare"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare two API dumps (ptdbg's compare) and name the root-cause API",
                       description="Pair the API calls of two dumps written by determ_backend.dump, judge every "
                                   "tensor and name the root cause: the first API whose inputs match while its "
                                   "output does not.  Writes ptdbg's compare_result CSV and the advisor text into "
                                   "OUT.  Exit 0: no divergence; 1: a divergence, or the runs are not shown to agree (a dump "
                                   "cut short with calls it never wrote, no call paired, nothing to judge); 2: bad input.")
    p.add_argument("npu", metavar="NPU_DUMP",
                   help="the dump under test: its index (*.pkl) or the rank directory holding it; with "
                        "--distributed, the directory holding rank0, rank1, ...")
    p.add_argument("bench", metavar="BENCH_DUMP", help="the benchmark dump, same kinds as NPU_DUMP")
    p.add_argument("-o", "--output", default="./compare_output", metavar="OUT",
                   help="directory for the CSV and advisor files (default ./compare_output)")
    p.add_argument("--stack", action="store_true", help="add the NPU_Stack_Info column (stack_mode)")
    verdict = p.add_mutually_exclusive_group()
    verdict.add_argument("--tol", type=tol_arg, default=DEFAULT_TOL,
                         help=f"tolerance of the verdicts when they are not bitwise -- dumps of two device types "
                              f"or dtypes (default {DEFAULT_TOL}; widened to 4 units in the last place of "
                              f"bf16/fp16)")
    verdict.add_argument("--exact", action="store_true",
                         help="bitwise verdicts even across device types or dtypes")
    p.add_argument("--suffix", default="", help="file names compare_result<SUFFIX>_<time>.csv, advisor<SUFFIX>_...")
    p.add_argument("--distributed", action="store_true",
                   help="compare rank by rank: NPU_DUMP/rank<N> with BENCH_DUMP/rank<N> (same ranks in both)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the analysis")
    p.set_defaults(func=run_compare)


def _check_single(path: str) -> None:
    """A directory of rank folders given without --distributed: say so, not just "no index here"."""
    p = check_path(path, "dump path")
    if p.is_dir() and not holds_index(p) and rank_dirs(p):
        raise ConfigError(f"{path}: holds rank directories ({', '.join(d.name for d in rank_dirs(p).values())}); "
                          f"pass one rank's directory, or add --distributed")


def _summary(cmp: DumpComparison) -> Dict[str, Any]:
    root = cmp.root_causes[0] if cmp.root_causes else None
    first = cmp.first_divergence
    out: Dict[str, Any] = {
        "divergent": cmp.divergent,
        "root_cause": root.a["name"] if root else None,
        "root_cause_bench": root.b["name"] if root else None,
        "root_causes": len(cmp.root_causes),
        "unpaired": cmp.unpaired,
        "paired": cmp.paired,
        "judged": cmp.judged,
        "partial": cmp.partial,
        "shown_to_agree": cmp.shown_to_agree,
        "first_divergence": first.name if first else None,
        "verdict": "bitwise" if cmp.exact else "tolerance",
        "csv": str(cmp.csv_path),
        "advisor": str(cmp.advisor_path) if cmp.advisor_path else None,
    }
    if cmp.rank is not None:
        out = {"rank": cmp.rank, **out}
    return out


def run_compare(args: argparse.Namespace) -> int:
    exact: Optional[bool] = True if args.exact else None
    kw = dict(stack_mode=args.stack, exact=exact, tol=args.tol)
    if args.distributed:
        results: List[DumpComparison] = compare_distributed(args.npu, args.bench, args.output, suffix=args.suffix,
                                                            is_print_compare_log=False, **kw)
    else:
        for path in (args.npu, args.bench):
            _check_single(path)
        param = {"npu_pkl_path": args.npu, "bench_pkl_path": args.bench, "is_print_compare_log": False}
        results = [compare(param, args.output, suffix=args.suffix, **kw)]
    divergent = any(c.divergent for c in results)
    status = 0 if all(c.shown_to_agree for c in results) else 1
    if args.json:
        summary = _summary(results[0]) if not args.distributed else {
            "divergent": divergent, "ranks": [_summary(c) for c in results]}
        print(json.dumps(summary, indent=2))
        return status
    for c in results:
        head = f"rank {c.rank}: " if c.rank is not None else ""
        print(f"{head}{c.analysis}")
        print(f"{'  ' if head else ''}csv: {c.csv_path}")
    if args.distributed:
        bad = [f"rank {c.rank}" for c in results if c.divergent]
        unshown = [f"rank {c.rank}" for c in results if not c.divergent and not c.shown_to_agree]
        # "ranks divergent: 0" read as "no rank diverges"
        print(f"divergent: {', '.join(bad)}" if bad else "no rank diverges")
        if unshown:
            print(f"not shown to agree: {', '.join(unshown)}")
    return status
