"""The repro flows (``REPRO_AFTER=dynamo|aot``, ``REPRO_LEVEL=1..4``).

:mod:`.after_dynamo` and :mod:`.after_aot` wrap a backend or compiler;
:mod:`.failure` is what they do once a graph fails (dump, minify, copy, summarize).
The backends find these modules through the ``determ_flows`` entry points, so
:mod:`determ_backend` never imports this package.
"""
