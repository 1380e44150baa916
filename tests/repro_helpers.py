"""Shared helpers for the repro-script and repro-flow tests.

Compilers here live at module level so generated scripts can import them by name
(``repro_helpers:aot_relu_abort``; the tests directory is recorded in the script).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Tuple

import torch

from determ_backend.config import load_config
from conftest import relu_as_plus_one

TESTS = Path(__file__).resolve().parent
_BLOCK_DETERM = ("import runpy, sys\n"
                 "for m in ('determ_backend', 'repro_tools'): sys.modules[m] = None\n"
                 "main = runpy.run_path(sys.argv[1], run_name='repro')['main']\n"
                 "for cmd in sys.argv[2:]:\n"
                 "    print('exit', cmd, main(cmd.split()), flush=True)\n")


def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A tiny graph whose only relu is the faulty op the test compilers break."""
    return torch.relu(x @ w).sum(0) * 2


def dropout_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`model` with a dropout (training) before its relu: its graphs draw random numbers."""
    return torch.relu(torch.nn.functional.dropout(x @ w, 0.5, training=True)).sum(0) * 2


def checkpointed_dropout_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`dropout_model` with its matmul, dropout and relu under activation checkpointing: the forward graph
    draws the mask inside ``run_and_save_rng_state``, which saves the generator's state for the backward."""
    block = lambda h: torch.relu(torch.nn.functional.dropout(h @ w, 0.5, training=True))  # noqa: E731
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum(0) * 2


def model_inputs(requires_grad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g).requires_grad_(requires_grad)


def repro_config(tmp_path: Path, level: int, **options: Any):
    return load_config({"repro_level": level, "dir": str(tmp_path / "out"), "run_id": "r", **options}, env={})


def capture_graph(fn, *inputs) -> Tuple[torch.fx.GraphModule, List[Any]]:
    """The dynamo graph of ``fn`` and its example inputs."""
    got = []

    def capture(gm, example_inputs):
        got.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*inputs)
    return got[0]


def run_script(path: Path, *args: str, timeout: float = 600, cwd: Path = None) -> subprocess.CompletedProcess:
    """``python path args`` in a fresh process (cwd: ``cwd`` or the script's directory)."""
    return _run([sys.executable, str(path), *args], cwd or Path(path).parent, timeout)


def run_without_determ(path: Path, *commands: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """One fresh process where determ cannot be imported, running the script's ``main`` for each
    command line in turn; prints ``exit <command> <code>`` after each."""
    return _run([sys.executable, "-c", _BLOCK_DETERM, str(path), *commands], Path(path).parent, timeout)


def run_main(path: Path, *args: str) -> int:
    """The script's ``main(args)`` in this process (no process start-up)."""
    from repro_tools.repro.script import import_script

    return import_script(path).main(list(args))


def _run(cmd: List[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def forward_source(path: Path) -> str:
    """The code of ``class Repro``'s ``forward`` in a generated script (comment lines dropped)."""
    text = Path(path).read_text()
    cls = text[text.index("class Repro(torch.nn.Module):"):]
    body = cls[cls.index("    def forward("):]
    end = re.search(r"\n\S", body)
    body = body[:end.start()] if end else body
    return "\n".join(ln for ln in body.splitlines() if not ln.strip().startswith("#"))


def assert_reproduces(path: Path, kind: str, op: str, *args: str) -> subprocess.CompletedProcess:
    """The script runs standalone, reproduces ``kind`` (exit 1) and its forward calls ``op``."""
    proc = run_script(path, *args)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    assert f"reproduced {kind}" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert op in forward_source(path), forward_source(path)
    return proc


def last_stderr_line(text: str) -> str:
    return [ln for ln in text.strip().splitlines() if ln.strip()][-1]


# ---------------------------------------------------------------- compilers (importable by name)

def _has_relu(gm: torch.fx.GraphModule) -> bool:
    return any(n.target in (torch.relu, torch.ops.aten.relu.default) for n in gm.graph.nodes)


def relu_abort_backend(gm, example_inputs):
    """A compiler that kills the process (SIGABRT) on graphs with a relu."""
    if _has_relu(gm):
        os.abort()
    return gm


def aot_relu_compile_error(gm, example_inputs):
    if _has_relu(gm):
        # several lines, as a C++ compile error's (its message, then the command line and the compiler's output)
        raise RuntimeError("relu is not supported by this compiler\n\nCommand:\ng++ kernel.cpp -o kernel.so")
    return gm


def aot_relu_runtime_error(gm, example_inputs):
    if not _has_relu(gm):
        return gm

    def run(*args):
        raise RuntimeError("relu kernel failed at run time")

    return run


def aot_as_is(gm, example_inputs):
    """A correct compiler: the graph runs as it is."""
    return gm


def aot_relu_accuracy_error(gm, example_inputs):
    """relu(x) computed as x + 1 (on a copy: the graph handed in stays intact)."""
    return relu_as_plus_one(gm)


def relu_plus_one_in_place(gm, example_inputs):
    """relu(x) computed as x + 1 by rewriting the graph it is handed (as PyTorch's relu_accuracy_error does)."""
    return relu_as_plus_one(gm, in_place=True)


def overshooting_optimizer(gm, example_inputs):
    """A compiled optimizer step that moves one parameter 1% too far (the graph updates it as an attribute)."""
    target = next(n.target for n in gm.graph.nodes if n.op == "get_attr" and "params" in n.target)

    def run(*args):
        out = gm(*args)
        with torch.no_grad():
            getattr(gm, target).data.mul_(1.01)
        return out

    return run


def input_update_too_large(gm, example_inputs):
    """Writes the graph's in-place update of its first input 1% too large."""
    def run(*args):
        out = gm(*args)
        with torch.no_grad():
            args[0].mul_(1.01)
        return out

    return run


def noisy_backend(gm, example_inputs):
    """Nondeterministic: each call adds a different tiny offset (not tied to the torch seed)."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        return [o + calls[0] * 1e-3 if isinstance(o, torch.Tensor) else o for o in gm(*args)]

    return run



def run_code(code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process, with the tests directory importable."""
    return _run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + code], cwd, timeout)


def compile_and_fail(backend, x_w=None) -> BaseException:
    """Compile and run :func:`model` with ``backend``; the exception it raises (it must raise)."""
    torch._dynamo.reset()
    x, w = x_w or model_inputs()
    try:
        torch.compile(model, backend=backend)(x, w)
    except Exception as e:  # whatever the flow re-raised: the test inspects it
        return e
    raise AssertionError("compiling and running the model did not fail")


def train_with_compiled_optimizer(backend, steps: int = 2, options=None):
    """A few AdamW steps of a small MLP whose ``opt.step()`` is compiled with ``backend``: dynamo hands the
    parameters and optimizer state to the graph as attributes it updates in place, not as inputs (``options``: a
    determ backend's).  Returns the
    parameters and each parameter's optimizer state (step count, moments) after the last step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)

    @torch.compile(backend=backend, options=options)
    def update():
        opt.step()

    x = torch.randn(4, 8)
    for _ in range(steps):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        update()
    params = [p.detach().clone() for p in m.parameters()]
    return params, [{k: v.detach().clone() for k, v in opt.state[p].items()} for p in m.parameters()]


def same_training(a, b) -> bool:
    """Two :func:`train_with_compiled_optimizer` results hold the same bits."""
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(
        sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


def _relu_grad_too_large(gm, example_inputs):
    """The backward graph's relu gradient (``threshold_backward``) computed 1.5x too large."""
    from determ_backend import _torch_compat

    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.threshold_backward.default:
            with g.inserting_after(n):
                scaled = g.call_function(torch.ops.aten.mul.Tensor, (n, 1.5))
            n.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    gm.recompile()
    return _torch_compat.boxed_nop(gm, example_inputs)


def relu_grad_wrong(gm, example_inputs):
    """A training compiler (AOT, graphs run as they are) whose only fault is in the backward: relu's gradient is
    1.5x too large.  Forward outputs are right; only gradients diverge."""
    from determ_backend import _torch_compat

    return _torch_compat.aot_eager(gm, example_inputs, fw_compiler=_torch_compat.boxed_nop,
                                   bw_compiler=_relu_grad_too_large)
