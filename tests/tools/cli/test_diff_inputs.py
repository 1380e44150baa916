"""``repro-tools diff`` on the inputs it is given: exit codes when records do not pair, empty,
partial, corrupt and wrongly typed traces, limited text logs, and bad options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from determ_backend.errors import TraceFormatError
from determ_backend.modes.core import HashDebugTrace, HashMode
from determ_backend.trace.stream import TraceWriter, read_trace
from repro_tools.cli import main as cli


def _program(x: torch.Tensor, extra: bool = False, scale: float = 1.0) -> torch.Tensor:
    h = (x @ x.T).relu() * scale
    h = h.sin()
    if extra:
        h.cos()  # one more op whose result is unused: nothing else changes
    return h.sum()


def traced(path: Path, **kwargs) -> Path:
    """A real HashMode trace of a small program."""
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    with HashMode(trace_path=path, stats=True):
        _program(x, **kwargs)
    return path


def diff(capsys, *argv: str):
    """(exit code, stdout, stderr lines) of ``repro-tools diff ARGV``."""
    rc = cli(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def one_error(err, *needles: str) -> None:
    assert len(err) == 1, err
    assert all(n in err[0] for n in needles), err[0]


def _lines(path: Path):
    return path.read_text().splitlines(keepends=True)


# -- exit codes: 0 only when every record pairs and none differs --------------------------------------

def test_identical_traces_exit_0_and_json_agrees(tmp_path, capsys):
    a, b = traced(tmp_path / "a.jsonl"), traced(tmp_path / "b.jsonl")
    rc, out, _ = diff(capsys, a, b)
    assert rc == 0 and out.strip().endswith("identical")
    rc, out, _ = diff(capsys, a, b, "--json")
    s = json.loads(out)
    assert rc == 0 and s["identical"] is True and s["notes"] == []
    rc, out, _ = diff(capsys, a, b, "--tol", "1e-3")  # agreeing within a tolerance is not said to be identical
    assert rc == 0 and out.strip().endswith("agree within tol=0.001: every record pairs and none differs beyond it")


def test_unpaired_records_exit_1_with_a_line_saying_so(tmp_path, capsys):
    a, b = traced(tmp_path / "a.jsonl"), traced(tmp_path / "b.jsonl", extra=True)
    rc, out, _ = diff(capsys, a, b)
    assert rc == 1, out
    note = [ln for ln in out.splitlines() if ln.startswith("not paired:")]
    assert len(note) == 1 and "0 records of A and 1 of B" in note[0] and "pair by" in note[0]
    assert "not shown identical" in out.splitlines()[-1]
    rc, out, _ = diff(capsys, a, b, "--json")
    s = json.loads(out)
    assert rc == 1 and s["identical"] is False and s["divergent"] is False and s["unmatched_b"] == 1


def test_divergent_traces_still_name_the_root_cause(tmp_path, capsys):
    a, b = traced(tmp_path / "a.jsonl"), traced(tmp_path / "b.jsonl", scale=1.0001)
    rc, out, _ = diff(capsys, a, b)
    assert rc == 1 and "root cause:" in out and "aten.mul.Tensor" in out.splitlines()[-1]


@pytest.mark.parametrize("side", [0, 1])
def test_a_trace_without_records_is_an_input_error_naming_it(tmp_path, capsys, side):
    full = traced(tmp_path / "full.jsonl")
    empty = tmp_path / "empty.jsonl"
    TraceWriter(empty, run="e").close()
    args = [empty, full] if side == 0 else [full, empty]
    rc, out, err = diff(capsys, *args)
    assert rc == 2 and not out
    one_error(err, str(empty), "no records")
    for argv in (args, [empty, empty]):  # the page of two traces exits as diff does, and writes no page
        rc = cli(["report", *map(str, argv), "-o", str(tmp_path / "page.html")])
        out = capsys.readouterr()
        assert rc == 2 and not (tmp_path / "page.html").exists()
        one_error(out.err.strip().splitlines(), str(empty), "no records")


# -- partial traces: only a cut last line is tolerated ------------------------------------------------

def test_allow_partial_rejects_a_corrupt_middle_line(tmp_path, capsys):
    a = traced(tmp_path / "a.jsonl")
    lines = _lines(a)
    bad = tmp_path / "mid.jsonl"
    bad.write_text("".join(lines[:3] + ["{garbage\n"] + lines[3:]))
    for extra in ([], ["--allow-partial"]):
        rc, out, err = diff(capsys, a, bad, *extra)
        assert rc == 2 and not out
        one_error(err, f"{bad}:4")


def test_allow_partial_accepts_a_cut_last_line(tmp_path, capsys):
    a = traced(tmp_path / "a.jsonl")
    lines = _lines(a)[:-1]  # no end line: the writer died ...
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # ... in the middle of a line
    rc, _, err = diff(capsys, a, cut)
    assert rc == 2 and "cut.jsonl" in err[0]
    rc, out, _ = diff(capsys, a, cut, "--allow-partial")
    assert rc == 1 and "partial trace" in out and "not paired: 1 records of A" in out


# -- malformed lines: one line naming file and line, exit 2 -------------------------------------------

@pytest.mark.parametrize("mutate,needle", [
    (lambda d: [d], "expected a JSON object"),
    (lambda d: 7, "expected a JSON object"),
    (lambda d: {**d, "shape": "abc"}, "'shape'"),
    (lambda d: {**d, "hash": 12}, "'hash'"),
    (lambda d: {**d, "stats": "x"}, "'stats'"),
    (lambda d: {**d, "inputs": "x"}, "'inputs'"),
    (lambda d: {**d, "call": "0"}, "'call'"),
    (lambda d: {k: v for k, v in d.items() if k != "node"}, "'node'"),
])
def test_badly_typed_records_are_one_line_errors(tmp_path, capsys, mutate, needle):
    a = traced(tmp_path / "a.jsonl")
    lines = _lines(a)
    bad = tmp_path / "bad.jsonl"
    lines[2] = json.dumps(mutate(json.loads(lines[2]))) + "\n"
    bad.write_text("".join(lines))
    rc, out, err = diff(capsys, a, bad)
    assert rc == 2 and not out
    one_error(err, f"{bad}:3", needle)
    with pytest.raises(TraceFormatError, match="bad.jsonl:3"):
        read_trace(bad)


@pytest.mark.parametrize("version,needle", [(99, "newer than this determ reads"), ("1", "bad trace format version"),
                                            (None, "bad trace format version")])
def test_unknown_header_versions_are_refused(tmp_path, capsys, version, needle):
    a = traced(tmp_path / "a.jsonl")
    lines = _lines(a)
    header = json.loads(lines[0])
    header["version"] = version
    bad = tmp_path / "v.jsonl"
    bad.write_text("".join([json.dumps(header) + "\n"] + lines[1:]))
    rc, _, err = diff(capsys, a, bad)
    assert rc == 2
    one_error(err, f"{bad}:1", needle)


# -- HashDebugTrace text logs cut at max_ops_logged ---------------------------------------------------

def _logged(path: Path, scale: float, limit) -> Path:
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    with HashDebugTrace(log_path=path, max_ops_logged=limit):
        _program(x, scale=scale)
    return path


def test_limited_logs_are_never_reported_identical(tmp_path, capsys):
    # the runs differ only after the first 3 logged ops
    a, b = _logged(tmp_path / "a.log", 1.0, 3), _logged(tmp_path / "b.log", 1.0001, 3)
    rc, out, _ = diff(capsys, a, b)
    assert rc == 1 and "identical" != out.splitlines()[-1]
    assert "max_ops_logged=3" in out and "not shown identical" in out
    rc, out, _ = diff(capsys, a, a, "--json")  # even a limited log against itself
    s = json.loads(out)
    assert rc == 1 and s["identical"] is False and s["inputs"]["a"]["limited"]
    rc, _, _ = diff(capsys, a.with_suffix(".jsonl"), b.with_suffix(".jsonl"))
    assert rc == 1  # the JSONL traces are complete and show the divergence


def test_unlimited_logs_diff_identical(tmp_path, capsys):
    a, b = _logged(tmp_path / "a.log", 1.0, None), _logged(tmp_path / "b.log", 1.0, 10_000)
    rc, out, _ = diff(capsys, a, b)
    assert rc == 0 and out.strip().endswith("identical")


def test_a_log_limited_to_nothing_is_an_input_error(tmp_path, capsys):
    a = _logged(tmp_path / "a.log", 1.0, 0)
    rc, _, err = diff(capsys, a, a)
    assert rc == 2
    one_error(err, str(a), "no records", "max_ops_logged=0")


def test_logs_under_any_name_and_cut_logs(tmp_path, capsys):
    a = _logged(tmp_path / "a.log", 1.0, None)
    txt = tmp_path / "a_copy.txt"  # recognized by its first line, not its name
    txt.write_text(a.read_text())
    rc, out, _ = diff(capsys, a, txt)
    assert rc == 0, out
    text = a.read_text()
    cut = tmp_path / "cut.log"
    cut.write_text(text[: text.rindex(" hash=") + 10])  # the run died while writing an output line
    rc, _, err = diff(capsys, a, cut)
    assert rc == 2 and "cut.log" in err[0]
    rc, out, _ = diff(capsys, a, cut, "--allow-partial")
    assert rc == 1 and "partial trace" in out and "not paired" in out


# -- options ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [(["--tol", "-1"], "--tol"), (["--tol", "nan"], "--tol"),
                                         (["--tol", "inf"], "--tol"), (["--limit", "-2"], "--limit")])
def test_bad_options_are_one_line_usage_errors(tmp_path, capsys, argv, needle):
    a = traced(tmp_path / "a.jsonl")
    rc, out, err = diff(capsys, a, a, *argv)
    assert rc == 2 and not out
    one_error(err, needle, ">= 0")


def test_tolerance_zero_is_accepted(tmp_path, capsys):
    a = traced(tmp_path / "a.jsonl")
    rc, _, _ = diff(capsys, a, a, "--tol", "0")
    assert rc == 0


def test_a_tolerance_without_statistics_judges_nothing_and_shows_nothing_identical(tmp_path, capsys):
    """HashMode traces without statistics, one weight 1e-3 off: with --tol 1e-5 every differing fingerprint was
    taken for agreeing (no statistics, no difference) and the runs were said to agree, exit 0."""
    for name, delta in (("a", 0.0), ("b", 1e-3)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        with torch.no_grad():
            lin.weight[0, 0] += delta
        with HashMode(trace_path=tmp_path / f"{name}.jsonl", module=lin):
            lin(torch.randn(4, 8)).relu().sum()
    rc, out, _ = diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--tol", "1e-5")
    assert rc == 1 and "agree within" not in out
    assert "differ in their fingerprints with no statistics or stored values to judge --tol by" in out
    rc, out, _ = diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert rc == 1 and "root cause: graph=eager stage=eager node=weight" in out


def test_views_and_copies_under_a_tolerance_take_their_inputs_verdict(tmp_path, capsys):
    """HashMode with statistics, inputs 1e-7 apart, --tol 1e-3: a view or a copy carries its source's fingerprint and
    no statistics of its own, so it was 'not judged' and diff could never say the runs agree (exit 1), while the
    page said they did."""
    from repro_tools.report import build

    for name, delta in (("a", 0.0), ("b", 1e-7)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 4)
        x = torch.randn(2, 8) + delta
        with HashMode(trace_path=tmp_path / f"{name}.jsonl", stats=True):
            lin(x).sum().backward()
    rc, out, _ = diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--tol", "1e-3")
    assert rc == 0 and "agree within tol=0.001" in out and "not judged" not in out
    rep = build([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tol=1e-3)
    assert not rep.divergent and rep.verdict.startswith("agree within tol=0.001")
    assert "by statistics alone" in rep.verdict  # x differs by 1e-7: its statistics agree, no element error bounded


def _two_steps(path: Path, delta: float = 0.0, flip: bool = False) -> Path:
    """Two AdamW steps of a small MLP under HashMode with statistics; ``delta`` added to one weight element, or the
    batch's rows in reverse order (``flip``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight[3, 5] += delta
    x = torch.randn(8, 16)
    x = x.flip(0).contiguous() if flip else x
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with HashMode(trace_path=path, stats=True, module=model):
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return path


def test_a_weight_given_differently_is_the_root_though_its_statistics_agree_within_the_tolerance(tmp_path, capsys):
    """One weight element 1e-2 off, --tol 1e-4: the weight's min/max/mean/L2 move by about the tolerance, so it
    'agreed', and the second step's matmul, where the values first cross the tolerance, was named the root cause.
    A tensor the run was given that differs in its fingerprint is where the difference comes from."""
    a, b = _two_steps(tmp_path / "a.jsonl"), _two_steps(tmp_path / "b.jsonl", delta=1e-2)
    rc, out, _ = diff(capsys, a, b, "--tol", "1e-4", "--json")
    s = json.loads(out)
    assert rc == 1 and [r["node"] for r in s["root_causes"]] == ["0.weight"], s["root_causes"]
    assert s["root_causes"][0]["metrics"]["within_tol_by_statistics_only"] is True
    rc, out, _ = diff(capsys, a, b, "--tol", "1e-4")
    assert "root cause: graph=eager stage=eager node=0.weight" in out and "by statistics:" in out
    rc, out, _ = diff(capsys, a, b)  # bitwise says the same
    assert rc == 1 and "root cause: graph=eager stage=eager node=0.weight" in out


def test_an_agreement_by_statistics_alone_says_so(tmp_path, capsys):
    """The same batch in another row order: every statistic agrees, elements do not.  The runs agree within the
    tolerance only as far as statistics tell, and diff says that, with how many records rest on them."""
    a, b = _two_steps(tmp_path / "a.jsonl"), _two_steps(tmp_path / "b.jsonl", flip=True)
    rc, out, _ = diff(capsys, a, b, "--tol", "1e-3")
    last = out.strip().splitlines()[-1]
    assert "by statistics:" in out and "bound no element error" in out
    assert last.startswith("agree within tol=0.001") and "by statistics alone" in last, last


def test_a_multi_rank_run_directory_names_its_ranks(tmp_path, capsys):
    """A run of several ranks writes ``run/rank<N>/trace.jsonl``: diff and report said 'no such trace file' / 'not a
    determ result' of the run directory."""
    for rank in (0, 1):
        (tmp_path / "run" / f"rank{rank}").mkdir(parents=True)
        with HashMode(trace_path=tmp_path / "run" / f"rank{rank}" / "trace.jsonl"):
            torch.ones(2).relu()
    run = str(tmp_path / "run")
    rc, _, err = diff(capsys, run, run)
    one_error(err, "holds rank directories (rank0, rank1), one trace per rank")
    assert rc == 2
    assert cli(["report", run, "-o", str(tmp_path / "r.html")]) == 2
    assert "holds rank directories (rank0, rank1)" in capsys.readouterr().err


def test_allocations_of_two_dtypes_are_said_to_hold_no_values_not_to_lack_statistics(tmp_path, capsys):
    """A bf16 run against an fp32 one under --tol: the unjudged records were memory as allocated (``new_empty``),
    and the note told the user to "record them with stats" though statistics were on."""
    for name, dt in (("a", torch.float32), ("b", torch.bfloat16)):
        with HashMode(trace_path=str(tmp_path / f"{name}.jsonl"), stats=True):
            x = torch.ones(4, 4, dtype=dt)
            x.new_empty((4, 4)).fill_(2.0) * x
    cli(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--tol", "0.01"])
    out = capsys.readouterr().out
    assert "memory as allocated" in out and "record them with stats" not in out, out


def test_a_batch_that_differs_by_rounding_alone_is_not_blamed_for_a_wrong_op(tmp_path, capsys):
    """B's batch went through preprocessing that rounds one unit apart on half its rows, and B scales by 1.1 where A
    scales by 1.0: the mul is the root, not the batch, whose difference is rounding noise."""
    for name, scale in (("a", 1.0), ("b", 1.1)):
        torch.manual_seed(0)
        x = torch.randn(8, 16)
        if name == "b":
            x[:4] = torch.nextafter(x[:4], torch.full_like(x[:4], math.inf))
        with HashMode(trace_path=tmp_path / f"{name}.jsonl", stats=True):
            torch.tanh(x @ torch.ones(16, 16)).mul(scale).sum()
    rc, out, _ = diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--tol", "1e-3", "--json")
    s = json.loads(out)
    assert rc == 1 and [r["op"] for r in s["root_causes"]] == ["aten.mul.Tensor"], s["root_causes"]


def test_one_element_of_a_large_weight_flipped_in_sign_is_the_root(tmp_path, capsys):
    """A 1024x1024 weight with one element's sign flipped: its L2 norm, min and max do not move and its mean by
    3e-7; a rounding bound taken from its largest magnitude (0.2) called that noise, and the sum after the matmul was
    blamed.  The mean moved by far more than rounding moves it (units of its RMS size, ~0.03)."""
    for name, sign in (("a", -1.0), ("b", 1.0)):
        g = torch.Generator().manual_seed(0)
        w = (torch.rand(1024, 1024, generator=g) * 2 - 1) * 0.05
        w[0, 0], w[0, 1] = 0.2, -0.2  # the min and the max, which the flip leaves alone
        w[3, 10] = sign * 0.15
        x = torch.zeros(2, 1024)
        x[:, 3] = 1.0
        with HashMode(trace_path=tmp_path / f"{name}.jsonl", stats=True):
            torch.tanh(x @ w).sum()
    rc, out, _ = diff(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--tol", "1e-3", "--json")
    s = json.loads(out)
    assert rc == 1 and [r["op"] for r in s["root_causes"]] == ["input"], s["root_causes"]
    assert s["root_causes"][0]["shape"] == [1024, 1024]
