"""``repro-tools ranks DIR``: check that data-parallel replicas agree, rank by rank.

DIR is the ``<fpath>/<dump_tag>`` directory of a multi-rank API dump (one
``rank<N>`` directory per rank, written by ``determ_backend.dump``).  The check
itself lives in :mod:`determ_backend.dump.comparison.replicas`.
"""

from __future__ import annotations

import argparse
import json

from determ_backend.dump.comparison.replicas import check_replicas

__all__ = ["register", "run_ranks"]


def _count(text: str) -> int:
    """``--limit``: a non-negative int (argparse turns the error into a usage line and exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {n}")
    return n


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ranks", help="check that data-parallel replicas agree (parameters, gradients, collectives)",
                       description="Read the index DIR/rank<N>/*.pkl of every rank and check that the records every "
                                   "replica must share -- parameters, gradients after the all-reduce, results of "
                                   "all-reduce/broadcast/all-gather -- are bit-identical; name the first rank and "
                                   "API that disagree.  Exit 0: all agree; 1: a rank disagrees; 2: bad input.")
    p.add_argument("dir", help="dump directory holding rank0, rank1, ... (the <fpath>/<dump_tag> of set_dump_path)")
    p.add_argument("--all", action="store_true",
                   help="compare every record, not only the replica-invariant ones (when every rank gets the same data)")
    p.add_argument("--index", default=None, metavar="NAME",
                   help="index file name inside each rank directory (default: the only *.pkl there)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--limit", type=_count, default=10, help="disagreements to print (default 10; 0: none)")
    p.set_defaults(func=run_ranks)


def run_ranks(args: argparse.Namespace) -> int:
    report = check_replicas(args.dir, everything=args.all, index=args.index)
    if args.json:
        print(json.dumps(report.summary(), indent=2, default=str))
        return 0 if report.ok else 1
    print(f"ranks: {', '.join(map(str, report.ranks))}  records checked: {report.checked}  "
          f"disagreements: {len(report.disagreements)}")
    for d in report.disagreements[: args.limit]:
        print(d.line())
    if len(report.disagreements) > args.limit:
        print(f"... {len(report.disagreements) - args.limit} more")
    if report.cut:
        print(f"cut short (a killed job): rank{'s' if len(report.cut) > 1 else ''} "
              f"{', '.join(map(str, sorted(report.cut)))}; the records after the end of a rank's dump are not compared")
        first = report.stopped_first
        if first is not None:  # a hung job: the rank that stopped before the others is the one to look at
            name, holder = report.ends_before[first]
            print(f"rank {first} stopped first: its dump ends before {name}, which rank {holder} recorded")
    if report.ok:
        print("all replicas agree" + (" on the records every rank holds" if report.cut else ""))
        return 0
    if report.first is None:
        print("nothing checked: the dumps hold no record every replica must share (parameters and gradients are "
              "recorded before optimizer.step(); collectives when called through torch.distributed), so the replicas "
              "are not shown to agree (--all compares every record, for ranks fed the same data)")
        return 1
    print(f"first disagreement: rank {report.first.rank} at {report.first.name}")
    return 1
