"""A picture of a report page: headless Chromium's own ``--screenshot``, no driver needed.

:func:`find_chromium` is where every caller (the ``--screenshot`` option of ``repro-tools report``, the
browser tests) looks for the browser.  When Pillow is installed the PNG is reduced to a 256-colour
palette (a page is mostly flat colour: a quarter of the size, no visible change).
"""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Union

from determ_backend.errors import ConfigError, ReproError
from determ_backend.trace.stream import atomic_path

__all__ = ["find_chromium", "screenshot", "BROWSERS"]

log = logging.getLogger(__name__)

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
"""The names a headless-capable Chromium goes by, in the order they are looked for on PATH."""


def find_chromium() -> Optional[str]:
    """The path of the first :data:`BROWSERS` on PATH, or None."""
    return next((p for p in (shutil.which(n) for n in BROWSERS) if p), None)


def _palette(png: bytes) -> bytes:
    try:
        from PIL import Image
    except ImportError:
        return png
    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def screenshot(page: Union[str, Path], png: Union[str, Path], width: int = 1100, height: int = 1180,
               timeout: float = 60.0) -> Path:
    """Render ``page`` in headless Chromium at ``width`` x ``height`` and write the PNG to ``png``."""
    if width <= 0 or height <= 0:
        raise ConfigError(f"--size {width}x{height}: expected two positive integers, e.g. 1100x1180")
    browser = find_chromium()
    if browser is None:
        raise ConfigError(f"--screenshot needs a headless Chromium on PATH ({', '.join(BROWSERS)}); "
                          "install it (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        shot = Path(tmp) / "shot.png"
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}", f"--screenshot={shot}",
               Path(page).resolve().as_uri()]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ReproError(f"{browser} took over {timeout:g} s to render {page}") from None
        if proc.returncode != 0 or not shot.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ReproError(f"{browser} could not render {page} (exit {proc.returncode}: {tail})")
        data = _palette(shot.read_bytes())
    out = Path(png)
    with atomic_path(out) as tmp_out:
        Path(tmp_out).write_bytes(data)
    return out
