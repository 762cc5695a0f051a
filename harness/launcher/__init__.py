"""The launch side: leasing cards and process slots, starting and supervising rank
processes. A launched case goes ``plugin`` -> ``case`` -> ``ranks`` [-> ``pool``] ->
``rank`` (``nodes`` for emulated nodes); docs/architecture.md maps the rest. It shares
only ``harness/*.py`` with the suite side."""
