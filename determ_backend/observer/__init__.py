"""The Observer: named observations and op traces of a run, checked against a reference run.

:mod:`.core` is the observer and its API; :mod:`._files` its run files.  Op facts
come from :mod:`determ_backend.modes.ops`, the verdict from :mod:`determ_backend.compare`.
"""

from determ_backend.observer.core import (Observer, ObserverContext, current_observer, disable_mode, enable_mode,
                                          marking_non_deterministic, observe, observe_grad,
                                          observe_non_deterministic)

__all__ = ["Observer", "ObserverContext", "observe", "observe_grad", "observe_non_deterministic",
           "marking_non_deterministic", "enable_mode", "disable_mode", "current_observer"]
