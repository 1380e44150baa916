"""Writing an API dump: hooks, switches, regions, gradients and the index writer.

:mod:`.control` (the ptdbg functions), :mod:`.debugger` (msprobe's
``PrecisionDebugger``), :mod:`.switch` (modes and selection), :mod:`.apis`,
:mod:`.hooks` and :mod:`.modules` (recording), :mod:`.regions` (compiled modules and
``module_dump``), :mod:`.compiled` (FX nodes of compiled graphs), :mod:`.backward`
(gradients), :mod:`.entries` (index entries), :mod:`.pipeline` (background
fingerprinting), :mod:`.session` and :mod:`.writer` (files), :mod:`.overflow`.
Reading and comparing dumps is :mod:`determ_backend.dump.comparison`.
"""
