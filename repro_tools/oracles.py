"""Old import path of :class:`repro_tools.minify.OracleSpec` (kept so existing scripts run)."""

from repro_tools.minify.oracles import OracleSpec

__all__ = ["OracleSpec"]
