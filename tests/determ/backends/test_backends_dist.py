"""determ backends under a real 2-process gloo group: one trace per rank, rank in every record."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend_helpers import MLP, load

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, port: int, out: str, run_id: str = "ddp") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = MLP()
        f = torch.compile(m, backend="determ_aot_eager", options={"dir": out, **({"run_id": run_id} if run_id else {})})
        loss = f(torch.randn(4, 8) + rank).sum()
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
        from determ_backend.backends import run as run_mod

        run_mod.finish_all()
        dist.barrier()  # torch's gloo group can abort a rank that tears down while its peer still talks
    finally:
        dist.destroy_process_group()


def test_each_rank_writes_its_own_trace_with_its_rank(tmp_path, free_port):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        recs, report = load(tmp_path / "ddp" / f"rank{rank}")
        assert recs and {r.rank for r in recs} == {rank}
        assert report["rank"] == rank
    from repro_tools.cli import main as cli

    # same weights, different data: the ranks' traces diverge at the batch input, not at a parameter
    assert cli(["diff", str(tmp_path / "ddp" / "rank0"), str(tmp_path / "ddp" / "rank1")]) == 1


def test_the_ranks_of_a_job_agree_on_the_default_run_id(tmp_path, free_port):
    """Without DETERM_RUN_ID each rank named its run ``<time>-<its pid>``: a 2-rank job wrote two run directories,
    ``<a>/rank0`` and ``<b>/rank1``, instead of one holding both."""
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), ""), nprocs=2, join=True)
    assert sorted(p.relative_to(tmp_path).parts[1] for p in tmp_path.glob("*/rank*")) == ["rank0", "rank1"]
    assert len({p.parent for p in tmp_path.glob("*/rank*")}) == 1


def _nan_worker(rank: int, port: int, out: str, cache: str) -> None:
    import torch.distributed._functional_collectives as funcol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_CACHE_DIR=cache)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        def h(x):
            y = torch.sqrt(x) * 2  # a NaN on rank 0 alone, created inside a fused kernel
            return y + funcol.all_reduce(x * 3, "sum", dist.group.WORLD)

        x = torch.rand(4, 8) + 0.1
        if rank == 0:
            x[0, 0] = -1.0
        torch.compile(h, backend="determ_inductor", options={"dir": out, "run_id": "nan", "check": "nan"})(x)
        t = torch.ones(3)
        dist.all_reduce(t)  # the program's next collective: a replay of the graph on rank 0 alone mismatched it
        assert t.tolist() == [2.0, 2.0, 2.0]
        from determ_backend.backends import run as run_mod

        run_mod.finish_all()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_check_never_replays_a_graph_with_collectives_on_one_rank(tmp_path, free_port):
    """Rank 0's fused kernel creates a NaN: the nan check replayed the whole graph on rank 0 to find the node,
    issuing its all_reduce once more, and gloo aborted the job at the program's next collective."""
    mp.spawn(_nan_worker, args=(free_port(), str(tmp_path), str(tmp_path / "cache")), nprocs=2, join=True)
    _, report = load(tmp_path / "nan" / "rank0")
    (finding,) = report["findings"]
    assert "collectives" in finding["first_divergence"]["inside"]["note"], finding
    assert not load(tmp_path / "nan" / "rank1")[1]["divergent"]
