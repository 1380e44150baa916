"""The user-frame walk: the native loop and the Python loop agree, on real module stacks."""

from __future__ import annotations

import sys

import pytest
import torch

from determ_backend._frames import FrameFilter
from determ_backend.fingerprint import _native


class _Probe(torch.nn.Module):
    """Records, from inside torch's module call machinery, what each filter names as the user frames."""

    def __init__(self, filters):
        super().__init__()
        self.filters, self.seen = filters, []

    def forward(self, x):
        frame = sys._getframe(0)
        self.seen.append([[(f.f_code.co_name, f.f_lineno) for f in flt.user_frames(frame, 3)] for flt in self.filters])
        return x


def _user_line(model, x):
    return model(x)  # the user frame the walk must reach past torch's frames


@pytest.mark.skipif(_native.frame_walker() is None, reason="native kernel not built as an extension module here")
def test_native_and_python_walks_name_the_same_frames():
    native, python = FrameFilter(), FrameFilter()
    python._walk = None  # the Python loop
    probe = _Probe([native, python])
    model = torch.nn.Sequential(torch.nn.Sequential(probe))
    for _ in range(3):  # cold cache, then warm: the native loop skips frames known to be internal
        _user_line(model, torch.ones(1))
    for got in probe.seen:
        assert got[0] == got[1]
        assert got[0][0][0] == "forward" and got[0][1][0] == "_user_line"  # the probe's file is user code


def test_the_walk_keeps_every_classified_code_alive():
    """Codes are cached by id: a cached code object is kept, so its id is never reused while cached."""
    flt = FrameFilter()

    def make_code():
        ns = {}
        exec("def f():\n    import sys\n    return sys._getframe(0)\n", ns)
        return ns["f"]()

    for _ in range(5):
        flt.user_frames(make_code(), 1)
    assert len(flt._codes) == len(flt._cache) >= 5
    assert all(id(c) in flt._cache for c in flt._codes)
