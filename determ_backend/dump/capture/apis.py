"""Which torch callables the API dump records, and their ptdbg names.

The table maps a callable (``torch.conv2d``, ``torch.Tensor.add``,
``torch.nn.functional.linear``...) to an :class:`ApiInfo` holding its ptdbg
prefix (``Torch``, ``Tensor``, ``Functional``, ``Distributed``) and short name;
a call is then named ``{prefix}_{name}_{count}_{forward|backward}``.  The
callables come from :func:`torch.overrides.get_overridable_functions` (the
public list of everything that goes through ``__torch_function__``), minus
metadata queries and autograd/housekeeping methods that carry no numbers.

Recording lives in :mod:`.hooks`; selection by name in :mod:`.switch`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Tuple

import torch

__all__ = ["ApiInfo", "api_table", "is_inplace", "DISTRIBUTED_APIS"]

# Calls that read metadata, convert to Python, manage autograd or storage: not numerical APIs.
_SKIP_NAMES = frozenset("""
backward register_hook register_post_accumulate_grad_hook retain_grad requires_grad_ detach_ share_memory_
size dim numel stride storage_offset data_ptr element_size is_contiguous is_floating_point is_complex
is_signed is_inference is_shared is_pinned is_set_to is_same_size is_nonzero item tolist numpy storage
untyped_storage get_device nelement ndimension has_names type pin_memory record_stream refine_names rename
rename_ align_to align_as unflatten_names dim_order data __repr__ __format__ __str__ __len__ __iter__
__hash__ __bool__ __int__ __float__ __complex__ __index__ __array__ __array_wrap__ __array_priority__
__reduce_ex__ __deepcopy__ __setstate__ __getstate__ __dir__ __contains__ __reversed__ __new__ __init__
__torch_function__ __torch_dispatch__ __get__ __set__ __delete__ __class__ __dlpack__ __dlpack_device__
is_tensor is_storage is_grad_enabled is_inference_mode_enabled is_autocast_enabled result_type can_cast
promote_types get_default_dtype typename broadcast_shapes is_same_size is_distributed
is_conj is_neg is_meta is_cuda is_quantized is_sparse is_nested is_vulkan is_xla is_mkldnn
module_load new_tensor_with_data _make_subclass
empty empty_like empty_strided new_empty new_empty_strided
""".split())
# uninitialized memory (empty*) is never recorded: its bytes differ run to run and mean nothing

_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "zeros", "ones", "full", "arange", "linspace",
              "logspace", "eye", "tensor", "as_tensor")
"""``torch`` factories take no tensor, so torch does not list them as overridable; they still reach the
mode, and random ones are a classic source of run-to-run differences."""

DISTRIBUTED_APIS: Tuple[str, ...] = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
    "all_to_all_single", "barrier",
)
"""``torch.distributed`` collectives wrapped while a dump is on (they bypass ``__torch_function__``)."""

_PREFIX_BY_NAMESPACE = (
    (torch, "Torch", ""),
    (torch.functional, "Torch", ""),
    (torch.linalg, "Torch", "linalg_"),
    (torch.fft, "Torch", "fft_"),
    (torch.special, "Torch", "special_"),
    (torch.nn.functional, "Functional", ""),  # after torch: F.conv2d is torch.conv2d and ptdbg calls it Functional
    (torch.Tensor, "Tensor", ""),
)


@dataclass(frozen=True)
class ApiInfo:
    prefix: str
    name: str

    @property
    def key(self) -> str:
        """``Functional_conv2d``: the counter key; the call name is ``{key}_{count}``."""
        return f"{self.prefix}_{self.name}" if self.prefix else self.name

    @property
    def op(self) -> str:
        """``Functional.conv2d``: dotted form used as the alignment signature."""
        return f"{self.prefix}.{self.name}" if self.prefix else self.name


_PRIVATE_APIS: Mapping[str, ApiInfo] = {"_grouped_mm": ApiInfo("Functional", "grouped_mm"),  # as the user calls it
                                        "_scaled_mm": ApiInfo("Torch", "_scaled_mm"),
                                        "_scaled_grouped_mm": ApiInfo("Torch", "_scaled_grouped_mm")}
"""``torch`` callables with a private name that carry a model's numbers, reached through a public API that
``__torch_function__`` does not see: ``F.grouped_mm`` (every expert matmul of transformers' mixture-of-experts
layers) calls ``torch._grouped_mm``; fp8 linears call ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``.  So do
the ``torch._foreach_*`` calls (:func:`api_table` adds every one): the multi-tensor optimizer updates, the
optimizers' default on CUDA, named ``Torch__foreach_add__N``; and the fused optimizer updates
(``torch._fused_adamw_``...)."""


def _short_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name


@functools.lru_cache(maxsize=1)
def api_table() -> Mapping[Callable, ApiInfo]:
    """Callable -> :class:`ApiInfo` for every recorded torch API (built once, on first dump)."""
    overridable = torch.overrides.get_overridable_functions()
    table: Dict[Callable, ApiInfo] = {}
    for namespace, prefix, extra in _PREFIX_BY_NAMESPACE:
        for func in overridable.get(namespace, ()):
            name = _short_name(func)
            if name in _SKIP_NAMES or (name.startswith("_") and not name.startswith("__")):
                continue
            try:  # torch.special.erf's own name is already special_erf
                table[func] = ApiInfo(prefix, name if name.startswith(extra) else extra + name)
            except TypeError:  # an unhashable descriptor: not a callable API
                continue
    foreach = {n: ApiInfo("Torch", n) for n in dir(torch) if n.startswith(("_foreach_", "_fused_adam", "_fused_sgd"))}
    for name, info in {**_PRIVATE_APIS, **foreach, **{n: ApiInfo("Torch", n) for n in _FACTORIES}}.items():
        func = getattr(torch, name, None)
        if func is not None and func not in table:
            table[func] = info
    return table


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})


def is_inplace(info: ApiInfo, kwargs: Mapping[str, Any]) -> bool:
    """True when the call may overwrite one of its inputs (``add_``, ``__setitem__``, ``inplace=True``, ``out=``)."""
    n = info.name
    if info.prefix == "Distributed":
        return True
    if n in _INPLACE_DUNDERS or (n.endswith("_") and not n.endswith("__")):
        return True
    return bool(kwargs.get("inplace")) or kwargs.get("out") is not None
