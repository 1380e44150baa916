"""``repro-tools compare`` and ``repro-tools dump export``, file-form index names, payload directories,
``is_print_compare_log``, ``tol``, and dumps whose writer was killed."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from determ_backend import dump
from determ_backend.errors import ConfigError, TraceFormatError
from dump_helpers import compare_two, dump_run, make_net, train_step
from paths import ROOT, TESTS
from repro_tools.cli import main


@pytest.fixture(autouse=True)
def _clean():
    yield
    dump.remove_hooks()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Tensor-mode dumps of one step: ``same`` and ``same2`` agree bitwise, ``bad`` has a perturbed fc1.weight,
    ``stats`` is statistics-only, ``bf16`` ran in bfloat16."""
    root = tmp_path_factory.mktemp("dumps")
    out = {
        "same": dump_run(root, "same", make_net()),
        "same2": dump_run(root, "same2", make_net()),
        "bad": dump_run(root, "bad", make_net(perturb="fc1.weight")),
        "stats": dump_run(root, "stats", make_net(), summary_only=True),
        "bf16": dump_run(root, "bf16", make_net(dtype=torch.bfloat16), step=lambda n: train_step(n, torch.bfloat16)),
    }
    dump.remove_hooks()
    return out


def _copy_as(index: Path, dest_dir: Path, name: str) -> Path:
    """The dump of ``index`` copied into ``dest_dir`` under the file-form name ``<name>.pkl`` + ``<name>/``."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(index, dest_dir / f"{name}.pkl")
    data = index.with_suffix("")
    if data.is_dir():
        shutil.copytree(data, dest_dir / name)
    return dest_dir / f"{name}.pkl"


def _err_lines(err: str):
    return [line for line in err.strip().splitlines() if line.startswith("repro-tools")]


# -- repro-tools compare -------------------------------------------------------------------------------------

def test_identical_dumps_exit_0_and_write_csv_and_advisor(dumps, tmp_path, capsys):
    assert main(["compare", str(dumps["same"]), str(dumps["same2"].parent), "-o", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out
    csv_line = next(line for line in out.splitlines() if line.startswith("csv: "))
    assert Path(csv_line[5:]).is_file() and Path(csv_line[5:]).parent == tmp_path / "o"
    assert len(list((tmp_path / "o").glob("advisor_*.txt"))) == 1


def test_perturbed_weight_exits_1_and_names_the_root_cause(dumps, tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="determ_backend.dump.comparison.dumps"):
        rc = main(["compare", str(dumps["bad"]), str(dumps["same"]), "-o", str(tmp_path), "--stack", "--suffix", "_x"])
    assert rc == 1
    # a dump made without stacks: the stack column stays empty, and a line says why
    assert any("holds no call stacks" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr().out
    assert out.startswith("root cause: Functional_linear_0_forward (bench: Functional_linear_0_forward)")
    (path,) = tmp_path.glob("compare_result_x_*.csv")
    rows = list(csv.DictReader(open(path)))
    assert "NPU_Stack_Info" in rows[0]
    assert [r["NPU Name"] for r in rows if r["Root Cause"] == "Yes"] == ["Functional_linear_0_forward_output"]


def test_json_summary(dumps, tmp_path, capsys):
    assert main(["compare", str(dumps["bad"]), str(dumps["same"]), "-o", str(tmp_path), "--json"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert s["divergent"] is True and s["root_cause"] == "Functional_linear_0_forward"
    assert s["verdict"] == "bitwise" and Path(s["csv"]).is_file() and Path(s["advisor"]).is_file()
    assert main(["compare", str(dumps["same"]), str(dumps["same2"]), "-o", str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["divergent"] is False and s["root_cause"] is None
    assert s["shown_to_agree"] is True and s["judged"] is True and s["paired"] > 0


@pytest.mark.parametrize("argv, needle", [
    (["compare", "MISSING", "SAME"], "no such dump index or directory"),
    (["compare", "SAME", "SAME", "-o", "AFILE"], "is not a directory"),
    (["compare", "TAG", "SAME"], "holds rank directories (rank0); pass one rank's directory, or add --distributed"),
    (["compare", "PICKLE", "SAME"], "a pickle file (ptdbg/msprobe?)"),
    (["compare", "HALFHEADER", "SAME"], "not a determ dump index"),
    (["compare", "SAME", "SAME", "--distributed"], "not a directory"),
    (["compare", "BADENTRY", "SAME"], "'outputs' must be a list of objects"),
    (["compare", "MIDDLE", "SAME"], "never past a corrupt line"),
    (["compare", "SAME", "SAME", "-o", "OUT", "--suffix", "/../../escaped"], "must not hold a path separator"),
    (["compare", "RUNDIR", "SAME"], "a determ run directory (a trace), not an API dump; compare two traces with "
                                    "`repro-tools diff`"),
])
def test_bad_input_exits_2_with_one_line(dumps, tmp_path, capsys, argv, needle):
    (tmp_path / "afile").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trace.jsonl").write_text("")
    lines = dumps["same"].read_text().splitlines()
    entry = json.loads(lines[1])
    entry["outputs"] = "zzz"  # a hand-edited index, or another tool's
    bad_entry = tmp_path / "e" / "dump.pkl"
    bad_entry.parent.mkdir()
    bad_entry.write_text("\n".join([lines[0], json.dumps(entry), *lines[2:]]) + "\n")
    middle = tmp_path / "m" / "dump.pkl"
    middle.parent.mkdir()
    middle.write_text("\n".join([lines[0], "{this is not json", *lines[2:]]) + "\n")
    pickle = tmp_path / "p" / "dump.pkl"
    pickle.parent.mkdir()
    pickle.write_bytes(b"\x80\x04\x95\x00\x00")
    half = tmp_path / "h" / "dump.pkl"
    half.parent.mkdir()
    half.write_text(dumps["same"].read_text()[:20])
    subst = {"MISSING": str(tmp_path / "missing"), "SAME": str(dumps["same"]), "AFILE": str(tmp_path / "afile"),
             "TAG": str(dumps["same"].parent.parent), "PICKLE": str(pickle), "HALFHEADER": str(half),
             "BADENTRY": str(bad_entry), "MIDDLE": str(middle), "OUT": str(tmp_path / "out" / "o"),
             "RUNDIR": str(tmp_path / "run")}
    assert main([subst.get(a, a) for a in argv]) == 2
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    lines = _err_lines(err)
    assert len(lines) == 1 and lines[0].startswith("repro-tools compare: error: ") and needle in lines[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--tol", "-1"], "argument --tol: expected a finite number >= 0, got '-1'"),
    (["--tol", "nan"], "argument --tol: expected a finite number >= 0"),
    (["--tol", "x"], "argument --tol: expected a finite number >= 0, got 'x'"),
    (["--tol", "0.1", "--exact"], "not allowed with argument"),
])
def test_bad_tol_is_a_usage_error(dumps, capsys, argv, needle):
    assert main(["compare", str(dumps["same"]), str(dumps["same"])] + argv) == 2
    assert needle in capsys.readouterr().err


def test_tol_and_exact_thread_into_the_verdict(dumps, tmp_path, capsys):
    bf16, fp32 = str(dumps["bf16"]), str(dumps["same"])
    assert main(["compare", bf16, fp32, "-o", str(tmp_path)]) == 0  # two dtypes: tolerance verdicts
    assert main(["compare", bf16, fp32, "-o", str(tmp_path), "--exact"]) == 1
    capsys.readouterr()
    bad = dump_run(tmp_path, "bf16bad", make_net(dtype=torch.bfloat16, perturb="fc1.weight", scale=0.5),
                   step=lambda n: train_step(n, torch.bfloat16))
    assert main(["compare", str(bad), fp32, "-o", str(tmp_path)]) == 1
    assert main(["compare", str(bad), fp32, "-o", str(tmp_path), "--tol", "1e3"]) == 0
    # the same dumps through the API; a bad tol there is a ConfigError
    assert not dump.compare_dumps(bad, dumps["same"], tol=1e3).divergent
    with pytest.raises(ConfigError, match=r"compare: tol must be a finite number >= 0, got -0.5"):
        dump.compare_dumps(bad, dumps["same"], tol=-0.5)
    with pytest.raises(ConfigError, match="compare: tol must be a finite number"):
        compare_two(bad, dumps["same"], tmp_path, tol="1e-3")


def test_exit_codes_through_a_real_process(dumps, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "repro_tools.cli", "compare", *map(str, args),
                               "-o", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)

    same = run(dumps["same"], dumps["same2"])
    assert same.returncode == 0 and "no divergence" in same.stdout, same.stderr
    bad = run(dumps["bad"], dumps["same"])
    assert bad.returncode == 1 and "root cause: Functional_linear_0_forward" in bad.stdout, bad.stderr
    missing = run(tmp_path / "missing", dumps["same"])
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        f"repro-tools compare: error: {tmp_path / 'missing'}: no such dump index or directory"]


# -- --distributed -------------------------------------------------------------------------------------------

def _ranks(root: Path, tag: str, n: int, bad_rank=None) -> Path:
    """``root/tag/rank0..rank<n-1>``, dumped one after the other in this process with ``register_hook(rank=)``."""
    for rank in range(n):
        net = make_net(perturb="fc2.weight" if rank == bad_rank else None)
        dump.set_dump_path(root, dump_tag=tag)
        dump.register_hook(net, dump.acc_cmp_dump, rank=rank)
        dump.set_dump_switch("ON")
        try:
            train_step(net)
        finally:
            dump.set_dump_switch("OFF")
            dump.remove_hooks()
    return root / tag


def test_distributed_compares_rank_by_rank(tmp_path, capsys):
    npu, bench = _ranks(tmp_path, "npu", 2, bad_rank=1), _ranks(tmp_path, "bench", 2)
    out = tmp_path / "out"
    assert main(["compare", str(npu), str(bench), "--distributed", "-o", str(out), "--suffix", "_s"]) == 1
    text = capsys.readouterr().out
    assert "rank 0: no divergence" in text and "rank 1: root cause: Functional_linear_1_forward" in text
    assert "divergent: rank 1" in text
    for r in (0, 1):
        assert len(list(out.glob(f"compare_result_s_rank{r}-rank{r}_*.csv"))) == 1
    assert main(["compare", str(npu), str(bench), "--distributed", "-o", str(out), "--json"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert s["divergent"] is True and [(r["rank"], r["divergent"]) for r in s["ranks"]] == [(0, False), (1, True)]
    assert s["ranks"][1]["root_cause"] == "Functional_linear_1_forward"
    assert main(["compare", str(bench), str(bench), "--distributed", "-o", str(out)]) == 0
    assert "no rank diverges" in capsys.readouterr().out


def test_distributed_with_mismatched_rank_counts_exits_2(tmp_path, capsys):
    npu, bench = _ranks(tmp_path, "npu", 2), _ranks(tmp_path, "bench", 1)
    assert main(["compare", str(npu), str(bench), "--distributed", "-o", str(tmp_path / "out")]) == 2
    lines = _err_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "has ranks [0, 1] but" in lines[0] and "has [0]" in lines[0]
    assert not (tmp_path / "out").exists()


# -- file-form names, payload directories, is_print_compare_log ---------------------------------------------

@pytest.mark.parametrize("name", ["myDump", "api_stack_npu_dump", "Overflow_info_20261124101010"])
def test_indexes_named_after_a_users_file(dumps, tmp_path, capsys, name):
    npu = _copy_as(dumps["bad"], tmp_path / "npu" / "rank0", name)
    bench = _copy_as(dumps["same"], tmp_path / "bench" / "rank0", name)
    assert dump.read_dump(npu.parent).data_dir == npu.parent / name
    assert main(["compare", str(npu.parent), str(bench), "-o", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "root cause: Functional_linear_0_forward" in captured.out and "missing" not in captured.err
    (path,) = (tmp_path / "out").glob("*.csv")
    row = next(r for r in csv.DictReader(open(path)) if r["NPU Name"] == "Functional_linear_0_forward_output")
    assert row["Cosine"] != "N/A"  # payloads read from <name>/tensors.bin
    assert main(["compare", str(tmp_path / "npu"), str(tmp_path / "bench"), "--distributed",
                 "-o", str(tmp_path / "out2")]) == 1


def test_a_rank_directory_with_several_indexes_is_refused(dumps, tmp_path, capsys):
    d = tmp_path / "rank0"
    _copy_as(dumps["same"], d, "a_dump")
    _copy_as(dumps["same"], d, "myDump")
    (d / "notes.pkl").mkdir()  # a directory named *.pkl is no index
    with pytest.raises(TraceFormatError, match=r"several indexes \(a_dump.pkl, myDump.pkl\); pass the index"):
        dump.read_dump(d)
    assert main(["compare", str(d), str(dumps["same"])]) == 2
    assert "several indexes" in capsys.readouterr().err


def test_payloads_are_read_from_the_given_data_dirs(dumps, tmp_path, caplog):
    npu = _copy_as(dumps["bad"], tmp_path / "npu", "dump")
    bench = _copy_as(dumps["same"], tmp_path / "bench", "dump")
    moved = tmp_path / "elsewhere"
    shutil.move(str(npu.with_suffix("")), moved / "npu")
    shutil.move(str(bench.with_suffix("")), moved / "bench")
    param = {"npu_pkl_path": str(npu), "bench_pkl_path": str(bench),
             "npu_dump_data_dir": str(moved / "npu"), "bench_dump_data_dir": str(moved / "bench")}
    with caplog.at_level(logging.WARNING):
        cmp = dump.compare(param, tmp_path / "out")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    row = next(r for r in cmp.rows if r["NPU Name"] == "Functional_linear_0_forward_output")
    assert isinstance(row["Cosine"], float) and row["Err_message"] == ""
    assert [p.a["name"] for p in cmp.root_causes] == ["Functional_linear_0_forward"]
    with caplog.at_level(logging.WARNING):  # without them: the statistics, and one warning per side
        cmp = compare_two(npu, bench, tmp_path / "out")
    assert len([r for r in caplog.records if "is missing: comparing on statistics only" in r.getMessage()]) == 2
    with pytest.raises(TraceFormatError, match=r"compare: npu_dump_data_dir .*nowhere: no such directory"):
        dump.compare({**param, "npu_dump_data_dir": str(tmp_path / "nowhere")}, tmp_path / "out")


def test_is_print_compare_log_false_prints_nothing_but_writes_the_files(dumps, tmp_path, capsys):
    param = {"npu_pkl_path": str(dumps["bad"]), "bench_pkl_path": str(dumps["same"]), "is_print_compare_log": False}
    cmp = dump.compare(param, tmp_path)
    assert capsys.readouterr().out == ""
    assert cmp.advisor_path.read_text().startswith("root cause: Functional_linear_0_forward")
    assert cmp.csv_path.is_file() and cmp.analysis.startswith("root cause:")
    dump.compare({**param, "is_print_compare_log": True}, tmp_path)
    assert capsys.readouterr().out.startswith("root cause: Functional_linear_0_forward")
    with pytest.raises(ConfigError, match=r"input_param\['is_print_compare_log'\] must be True or False, got 'no'"):
        dump.compare({**param, "is_print_compare_log": "no"}, tmp_path)
    dump.compare_distributed(dumps["bad"].parent.parent, dumps["same"].parent.parent, tmp_path / "d",
                             is_print_compare_log=False)
    assert capsys.readouterr().out == ""


# -- a dump whose writer was killed --------------------------------------------------------------------------

_KILLED = '''
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from determ_backend import dump
from dump_helpers import make_net, train_step

root, kill = sys.argv[1], sys.argv[2] == "kill"
net = make_net()
dump.set_dump_path(root, dump_tag="run")
dump.register_hook(net, dump.acc_cmp_dump)
dump.set_dump_switch("ON")
for step in range(3):
    net.zero_grad()
    train_step(net, opt=True)
    if kill and step == 1:
        time.sleep(0.5)  # let the dump's writer thread catch up, so the kill finds entries on disk
        os.kill(os.getpid(), signal.SIGKILL)
dump.set_dump_switch("OFF")
'''


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``(killed index, complete index)``: three training steps dumped in tensor mode by a real process,
    SIGKILLed during the second step's dump; and the same run left to finish."""
    root = tmp_path_factory.mktemp("killed")
    script = root / "train.py"
    script.write_text(_KILLED.format(tests=str(TESTS)))
    for how in ("kill", "finish"):
        p = subprocess.run([sys.executable, str(script), str(root / how), how], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == (-9 if how == "kill" else 0), p.stderr[-2000:]
    return root / "kill" / "run" / "rank0" / "dump.pkl", root / "finish" / "run" / "rank0" / "dump.pkl"


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_killed_dump_compares_up_to_its_last_complete_entry(killed, tmp_path, caplog, capsys):
    index, whole = killed
    assert '"end": true' not in index.read_text() and (index.parent / "dump" / "tensors.bin").is_file()
    with pytest.raises(TraceFormatError, match="truncated dump index"):
        dump.read_dump(index)  # the strict reader still says so
    with caplog.at_level(logging.WARNING):
        cmp = compare_two(index, whole, tmp_path / "out")
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(index) in warned[0] and "writer stopped without closing it" in warned[0]
    n = len(dump.read_dump(index, allow_partial=True).entries)
    assert 0 < n < len(dump.read_dump(whole).entries)
    assert not cmp.divergent and sum(1 for p in cmp.pairs if p.a is not None and p.b is not None) == n
    assert any(isinstance(r["Cosine"], float) for r in cmp.rows)  # payloads of the killed dump are read
    caplog.clear()
    assert cmp.partial and not cmp.shown_to_agree
    # the calls the killed run never dumped are not shown to agree: exit 1, with the reason
    assert main(["compare", str(index.parent), str(whole), "-o", str(tmp_path / "cli")]) == 1
    out = capsys.readouterr().out
    assert len(_warnings(caplog)) == 1 and "not shown to agree" in out and "cut short" in out


def test_killed_dump_with_a_cut_last_line(killed, tmp_path, caplog):
    index, whole = killed
    cut = _copy_as(index, tmp_path / "rank0", "dump")
    lines = cut.read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    with caplog.at_level(logging.WARNING):
        cmp = compare_two(cut, whole, tmp_path / "out")
        got = dump.parse(cut, "Functional_conv2d_0_forward")
    assert not cmp.divergent and got[0].startswith("Functional_conv2d_0_forward")
    warned = _warnings(caplog)
    assert len(warned) == 2 and all(str(cut) in w for w in warned)  # one per read: compare, then parse
    assert f"reading the {len(lines) - 2} entries" in warned[0]


def test_killed_dumps_compare_distributed_and_export(killed, tmp_path, caplog):
    index, whole = killed
    for tag, src in (("npu", index), ("bench", whole)):
        _copy_as(src, tmp_path / tag / "rank0", "dump")
    with caplog.at_level(logging.WARNING):
        (cmp,) = dump.compare_distributed(tmp_path / "npu", tmp_path / "bench", tmp_path / "out")
    assert not cmp.divergent and len(_warnings(caplog)) == 1
    assert main(["dump", "export", str(index), "--npy", "-o", str(tmp_path / "npy")]) == 0
    assert list((tmp_path / "npy").glob("*.npy"))


def test_a_dump_this_process_still_writes_is_not_read_as_killed(tmp_path):
    idx = dump_run(tmp_path, "a", make_net())
    net = make_net()
    dump.set_dump_path(tmp_path, dump_tag="open")
    dump.register_hook(net, dump.acc_cmp_dump)
    dump.set_dump_switch("ON")
    try:
        train_step(net)
        with pytest.raises(TraceFormatError, match=r"this dump is still switched on"):
            compare_two(tmp_path / "open" / "rank0", idx, tmp_path / "out")
    finally:
        dump.set_dump_switch("OFF")
    assert not compare_two(tmp_path / "open" / "rank0", idx, tmp_path / "out").divergent


# -- repro-tools dump export --npy ---------------------------------------------------------------------------

def _check_export(index: Path, folder: Path) -> int:
    d = dump.read_dump(index)
    n = 0
    for e in d.entries:
        for t in e.get("inputs", []) + e.get("outputs", []):
            if "payload" not in t:
                continue
            arr = np.load(folder / f"{e['name']}_{t['name']}.npy", allow_pickle=False)
            want = d.tensor(t)
            if want.dtype == torch.bfloat16:
                assert arr.dtype == np.float32
                want = want.float()
            assert torch.equal(torch.from_numpy(arr), want), (e["name"], t["name"])
            n += 1
    return n


def test_export_npy_writes_every_stored_tensor_with_ptdbgs_names(dumps, tmp_path, capsys):
    out = tmp_path / "npy"
    assert main(["dump", "export", str(dumps["same"]), "--npy", "-o", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    for name in ("Functional_conv2d_0_forward_input.0.npy", "Torch_relu_0_forward_output.npy",
                 "Torch_relu_0_backward_output.0.npy"):  # the CSV's names: <entry>_<tensor>
        assert name in files
    assert not [f for f in files if not f.endswith(".npy")]  # no temp files left
    n = _check_export(dumps["same"], out)
    assert len(files) == n and f"wrote {n} .npy files to {out}" in capsys.readouterr().out


def test_export_bfloat16_as_float32_with_one_log_line(dumps, tmp_path, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="determ_backend.dump.comparison.export"):
        assert main(["dump", "export", str(dumps["bf16"].parent), "--npy", "-o", str(tmp_path)]) == 0
    lines = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(lines) == 1 and "as float32" in lines[0]
    assert _check_export(dumps["bf16"], tmp_path) > 0


def test_export_of_a_file_form_dump_and_of_rank_folders(dumps, tmp_path, capsys):
    named = _copy_as(dumps["same"], tmp_path / "one" / "rank0", "myDump")
    assert main(["dump", "export", str(named), "--npy", "-o", str(tmp_path / "a")]) == 0
    _check_export(named, tmp_path / "a")
    tag = _ranks(tmp_path, "tag", 2, bad_rank=1)
    assert main(["dump", "export", str(tag), "--npy", "-o", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["rank0", "rank1"]
    total = sum(_check_export(tag / f"rank{r}" / "dump.pkl", tmp_path / "b" / f"rank{r}") for r in (0, 1))
    assert f"wrote {total} .npy files" in capsys.readouterr().out


def test_export_refuses_statistics_only_dumps_and_bad_input(dumps, tmp_path, capsys):
    assert main(["dump", "export", str(dumps["stats"]), "--npy", "-o", str(tmp_path / "o")]) == 2
    lines = _err_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("repro-tools dump: error: ") and "statistics-only" in lines[0]
    assert not (tmp_path / "o").exists()
    assert main(["dump", "export", str(tmp_path / "missing"), "--npy"]) == 2
    assert main(["dump", "export", str(dumps["same"])]) == 2  # --npy is required
    assert "the following arguments are required: --npy" in capsys.readouterr().err
    nodata = _copy_as(dumps["same"], tmp_path / "nodata", "dump")
    shutil.rmtree(nodata.with_suffix(""))
    assert main(["dump", "export", str(nodata), "--npy", "-o", str(tmp_path / "o")]) == 2
    assert "tensor payload file missing" in capsys.readouterr().err
    # a payload file cut short (not a dump that stopped early): one line, and the export leaves nothing behind
    cut = _copy_as(dumps["same"], tmp_path / "cut", "dump")
    payload = cut.with_suffix("") / "tensors.bin"
    payload.write_bytes(payload.read_bytes()[: payload.stat().st_size // 2])
    assert main(["dump", "export", str(cut), "--npy", "-o", str(tmp_path / "o" / "npy")]) == 2
    assert len(_err_lines(capsys.readouterr().err)) == 1 and not (tmp_path / "o").exists()
    # ... and never the files an earlier export left there
    assert main(["dump", "export", str(dumps["same"]), "--npy", "-o", str(tmp_path / "o2")]) == 0
    before = sorted(p.name for p in (tmp_path / "o2").iterdir())
    assert main(["dump", "export", str(cut), "--npy", "-o", str(tmp_path / "o2")]) == 2
    assert sorted(p.name for p in (tmp_path / "o2").iterdir()) == before


def test_compare_of_a_dump_path_root_names_the_indexes_below_it(dumps, tmp_path, capsys):
    """msprobe users pass their dump_path; its indexes are in step<N>/rank<R>: the error said only 'pass the index
    file itself'."""
    net = torch.nn.Linear(4, 2)
    dbg = dump.PrecisionDebugger(dump_path=str(tmp_path / "dp"), task="statistics", level="L1", model=net)
    dbg.start(net)
    net(torch.randn(2, 4)).sum().backward()
    dbg.stop()
    root = tmp_path / "dp"  # the dump_path: step0/rank0/dump.pkl below it
    assert main(["compare", str(root), str(root), "-o", str(tmp_path / "o")]) == 2
    line = _err_lines(capsys.readouterr().err)[0]
    assert "the indexes below it are in its step/rank folders" in line and "dump.pkl" in line, line
    (tmp_path / "proj" / "checkpoints").mkdir(parents=True)  # any other pickle below is none of its indexes
    (tmp_path / "proj" / "checkpoints" / "optimizer.pkl").write_bytes(b"x")
    assert main(["compare", str(tmp_path / "proj"), str(root), "-o", str(tmp_path / "o")]) == 2
    assert "optimizer.pkl" not in capsys.readouterr().err


@pytest.mark.parametrize("edit, needle", [('"hash":"zz"', "hash must be hexadecimal"),
                                          ('"max":"big"', "stats must map names to numbers")])
def test_a_hand_edited_dump_value_is_a_one_line_error(tmp_path, edit, needle):
    """A dump whose hash or statistic was edited by hand was read as it was (a trace's reader refuses the same)."""
    import re

    from determ_backend import dump
    from determ_backend.errors import TraceFormatError

    d = dump.PrecisionDebugger(task="statistics", dump_path=str(tmp_path / "d"))
    d.start()
    torch.relu(torch.randn(4))
    d.stop()
    index = tmp_path / "d" / "step0" / "rank0" / "dump.pkl"
    key = edit.split(":")[0]
    text = re.sub(rf'{key}:("[0-9a-f]+"|[-0-9.e]+)', edit, index.read_text(), count=1)
    assert edit in text
    index.write_text(text)
    with pytest.raises(TraceFormatError, match=needle):
        dump.read_dump(index)
