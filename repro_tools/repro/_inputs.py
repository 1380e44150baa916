"""Runtime of a generated ``repro.py``, part 1: its inputs, parameters and constants, and the tracer that
turns ``Repro`` back into a graph.

:mod:`repro_tools.repro.codegen` copies this file's source (minus the placeholder
block below), then :mod:`repro_tools.repro._harness`'s, into every script it
writes, after the script's data (``META``, ``INPUTS``, ``ATTRS``) and its
``class Repro``.  Only the standard library and torch may be imported here: a
repro runs where only torch is installed.  Data comes from the content store
next to the script (see :mod:`repro_tools.repro.store`; the files are loose files
of :mod:`determ_backend.trace.store`, read here by a reader of their own, since
determ need not be installed), or is regenerated with a fixed seed.
"""

import hashlib
import json
import operator
import os
import struct

import torch

# --- placeholders: replaced by the generated script's own definitions (not copied) ---
META = {}
INPUTS = []
ATTRS = []
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


def _check_key(key):
    """A storage key names its file by the checksum of its bytes: hex digits only, so an empty key, an
    absolute path or one that leaves the store is refused by name, before any file is opened."""
    if not isinstance(key, str) or not (8 <= len(key) <= 64) or any(c not in "0123456789abcdef" for c in key):
        raise ReproInputError(f"{__file__}: input storage key {key!r} is not a content checksum "
                              "(expected 8 to 64 lowercase hex digits)")


def read_storage(key):
    """Bytes of one stored storage (a one-tensor safetensors file of determ's tensor store: the tensor is
    named by its key, or ``data`` in stores written before), checksum verified."""
    _check_key(key)
    tried = [os.path.join(d, key + ".safetensors") for d in _store_dirs()]
    path = next((p for p in tried if os.path.isfile(p)), None)
    if path is None:
        raise ReproInputError(f"{tried[0]}: missing input file (content store of {os.path.basename(__file__)}; "
                              "copy the repro_store directory next to the script)")
    try:
        with open(path, "rb") as f:  # the header, then the tensor's bytes straight into the buffer returned
            head = f.read(8)
            if head.startswith(b"version "):  # a Git LFS pointer where the file should be
                raise ReproInputError(f"{path}: corrupt content store file (a Git LFS pointer, not the stored "
                                      "tensor: run git lfs pull, or copy the repro_store directory itself)")
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:  # a length read from other bytes: no allocation of it
                raise ValueError("not a safetensors header")
            header = json.loads(f.read(n))
            start, end = (header.get(key) or header["data"])["data_offsets"]
            if not 0 <= start <= end <= size - 8 - n:
                raise ValueError("data offsets past the end of the file")
            data = bytearray(end - start)
            f.seek(8 + n + start)
            if f.readinto(data) != len(data):
                raise ValueError("truncated")
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
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
        # tensors share memory when they shared it when dumped ("memory"), not because their bytes were equal
        # (older scripts: by file)
        mem = ("memory", spec["memory"]) if "memory" in spec else key
        if cache is None or mem not in cache:
            raw = read_storage(key)
            base = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            base = base.to(dev)
            if cache is not None:
                cache[mem] = base
        else:
            base = cache[mem]
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


def _owner(root, name):
    """``(module, leaf)``: the module of ``root`` that holds dotted ``name`` (plain containers made for the missing
    levels) and the last part of the name."""
    *path, leaf = name.split(".")
    for p in path:
        if not hasattr(root, p):
            root.add_module(p, torch.nn.Module())
        root = getattr(root, p)
    return root, leaf


def install_module(root, name, module):
    """``module`` as ``root``'s submodule at dotted ``name`` (``layers.0``: not an attribute Python can assign)."""
    owner, leaf = _owner(root, name)
    owner.add_module(leaf, module)


def install_attrs(root, device=None):
    """Parameters, buffers and constants of ``Repro`` (``ATTRS``), installed by dotted name."""
    gen = torch.Generator().manual_seed(int(META.get("seed", 1234)) + 1)
    cache = {}
    for spec in ATTRS:
        t = make_tensor(spec, gen, device, cache)
        mod, leaf = _owner(root, spec["name"])
        if spec.get("attr_kind") == "parameter":
            mod.register_parameter(leaf, torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad))
        else:
            mod.register_buffer(leaf, t.detach())


class _InPlaceProxy(torch.fx.Proxy):
    """A traced value whose augmented assignments (``step += 1``) stay in-place calls, as in the graph: plain
    proxies turn them into an out-of-place op and a rebinding, and the tensor is never updated."""


def _in_place(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    return method


for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
              "irshift", "imatmul"):
    setattr(_InPlaceProxy, f"__{_name}__", _in_place(getattr(operator, _name)))


def _set_item(self, key, value):
    """``x[idx] = v`` (a dynamo graph's ``operator.setitem``, as BART's ``shift_tokens_right`` writes): a node."""
    self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


_InPlaceProxy.__setitem__ = _set_item


class ReproTracer(torch.fx.Tracer):
    """Traces ``Repro`` back into a graph (the runtime's ``trace_repro`` and determ's loader): buffers are read as
    the attributes they are, not folded in as constants, and augmented assignments stay in place (a graph may
    update its buffers: an optimizer step's state)."""

    proxy_buffer_attributes = True

    def proxy(self, node):
        return _InPlaceProxy(node, self)
