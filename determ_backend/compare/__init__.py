"""The compare core: alignment, the verdict and the root-cause rule, one home for each.

* :mod:`.align`: :class:`Pair`, :func:`align` (pairs the records of two traces);
* :mod:`.verdict`: :func:`judge` ("do these two values differ?", one meaning of
  ``tol``, ``fp64_multiplier``, ``strict`` and ``bitwise``), :func:`tensor_metrics`,
  :func:`judge_records` (two trace records), :func:`rows_agree` (batch invariance of one value);
* :mod:`.roots`: :func:`find_roots` (the causal root-cause rule: symptom, live
  divergences, masked notes), :class:`Comparison`, :func:`compare_traces`.

Every tool that decides whether values differ (the backends' checks, ``diff``,
the observer, ``xdevice``, the oracles and localization of the minifier,
``analyze``, the dump compare) goes through this package.  Reading and writing
traces lives in :mod:`determ_backend.trace.stream`.
"""

from determ_backend.compare.align import Pair, align
from determ_backend.compare.roots import (Comparison, Confirm, compare_traces, describe, find_roots, is_allocation,
                                          is_output, pair_row)
from determ_backend.compare.verdict import (DEFAULT_FP64_MULTIPLIER, DEFAULT_TOL, EPS, close_to_scale, rounds_alike, KERNEL_ULPS, dtype_tol, largest_magnitude, is_float, judge, judge_records, metrics_text, batch_rows, by_statistics, rmse, rows_agree, stats_metrics, sub_batches, tensor_metrics)

__all__ = ["Pair", "align", "Comparison", "Confirm", "compare_traces", "describe", "find_roots", "is_allocation", "is_output", "pair_row",
           "DEFAULT_FP64_MULTIPLIER", "DEFAULT_TOL", "EPS", "close_to_scale", "rounds_alike", "KERNEL_ULPS", "dtype_tol", "largest_magnitude", "is_float", "judge", "judge_records", "metrics_text", "by_statistics", "rmse",
           "batch_rows", "rows_agree", "sub_batches", "stats_metrics", "tensor_metrics"]
