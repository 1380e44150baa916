"""The demo's cheap parts: the shipped model, the determinism step, the command line.
(The full demo compiles inductor several times; it is what ``scripts/demo`` runs.)"""

from __future__ import annotations

import torch

from determ_backend.demo_model import DemoTransformer, demo_inputs
from repro_tools.cli import demo
from repro_tools.cli import main


def test_demo_model_runs_and_its_nondeterministic_op_varies():
    (x,) = demo_inputs()
    assert DemoTransformer()(x).shape == x.shape
    assert DemoTransformer(nondeterministic=True)(x).shape == x.shape
    y = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 1000
    op = torch.ops.determ_demo.scrambled_sum
    assert not torch.equal(op(y), op(y))  # the accumulation order changes from call to call


def test_determinism_step_names_the_nondeterministic_op(tmp_path):
    r = demo._nondeterminism(tmp_path)
    assert r["caught"] and r["first"]["op"] == "determ_demo.scrambled_sum.default"
    assert "demo_model.py" in r["first"]["source"]


def test_demo_command_is_registered(capsys):
    assert main(["demo", "--help"]) == 0
    assert "--out" in capsys.readouterr().out
