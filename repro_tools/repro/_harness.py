"""Runtime of a generated ``repro.py``, part 2: compiling, checking, the subcommands.

Copied into every script after :mod:`repro_tools.repro._inputs` (see there).
Only the standard library and torch may be imported here; determ is imported
lazily, by the ``minify`` and ``analyze`` subcommands only.
"""

import argparse
import contextlib
import copy
import os
import subprocess
import sys
import traceback

import torch

# --- placeholders: replaced by the generated script's own definitions (not copied) ---
from repro_tools.repro._inputs import META, INPUTS, ReproInputError, ReproTracer, _device, _dtype, load_args  # noqa: F401
Repro = torch.nn.Module


def compile_config():
    return []
# --- end placeholders ---


def _clone(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = a.detach().clone()
            out.append(c.requires_grad_(a.requires_grad) if c.is_floating_point() or c.is_complex() else c)
        else:
            out.append(a)
    return out


def resolve_compiler(name):
    """The compiler ``f(gm, example_inputs)`` named in ``META["compiler"]``."""
    if name == "eager":
        return lambda gm, example_inputs: gm
    if name == "inductor_inner":
        from torch._inductor.compile_fx import compile_fx_inner
        return compile_fx_inner
    if ":" in name:
        import importlib
        sys.path.extend(p for p in META.get("sys_path", []) if p not in sys.path)
        mod, _, attr = name.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    from torch._dynamo import lookup_backend
    return lookup_backend(name)


class _EveryOpTraced(torch.overrides.TorchFunctionMode):
    """While tracing ``Repro``: every operator call becomes a node -- also a factory op called on no traced
    value, and one whose traced values sit inside a list (``full([2, s0], ...)`` with a symbolic size),
    which the operator's own argument parser would refuse."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # a higher-order op (an autograd.Function, a checkpoint) is a node too: it takes its subgraphs as modules
        if isinstance(func, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            return self.tracer.create_proxy("call_function", func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _subgraphs_traced(mod):
    """``mod`` with each subgraph module written as a ``Repro_<name>`` class (the bodies a higher-order op takes)
    traced back into a GraphModule: the op reads its ``graph``.  (The script may import only torch: determ's loader
    does the same in ``repro_tools.repro.script._subgraphs_retraced``; a change to one belongs in both.)"""
    for name, child in list(mod.named_children()):
        if type(child).__name__.startswith("Repro_") and not isinstance(child, torch.fx.GraphModule):
            setattr(mod, name, trace_repro(child))
    return mod


def trace_repro(mod):
    """``Repro`` as a GraphModule."""
    tracer = ReproTracer()
    _subgraphs_traced(mod)
    with _EveryOpTraced(tracer):
        graph = tracer.trace(mod)
    return torch.fx.GraphModule(tracer.root, graph)


def compile_repro(mod, args, compiler=None, gm=None):
    """Compile ``Repro`` the way the original graph was compiled; returns ``f(list_of_args)``.  ``gm``: ``mod``
    traced already (:func:`trace_repro`)."""
    gm = trace_repro(mod) if gm is None else gm
    comp = compiler or resolve_compiler(META.get("compiler", "eager"))
    if META.get("after") == "dynamo" and any(n.op == "call_method" and n.target in ("item", "tolist")
                                             for n in gm.graph.nodes):
        # a value read back from a tensor (``.item()`` under capture_scalar_outputs) is a symbol only dynamo's shape
        # environment holds: the graph goes through dynamo again, as it did in the user's program (the minifier's
        # test of the same is ``repro_tools.minify.compilers.reads_scalars``)
        def run(*a):  # dynamo starts from a plain function (it skips a GraphModule's own call frames)
            return gm(*a)

        fn = torch.compile(run, backend=comp, fullgraph=True)
        return lambda a: fn(*a)
    fn = comp(gm, _clone(args))
    # only AOT-level compilers use the boxed convention; dynamo calls a backend's result with positional
    # args (inductor's compile_fx result carries a misleading _boxed_call)
    if getattr(fn, "_boxed_call", False) and META.get("after") == "aot":
        return lambda a: fn(list(a))
    return lambda a: fn(*a)


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for k in sorted(x, key=str) for y in _flat(x[k])]
    return [x]


def run_fwd_maybe_bwd(fn, args, params=(), after=None, positions=None):
    """Outputs, then the gradients of float leaves (inputs requiring grad, parameters) when any output needs one.
    ``after``: receives the argument copies the run was given, as the run left them; ``positions``: each tensor
    output's position among everything the graph returns (its sizes too), as the flows number outputs."""
    args = _clone(args)
    if after is not None:
        after.extend(args)
    with torch.set_grad_enabled(not META.get("only_fwd", True)):  # a forward-only graph ran without grad
        flat = _flat(fn(args))
    outs = [o for o in flat if isinstance(o, torch.Tensor)]
    if positions is not None:
        positions.extend(i for i, o in enumerate(flat) if isinstance(o, torch.Tensor))
    diff = [o for o in outs if o.requires_grad]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + list(params)
    if META.get("only_fwd", True) or not diff or not leaves:
        return [o.detach() for o in outs]
    loss = sum(o.float().sum() for o in diff)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs] + [g for g in grads if g is not None]


def _rmse(x, y):
    d = x.detach().double().cpu() - y.detach().double().cpu()
    return float(torch.sqrt(torch.mean(d * d))) if d.numel() else 0.0


def same_leaf(e, c, r, tol, mult, strict):
    """determ's verdict, kept torch-only for standalone repro scripts (tested equal to
    ``determ_backend.compare.judge``); None when ``e`` is not compared."""
    if e.shape != c.shape:
        return False
    if strict and tol == 0:
        return e.dtype == c.dtype and torch.equal(e.cpu(), c.cpu())
    if not (e.is_floating_point() or e.is_complex()):
        return torch.equal(e.cpu(), c.cpu()) if strict else None
    e, c = e.detach().cpu(), c.detach().cpu().to(e.dtype)
    if torch.allclose(e, c, atol=tol, rtol=tol, equal_nan=True):
        return True
    if r is None or (torch.isnan(c).any() and not torch.isnan(e).any()):
        return False
    return _rmse(r, c) <= mult * _rmse(r, e) + tol / 10.0


def _module_tensors(mod):
    """The module's parameters and buffers by name: the state a graph may update in place."""
    return dict(list(mod.named_parameters()) + list(mod.named_buffers()))


def _written_state(tensors, saved):
    """``{name: tensor as left}`` for the module tensors a run changed (and puts them back as ``saved``)."""
    written = {k: t.detach().clone() for k, t in tensors.items() if not _bitwise_equal([t], [saved[k]])}
    _put_back(tensors, saved, written)
    return written


def _put_back(tensors, saved, names=None):
    """``saved`` back into ``tensors`` (those named, else those that differ)."""
    with torch.no_grad():
        for k, t in tensors.items():
            if (k in names) if names is not None else not _bitwise_equal([t], [saved[k]]):
                t.data.copy_(saved[k])  # through .data: the version counter does not move


def check_accuracy(mod, fn, args, tol, strict):
    """``None`` when compiled agrees with eager (fp64 reference), else a message naming the first bad output.
    Each run starts from the module's state as found (a graph may update it in place: a compiled optimizer
    step), and what a run writes besides its outputs -- an input eager writes, a parameter or buffer either run
    writes -- is compared like an output; the state is put back at the end."""
    params = list(mod.parameters())
    tensors = _module_tensors(mod)
    saved = {k: t.detach().clone() for k, t in tensors.items()}
    try:
        e_after, c_after, positions = [], [], []
        eager = run_fwd_maybe_bwd(lambda a: mod(*a), args, params, e_after, positions)
        e_args = {i: a.detach() for i, (x, a) in enumerate(zip(args, e_after))
                  if isinstance(x, torch.Tensor) and isinstance(a, torch.Tensor) and not _bitwise_equal([x], [a])}
        e_attrs = _written_state(tensors, saved)
        comp = run_fwd_maybe_bwd(fn, args, params, c_after)
        c_attrs = _written_state(tensors, saved)
        r_args, r_attrs = {}, {}
        try:
            m64 = copy.deepcopy(mod).double()
            a64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in _clone(args)]
            r_after, t64 = [], _module_tensors(m64)
            ref = run_fwd_maybe_bwd(lambda a: m64(*a), a64, list(m64.parameters()), r_after)
            r_args = dict(enumerate(r_after))
            r_attrs = {k: t.detach() for k, t in t64.items()}
        except Exception as err:  # an op without fp64 support: judged without a reference, and said so
            print(f"warning: no fp64 reference ({type(err).__name__}: {err}); comparing with tolerance only",
                  file=sys.stderr)
            ref = [None] * len(eager)
    finally:
        _put_back(tensors, saved)
    if len(eager) != len(comp):
        return f"compiled returned {len(comp)} tensors, eager {len(eager)}"
    # numbered as the flows number them: an output by its place in what the graph returns, then the gradients
    names = [f"output {p}" for p in positions] + [f"gradient {k}" for k in range(len(eager) - len(positions))]
    for i in sorted(e_args):  # an input only compiled code wrote is scratch memory it was given
        eager.append(e_args[i])
        comp.append(c_after[i].detach())
        ref.append(r_args.get(i))
        names.append(f"input {i} as the graph left it")
    for k in sorted(set(e_attrs) | set(c_attrs)):
        eager.append(e_attrs.get(k, saved[k]))
        comp.append(c_attrs.get(k, saved[k]))
        ref.append(r_attrs.get(k))
        names.append(f"{k} as the graph left it")
    mult = float(META.get("multiplier", 2.0))
    for name, e, c, r in zip(names, eager, comp, ref):
        if same_leaf(e, c, r, tol, mult, strict) is False:
            err = (e.double() - c.double()).abs().max().item() if e.shape == c.shape else float("nan")
            extra = f", rmse vs fp64: compiled {_rmse(r, c):.3g} eager {_rmse(r, e):.3g}" if r is not None else ""
            return f"{name} {tuple(e.shape)} {e.dtype}: max abs error {err:.3g}{extra}"
    return None


def _bits(x):
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
                                    for x, y in zip(a, b))


def _eager_fails(mod, args):
    """2, said in one line, when the graph fails without any compiler too (an input that does not fit it, a script
    edited by hand): the compiler's failure cannot be told from that, and is not reproduced.  None when eager runs."""
    try:
        with torch.set_grad_enabled(not META.get("only_fwd", True)):
            mod(*_clone(args))
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"{os.path.basename(__file__)}: error: the graph fails without the compiler too ({type(err).__name__}: "
              f"{first[:300]}): its inputs or the script are wrong, not the compiler (see get-args)", file=sys.stderr)
        return 2
    return None


def _report(stage, err):
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    kind = META.get("kind", "any")
    note = "" if kind in ("any", "crash", stage) else f"  (recorded failure: {kind})"
    print(f"reproduced {stage}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}{note}")
    return 1


def missing_custom_op():
    """Why the graph cannot run here when a custom op it calls is not registered (one defined in the program's main
    script, which no repro can import), else None."""
    for qual, where in META.get("main_ops", {}).items():
        ns, _, name = qual.partition("::")
        try:
            getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError):
            return (f"{__file__}: the graph calls custom op {qual}, defined in {where}, which no script can import "
                    "(it ran as the main program): define the op in a module the program imports, and record the "
                    "failure again")
    return None


def _setup(ns):
    missing = missing_custom_op()
    if missing:
        raise ReproInputError(missing)
    try:
        mod, args = Repro(), load_args(ns.device)
        if ns.device:
            mod.to(ns.device)
        return mod, args, resolve_compiler(META.get("compiler", "eager"))
    except ReproInputError:
        raise
    except Exception as err:
        raise ReproInputError(f"{__file__}: cannot set up the repro ({type(err).__name__}: {err})") from err


def _on(spec, mod, args):
    """``mod`` and ``args`` moved to a device spec such as ``cuda`` or ``cpu:float64``."""
    dev, _, dt = spec.partition(":")
    dtype = _dtype(dt) if dt and not dt.isdigit() else None
    dev = _device({"device": dev if not dt.isdigit() else spec, "name": spec}, None)
    m = copy.deepcopy(mod).to(dev)
    moved = [a.detach().to(dev) if isinstance(a, torch.Tensor) else a for a in args]
    if dtype is not None:
        m = m.to(dtype)
        moved = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in moved]
    return m, moved


def _cross_device(mod, compiler, args, tol):
    runs = []
    for spec in META.get("devices", ["cpu", "cpu:float64"]):
        m, a = _on(spec, mod, args)
        runs.append([o.detach().double().cpu() for o in _flat(compile_repro(m, a, compiler)(a))
                     if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())])
    bad = [i for i, (x, y) in enumerate(zip(*runs)) if not torch.allclose(x, y, atol=tol, rtol=tol, equal_nan=True)]
    return f"outputs {bad} differ beyond tol={tol:g} between {' and '.join(META.get('devices', []))}" if bad else None


def _sub_batch(args, batch, b, dim):
    """The first ``b`` rows of the batched inputs (the minifier's rules, repeated here: this runtime imports
    torch alone).  A repro that recorded its cuts (``batch_cuts``: per sub-batch size, ``[input index, dim,
    rows]`` of each input that holds the batch, ``dim`` None for a size argument) is cut by them; an older one
    by a guess: a tensor whose dimension ``dim`` is a multiple of ``batch`` keeps that multiple of ``b`` rows,
    an int size equal to ``batch`` becomes ``b``."""
    recorded = META.get("batch_cuts")
    if recorded:
        cuts = {int(i): (d, int(rows)) for i, d, rows in recorded.get(b, recorded.get(str(b), []))}
        out = []
        for i, a in enumerate(_clone(args)):
            cut = cuts.get(i)  # None: the input holds no batch
            out.append(a if cut is None else cut[1] if cut[0] is None else a.detach().narrow(int(cut[0]), 0, cut[1]).clone())
        return out
    out = []
    for a in _clone(args):
        if isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] and a.shape[dim] % batch == 0:
            out.append(a.detach().narrow(dim, 0, a.shape[dim] // batch * b).clone())
        elif isinstance(a, int) and not isinstance(a, bool) and a == batch:
            out.append(b)
        else:
            out.append(a)
    return out


def _batch_invariance(mod, fn, compiler, args):
    batch, dim = int(META["batch"]), int(META.get("batch_dim", 0))
    with torch.no_grad():
        full = [o for o in _flat(fn(_clone(args))) if isinstance(o, torch.Tensor)]
        for b in sorted({batch // 2, 1} - {0, batch}, reverse=True):  # compare.sub_batches (torch alone here)
            sub = _sub_batch(args, batch, b, dim)
            part = [o for o in _flat(compile_repro(mod, sub, compiler)(sub)) if isinstance(o, torch.Tensor)]
            for i, (x, y) in enumerate(zip(full, part)):
                rows = x.narrow(dim, 0, x.shape[dim] // batch * b) if x.dim() > dim and x.shape[dim] % batch == 0 \
                    and x.shape[dim] != y.shape[dim] else None
                if rows is not None and rows.shape == y.shape and not torch.equal(_bits(rows), _bits(y)):
                    return f"output {i}: rows 0..{b - 1} differ bitwise between batch {batch} and batch {b}"
    return None


def _nonfinite(xs):
    return any(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel()
               and not bool(torch.isfinite(x.detach()).all()) for x in xs)


def _nan(fn, args):
    if _nonfinite(args):
        return None  # an input already holds one: nothing is created here
    with torch.no_grad():
        outs = [o for o in _flat(fn(_clone(args))) if isinstance(o, torch.Tensor)]
    bad = [i for i, o in enumerate(outs) if _nonfinite([o])]
    return f"outputs {bad} hold NaN/Inf created from finite inputs" if bad else None


def _check(kind, mod, fn, compiler, args, ns):
    """A message when ``kind`` reproduces (errors propagate), else None."""
    if kind == "accuracy":
        msg = check_accuracy(mod, fn, args, ns.tol, ns.strict)
        return msg and f"AccuracyError: {msg}"
    if kind == "nondeterminism":
        outs = []
        for _ in range(int(META.get("runs", 2))):
            torch.manual_seed(int(META.get("seed", 1234)))
            outs.append(run_fwd_maybe_bwd(fn, args))
        same = all(_bitwise_equal(outs[0], o) for o in outs[1:])
        return None if same else "runs of the compiled graph on identical inputs differ bitwise"
    if kind == "cross_device":
        return _cross_device(mod, compiler, args, ns.tol)
    if kind == "batch_invariance":
        return _batch_invariance(mod, fn, compiler, args)
    if kind == "nan":
        return _nan(fn, args)
    with torch.set_grad_enabled(not META.get("only_fwd", True)):  # as the graph ran: an inference graph without grad
        fn(_clone(args))
    return None


def _run_checks(ns):
    kind = ns.kind or META.get("kind", "any")
    mod, args, compiler = _setup(ns)
    try:
        gm = trace_repro(mod)
    except Exception as err:  # the script's own loader, not the compiler: never "reproduced"
        print(f"{os.path.basename(__file__)}: error: the Repro module cannot be traced back into a graph "
              f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
              "this is a fault of the script, not the failure it records", file=sys.stderr)
        return 2
    try:
        fn = compile_repro(mod, args, compiler, gm)
    except Exception as err:
        return _eager_fails(mod, args) or _report("compile_error", err)
    try:
        msg = _check(kind, mod, fn, compiler, args, ns)
    except Exception as err:
        return _eager_fails(mod, args) or _report("runtime_error", err)
    if msg:
        print(f"reproduced {kind}: {msg}")
        return 1
    print(f"not reproduced: the compiled graph ran and passed the {kind} check{_regenerated()}")
    return 0


def _regenerated():
    """``" (N tensors were regenerated ...)"`` when some inputs or weights do not hold the program's values, else
    "".  (determ's twin, for minify, analyze and xdevice: ``repro_tools.minify.repro_files.regenerated_note``.)"""
    n = META.get("regenerated_inputs")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return ""
    return (f" ({n} tensor{'s were' if n > 1 else ' was'} regenerated from a fixed seed, not the values the program "
            "ran with: a failure that depends on the values may not show)")


def _run_isolated(ns, kind):
    """Crash and hang checks: the same command in a child process, judged by how it ends."""
    cmd = [sys.executable, os.path.abspath(__file__), "run", "--in-process"] + _forward_flags(ns)
    timeout = float(META.get("timeout", 300)) if kind == "hang" else None
    try:
        proc = subprocess.run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"reproduced hang: no answer within {timeout:g} s")
        return 1
    if proc.returncode < 0:
        import signal
        print(f"reproduced crash: the compiled graph killed the process with {signal.Signals(-proc.returncode).name}")
        return 1
    return proc.returncode


_KINDS = ("compile_error", "runtime_error", "accuracy", "nondeterminism", "crash", "hang", "cross_device",
          "batch_invariance", "nan", "any")  # twin of repro_tools.repro.script.FAILURE_KINDS (this runtime imports torch only)


def _run(ns):
    kind = ns.kind or META.get("kind", "any")
    if kind not in _KINDS:  # a hand-edited META: checking nothing would pass for "not reproduced"
        raise ReproInputError(f"{__file__}: META kind {kind!r}: expected one of {', '.join(_KINDS)}")
    if kind in ("crash", "hang", "any") and not ns.in_process:
        return _run_isolated(ns, kind)
    with config_applied():
        return _run_checks(ns)


def _forward_flags(ns):
    out = ["--tol", str(ns.tol)] + (["--strict"] if ns.strict else [])
    out += (["--device", ns.device] if ns.device else []) + (["--kind", ns.kind] if ns.kind else [])
    return out


@contextlib.contextmanager
def config_applied():
    """The compile-time config (``compile_config()``) for the duration of the block, restored afterwards."""
    with contextlib.ExitStack() as stack:
        for module, entries in compile_config():
            stack.enter_context(module.patch(entries))
        yield


def _get_args(ns):
    if ns.out:
        _check_out(ns.out)
        if os.path.exists(ns.out) and not ns.force:
            raise ReproInputError(f"--out {ns.out}: the file exists; pass --force to replace it")
    args = load_args(ns.device)
    for i, (spec, a) in enumerate(zip(INPUTS, args)):
        if isinstance(a, torch.Tensor):
            src = "stored" if spec.get("storage") else "regenerated"
            print(f"{i}\t{spec.get('name', '')}\t{a.dtype}\t{tuple(a.shape)}\tstride={tuple(a.stride())}\t{a.device}\t{src}")
        else:
            print(f"{i}\t{spec.get('name', '')}\t{type(a).__name__}\t{a!r}")
    if ns.out:
        _save_args(args, ns.out)
        print(f"saved to {ns.out} (load with torch.load(path, weights_only=True))", file=sys.stderr)
    return 0


def _check_out(out):
    """The directory ``out`` goes into; a ReproInputError when it cannot be a new or replaced file there."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ReproInputError(f"--out {out}: directory {parent} does not exist")
    if os.path.isdir(out):
        raise ReproInputError(f"--out {out}: is a directory; expected a file path")
    return parent


def _save_args(args, out):
    """``torch.save`` of the inputs to ``out``, atomically (a temporary file next to it, then renamed)."""
    parent = _check_out(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        torch.save([a.detach() if isinstance(a, torch.Tensor) else a for a in args], tmp)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as err:  # torch.save reports unwritable paths as RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ReproInputError(f"--out {out}: cannot write it ({str(err).strip().splitlines()[0]})") from None


def _determ(command, rest):
    try:
        from repro_tools.cli import main as determ_main
        from repro_tools.flows.failure import minify_script
    except ImportError:
        print(f"{os.path.basename(__file__)} {command}: needs determ (pip install determ); "
              "'run' and 'get-args' work with torch alone", file=sys.stderr)
        return 2
    from determ_backend.errors import DetermError
    try:
        if command == "minify":
            return minify_script(os.path.abspath(__file__), rest)
        return determ_main([command, os.path.abspath(__file__)] + rest)
    except DetermError as err:
        print(f"{os.path.basename(__file__)} {command}: error: {err}", file=sys.stderr)
        return 2


def _version_warning():
    have, want = torch.__version__, META.get("torch_version")
    if want and want != have:
        print(f"warning: {os.path.basename(__file__)} was written with torch {want}, running torch {have}; "
              "the failure may not reproduce, or differently", file=sys.stderr)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    for var in ("REPRO_AFTER", "REPRO_LEVEL"):  # they configured the program this graph came from, not its repro:
        os.environ.pop(var, None)               # a determ backend compiling it here runs without a repro flow
    if META.get("threads"):  # the program's thread count: a C++ error thrown in a parallel region aborts instead
        torch.set_num_threads(int(META["threads"]))
    commands = ("run", "minify", "analyze", "get-args")
    default = "minify" if META.get("launcher") else "run"
    command = argv.pop(0) if argv and argv[0] in commands else default
    _version_warning()
    if command in ("minify", "analyze"):
        return _determ(command, argv)
    p = argparse.ArgumentParser(prog=f"{os.path.basename(__file__)} {command}",
                                description=f"subcommands: run, minify, analyze, get-args (default: {default}); "
                                            "run exits 1 when the failure reproduces, 0 when not, 2 on bad input")
    p.add_argument("--device", help="run on this device instead of the recorded one (e.g. cpu)")
    if command == "get-args":
        p.add_argument("--out", help="also save the inputs to this file (torch.save)")
        p.add_argument("--force", action="store_true", help="replace --out when it exists")
    else:
        p.add_argument("--kind", choices=_KINDS,
                       help=f"failure to check for (default: the recorded one, {META.get('kind', 'any')})")
        p.add_argument("--tol", type=float, default=float(META.get("tol", 1e-3)), help="accuracy tolerance")
        p.add_argument("--strict", action="store_true", default=bool(META.get("strict")),
                       help="accuracy: also compare non-float outputs (bitwise with --tol 0)")
        p.add_argument("--in-process", action="store_true", help="do not isolate a crash check in a subprocess")
    ns = p.parse_args(argv)
    try:
        return _get_args(ns) if command == "get-args" else _run(ns)
    except ReproInputError as err:
        print(f"{os.path.basename(__file__)}: error: {err}", file=sys.stderr)
        return 2
