"""Reading and comparing API dumps: ptdbg's ``compare`` / ``compare_distributed`` and the root cause.

:mod:`.parse` (reading a dump back), :mod:`.dumps` (the CSV compare and root cause),
:mod:`.compiled` (pairing compiled graphs' FX-node entries), :mod:`.metrics`
(ptdbg's per-tensor metrics), :mod:`.replicas` (data-parallel rank agreement),
:mod:`.export` (stored tensors as ptdbg-named ``.npy`` files).  The
verdict and root-cause rule are :mod:`determ_backend.compare`'s.
"""
