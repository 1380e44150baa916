"""Old import path of :mod:`repro_tools.flows.after_aot`'s backends (kept so existing scripts run)."""

from repro_tools.flows.after_aot import aot_backend, inductor_backend

__all__ = ["inductor_backend", "aot_backend"]
