"""HashMode on a torch.distributed (gloo) run: a collective's outputs are fingerprinted once its work is done."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
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


def _ddp_worker(rank: int, port: int, root: str, perturb: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from determ_backend import HashMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = DDP(model)
        if perturb and rank == 1:  # the replicas part: rank 1's weight differs after DDP's initial broadcast
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-2
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(rank)
        xs = [torch.randn(2, 16) for _ in range(2)]
        with HashMode(trace_path=os.path.join(root, f"rank{rank}.jsonl"), stats=True):
            for x in xs:
                opt.zero_grad()
                ddp(x).pow(2).mean().backward()
                opt.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_are_recorded_as_all_reduced_and_identical_runs_diff_identical(tmp_path, free_port):
    """DDP writes gradients into its bucket with ``mul.out`` (whose ``out=`` memory it does not read: uninitialized on
    the first step) and all-reduces the bucket, which moves no version counter.  The bucket view copied into .grad
    kept the record of the local gradient, so the SGD update after it looked like a second root cause; and two
    identical runs never diffed identical (the bucket's garbage was an input)."""
    from repro_tools.cli import main

    runs = {}
    for name, perturb in (("a", False), ("b", False), ("p", True)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        mp.spawn(_ddp_worker, args=(free_port(), str(runs[name]), perturb), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        assert main(["diff", str(runs["a"] / f"rank{rank}.jsonl"), str(runs["b"] / f"rank{rank}.jsonl")]) == 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["diff", str(runs["a"] / "rank0.jsonl"), str(runs["p"] / "rank0.jsonl"), "--json"]) == 1
    roots = [r["op"] for r in json.loads(buf.getvalue())["root_causes"]]
    assert roots == ["c10d.allreduce_.default"], roots  # rank 0 first sees rank 1's weight in the all-reduce


def _all_to_all_worker(rank: int, port: int, root: str, perturb: bool, op: str = "all_to_all") -> None:
    from determ_backend import HashMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(rank)
        src = torch.randn(8)
        if perturb and rank == 1:
            src[0] += 1.0  # rank 1 sends other data
        with HashMode(trace_path=os.path.join(root, f"rank{rank}.jsonl"), stats=True):
            if op == "all_to_all":
                o = torch.empty(8)
                dist.all_to_all_single(o, src * 2)  # returns only its Work: the schema does not say it writes o
            else:  # gloo copies the result out of a buffer of its own in Python's work.wait(), after the op
                o = torch.empty(4)
                dist.reduce_scatter_tensor(o, src * 2)
            (o * 3).sum()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("op, recorded", [("all_to_all", "c10d.alltoall_base_.default"),
                                          ("reduce_scatter", "c10d._reduce_scatter_base_.default")])
def test_a_collective_that_returns_only_its_work_is_recorded_and_blamed(tmp_path, free_port, op, recorded):
    """``all_to_all_single`` writes its output unannounced: it is recorded with the value it left, its consumer
    reads that record, and another rank's different data is blamed on the collective, not on the consumer.
    gloo's ``reduce_scatter_tensor`` copies its result out of a buffer of its own after the op: that buffer is the
    collective's value, not a second root cause."""
    from repro_tools.cli import main as cli

    for name, perturb in (("a", False), ("b", True)):
        (tmp_path / name).mkdir()
        mp.spawn(_all_to_all_worker, args=(free_port(), str(tmp_path / name), perturb, op), nprocs=WORLD, join=True)
    recs = [json.loads(line) for line in (tmp_path / "a" / "rank0.jsonl").read_text().splitlines()[1:-1]]
    (coll,) = [r for r in recs if r["op"] == recorded]
    assert len([r for r in recs if r["op"] == "input"]) == 1  # src alone: gloo's own buffer is no input
    if op == "reduce_scatter":
        assert [r["inputs"] for r in recs if r["op"] == "alias"] == [[coll["node"]]]  # it is the collective's value
    if op == "all_to_all":
        (mul,) = [r for r in recs if r["op"] == "aten.mul.Tensor" and r["inputs"] == [coll["node"]]]
        assert mul["in_hashes"] == [coll["hash"]]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli(["diff", str(tmp_path / "a" / "rank0.jsonl"), str(tmp_path / "b" / "rank0.jsonl"), "--json"])
    assert code == 1 and [r["op"] for r in json.loads(buf.getvalue())["root_causes"]] == [recorded]
