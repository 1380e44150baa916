"""Do data-parallel replicas agree?  The check behind ``repro-tools ranks DIR``.

Under data parallelism every rank sees different data, so activations differ;
but the parameters, the gradients after the all-reduce, and the results of
all-reduce/broadcast/all-gather must be bit-identical on every rank.  The
check reads ``DIR/rank<N>/*.pkl`` (the index) for every rank, walks the records that
must agree (``Parameter_*`` and those collectives; every record with
``everything=True``, for runs that feed all ranks the same data) in rank 0's
execution order, and reports the first record on which a rank departs from
the majority (from rank 0 when there are only two).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from determ_backend.errors import TraceFormatError
from determ_backend.dump.comparison.parse import Dump, check_rank_folders, find_index, open_dump, rank_dirs

__all__ = ["check_replicas", "ReplicaReport", "Disagreement", "INVARIANT_COLLECTIVES"]

INVARIANT_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor")


@dataclass
class Disagreement:
    name: str
    rank: int
    reference_rank: int
    detail: str
    source: Optional[str] = None

    def line(self) -> str:
        at = f" (at {self.source})" if self.source else ""
        return f"rank {self.rank} disagrees with rank {self.reference_rank} at {self.name}{at}: {self.detail}"


@dataclass
class ReplicaReport:
    ranks: List[int]
    checked: int
    disagreements: List[Disagreement] = field(default_factory=list)
    cut: set = field(default_factory=set)
    """Ranks whose dump ends before records other ranks hold (a killed job): those records are not compared."""
    ends_before: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    """Cut rank -> ``(the first record it lacks that another rank holds, that rank)``: where it stopped (a hung rank
    stops before a collective the others entered)."""

    @property
    def stopped_first(self) -> Optional[int]:
        """The cut rank that stopped earliest in the records' order (None when no cut rank lacks a record)."""
        return min(self.ends_before, key=lambda r: self._order.index(self.ends_before[r][0])) \
            if self.ends_before else None

    _order: List[str] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """No disagreement, on at least one record checked (replicas of which nothing was compared are not shown
        to agree)."""
        return not self.disagreements and self.checked > 0

    @property
    def first(self) -> Optional[Disagreement]:
        return self.disagreements[0] if self.disagreements else None

    def summary(self) -> Dict[str, Any]:
        return {"ranks": self.ranks, "checked": self.checked, "agree": self.ok, "cut_short": sorted(self.cut),
                "ends_before": {r: name for r, (name, _) in sorted(self.ends_before.items())},
                "stopped_first": self.stopped_first,
                "first": self.first.__dict__ if self.first else None,
                "disagreements": [d.__dict__ for d in self.disagreements]}


def _invariant(e: Dict[str, Any]) -> bool:
    op = str(e.get("op", ""))
    if op.startswith("Parameter."):
        return True
    return op.startswith("Distributed.") and op.split(".", 1)[1] in INVARIANT_COLLECTIVES


def _outputs(e: Dict[str, Any]) -> Tuple[Tuple[str, Optional[str]], ...]:
    return tuple((t.get("name"), t.get("hash")) for t in e.get("outputs", []) if "dtype" in t)


def _detail(ref: Dict[str, Any], other: Dict[str, Any]) -> str:
    by_name = {t.get("name"): t for t in ref.get("outputs", [])}
    for t in other.get("outputs", []):
        r = by_name.get(t.get("name"))
        if r is None or r.get("hash") == t.get("hash"):
            continue
        sa, sb = t.get("stats") or {}, r.get("stats") or {}
        diffs = []
        for k in ("max", "min", "l2"):
            if isinstance(sa.get(k), (int, float)) and isinstance(sb.get(k), (int, float)):
                diffs.append(f"{k} {sb[k]:.9g} vs {sa[k]:.9g}")
        return f"{t.get('name')} hash {r.get('hash')} vs {t.get('hash')}" + (f" ({', '.join(diffs)})" if diffs else "")
    return "different outputs"


def _load(root: Union[str, Path], index: Optional[str]) -> Dict[int, Dump]:
    dirs = rank_dirs(root)
    if len(dirs) < 2:
        raise TraceFormatError(f"{root}: found {len(dirs)} rank<N> directories; a replica check needs at least two "
                               f"(the <fpath>/<dump_tag> directory of a multi-rank dump)")
    # a killed job's dumps (no end line) are read up to their last whole entry, as compare reads them
    several = "name the one to check (repro-tools ranks --index NAME; index= in Python)"
    dumps = {r: open_dump(d / index if index else find_index(d, several)) for r, d in dirs.items()}
    check_rank_folders(root, {r: (d.path, d.header) for r, d in dumps.items()})
    return dumps


def check_replicas(root: Union[str, Path], everything: bool = False, index: Optional[str] = None) -> ReplicaReport:
    """Compare every rank's dump under ``root`` (see the module docstring)."""
    dumps = _load(root, index)
    ranks = list(dumps)
    by_rank = {r: {e["name"]: e for e in d.entries if everything or _invariant(e)} for r, d in dumps.items()}
    order: List[str] = list(by_rank[ranks[0]])
    for r in ranks[1:]:
        order += [n for n in by_rank[r] if n not in by_rank[ranks[0]]]
    report = ReplicaReport(ranks, len(order))
    report.cut = {r for r, d in dumps.items() if d.partial or d.cut}
    report._order = order
    for name in order:
        present = {r: by_rank[r].get(name) for r in ranks}
        missing = [r for r, e in present.items() if e is None]
        have = [r for r in ranks if present[r] is not None]
        for r in missing:
            if r in report.cut:  # its writer stopped before this record: where it stopped, not a disagreement
                report.ends_before.setdefault(r, (name, have[0]))
                continue
            report.disagreements.append(Disagreement(name, r, have[0], f"record missing on rank {r}"))
        votes = collections.Counter(_outputs(present[r]) for r in have)
        if len(votes) <= 1:
            continue
        ref_rank = have[0]
        top = votes.most_common()
        majority = top[0][0] if top[0][1] > top[1][1] else _outputs(present[ref_rank])
        ref_rank = next(r for r in have if _outputs(present[r]) == majority)
        for r in have:
            if _outputs(present[r]) != majority:
                report.disagreements.append(Disagreement(name, r, ref_rank, _detail(present[ref_rank], present[r]),
                                                         present[r].get("source")))
    return report
