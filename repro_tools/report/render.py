"""A :class:`~.model.Report` as one self-contained HTML page (jinja2, autoescaped; no network, no CDN).

The page's styles and script are the package files ``templates/report.css`` and ``templates/report.js``,
inlined; the node rows travel as JSON in a ``<script type="application/json">`` element (``<``, ``>``
and ``&`` escaped, so no value can close it) and the script draws the plot, the neighbourhood and the
table from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import jinja2
from markupsafe import Markup

from determ_backend.trace.stream import atomic_write_text

from repro_tools.report.model import Report

__all__ = ["render", "write_html"]

_TEMPLATES = Path(__file__).parent / "templates"


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
                              autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True),
                              trim_blocks=True, lstrip_blocks=True)


def _script_json(data) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render(rep: Report) -> str:
    """The page's HTML text."""
    env = _env()
    env.filters["fmt"] = _fmt
    tpl = env.get_template("report.html.j2")
    return tpl.render(rep=rep, data=Markup(_script_json(rep.data())),
                      css=Markup((_TEMPLATES / "report.css").read_text(encoding="utf-8")),
                      js=Markup((_TEMPLATES / "report.js").read_text(encoding="utf-8")))


def write_html(rep: Report, out: Union[str, Path]) -> Path:
    """Render ``rep`` into ``out`` atomically; returns the path."""
    out = Path(out)
    atomic_write_text(out, render(rep))
    return out
