"""An online baseline: compare each record with a reference dump while the dump is written.

msprobe's ``bench_path``: the run being dumped is checked, record by record, against a
stored reference dump of the same step and rank (matched by call name).  Each tensor is
judged by the compare core's rule (:func:`determ_backend.compare.judge_records`):
bitwise when both sides ran on the same device type in the same dtype, otherwise within
the dtypes' tolerance on the statistics.  A record whose inputs agree while an output
does not is a **root cause**, by compare's own rule
(:class:`~determ_backend.dump.comparison.dumps.InputsRule`: weights after a divergence,
parameter read-outs, a backward whose forward's inputs differed); one whose inputs
already differ only carries a divergence along.  The first root cause is logged at once with its
source line; every divergent record is counted.

In statistics mode the dump keeps no tensors, except for the first ``keep`` divergent
records (``diff_nums``, default 5; -1: all): their tensors are stored in the dump's
``tensors.bin`` so ``compare`` can compute exact metrics for them.  At switch-off the
findings are written to ``online_compare.json`` next to the index and summarized in
one log line.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from determ_backend.compare import DEFAULT_TOL, dtype_tol, judge_records
from determ_backend.errors import ConfigError, DetermError
from determ_backend.trace.store import PackWriter
from determ_backend.trace.stream import atomic_write_text
from determ_backend.dump.capture.writer import PAYLOAD_FILE
from determ_backend.dump.comparison.dumps import InputsRule, is_given
from determ_backend.dump.comparison.metrics import tensor_record

__all__ = ["OnlineBaseline", "REPORT_FILE"]

log = logging.getLogger(__name__)

REPORT_FILE = "online_compare.json"
_FIRST = 20  # divergent records listed in the report
_REMEMBERED = 1 << 16  # forward calls with differing inputs remembered for their backward


def _resolve_index(bench: Path, step: int, rank: int) -> Path:
    """The reference index for ``step``/``rank`` under ``bench``: ``<bench>/step<N>/rank<R>``, ``<bench>/rank<R>``,
    or ``bench`` itself (a rank directory or an index file)."""
    from determ_backend.dump.comparison.parse import find_index, holds_index

    for cand in (bench / f"step{step}" / f"rank{rank}", bench / f"rank{rank}", bench):
        if cand.is_file() or holds_index(cand):
            return find_index(cand)
    raise ConfigError(f"online baseline: {bench} holds no reference dump for step {step}, rank {rank} (expected "
                      f"{bench}/step{step}/rank{rank}/dump.pkl, a rank directory or an index file)")


def _floating(dtype: Optional[str]) -> bool:
    d = getattr(torch, str(dtype).replace("torch.", ""), None) if dtype else None
    return isinstance(d, torch.dtype) and d.is_floating_point


class OnlineBaseline:
    """Judges records against a reference dump as they are produced; see the module docstring."""

    def __init__(self, reference: Any, keep: int = 5):
        self.reference_path = reference.path
        self.device = reference.header.get("device")
        self.ref: Dict[str, Dict[str, Any]] = {e["name"]: e for e in reference.entries}
        self.keep = keep
        self.kept = 0
        self.checked = 0
        self.unmatched = 0
        self.divergent = 0
        self.first: List[Dict[str, Any]] = []
        """The first :data:`_FIRST` divergent records (their count is :attr:`divergent`)."""
        self.root: Optional[Dict[str, Any]] = None
        self._device: Optional[str] = None
        self._pack: Optional[PackWriter] = None
        self._lock = threading.Lock()
        self._rule = InputsRule(remembered=_REMEMBERED)  # compare's rule for whether a call's inputs agree
        self.off = False
        """Set when the check itself failed (reported once): the dump goes on without it."""
        self._dtypes: set = set()  # the dtypes of tensors met in another dtype on each side (mixed precision)

    @classmethod
    def for_step(cls, bench_path: Union[str, Path], step: int, rank: int, keep: int = 5) -> "OnlineBaseline":
        from determ_backend.dump.comparison.parse import read_dump

        return cls(read_dump(_resolve_index(Path(bench_path), step, rank), allow_partial=True), keep)

    def start(self, device: str) -> None:
        """The dump begins on ``device`` (the verdicts are bitwise only when the reference ran on the same)."""
        self._device = device

    def _tol(self, ta: Dict[str, Any], tb: Dict[str, Any]) -> Optional[float]:
        """Bitwise on the same device and dtypes; once the runs are seen to compute in other dtypes (bfloat16
        against float32), every tensor within the tolerance of the narrowest dtype met, as compare judges: a
        ``.float()`` of bfloat16 values carries bfloat16's rounding, and was blamed when judged bitwise."""
        da, db = ta.get("dtype"), tb.get("dtype")
        if da != db and _floating(da) and _floating(db):  # int32 ids against int64 ones are no mixed precision
            self._dtypes.update((da, db))
        if self._device == self.device and da == db and not self._dtypes:
            return None
        return dtype_tol(DEFAULT_TOL, da, db, *self._dtypes)

    def _agree(self, io: str, entry: Dict[str, Any], ref: Dict[str, Any],
               given: Optional[bool] = None) -> List[Optional[bool]]:
        """Verdicts of ``entry``'s ``io`` tensors against the reference's (None: not judged -- fingerprints alone,
        which a tolerance cannot judge); ``given``: only the inputs that are (True) or are not (False) weights and
        non-tensor arguments (:func:`~..comparison.dumps.is_given`)."""
        theirs = {t.get("name"): t for t in ref.get(io, [])}
        out: List[Optional[bool]] = []
        for t in entry.get(io, []):
            r = theirs.get(t.get("name"))
            if given is not None and is_given(t) != given:
                continue
            if "dtype" not in t:
                if "type" in t and r is not None:  # a non-tensor argument: its value
                    out.append(t.get("value") == r.get("value") and t.get("type") == r.get("type"))
                continue
            if r is None or "dtype" not in r:
                out.append(False)
                continue
            if t.get("hash") is None and t.get("stats") is None:
                continue  # stack-only records: nothing to judge
            out.append(judge_records(tensor_record(t), tensor_record(r), self._tol(t, r), scaled=True)[0])
        return out

    def _failed(self, e: BaseException) -> None:
        """A failing check never costs the dump or the run: reported once, then the baseline is off."""
        if not self.off:
            self.off = True
            log.error("determ dump: the online baseline failed (%s: %s) and is off for this dump",
                      type(e).__name__, e)

    def check(self, entry: Dict[str, Any]) -> Optional[str]:
        """``"root_cause"``, ``"diverged"`` or None (agrees, no counterpart, or the baseline is off) for an entry
        whose tensors carry their hash and statistics."""
        if self.off:
            return None
        try:
            return self._check(entry)
        except Exception as e:
            self._failed(e)
            return None

    def _check(self, entry: Dict[str, Any]) -> Optional[str]:
        ref = self.ref.get(entry["name"])
        with self._lock:
            self.checked += 1
            if ref is None:
                self.unmatched += 1
                self._rule.unpaired(entry.get("seq"))
                return None
            ins = self._rule.inputs_agree(entry, self._agree("inputs", entry, ref, given=False),
                                          self._agree("inputs", entry, ref, given=True))
            diverges = any(v is False for v in self._agree("outputs", entry, ref))
            self._rule.output_judged(entry, diverges)
            if not diverges:
                return None
            verdict = "root_cause" if ins else "diverged"
            finding = {"name": entry["name"], "verdict": verdict, "source": entry.get("source")}
            self.divergent += 1
            if len(self.first) < _FIRST:
                self.first.append(finding)
            if verdict == "root_cause" and self.root is None:
                self.root = finding
                given = [f"{entry['name']}_{t.get('name')}" for t in entry.get("inputs", [])
                         if is_given(t) and False in self._agree("inputs", {"inputs": [t]}, ref, given=True)]
                if given:  # compare's words: a call fed a changed weight is where the divergence starts
                    log.warning("online baseline: root cause %s at %s: its output differs from %s, and so does what "
                                "it was given (%s), while nothing before it diverged", entry["name"],
                                entry.get("source") or "?", self.reference_path, ", ".join(given))
                else:
                    log.warning("online baseline: root cause %s at %s: its inputs match %s, its output does not",
                                entry["name"], entry.get("source") or "?", self.reference_path)
            return verdict

    def wants_tensors(self) -> bool:
        """Whether the next divergent record's tensors are still to be kept."""
        return not self.off and (self.keep == -1 or self.kept < self.keep)

    def store(self, data_dir: Path, entry: Dict[str, Any], tensors: Dict[int, torch.Tensor]) -> None:
        """Keep the tensors of one divergent entry in ``data_dir/tensors.bin`` (statistics mode)."""
        try:
            self._store(data_dir, entry, tensors)
        except Exception as e:  # a full disk, say: the entry keeps its statistics
            self._failed(e)

    def _store(self, data_dir: Path, entry: Dict[str, Any], tensors: Dict[int, torch.Tensor]) -> None:
        if self._pack is None:
            data_dir.mkdir(parents=True, exist_ok=True)
            self._pack = PackWriter(data_dir / PAYLOAD_FILE, append=(data_dir / PAYLOAD_FILE).is_file())
        items = [(t["hash"], tensors[id(t)]) for io in ("inputs", "outputs") for t in entry.get(io, [])
                 if id(t) in tensors and t.get("hash")]
        spans = self._pack.put_many(items)
        by_hash = dict(zip((h for h, _ in items), spans))
        for io in ("inputs", "outputs"):
            for t in entry.get(io, []):
                if t.get("hash") in by_hash:
                    t["payload"] = list(by_hash[t["hash"]])
        self.kept += 1

    def summary(self) -> Dict[str, Any]:
        return {"reference": str(self.reference_path), "checked": self.checked, "unmatched": self.unmatched,
                "divergent": self.divergent, "root_cause": self.root, "first_divergences": self.first,
                "tensors_kept": self.kept}

    def close(self, rank_dir: Path) -> None:
        """Finish the stored tensors, write ``online_compare.json`` into ``rank_dir`` and log one summary line."""
        if self._pack is not None:
            self._pack.close()
            self._pack = None
        s = self.summary()
        try:
            atomic_write_text(rank_dir / REPORT_FILE, json.dumps(s, indent=2, default=str) + "\n")
        except OSError as e:
            raise DetermError(f"online baseline: cannot write {rank_dir / REPORT_FILE}: {e.strerror or e}") from None
        if not s["divergent"]:
            log.info("online baseline: %d records checked against %s, all agree", s["checked"], self.reference_path)
            return
        root = f"root cause {s['root_cause']['name']}" if s["root_cause"] else "no root cause"
        log.warning("online baseline: %d records checked against %s, %d divergent, %s; see %s", s["checked"],
                    self.reference_path, s["divergent"], root, rank_dir / REPORT_FILE)
