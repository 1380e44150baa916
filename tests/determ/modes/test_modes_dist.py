"""HashMode on a torch.distributed (gloo) run: a collective's outputs are fingerprinted once its work is done."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, port: int, root: str) -> None:
    from determ_backend import HashMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        xs = [torch.randn(200_000) for _ in range(12)]  # large enough that gloo is still busy when the op returns
        with HashMode(trace_path=os.path.join(root, f"rank{rank}.jsonl")):
            for i, x in enumerate(xs):
                y = x * (rank + 1)
                if i % 2:
                    dist.all_reduce(y)
                else:
                    dist.all_reduce(y, async_op=True).wait()
                y.sum()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_collective_is_fingerprinted_after_its_work_not_before(tmp_path, free_port):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        recs = [json.loads(line) for line in lines[1:-1]]
        reduced = [r for r in recs if r["op"].startswith("c10d.allreduce_")]
        assert len(reduced) == 12
        # the sum over both ranks (x * 3) never has the fingerprint of this rank's input (x or 2x)
        assert not [r["node"] for r in reduced if r["hash"] == r["in_hashes"][0]]
        # and the reduced value is the same on both ranks
        if rank:
            assert [r["hash"] for r in reduced] == first
        first = [r["hash"] for r in reduced]
