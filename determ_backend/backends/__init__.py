"""The compile backends ``determ_eager``, ``determ_aot_eager`` and ``determ_inductor``.

Owns what runs when a compiled graph is called under determ: the backends
(:mod:`.core`), FX and inductor instrumentation (:mod:`.instrument`,
:mod:`.inductor_instrument`), the per-call recorder (:mod:`.recorder`), the online
checks (:mod:`.checks`) and narrowing inside fused kernels (:mod:`.narrow`), the run
directory (:mod:`.run`) and retargeting (:mod:`.retarget`).  The repro flows
(``REPRO_AFTER``) are plug-ins found through the ``determ_flows`` entry points
(:mod:`.flows`); this package never imports :mod:`repro_tools`.
"""

from determ_backend.backends.core import determ_aot_eager, determ_eager, determ_inductor, make_backend

__all__ = ["determ_eager", "determ_aot_eager", "determ_inductor", "make_backend"]
