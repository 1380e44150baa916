"""Multi-rank dumps with a real 2-process gloo group: per-rank directories, replica check, compare_distributed."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from determ_backend import dump
from determ_backend.errors import TraceFormatError
from repro_tools.cli import main as cli_main
from repro_tools.report import build as build_report
from paths import TESTS

WORLD = 2



def _worker(rank: int, port: int, root: str) -> None:
    sys.path.insert(0, str(TESTS))
    from dump_helpers import make_net

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for tag, perturb in (("agree", False), ("perturbed", True)):
            net = torch.nn.parallel.DistributedDataParallel(make_net(seed=rank))  # DDP broadcasts rank 0's weights
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            dump.set_dump_path(root, dump_tag=tag)
            dump.register_hook(net, dump.acc_cmp_dump)
            dump.set_dump_switch("ON", mode="api_stack", summary_only=True)
            g = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
            for _ in range(2):
                x = torch.randn(4, 3, 8, 8, generator=g)
                F.cross_entropy(net(x), torch.tensor([0, 1, 2, 3])).backward()
                if perturb and rank == 1:
                    net.module.fc2.weight.grad[0, 0] += 1e-3  # a faulty gradient on one replica
                # a manual all-reduce of a statistic, recorded as Distributed_all_reduce
                loss_sum = torch.tensor([float(x.sum())])
                dist.all_reduce(loss_sum)
                opt.step()
                opt.zero_grad()
            dump.set_dump_switch("OFF")
            dump.remove_hooks()
        dist.barrier()  # torch's gloo group can abort a rank that tears down while its peer still talks
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_dumps(tmp_path_factory, free_port):
    root = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=WORLD, join=True)
    return root


@pytest.mark.slow
def test_each_rank_dumps_to_its_own_directory(ddp_dumps):
    for rank in range(WORLD):
        d = dump.read_dump(ddp_dumps / "agree" / f"rank{rank}" / "api_stack_dump.pkl")
        assert d.header["rank"] == rank and d.header["world_size"] == WORLD
        got = {e["name"] for e in d.entries}
        assert {"Functional_linear_1_backward", "Distributed_all_reduce_0_forward",
                "Parameter_module.fc2.weight_1_backward"} <= got


@pytest.mark.slow
def test_ranks_command_passes_when_replicas_agree(ddp_dumps, capsys):
    assert cli_main(["ranks", str(ddp_dumps / "agree")]) == 0
    assert "all replicas agree" in capsys.readouterr().out


@pytest.mark.slow
def test_ranks_command_names_first_rank_and_api_that_disagree(ddp_dumps, capsys):
    assert cli_main(["ranks", str(ddp_dumps / "perturbed")]) == 1
    out = capsys.readouterr().out
    assert "first disagreement: rank 1 at Parameter_module.fc2.weight_0_backward" in out
    report = dump.check_replicas(ddp_dumps / "perturbed")
    assert report.first.rank == 1 and report.first.reference_rank == 0


@pytest.mark.slow
def test_compare_distributed_pairs_ranks(ddp_dumps, tmp_path):
    results = dump.compare_distributed(ddp_dumps / "perturbed", ddp_dumps / "agree", tmp_path)
    assert len(results) == WORLD
    for r in range(WORLD):
        assert len(list(tmp_path.glob(f"compare_result_rank{r}-rank{r}_*.csv"))) == 1
    rank0, rank1 = results
    assert not rank0.divergent  # rank 0's own gradients were not touched, only averaged ones differ later
    assert rank1.root_causes[0].a["name"] == "Parameter_module.fc2.weight_0_backward"


@pytest.mark.slow
def test_the_report_of_a_distributed_compare_shows_every_rank(ddp_dumps, tmp_path, capsys):
    """The page read only the newest CSV (the last rank's): with rank 1 divergent and rank 0 written last it said
    "no divergence", exit 0.  Every rank's newest result is on the page now, names prefixed ``rank<N>/``."""
    out = tmp_path / "cmp"
    dump.compare_distributed(ddp_dumps / "perturbed", ddp_dumps / "agree", out)
    newest = max(out.glob("compare_result_*.csv"), key=lambda f: f.stat().st_mtime)
    os.utime(next(out.glob("compare_result_rank0-rank0_*.csv")), (newest.stat().st_atime, newest.stat().st_mtime + 5))
    assert cli_main(["report", str(out), "-o", str(tmp_path / "page.html")]) == 1
    rep = build_report([str(out)])
    assert rep.divergent and rep.root["node"].startswith("rank1/Parameter_module.fc2.weight_0_backward")
    assert {r["n"].split("/")[0] for r in rep.rows} == {"rank0", "rank1"}


def test_bad_rank_layouts_give_clear_errors(tmp_path, capsys):
    (tmp_path / "a" / "rank0").mkdir(parents=True)
    (tmp_path / "a" / "rank1").mkdir()
    (tmp_path / "b" / "rank0").mkdir(parents=True)
    with pytest.raises(TraceFormatError, match=r"has ranks \[0, 1\] but .* has \[0\]"):
        dump.compare_distributed(tmp_path / "a", tmp_path / "b", tmp_path / "out")
    assert cli_main(["ranks", str(tmp_path / "missing")]) == 2
    assert cli_main(["ranks", str(tmp_path / "b")]) == 2
    assert cli_main(["ranks", str(tmp_path / "a")]) == 2  # rank dirs without an index
    err = capsys.readouterr().err
    assert "no such dump directory" in err and "needs at least two" in err and "no *.pkl index" in err
    (tmp_path / "mk.py").write_text("")
    assert cli_main(["ranks", str(tmp_path / "mk.py")]) == 2
    assert "mk.py: not a directory" in capsys.readouterr().err


def _replicas_in_one_process(root, bad_rank: int) -> None:
    """Three replicas dumped one after the other with register_hook(rank=...); ``bad_rank`` has a perturbed bias."""
    for rank in range(3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        if rank == bad_rank:
            with torch.no_grad():
                model[0].bias[0] += 1e-6
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dump.set_dump_path(root)
        dump.register_hook(model, dump.acc_cmp_dump, rank=rank)
        dump.set_dump_switch("ON", summary_only=True)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        dump.set_dump_switch("OFF")
        dump.remove_hooks()


def test_a_rank_folder_missing_from_the_run_is_an_input_error(tmp_path, capsys):
    """Three ranks' dumps whose headers say a 3-rank job, rank1's folder gone: never 'all replicas agree'; unless
    the dump was told to cover ranks 0 and 2 alone."""
    import shutil

    for tag in ("a", "b"):
        _replicas_in_one_process(tmp_path / tag, bad_rank=-1)
        for rank in range(3):  # as a real 3-rank job writes them
            index = tmp_path / tag / "ptdbg_dump" / f"rank{rank}" / "dump.pkl"
            lines = index.read_text().splitlines(keepends=True)
            head = json.loads(lines[0])
            head["world_size"] = 3
            index.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    assert cli_main(["ranks", str(tmp_path / "a" / "ptdbg_dump")]) == 0
    for tag in ("a", "b"):
        shutil.rmtree(tmp_path / tag / "ptdbg_dump" / "rank1")
    capsys.readouterr()
    assert cli_main(["ranks", str(tmp_path / "a" / "ptdbg_dump")]) == 2
    assert "the run had 3 ranks: rank1 missing" in capsys.readouterr().err
    with pytest.raises(TraceFormatError, match="rank1 missing"):
        dump.compare_distributed(tmp_path / "a" / "ptdbg_dump", tmp_path / "b" / "ptdbg_dump", tmp_path / "out")
    for tag in ("a", "b"):  # a dump told to cover ranks 0 and 2 (msprobe's "rank" key) says so: nothing is missing
        for rank in (0, 2):
            index = tmp_path / tag / "ptdbg_dump" / f"rank{rank}" / "dump.pkl"
            lines = index.read_text().splitlines(keepends=True)
            index.write_text(json.dumps(dict(json.loads(lines[0]), ranks=[0, 2])) + "\n" + "".join(lines[1:]))
    assert cli_main(["ranks", str(tmp_path / "a" / "ptdbg_dump")]) == 0
    assert len(dump.compare_distributed(tmp_path / "a" / "ptdbg_dump", tmp_path / "b" / "ptdbg_dump",
                                        tmp_path / "out2")) == 2


def test_a_precision_debugger_told_to_dump_some_ranks_says_which_in_its_headers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / "out"), "rank": [0]}))
    model = torch.nn.Linear(4, 4)
    dbg = dump.PrecisionDebugger(config_path=str(config), model=model)
    dbg.start(model)
    model(torch.randn(2, 4)).sum().backward()
    dbg.stop()
    assert dump.read_dump(tmp_path / "out" / "step0" / "rank0").header["ranks"] == [0]
    dump.remove_hooks()


def test_replicas_of_which_nothing_was_checked_are_not_said_to_agree(tmp_path, capsys):
    for rank in range(2):  # a forward and backward, no optimizer step: no parameter is recorded
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        dump.set_dump_path(tmp_path)
        dump.register_hook(model, dump.acc_cmp_dump, rank=rank)
        dump.set_dump_switch("ON", summary_only=True)
        model(torch.randn(2, 4)).sum().backward()
        dump.set_dump_switch("OFF")
        dump.remove_hooks()
    assert cli_main(["ranks", str(tmp_path / "ptdbg_dump")]) == 1
    out = capsys.readouterr().out
    assert "records checked: 0" in out and "nothing checked" in out and "all replicas agree" not in out


@pytest.mark.parametrize("limit, code, expect, absent", [
    ("-1", 2, "argument --limit: expected a non-negative int, got -1", "more"),
    ("0", 1, "... 2 more", "disagrees with rank 0"),
    ("1", 1, "... 1 more", "... 2 more"),
])
def test_ranks_limit(tmp_path, capsys, limit, code, expect, absent):
    _replicas_in_one_process(tmp_path, bad_rank=2)
    assert cli_main(["ranks", str(tmp_path / "ptdbg_dump"), "--limit", limit]) == code
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert expect in out and absent not in out


@pytest.mark.slow
def test_a_rank_dump_copied_into_another_ranks_folder_is_refused(ddp_dumps, tmp_path, capsys):
    import shutil

    shutil.copytree(ddp_dumps / "agree" / "rank0", tmp_path / "copied" / "rank0")
    shutil.copytree(ddp_dumps / "agree" / "rank0", tmp_path / "copied" / "rank1")
    assert cli_main(["ranks", str(tmp_path / "copied")]) == 2
    err = capsys.readouterr().err
    assert "header says rank 0, but it is in folder rank1" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(TraceFormatError, match="header says rank 0, but it is in folder rank1"):
        dump.compare_distributed(tmp_path / "copied", ddp_dumps / "agree", tmp_path / "out")


@pytest.mark.slow
def test_ranks_reads_a_killed_jobs_dumps_up_to_each_ranks_last_entry(ddp_dumps, tmp_path, capsys):
    """A killed or hung job is when a replica check is wanted: every line but the end line, and rank 1 cut
    earlier than rank 0; the records both hold are compared, the rest are not called missing."""
    import shutil

    root = tmp_path / "killed"
    shutil.copytree(ddp_dumps / "agree", root)
    for rank in (0, 1):
        index = root / f"rank{rank}" / "api_stack_dump.pkl"
        lines = index.read_text().splitlines(True)
        index.write_text("".join(lines[:-1] if rank == 0 else lines[: len(lines) // 2]))
    assert cli_main(["ranks", str(root)]) == 0
    out = capsys.readouterr().out
    assert "cut short (a killed job): ranks 0, 1" in out and "all replicas agree on the records every rank holds" in out
    assert "rank 1 stopped first: its dump ends before " in out and "which rank 0 recorded" in out


@pytest.mark.slow
def test_ranks_with_several_indexes_in_a_rank_folder_names_its_index_flag(ddp_dumps, tmp_path, capsys):
    import shutil

    root = tmp_path / "two"
    shutil.copytree(ddp_dumps / "agree", root)
    shutil.copy(root / "rank0" / "api_stack_dump.pkl", root / "rank0" / "other.pkl")
    assert cli_main(["ranks", str(root)]) == 2
    assert "several indexes (api_stack_dump.pkl, other.pkl); name the one to check (repro-tools ranks --index NAME" \
        in capsys.readouterr().err
    assert cli_main(["ranks", str(root), "--index", "api_stack_dump.pkl"]) == 0


def _a2a_worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for tag, fill in (("a", 0.0), ("b", 7.0)):  # what the output buffer held before: as torch.empty's, it varies
            o = torch.full((8,), fill)  # made before the dump: only the collective sees it
            dump.set_dump_path(root, dump_tag=tag)
            dump.register_hook(torch.nn.Linear(1, 1), dump.acc_cmp_dump)
            dump.set_dump_switch("ON")
            h = torch.arange(8.0) * (rank + 1)
            dist.all_to_all_single(o, h)
            dump.set_dump_switch("OFF")
            dump.remove_hooks()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_collectives_output_buffer_is_no_input_of_it(tmp_path, free_port):
    """``all_to_all_single(output, input)`` only writes its output: what the buffer held before is not recorded as
    an input, so two runs whose buffers held other bytes agree."""
    mp.spawn(_a2a_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    a, b = (tmp_path / tag / "rank0" / "dump.pkl" for tag in ("a", "b"))
    (entry,) = [e for e in dump.read_dump(a).entries if e["name"].startswith("Distributed_all_to_all_single")]
    assert [t["name"] for t in entry["inputs"]] == ["input.1"] and entry["outputs"]
    cmp = dump.compare({"npu_pkl_path": str(a), "bench_pkl_path": str(b)}, tmp_path / "out")
    assert not cmp.divergent
