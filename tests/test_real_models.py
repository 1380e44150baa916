"""tests/real_models.py: every family builds offline, runs forward and backward eagerly, and RELU_FAMILIES
names exactly the families whose forward dispatches ``aten.relu``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import real_models

pytestmark = pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def test_at_least_ten_families():
    assert len(real_models.FAMILIES) >= 10
    assert real_models.RELU_FAMILIES <= set(real_models.FAMILIES)


@pytest.mark.parametrize("family", list(real_models.FAMILIES))
def test_family_runs_forward_and_backward(family):
    model, inputs = real_models.build(family)
    assert sum(p.numel() for p in model.parameters()) < 300_000  # small enough for a quick compile
    model.train()
    with _Ops() as seen:
        loss = real_models.loss_of(model(**inputs))
        loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None for p in model.parameters())
    assert (torch.ops.aten.relu.default in seen.ops) == real_models.has_relu(family)


def test_has_relu_rejects_unknown_families():
    with pytest.raises(KeyError, match="unknown family"):
        real_models.has_relu("nosuch")
