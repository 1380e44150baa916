"""determ backends under a real 2-process gloo group: one trace per rank, rank in every record."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend_helpers import MLP, load

pytestmark = pytest.mark.slow



def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = MLP()
        f = torch.compile(m, backend="determ_aot_eager", options={"dir": out, "run_id": "ddp"})
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
