"""A run directory is never shared or replaced (determ_backend.backends.run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from determ_backend.trace.stream import read_trace_file

_SCRIPT = textwrap.dedent("""
    import torch
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    f = torch.compile(m, backend="determ_eager")
    for _ in range(3):
        f(torch.randn(4, 8))
""")


def test_two_processes_with_the_same_run_id_both_keep_their_whole_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, DETERM_DIR=str(tmp_path / "out"), DETERM_RUN_ID="same", DETERM_CHECK="determinism")
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    dirs = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert dirs == ["same", "same-2"], dirs
    for d in dirs:
        tf = read_trace_file(tmp_path / "out" / d / "trace.jsonl")
        assert tf.complete and len({r.call for r in tf.records}) == 3  # every call of that process
        assert json.loads((tmp_path / "out" / d / "report.json").read_text())["divergent"] is False
    assert sum("writes to" in e for e in errs) == 1  # the one that moved says where


def test_a_second_run_of_the_same_id_does_not_replace_the_first(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, DETERM_DIR=str(tmp_path / "out"), DETERM_RUN_ID="again")
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, timeout=300)
    first = (tmp_path / "out" / "again" / "trace.jsonl").read_bytes()
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"writes to {tmp_path / 'out' / 'again-2'}" in r.stderr
    assert (tmp_path / "out" / "again" / "trace.jsonl").read_bytes() == first
    assert (tmp_path / "out" / "again-2" / "trace.jsonl").is_file()


def test_a_directory_created_empty_beforehand_is_used_and_then_owned(tmp_path):
    from determ_backend.config import load_config
    from determ_backend.backends.run import Run

    (tmp_path / "mine").mkdir()
    first = Run(load_config({"dir": str(tmp_path), "run_id": "mine"}, env={}))
    second = Run(load_config({"dir": str(tmp_path), "run_id": "mine"}, env={}))
    assert (first.dir, second.dir) == (tmp_path / "mine", tmp_path / "mine-2")
    first.close()
    second.close()
