"""Old import path of :func:`repro_tools.minify.minify` (kept so existing scripts run)."""

from repro_tools.minify.minifier import MinifyResult, minify

__all__ = ["minify", "MinifyResult"]
