"""repro_tools: work after the fact on graphs, repro scripts and traces, and the ``repro-tools`` command line.

Subpackages, one per family: :mod:`.repro` (repro.py scripts: codegen, content store, the standalone
runtime), :mod:`.flows` (``REPRO_AFTER`` flows, plugged into the backends through entry points),
:mod:`.minify` (minifier, oracles, passes, analyze), :mod:`.xdevice`, :mod:`.bisect`, and :mod:`.cli`
(one module per subcommand).  Everything that runs inside the user's process lives in
:mod:`determ_backend`, which never imports this package.

Compatibility aliases (old import paths that scripts written for earlier versions use):
``repro_tools.minifier``, ``repro_tools.oracles``, ``repro_tools.after_aot`` and ``repro_tools.repro_flows``.
"""
