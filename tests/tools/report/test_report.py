"""repro-tools report and report.html: every kind of result read into a page, the run's own page on a finding.

The results are real: determ backends' runs (determinism and nan checks under determ_aot_eager), two traces,
two API dumps and their compare output.  The xdevice and minify outputs are covered in
``tests/tools/xdevice/test_xdevice.py`` next to the runs that make them, the accuracy check's page in
``tests/determ/backends/test_backends_inductor.py``; the rendered pages in a browser in
``test_report_browser.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import dump_helpers as dh
from backend_helpers import NondetModel, compile_run

import repro_tools.report as report_pkg
from determ_backend.trace.stream import read_trace
from repro_tools.cli import main
from repro_tools.report import build, render
from repro_tools.report.model import Report, limit_rows, rows_from_pairs


def _determinism_run(tmp_path: Path, run_id: str = "nd", **options) -> Path:
    torch.manual_seed(0)
    options.setdefault("check", "determinism")
    _, run_dir = compile_run(NondetModel(), (torch.randn(4, 64),), "determ_aot_eager", tmp_path, run_id, **options)
    return run_dir


class NanModel(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 1.0).sum(-1) + x.mean()


def _pairs(run_dir: Path):
    return [json.loads(ln) for ln in (run_dir / "pairs-0.jsonl").read_text().splitlines()]


def test_a_finding_writes_its_page_and_says_where(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        run_dir = _determinism_run(tmp_path)
    page = run_dir / "report.html"
    assert page.is_file()
    line = next(r.getMessage() for r in caplog.records if "determinism divergence" in r.getMessage())
    assert line.endswith(f"; report: {page}")
    rj = json.loads((run_dir / "report.json").read_text())
    fd = rj["first_divergence"]
    assert rj["findings"][0]["pairs"] == "pairs-0.jsonl"
    pairs = _pairs(run_dir)
    assert [p["node"] for p in pairs if p["root_cause"]] == [fd["node"]]
    rep = build([str(run_dir)])
    assert rep.kind == "run" and rep.divergent and rep.root["node"] == fd["node"] == "nd_rowsum"
    assert len(rep.rows) == len(pairs)  # one row (one plot point) per judged record
    root = rep.rows[rep.root["row"]]
    assert root["v"] == "root" and root["n"] == fd["node"]
    # the producers agree; nd_rowsum is saved for the backward (an output), and its consumer mul_1 differs
    # but tanh saturates: a masked divergence, told apart from the root and from what reaches an output
    assert {rep.rows[i]["v"] for i in root["in"] if i is not None} == {"equal"}
    assert [(r["n"], r["v"]) for r in rep.rows if rep.root["row"] in r["in"]] == [("mul_1", "masked")]
    assert {r["n"]: r["v"] for r in rep.rows}["tanh"] == "equal"
    assert rep.snippet and fd["source"].startswith(f"{rep.snippet['path']}:{rep.snippet['line']}")
    assert rep.snippet["line"] == 124 and "nd_rowsum(h * 1000.0)" in dict(rep.snippet["lines"])[124]
    html = page.read_text()
    assert fd["node"] in html and "<script" in html and "http://" not in html.replace("http://www.w3.org", "")


def test_a_training_step_page_holds_forward_then_backward(tmp_path):
    """The finding is in the forward graph; the backward graph of the same step follows it, not judged."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    _, run_dir = compile_run(NondetModel(), (x,), "determ_aot_eager", tmp_path, "train", backward=True,
                             check="determinism")
    rep = build([str(run_dir)])
    stages = [r["s"] for r in rep.rows]
    k = stages.index("aot_backward")
    assert set(stages[:k]) == {"aot_forward"} and set(stages[k:]) == {"aot_backward"}
    assert len(rep.rows) - k == sum(1 for r in read_trace(run_dir) if r.stage == "aot_backward")
    assert {r["v"] for r in rep.rows[k:]} == {"unjudged"} and rep.rows[rep.root["row"]]["s"] == "aot_forward"


def test_determ_report_0_writes_no_page(tmp_path, monkeypatch):
    monkeypatch.setenv("DETERM_REPORT", "0")
    run_dir = _determinism_run(tmp_path)
    assert json.loads((run_dir / "report.json").read_text())["divergent"]
    assert not (run_dir / "report.html").exists()


def test_a_failing_report_is_a_checker_error_and_the_model_goes_on(tmp_path, monkeypatch):
    def broken(run_dir):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(report_pkg, "write_run_report", broken)
    run_dir = _determinism_run(tmp_path)
    rj = json.loads((run_dir / "report.json").read_text())
    assert rj["divergent"] and any(e.startswith("report: writing report.html: RuntimeError: disk on fire")
                                   for e in rj["checker_errors"])


def test_a_nan_finding_page_shows_the_trace_rows(tmp_path):
    x = torch.rand(4, 8) * 2.0
    _, run_dir = compile_run(NanModel(), (x,), "determ_aot_eager", tmp_path, "nan", check="nan")
    rep = build([str(run_dir)])
    assert rep.divergent and rep.root["node"] == "sqrt" and rep.rows[rep.root["row"]]["n"] == "sqrt"
    assert rep.rows[rep.root["row"]]["v"] == "root" and rep.rows[rep.root["row"]]["m"]["nan"] > 0


def test_two_traces_are_compared_like_diff(tmp_path, capsys):
    a = _determinism_run(tmp_path, "a", check="")
    b = _determinism_run(tmp_path, "b", check="")
    out = tmp_path / "diff.html"
    code = main(["report", str(a), str(b), "-o", str(out)])
    assert code == 1 and capsys.readouterr().out.strip() == str(out)
    rep = build([str(a), str(b)])
    assert rep.kind == "diff" and rep.root["node"] == "nd_rowsum" and rep.rows[rep.root["row"]]["v"] == "root"
    assert "nd_rowsum" in out.read_text()
    same = build([str(a), str(a)])
    assert not same.divergent and same.verdict == "identical" and {r["v"] for r in same.rows} <= {"equal", "unjudged"}
    # two traces hold no error against float64: neither the chart's key nor the table names one
    assert rep.series[1] == "" and "r" not in {c[0] for c in rep.data()["columns"]}
    assert '<span class="key ref">' not in out.read_text()


def test_a_single_trace_renders_without_a_verdict(tmp_path):
    a = _determinism_run(tmp_path, "a", check="")
    rep = build([str(a / "trace.jsonl")])
    assert rep.kind == "trace" and not rep.divergent and rep.rows and rep.root is None
    assert "incomplete" not in rep.checked


def test_a_single_incomplete_trace_says_so_and_traces_are_known_by_content(tmp_path, caplog, capsys):
    """A trace whose producer died is read up to its last line and the page says it is incomplete; a JSONL trace
    saved as ``*.log`` and a text log given alone are traces, whatever their names."""
    from determ_backend.modes.core import HashDebugTrace, HashMode

    x = torch.randn(4, 4)
    with HashMode(trace_path=tmp_path / "t.jsonl"):
        (x @ x).relu()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n")  # no end line: the producer was killed
    rep = build([str(cut)])
    assert rep.kind == "trace" and "incomplete" in rep.checked and "incomplete" in render(rep)
    assert "incomplete" in caplog.text
    named_log = tmp_path / "hm.log"
    named_log.write_text((tmp_path / "t.jsonl").read_text())
    assert main(["diff", str(named_log), str(named_log)]) == 0
    with HashDebugTrace(log_path=tmp_path / "h.log"):
        (x @ x).relu()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "h.log"), "-o", str(tmp_path / "h.html")]) == 0
    assert build([str(tmp_path / "h.log")]).kind == "trace"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumps")
    a = dh.dump_run(d, "npu", dh.make_net(perturb="fc1.weight", scale=0.5))
    b = dh.dump_run(d, "bench", dh.make_net())
    cmp = dh.compare_two(a, b, d / "cmp")
    return a, b, d / "cmp", cmp


def test_a_dump_pair_and_its_compare_output(dumps, tmp_path):
    a, b, out, cmp = dumps
    want = cmp.root_causes[0].a["name"]
    for paths, kind in (([a, b], "dump"), ([a.parent, b.parent], "dump"), ([out], "compare"),
                        ([cmp.csv_path], "compare")):
        rep = build([str(p) for p in paths])
        assert rep.kind == kind and rep.divergent and rep.root["node"].startswith(want[: want.rindex("_")])
        row = rep.rows[rep.root["row"]]
        assert row["v"] == "root" and dict(rep.columns)["c9"] == "Root Cause" and row["c9"] == "Yes"
        assert "NPU Name" in render(rep)


def _run_dir_with(p, content):
    (p / "run").mkdir()
    (p / "run" / "report.json").write_text(json.dumps(content))
    return p / "run"


@pytest.mark.parametrize("content, needle", [
    ([1, 2], "expected determ's report.json (a JSON object), got a JSON list"),
    ({"divergent": "yes", "findings": 3}, "field 'findings': expected list, got int"),
    ({"divergent": True, "findings": [3]}, "field 'findings' holds something other than objects"),
    ({"queries": 12, "seconds": 3.5}, "neither 'divergent' nor 'findings' is there"),  # a minify summary copied in
])
def test_a_report_json_of_another_shape_is_one_line_and_exit_2(tmp_path, capsys, content, needle):
    assert main(["report", str(_run_dir_with(tmp_path, content)), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: p, "not a determ result"),
    (lambda p: (p / "x.txt").write_text("hi") and p / "x.txt", "not a determ result"),
    # an msprobe dump_path: its indexes below it are named, as compare names them
    (lambda p: ((p / "d" / "step0" / "rank0").mkdir(parents=True), (p / "d" / "step0" / "rank0" / "dump.pkl").touch(),
                p / "d")[2], "its indexes are in its step/rank folders (step0/rank0/dump.pkl)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, needle):
    target = make(tmp_path)
    assert main(["report", str(target), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not (tmp_path / "r.html").exists()


def test_one_dump_asks_for_its_pair(dumps, capsys, tmp_path):
    a = dumps[0]
    assert main(["report", str(a), "-o", str(tmp_path / "r.html")]) == 2
    assert "one API dump; expected two" in capsys.readouterr().err


def test_values_cannot_break_out_of_the_page():
    evil = "</script><script>alert(1)</script><b>x</b>"
    rep = Report(kind="run", title=evil, inputs=[evil], checked=evil, divergent=True, verdict=evil,
                 root={"node": evil, "op": evil, "source": evil, "metrics": {evil: evil}, "row": 0},
                 rows=[{"id": 0, "n": evil, "op": evil, "v": "root", "e": float("nan"), "r": float("inf"),
                        "in": [], "ins": [evil]}])
    html = render(rep)
    assert evil not in html and "<script>alert(1)" not in html
    assert html.count("<script") == 2  # the data and the page's own script
    data = html.split('<script id="report-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    parsed = json.loads(data)
    assert parsed["rows"][0]["n"] == evil and parsed["rows"][0]["e"] == "nan" and parsed["rows"][0]["r"] == "inf"


def _chain(n: int, divergent_from: int, root: int):
    """``n`` pair rows of one graph call, each consuming the previous; rows from ``divergent_from`` on differ."""
    rows = []
    for i in range(n):
        rows.append({"graph": "g0", "stage": "aot_forward", "call": 0, "node": f"n{i}", "op": "aten.sin.default",
                     "kind": "node", "inputs": [f"n{i - 1}"] if i else [], "equal": i < divergent_from,
                     "root_cause": i == root, "metrics": {"rmse": 1.0} if i >= divergent_from else {}})
    return rows


def test_a_page_past_the_row_limit_keeps_the_root_and_its_links():
    rows = rows_from_pairs(_chain(40, 5, 30))  # the root lies past the first half of the limit
    kept, root, note = limit_rows(rows, 30, limit=10)
    assert note and kept[root]["n"] == "n30" and kept[root]["v"] == "root"
    by_name = {r["n"]: r for r in kept}
    assert {"n29", "n31"} <= set(by_name) and by_name["n29"]["id"] in kept[root]["in"]
    assert [r["id"] for r in kept] == list(range(len(kept)))
    assert all(i is None or kept[i]["n"] == f"n{int(r['n'][1:]) - 1}" for r in kept for i in r["in"])
    assert limit_rows(rows, 30, limit=100) == (rows, 30, None)


def test_graphs_come_in_compile_order_and_forward_before_backward():
    pairs = []
    for g in ("g10", "g2", "g1"):
        for stage in ("aot_backward", "aot_forward"):
            pairs.append({"graph": g, "stage": stage, "call": 0, "node": "x", "op": "aten.sin.default", "inputs": [],
                          "equal": True})
    rows = rows_from_pairs(pairs)
    assert [(r["s"], r["g"]) for r in rows] == [("aot_forward", "g1"), ("aot_forward", "g2"), ("aot_forward", "g10"),
                                               ("aot_backward", "g1"), ("aot_backward", "g2"), ("aot_backward", "g10")]


def test_two_findings_on_one_call_show_its_nodes_once(tmp_path):
    run_dir = _determinism_run(tmp_path)
    rj = json.loads((run_dir / "report.json").read_text())
    rj["findings"].append(dict(rj["findings"][0], check="accuracy"))  # a second check judging the same call
    (run_dir / "report.json").write_text(json.dumps(rj))
    rep = build([str(run_dir)])
    assert len(rep.rows) == len(_pairs(run_dir)) and sum(r["v"] == "root" for r in rep.rows) == 1


class _Zeroes(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.relu(torch.zeros_like(x))


def test_dumps_that_differ_only_in_an_input_are_not_divergent(tmp_path):
    """An input that differs while every output agrees (an ``all_gather`` into buffers holding other values, a
    ``* 0``): compare says no divergence, and so does the page (it called any differing row divergent)."""
    paths = []
    for tag, seed in (("a", 0), ("b", 1)):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        paths.append(dh.dump_run(tmp_path, tag, _Zeroes(), step=lambda net, x=x: net(x)))
    cmp = dh.compare_two(*paths, tmp_path / "cmp")
    assert not cmp.divergent and any(r["_match"] is False for r in cmp.rows)
    for p in (paths, [tmp_path / "cmp"]):
        rep = build([str(q) for q in p])
        assert not rep.divergent and rep.verdict == "no divergence"
    assert main(["report", str(tmp_path / "cmp"), "-o", str(tmp_path / "r.html")]) == 0


def test_the_report_of_two_traces_exits_as_diff_does(tmp_path, capsys):
    """A divergence in a side branch whose effect on the output is below --tol (masked): diff says the runs are not
    shown to agree (exit 1) and the page said 'no output differs' with exit 0."""
    from determ_backend import HashDebugTrace

    for run in ("a", "b"):
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        x, side = torch.randn(2, 8), torch.randn(8, 8)
        if run == "b":
            side[0, 0] += 0.5
        with HashDebugTrace(log_path=tmp_path / f"{run}.log", module=net):
            (net(x).sum() + (x @ side).sum() * 1e-9).backward()
    a, b = str(tmp_path / "a.log"), str(tmp_path / "b.log")
    assert main(["diff", a, b, "--tol", "1e-3"]) == 1
    assert "masked" in capsys.readouterr().out
    assert main(["report", a, b, "--tol", "1e-3", "-o", str(tmp_path / "r.html")]) == 1
    assert "not shown identical" in (tmp_path / "r.html").read_text()
    assert main(["report", a, a, "--tol", "1e-3", "-o", str(tmp_path / "same.html")]) == 0


def test_the_report_of_an_xdevice_output_exits_as_xdevice_does(tmp_path):
    """Only two traces read as diff reads them take diff's exit rule: an xdevice output whose sides agree with a
    record one side alone has exits 0, as xdevice does."""
    from determ_backend import HashDebugTrace

    for side, extra in (("side0_cpu", False), ("side1_cpu_float64", True)):
        torch.manual_seed(0)
        x = torch.randn(4, 4)
        with HashDebugTrace(log_path=tmp_path / "x" / side / "trace.jsonl"):
            y = x * 2.0
            if extra:
                y = y * 1.0
            y.sum()
    assert main(["report", str(tmp_path / "x"), "-o", str(tmp_path / "x.html")]) == 0


@pytest.mark.parametrize("size", ["0x0", "abc", "100x-5"])
def test_a_bad_screenshot_size_is_refused_before_the_page_is_written(tmp_path, capsys, size):
    run = _run_dir_with(tmp_path, {"divergent": False, "findings": []})
    page = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(page), "--screenshot", str(tmp_path / "p.png"), "--size", size]) == 2
    assert f"--size {size!r}" in capsys.readouterr().err and not page.exists()
