"""The suite side: manifests, inventory, planning and running whole suites.

Reads ``suites/*.json`` (``manifest``, validated against the schema shipped
here), proves every test is owned and runnable (``inventory``), picks what a
change affects (``changes``), partitions suites onto CI runners (``plan``),
runs a suite through pytest (``run``, ``selection``) and summarises it
(``report``); ``init`` scaffolds a repository's suites from its pytest
configuration; ``cli`` is the ``harness`` command. It shares only the shared
ground (``harness/*.py``: the spec, the device table, names, validation,
errors, process trees, the atomic writer) with the launch side, never a
``harness.launcher`` module.
"""
