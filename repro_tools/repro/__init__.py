"""Repro scripts: a GraphModule and its inputs as a standalone ``repro.py``, and back.

:mod:`.script` (write and load a script), :mod:`.codegen` (its source text),
:mod:`.store` (the content store of its tensors), :mod:`.graph_code` (a graph as
importable source for worker processes), and the runtime copied into every script, which needs torch
alone: :mod:`._inputs` and :mod:`._harness`.
"""
