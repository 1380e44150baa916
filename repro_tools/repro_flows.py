"""Old import path of :func:`repro_tools.flows.failure.minify_script`: ``repro.py minify`` in
scripts written by earlier determ versions imports it from here."""

from repro_tools.flows.failure import minify_script

__all__ = ["minify_script"]
