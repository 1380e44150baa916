"""API dump and compare with the ptdbg_ascend interface: ``from determ_backend.dump import *``.

Dump every torch API call (forward and backward, inputs and outputs) of a model
on two devices or dtypes, then compare the dumps and get the root cause: the
first API whose inputs match while its output does not.

Modules: :mod:`.control` (the ptdbg functions), :mod:`.switch` (modes and
selection), :mod:`.hooks` and :mod:`.modules` (recording), :mod:`.regions`
(compiled modules and functions, ``module_dump``), :mod:`.compiled` (the FX
nodes of compiled graphs, from the determ backends' traces), :mod:`.backward`
(gradients), :mod:`.entries` (fingerprints and statistics), :mod:`.writer`
(files), :mod:`.parse` (reading), :mod:`.compare` and :mod:`.compiled_compare`
(CSV compare, root cause),
:mod:`.replicas` (data-parallel rank agreement), :mod:`.overflow`, :mod:`.debugger`
(msprobe's ``PrecisionDebugger``).
"""

from .compare import DumpComparison, auto_analyze, compare, compare_distributed, compare_dumps
from .debugger import PrecisionDebugger
from .control import (acc_cmp_dump, dump_parameters, get_dump_dir, module_dump, module_dump_end, overflow_check,
                      register_hook, remove_hooks, seed_all, set_dump_path, set_dump_switch, set_overflow_check_switch)
from .overflow import DumpOverflowError
from .parse import Dump, parse, read_dump
from .replicas import ReplicaReport, check_replicas
from .writer import DumpWriteError

__all__ = [
    "seed_all", "set_dump_path", "register_hook", "set_dump_switch", "set_overflow_check_switch", "acc_cmp_dump",
    "overflow_check", "compare", "compare_distributed", "parse", "module_dump", "module_dump_end",
    "remove_hooks", "dump_parameters", "get_dump_dir", "compare_dumps", "auto_analyze", "DumpComparison",
    "read_dump", "Dump", "check_replicas", "ReplicaReport", "DumpOverflowError", "DumpWriteError",
    "PrecisionDebugger",
]
