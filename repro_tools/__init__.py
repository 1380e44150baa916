"""repro_tools: work after the fact on graphs, repro scripts and traces (minifier,
accuracy checks, analyze, bisect, reports) and the ``repro-tools`` command line."""
