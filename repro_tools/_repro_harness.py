"""Runtime of a generated ``repro.py``: loading inputs, compiling, checking, the subcommands.

:mod:`repro_tools.repro_script` copies this file's source (minus the placeholder
block below) into every script it writes, after the script's data (``META``,
``INPUTS``, ``ATTRS``) and its ``class Repro``.  It must therefore import nothing
but the standard library and torch: a repro runs where only torch is installed.
determ is imported lazily, only by the ``minify`` and ``analyze`` subcommands.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import os
import struct
import subprocess
import sys
import traceback

import torch

# --- placeholders: replaced by the generated script's own definitions (not copied) ---
META = {}
INPUTS = []
ATTRS = []
Repro = torch.nn.Module


def compile_config():
    return []
# --- end placeholders ---

try:  # inside determ's process, input errors are determ's ReproError (a DetermError)
    from determ_backend.errors import ReproError as _ReproBase
except ImportError:
    _ReproBase = RuntimeError


class ReproInputError(_ReproBase):
    """The repro's content store, an input file or a setting cannot be used."""


def _here():
    return os.path.dirname(os.path.abspath(__file__))


def _store_dirs():
    dirs = [os.path.join(_here(), META.get("store", "repro_store"))]
    if META.get("store_abs"):
        dirs.append(META["store_abs"])
    return dirs


def read_storage(key):
    """Bytes of one stored storage (a one-tensor safetensors file), checksum verified."""
    tried = [os.path.join(d, key + ".safetensors") for d in _store_dirs()]
    path = next((p for p in tried if os.path.isfile(p)), None)
    if path is None:
        raise ReproInputError(f"{tried[0]}: missing input file (content store of {os.path.basename(__file__)}; "
                              "copy the repro_store directory next to the script)")
    with open(path, "rb") as f:
        blob = f.read()
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        start, end = header["data"]["data_offsets"]
        data = bytearray(blob[8 + n + start:8 + n + end])
    except (struct.error, ValueError, KeyError, TypeError):
        raise ReproInputError(f"{path}: corrupt content store file (not a one-tensor safetensors file)") from None
    if hashlib.sha256(data).hexdigest()[:len(key)] != key:
        raise ReproInputError(f"{path}: corrupt content store file (checksum does not match its name)")
    return data


def _dtype(name):
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ReproInputError(f"{__file__}: unknown dtype {name!r} in the input description")
    return dt


def _device(spec, override):
    dev = torch.device(override or spec.get("device", "cpu"))
    if dev.type != "cpu":
        mod = getattr(torch, dev.type, None)
        if mod is None or not mod.is_available():
            raise ReproInputError(f"input {spec.get('name')!r} needs device {dev}, which is not available here "
                                  "(use --device cpu to run on the CPU)")
    return dev


def _span(shape, stride, offset):
    if any(s == 0 for s in shape):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def make_tensor(spec, gen, device=None, cache=None):
    """One tensor from its description: stored storage bytes, or regenerated with ``gen``."""
    dtype, dev = _dtype(spec["dtype"]), _device(spec, device)
    shape, stride, offset = spec["shape"], spec["stride"], spec.get("offset", 0)
    key = spec.get("storage")
    if key is not None:
        if cache is None or key not in cache:
            raw = read_storage(key)
            base = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            base = base.to(dev)
            if cache is not None:
                cache[key] = base
        else:
            base = cache[key]
        t = torch.empty(0, dtype=dtype, device=dev).set_(base.untyped_storage(), offset, shape, stride)
    else:
        n = _span(shape, stride, offset)
        if dtype.is_floating_point or dtype.is_complex:
            flat = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            flat = torch.randint(0, 2, (n,), generator=gen).bool()
        else:
            flat = torch.randint(0, 2, (n,), generator=gen).to(dtype)
        t = flat.to(dev).as_strided(shape, stride, offset)
    if spec.get("requires_grad"):
        t.requires_grad_(True)
    return t


def _value(spec, gen, device, cache):
    if spec["kind"] == "tensor":
        return make_tensor(spec, gen, device, cache)
    if spec["kind"] == "device":
        return torch.device(spec["value"])
    if spec["kind"] == "dtype":
        return _dtype(spec["value"])
    return spec.get("value")


def load_args(device=None):
    """The graph's inputs: from the content store, or regenerated (fixed seed) when data was not saved."""
    gen = torch.Generator().manual_seed(int(META.get("seed", 1234)))
    cache = {}
    return [_value(s, gen, device, cache) for s in INPUTS]


def install_attrs(root, device=None):
    """Parameters, buffers and constants of ``Repro`` (``ATTRS``), installed by dotted name."""
    gen = torch.Generator().manual_seed(int(META.get("seed", 1234)) + 1)
    cache = {}
    for spec in ATTRS:
        t = make_tensor(spec, gen, device, cache)
        *path, leaf = spec["name"].split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        if spec.get("attr_kind") == "parameter":
            mod.register_parameter(leaf, torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad))
        else:
            mod.register_buffer(leaf, t.detach())


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


def compile_repro(mod, args, compiler=None):
    """Compile ``Repro`` the way the original graph was compiled; returns ``f(list_of_args)``."""
    gm = torch.fx.symbolic_trace(mod)
    fn = (compiler or resolve_compiler(META.get("compiler", "eager")))(gm, _clone(args))
    if getattr(fn, "_boxed_call", False):
        return lambda a: fn(list(a))
    return lambda a: fn(*a)


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for k in sorted(x, key=str) for y in _flat(x[k])]
    return [x]


def run_fwd_maybe_bwd(fn, args, params=()):
    """Outputs, then the gradients of float leaves (inputs requiring grad, parameters) when any output needs one."""
    args = _clone(args)
    outs = [o for o in _flat(fn(args)) if isinstance(o, torch.Tensor)]
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
    """determ's fp64 criterion (see ``determ_backend.compare.fp64_close``); None when ``e`` is not compared."""
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


def check_accuracy(mod, fn, args, tol, strict):
    """``None`` when compiled agrees with eager (fp64 reference), else a message naming the first bad output."""
    params = list(mod.parameters())
    eager = run_fwd_maybe_bwd(lambda a: mod(*a), args, params)
    comp = run_fwd_maybe_bwd(fn, args, params)
    try:
        m64 = copy.deepcopy(mod).double()
        a64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in _clone(args)]
        ref = run_fwd_maybe_bwd(lambda a: m64(*a), a64, list(m64.parameters()))
    except Exception as err:  # an op without fp64 support: judged without a reference, and said so
        print(f"warning: no fp64 reference ({type(err).__name__}: {err}); comparing with tolerance only", file=sys.stderr)
        ref = [None] * len(eager)
    if len(eager) != len(comp):
        return f"compiled returned {len(comp)} tensors, eager {len(eager)}"
    mult = float(META.get("multiplier", 2.0))
    for i, (e, c, r) in enumerate(zip(eager, comp, ref)):
        if same_leaf(e, c, r, tol, mult, strict) is False:
            err = (e.double() - c.double()).abs().max().item() if e.shape == c.shape else float("nan")
            extra = f", rmse vs fp64: compiled {_rmse(r, c):.3g} eager {_rmse(r, e):.3g}" if r is not None else ""
            return f"output {i} {tuple(e.shape)} {e.dtype}: max abs error {err:.3g}{extra}"
    return None


def _bits(x):
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
                                    for x, y in zip(a, b))


def _report(stage, err):
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    kind = META.get("kind", "any")
    note = "" if kind in ("any", "crash", stage) else f"  (recorded failure: {kind})"
    print(f"reproduced {stage}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}{note}")
    return 1


def _run_checks(args_ns):
    kind = args_ns.kind or META.get("kind", "any")
    try:
        mod = Repro()
        args = load_args(args_ns.device)
        if args_ns.device:
            mod.to(args_ns.device)
        compiler = resolve_compiler(META.get("compiler", "eager"))
    except ReproInputError:
        raise
    except Exception as err:
        raise ReproInputError(f"{__file__}: cannot set up the repro ({type(err).__name__}: {err})") from err
    try:
        fn = compile_repro(mod, args, compiler)
    except Exception as err:
        return _report("compile_error", err)
    try:
        if kind == "accuracy":
            msg = check_accuracy(mod, fn, args, args_ns.tol, args_ns.strict)
            if msg:
                print(f"reproduced accuracy: AccuracyError: {msg}")
                return 1
        elif kind == "nondeterminism":
            outs = []
            for _ in range(2):
                torch.manual_seed(int(META.get("seed", 1234)))
                outs.append(run_fwd_maybe_bwd(fn, args))
            if not _bitwise_equal(*outs):
                print("reproduced nondeterminism: two runs of the compiled graph on identical inputs differ bitwise")
                return 1
        else:
            fn(_clone(args))
    except Exception as err:
        return _report("runtime_error", err)
    print(f"not reproduced: the compiled graph ran and passed the {kind} check")
    return 0


def _run(args_ns):
    kind = args_ns.kind or META.get("kind", "any")
    if kind in ("crash", "any") and not args_ns.in_process:
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--in-process"] + _forward_flags(args_ns)
        proc = subprocess.run(cmd)
        if proc.returncode < 0:
            import signal
            name = signal.Signals(-proc.returncode).name
            print(f"reproduced crash: the compiled graph killed the process with {name}")
            return 1
        return proc.returncode
    with config_applied():
        return _run_checks(args_ns)


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
    args = load_args(ns.device)
    for i, (spec, a) in enumerate(zip(INPUTS, args)):
        if isinstance(a, torch.Tensor):
            src = "stored" if spec.get("storage") else "regenerated"
            print(f"{i}\t{spec.get('name', '')}\t{a.dtype}\t{tuple(a.shape)}\tstride={tuple(a.stride())}\t{a.device}\t{src}")
        else:
            print(f"{i}\t{spec.get('name', '')}\t{type(a).__name__}\t{a!r}")
    if ns.out:
        torch.save([a.detach() if isinstance(a, torch.Tensor) else a for a in args], ns.out)
        print(f"saved to {ns.out} (load with torch.load(path, weights_only=True))", file=sys.stderr)
    return 0


def _determ(command, rest):
    try:
        from repro_tools.cli import main as determ_main
    except ImportError:
        print(f"{os.path.basename(__file__)} {command}: needs determ (pip install determ); "
              "'run' and 'get-args' work with torch alone", file=sys.stderr)
        return 2
    return determ_main([command, os.path.abspath(__file__)] + rest)


def _version_warning():
    have, want = torch.__version__, META.get("torch_version")
    if want and want != have:
        print(f"warning: {os.path.basename(__file__)} was written with torch {want}, running torch {have}; "
              "the failure may not reproduce, or differently", file=sys.stderr)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "minify", "analyze", "get-args")
    default = "minify" if META.get("launcher") else "run"
    command = argv.pop(0) if argv and argv[0] in commands else default
    _version_warning()
    if command in ("minify", "analyze"):
        return _determ(command, argv)
    p = argparse.ArgumentParser(prog=f"{os.path.basename(__file__)} {command}")
    p.add_argument("--device", help="run on this device instead of the recorded one (e.g. cpu)")
    if command == "get-args":
        p.add_argument("--out", help="also save the inputs to this file (torch.save)")
    else:
        p.add_argument("--kind", choices=("compile_error", "runtime_error", "accuracy", "nondeterminism", "crash", "any"),
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
