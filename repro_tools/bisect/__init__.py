"""``repro-tools bisect -- CMD``: which stage of the compiler stack, and which knob in it, is guilty.

:mod:`.core` (the search and the command), :mod:`.runs` (one run of the user's command per question).
"""

from repro_tools.bisect.core import Verdict, bisect_command, config_knobs, register, run

__all__ = ["register", "run", "bisect_command", "Verdict", "config_knobs"]
