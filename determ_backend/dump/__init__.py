"""API dump and compare with the ptdbg_ascend interface: ``from determ_backend.dump import *``.

Dump every torch API call (forward and backward, inputs and outputs) of a model
on two devices or dtypes, then compare the dumps and get the root cause: the
first API whose inputs match while its output does not.

Two halves: :mod:`.capture` writes a dump (hooks, switches, regions, gradients,
the index writer) inside the user's program; :mod:`.comparison` reads dumps back
and compares them (ptdbg's CSV, the root cause, replica agreement).
"""
from determ_backend.dump.comparison.dumps import (DumpComparison, auto_analyze, compare, compare_distributed, compare_dumps)
from determ_backend.dump.capture.debugger import PrecisionDebugger
from determ_backend.dump.capture.control import (acc_cmp_dump, dump_parameters, get_dump_dir, module_dump, module_dump_end, overflow_check, register_hook, remove_hooks, seed_all, set_dump_path, set_dump_switch, set_overflow_check_switch)
from determ_backend.dump.capture.overflow import DumpOverflowError
from determ_backend.dump.comparison.export import export_npy
from determ_backend.dump.comparison.parse import Dump, parse, read_dump
from determ_backend.dump.comparison.replicas import ReplicaReport, check_replicas
from determ_backend.dump.capture.writer import DumpWriteError

__all__ = [
    "seed_all", "set_dump_path", "register_hook", "set_dump_switch", "set_overflow_check_switch", "acc_cmp_dump",
    "overflow_check", "compare", "compare_distributed", "parse", "module_dump", "module_dump_end",
    "remove_hooks", "dump_parameters", "get_dump_dir", "compare_dumps", "auto_analyze", "DumpComparison",
    "read_dump", "Dump", "check_replicas", "ReplicaReport", "DumpOverflowError", "DumpWriteError",
    "PrecisionDebugger", "export_npy",
]
