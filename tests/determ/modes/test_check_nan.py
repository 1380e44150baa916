"""HashMode(check_nan=True): the eager op that creates a NaN/Inf from finite inputs, forward and backward, once per
site; ops that only carry it along are not named (the rule shared with DETERM_CHECK=nan and the dump's overflow
check)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from determ_backend.errors import ConfigError
from determ_backend.modes import HashDebugTrace, HashMode, read_hash_log


def test_hashmode_names_forward_and_backward_creators_once(caplog):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes.core"):
        with HashMode(check_nan=True, batch=7) as m:  # small batches: creations span flushes
            for _ in range(3):
                h = lin(x)
                y = torch.log(h - 0.2)  # forward creator: NaN where h < 0.2
                # sqrt's backward: an Inf at 0, which the backward of `* 0.0` turns into a NaN
                z = (torch.sqrt(h * 0.0) + torch.nan_to_num(y)).sum()
                z.backward()
        m.flush()
    ops = [c.record.op for c in m.nan_creations]
    assert ops[:1] == ["aten.log.default"]
    assert "aten.div.Tensor" in ops or "aten.mul.Tensor" in ops  # the backward of sqrt at relu == 0
    assert all(c.record.op not in ("aten.sqrt.default", "aten.sum.default") for c in m.nan_creations)
    log_lines = [r.getMessage() for r in caplog.records if "created by" in r.getMessage()]
    assert len(log_lines) == len({(c.record.op, c.record.source) for c in m.nan_creations})  # once per site
    assert len(m.nan_creations) == 3 * len(log_lines)  # every step counted
    assert any("NaN/Inf created by" in s for s in m.summary())
    log_creation = m.nan_creations[0]
    assert log_creation.nan > 0 and log_creation.inputs[0]["min"] < 0.2


def test_hashmode_healthy_run_names_nothing_and_bad_flag_is_a_config_error():
    with HashMode(check_nan=True) as m:
        torch.sqrt(torch.rand(16) + 1).sum()
    m.flush()
    assert m.nan_creations == []
    with pytest.raises(ConfigError, match="check_nan"):
        HashMode(check_nan="yes")


def test_a_creation_from_a_view_gives_the_range_of_the_values_it_views(caplog):
    """A Linear on a 3-D input returns a view of its addmm: the view's values are not read, its range is its base's."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 3, 8)
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes.core"):
        with HashMode(check_nan=True) as m:
            torch.log(lin(x))
    (c,) = m.nan_creations
    (inp,) = c.inputs
    h = lin(x).detach()
    assert inp["view"] and (inp["min"], inp["max"]) == (h.min().item(), h.max().item())
    assert f"within [{inp['min']}, {inp['max']}]" in caplog.text


def test_an_inf_mask_is_named_only_once_a_nan_comes_of_it(caplog):
    """Attention's math path turns a boolean padding mask into -inf (a new Inf from finite inputs) that the softmax
    turns into 0: masked, not named -- as the backends' DETERM_CHECK=nan keeps such a mask a note.  A row masked
    whole gives the softmax nothing but -inf: NaN, and the mask is named then."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[:, -1] = False  # padding
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes.core"):
        with HashMode(check_nan=True) as m:
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=0.1)  # dropout: the math path
    assert torch.isfinite(out).all()
    assert m.nan_creations == [] and m.masked_creations and "created by" not in caplog.text
    assert any("masked, not named" in line for line in m.summary())
    mask[2] = False  # row 2 may attend to nothing
    with HashMode(check_nan=True) as m:
        scores = (q @ q.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ q
    assert out.isnan().any()
    assert [(c.record.op, c.inf > 0, c.nan) for c in m.nan_creations] == [("aten.masked_fill.Scalar", True, 0)]
    assert m.masked_creations == []


def test_hashdebugtrace_takes_check_nan_and_keep_records_and_says_the_creator_in_its_footer(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    log_path = tmp_path / "run.log"
    with HashDebugTrace(log_path=log_path, check_nan=True, keep_records=True) as m:
        torch.log(lin(x) - 0.2).sum()
    assert [c.record.op for c in m.nan_creations] == ["aten.log.default"]
    assert m.records and m.records[-1].op == "aten.sum.default"  # kept
    footer = [line for line in log_path.read_text().splitlines() if line.startswith("# NaN/Inf created by")]
    assert len(footer) == 1 and "aten.log.default" in footer[0], footer
    assert len(read_hash_log(log_path)) == len(m.records)  # the footer line leaves the log readable
    with HashDebugTrace(log_path=tmp_path / "healthy.log") as quiet:  # by default: no records kept, no footer line
        torch.sqrt(torch.rand(4) + 1)
    assert quiet.records == [] and "NaN/Inf" not in (tmp_path / "healthy.log").read_text()
    with pytest.raises(ConfigError, match="check_nan"):
        HashDebugTrace(log_path=tmp_path / "bad.log", check_nan="yes")
