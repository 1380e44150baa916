"""``repro-tools xdevice``: on which device does a graph go wrong, and where?

:mod:`.core` (the command and its verdicts), :mod:`.trace` (one graph, two devices:
per-node values paired and judged).
"""

from repro_tools.xdevice.core import compare_repro, compare_script, compare_trace_pair, register, run

__all__ = ["register", "run", "compare_repro", "compare_trace_pair", "compare_script"]
