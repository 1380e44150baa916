"""The verdict: do two values differ?  One :func:`judge` for every caller.

Meaning (PyTorch's ``same(..., fp64_ref)``):

* **bitwise** (``bitwise=True``: determinism, same-device references): same dtype,
  same shape, same bits (fingerprints).
* **floating values**: equal when ``allclose(expected, actual, atol=tol, rtol=tol)``;
  otherwise, when an fp64 reference ``ref64`` is given, when ``actual``'s RMSE
  against it is at most ``fp64_multiplier`` times ``expected``'s own RMSE against it,
  plus ``tol / 10`` (a NaN that ``expected`` does not have always differs).
* **non-floating values** (bool, integer tensors, Python values): compared exactly
  when ``strict``, else not compared (``None``).  ``strict`` with ``tol == 0``
  compares every value bitwise.
* a shape mismatch, or a tensor against a non-tensor, always differs.
* ``symmetric`` (two devices, neither of them the reference): with ``ref64``, the
  values also differ when ``expected`` is the one farther from fp64 (beyond the
  multiplier); the accuracy check is one-sided (compiled may be *more* accurate).

:func:`close_to_scale` is the relative-to-size test the accuracy check asks of a root it suspects innocent
(whether a node computes its compiled value from its compiled inputs), where an absolute tolerance would
pass any two small tensors; :func:`rounds_alike` the test of one kernel's own rounding that narrowing a fused
kernel asks of a node run on its compiled inputs.

:func:`tensor_metrics` measures a pair (max abs/rel error, cosine, errors vs fp64);
:func:`judge_records` judges two trace records from their fingerprints, their
stored payloads or, failing those, their statistics.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend.fingerprint.core import hash_tensor, hash_tensors
from determ_backend.trace.store import TensorStore
from determ_backend.trace.stream import Record

__all__ = ["DEFAULT_TOL", "DEFAULT_FP64_MULTIPLIER", "EPS", "judge", "close_to_scale", "rounds_alike", "KERNEL_ULPS",
           "largest_magnitude", "is_float", "tensor_metrics", "rmse", "rows_agree", "batch_rows", "sub_batches",
           "stats_metrics", "by_statistics", "judge_records", "dtype_tol", "metrics_text"]

DEFAULT_TOL = 1e-3
"""The default tolerance of every verdict (``DETERM_TOL``, ``--tol``)."""
DEFAULT_FP64_MULTIPLIER = 2.0
"""The default allowed ratio of compiled to eager error against fp64 (``DETERM_FP64_MULTIPLIER``)."""
EPS = 1e-12


def is_float(x: Any) -> bool:
    """A floating or complex tensor or dtype, or the name of one as records (``float32``, ``bfloat16``) and dumps
    (``torch.float32``) spell it."""
    if isinstance(x, torch.Tensor):
        return x.is_floating_point() or x.is_complex()
    if isinstance(x, str):
        x = getattr(torch, x[6:] if x.startswith("torch.") else x, None)
    return isinstance(x, torch.dtype) and (x.is_floating_point or x.is_complex)


_ULPS = 4
"""Units in the last place of the narrowest floating dtype that :func:`dtype_tol` allows."""


def dtype_tol(tol: float, *dtypes: Any) -> float:
    """The tolerance for values computed in ``dtypes`` (torch dtypes or their names) with no fp64
    reference at hand: ``tol``, widened to a few units in the last place of the narrowest floating
    dtype (bf16 or fp16 results cannot agree with fp32 ones to 1e-3)."""
    eps = 0.0
    for d in dtypes:
        if isinstance(d, str):
            d = getattr(torch, d.replace("torch.", ""), None)
        if isinstance(d, torch.dtype) and d.is_floating_point:
            eps = max(eps, torch.finfo(d).eps)
    return max(tol, _ULPS * eps)


def rmse(x: torch.Tensor, y: torch.Tensor) -> float:
    d = x.detach().to(torch.float64).cpu() - y.detach().to(torch.float64).cpu()
    return math.sqrt(float(torch.mean(d * d))) if d.numel() else 0.0


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    ha, hb = hash_tensors([a, b])
    return ha == hb


def judge(expected: Any, actual: Any, ref64: Any = None, *, tol: float = DEFAULT_TOL,
          fp64_multiplier: float = DEFAULT_FP64_MULTIPLIER, strict: bool = False,
          bitwise: bool = False, symmetric: bool = False) -> Optional[bool]:
    """True when ``actual`` agrees with ``expected``, False when it differs, None when not compared
    (a non-floating value without ``strict``).  See the module docstring for the meaning."""
    et, at = isinstance(expected, torch.Tensor), isinstance(actual, torch.Tensor)
    if not et or not at:
        if et or at:
            return False
        return bool(expected == actual) if (strict or bitwise) else None
    if expected.shape != actual.shape:
        return False
    if bitwise or (strict and tol == 0 and expected.dtype == actual.dtype):
        return _bitwise(expected.detach(), actual.detach())  # two dtypes never hold the same bits: values, within 0
    if not is_float(expected):
        if not strict:
            return None
        return bool(torch.equal(expected.detach().cpu(), actual.detach().cpu().to(expected.dtype)))
    common = torch.promote_types(expected.dtype, actual.dtype)  # two dtypes: judged in the wider one
    e, c = expected.detach().cpu().to(common), actual.detach().cpu().to(common)
    if torch.allclose(e, c, atol=tol, rtol=tol, equal_nan=True):
        return True
    r = ref64.detach().cpu() if isinstance(ref64, torch.Tensor) and ref64.shape == e.shape else None
    if r is None:
        return False
    if e.is_complex() or c.is_complex():
        e, c, r = e.abs(), c.abs(), r.abs()
    nan_c, nan_e = bool(torch.isnan(c).any()), bool(torch.isnan(e).any())
    if nan_c != nan_e and (nan_c or symmetric):
        return False
    err_c, err_e = rmse(r, c), rmse(r, e)
    if symmetric and err_e > fp64_multiplier * err_c + tol / 10.0:
        return False
    return err_c <= fp64_multiplier * err_e + tol / 10.0


def largest_magnitude(t: torch.Tensor) -> float:
    """The largest finite magnitude ``t`` holds (0 for an empty tensor): the size a tolerance is taken relative to."""
    return float(t.detach().abs().double().nan_to_num(posinf=0.0, neginf=0.0).max()) if t.numel() else 0.0


def close_to_scale(exp: Any, got: Any, tol: float) -> Optional[bool]:
    """``got`` within ``tol`` of ``exp`` relative to ``exp``'s largest magnitude (an absolute tolerance passes any
    two tensors that are small enough); None when they are not two floating tensors of one shape."""
    if not (isinstance(exp, torch.Tensor) and isinstance(got, torch.Tensor)) or exp.shape != got.shape:
        return None
    if not (exp.is_floating_point() and got.is_floating_point()):
        return None
    e, g = exp.detach().double().cpu(), got.detach().double().cpu()
    return bool(torch.allclose(e, g, atol=tol * largest_magnitude(e), rtol=tol, equal_nan=True))


KERNEL_ULPS = 16
"""Units in the last place one kernel may round a node's value apart from eager's, on the same inputs."""


def rounds_alike(exp: Any, got: Any, inputs: Sequence[Any] = (), ulps: int = KERNEL_ULPS) -> Optional[bool]:
    """Whether ``got`` is ``exp`` (two computations of one node from the same ``inputs``) up to a kernel's own
    rounding: ``ulps`` units in the last place of the wider-rounding dtype, of the value's own size and, for each
    of the k input elements an output element may combine, of the largest input.  An honest sum that cancels to
    about 0 rounds at the size of what it sums (a LayerNorm backward's ``sum(dy * w * xhat)``), while a 1% wrong
    mean of small squares is far beyond.  Non-floating values compare exactly; None when they are not two tensors
    of one shape."""
    if not (isinstance(exp, torch.Tensor) and isinstance(got, torch.Tensor)) or exp.shape != got.shape:
        return None
    if not (exp.is_floating_point() and got.is_floating_point()):
        return bool(torch.equal(exp.cpu(), got.to(exp.dtype).cpu()))
    tol = ulps * max(torch.finfo(exp.dtype).eps, torch.finfo(got.dtype).eps)
    floats = [x.detach().double().cpu() for x in inputs
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
    e, g = exp.detach().double().cpu(), got.detach().double().cpu()
    k = max([x.numel() for x in floats] + [1]) / max(e.numel(), 1)
    scale = max(largest_magnitude(x) for x in floats + [e])
    return bool(torch.allclose(e, g, atol=tol * max(k, 1.0) * scale, rtol=tol, equal_nan=True))


def tensor_metrics(a: torch.Tensor, b: torch.Tensor, ref64: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """max abs/rel error (rel with an epsilon), cosine, bitwise flag; RMSE of each side vs ``ref64`` when given."""
    out: Dict[str, Any] = {}
    if a.shape != b.shape:
        return {"bitwise": False, "shape_mismatch": [list(a.shape), list(b.shape)]}
    x = a.detach().to(torch.float64).cpu() if not a.is_complex() else a.detach().abs().double().cpu()
    y = b.detach().to(torch.float64).cpu() if not b.is_complex() else b.detach().abs().double().cpu()
    out["bitwise"] = a.dtype == b.dtype and hash_tensor(a) == hash_tensor(b.to(a.device))
    if x.numel() == 0:
        out.update(max_abs=0.0, max_rel=0.0, cosine=1.0)
        return out
    both_nan = torch.isnan(x) & torch.isnan(y)
    d = torch.where(both_nan, torch.zeros_like(x), (x - y).abs())
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    out["max_abs"] = float(d.max())
    out["max_rel"] = float((d / (y.abs() + EPS)).max())
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if (nx == 0 and ny == 0) or (out["max_abs"] == 0.0 and math.isfinite(nx)):  # the same values: exactly 1, not
        out["cosine"] = 1.0                                                       # 1 less a rounding (0.99999...97)
    elif nx == 0 or ny == 0 or not (math.isfinite(nx) and math.isfinite(ny)):
        out["cosine"] = float("nan") if not (math.isfinite(nx) and math.isfinite(ny)) else 0.0
    else:
        # the dot and the norms round apart: identical tensors gave 1.0000000000000007
        out["cosine"] = min(1.0, max(-1.0, float(torch.dot(x.reshape(-1), y.reshape(-1)) / (nx * ny))))
    if ref64 is not None and ref64.shape == a.shape:
        out["err_a_vs_fp64"] = rmse(a, ref64)
        out["err_b_vs_fp64"] = rmse(b, ref64)
    return out


_STATS = ("min", "max", "mean", "l2")  # the statistics two records are compared by, each as a ``<stat>_diff``
_STAT_DELTAS = tuple(f"{k}_diff" for k in _STATS)


def metrics_text(m: Optional[Dict[str, Any]], skip: Sequence[str] = ()) -> str:
    """Metrics as one line: ``key=value`` pairs, floats to 3 significant digits.  Differences of the two sides'
    min/max/mean/L2 statistics are grouped and labelled as such: ``max_diff=0`` alone reads as "no element
    differs", which it does not say."""
    def num(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    items = [(k, v) for k, v in (m or {}).items() if k not in skip]
    parts = [f"{k}={num(v)}" for k, v in items if k not in _STAT_DELTAS]
    deltas = [f"{k[:-5]}={num(v)}" for k, v in items if k in _STAT_DELTAS]
    if deltas:
        parts.append(f"statistics |a-b| (not element errors): {' '.join(deltas)}")
    return " ".join(parts)


def by_statistics(m: Optional[Dict[str, Any]]) -> bool:
    """Whether a pair's metrics were judged from the two records' statistics, their fingerprints differing: an
    agreement of statistics, which no element error bounds (a permutation of the values keeps every one)."""
    return bool(m) and m.get("bitwise") is False and any(k in m for k in _STAT_DELTAS)


def stats_metrics(a: Record, b: Record) -> Dict[str, Any]:
    """What two records' statistics say about their difference (no payloads at hand)."""
    out: Dict[str, Any] = {"bitwise": a.hash == b.hash}
    sa, sb = a.stats or {}, b.stats or {}
    for k in _STATS:
        va, vb = sa.get(k), sb.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            out[f"{k}_diff"] = abs(va - vb) if not (math.isnan(va) and math.isnan(vb)) else 0.0
    if "l2" in sa and "l2" in sb and isinstance(sb["l2"], (int, float)):
        out["l2_rel"] = out.get("l2_diff", 0.0) / (abs(sb["l2"]) + EPS)
    for k in ("nan", "inf"):
        if sa.get(k) != sb.get(k):
            out[f"{k}_counts"] = [sa.get(k), sb.get(k)]
    return out


def _stats_close(m: Dict[str, Any], b: Record, tol: float) -> bool:
    if "nan_counts" in m or "inf_counts" in m:
        return False
    scale = max((abs(v) for v in (b.stats or {}).values() if isinstance(v, float) and math.isfinite(v)), default=1.0)
    return all(m.get(k, 0.0) <= tol * (1.0 + scale) for k in _STAT_DELTAS)


def _stats_close_to_scale(m: Dict[str, Any], b: Record, tol: float) -> bool:
    """The statistics' side of :func:`close_to_scale`: what two tensors within ``tol`` of ``b``'s largest magnitude
    (element-wise, ``atol = tol * amax``, ``rtol = tol``) can differ by in each statistic -- ``2 tol amax`` in the
    min, max and mean, ``tol (amax sqrt(n) + l2)`` in the L2 norm -- and no more."""
    if "nan_counts" in m or "inf_counts" in m:
        return False
    st = b.stats or {}

    def finite(k: str) -> float:
        v = st.get(k)
        return abs(float(v)) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0

    amax = max(finite("max"), finite("min"))
    n = math.prod(int(d) for d in b.shape) if isinstance(b.shape, (list, tuple)) and \
        all(isinstance(d, int) for d in b.shape) else 1
    bounds = {"min_diff": 2 * tol * amax, "max_diff": 2 * tol * amax, "mean_diff": 2 * tol * amax,
              "l2_diff": tol * (amax * math.sqrt(max(n, 1)) + finite("l2"))}
    return all(m.get(k, 0.0) <= bound + EPS for k, bound in bounds.items())


def judge_records(a: Record, b: Record, tol: Optional[float], store_a: Optional[TensorStore] = None,
                  store_b: Optional[TensorStore] = None, strict: bool = False, scaled: bool = False):
    """``(verdict, metrics)`` for two records of one value: bitwise when ``tol`` is None, else within
    ``tol`` by :func:`judge` on the stored payloads, or by the statistics when no payloads are stored; None
    (not judged) within a tolerance when the fingerprints differ and neither is at hand.  ``scaled``: within
    ``tol`` of ``b``'s size (:func:`close_to_scale`, and its bounds on the statistics) rather than ``tol`` as an
    absolute tolerance too, which passes any two tensors small enough (gradients) -- for comparisons without an
    fp64 reference."""
    if a.hash is not None and a.hash == b.hash and a.dtype == b.dtype and a.shape == b.shape:
        return True, {"bitwise": True}
    if a.shape != b.shape:
        return False, {"bitwise": False, "shape_mismatch": [a.shape, b.shape]}
    if tol is not None and not strict and a.dtype and not is_float(a.dtype) and a.dtype == b.dtype:
        return False, {"bitwise": False}  # integer/bool values agree only bitwise
    if store_a is not None and store_b is not None and a.payload and b.payload and a.payload in store_a \
            and b.payload in store_b:
        va, vb = store_a.get(a.payload), store_b.get(b.payload)
        m = tensor_metrics(va, vb)
        m["bitwise"] = False
        if tol is None:
            return False, m
        close = close_to_scale(vb, va, tol) if scaled else None
        return (close if close is not None else judge(va, vb, tol=tol, strict=True) is not False), m
    m = stats_metrics(a, b)
    if tol is None:
        return False, m
    if not any(k in m for k in _STAT_DELTAS):  # fingerprints alone: they differ, by how much nothing says
        return None, dict(m, unjudged="no statistics or stored values to judge a tolerance by")
    return (_stats_close_to_scale(m, b, tol) if scaled else _stats_close(m, b, tol)), m


def sub_batches(batch: int) -> List[int]:
    """The sub-batch sizes a batch-invariance check runs, in order: the first half, then the first row."""
    return sorted({batch // 2, 1} - {0, batch}, reverse=True)


def batch_rows(full_shape: Sequence[int], part_shape: Sequence[int], batch: int, b: int) -> Optional[Tuple[int, int]]:
    """``(dimension, rows)``: where the first ``b`` of ``batch`` rows lie in a value of shape ``full_shape`` whose
    sub-batch counterpart has shape ``part_shape`` -- the dimension whose size is ``batch*k`` in one and ``b*k`` in
    the other while every other dimension agrees (the batch may be folded with others, ``B*H`` rows after a
    reshape); None when the value has no batch dimension to match (a parameter, a reduction over the batch)."""
    if full_shape is None or part_shape is None or len(full_shape) != len(part_shape):
        return None
    for d, (n, m) in enumerate(zip(full_shape, part_shape)):
        if n != m and n % batch == 0 and n // batch * b == m and \
                all(x == y for e, (x, y) in enumerate(zip(full_shape, part_shape)) if e != d):
            return d, m
    return None


def rows_agree(full: Any, part: Any, batch: int, b: int) -> Optional[bool]:
    """Batch invariance of one value: whether the first rows of ``full`` (computed for a batch of ``batch``) equal
    ``part`` (the same value computed for the first ``b`` rows) bit for bit; None when the value has no batch
    dimension to match (:func:`batch_rows`)."""
    if not isinstance(full, torch.Tensor) or not isinstance(part, torch.Tensor):
        return None
    where = batch_rows(list(full.shape), list(part.shape), batch, b)
    if where is None:
        return None
    return judge(full.narrow(where[0], 0, where[1]), part, strict=True, bitwise=True)
