"""The suite side: manifests, inventory, planning and running whole suites.

Reads ``suites/*.json`` (``manifest``, validated against the schema shipped
here), proves every test is owned and runnable (``inventory``), picks what a
change affects (``changes``), partitions suites onto CI runners (``plan``),
runs a suite through pytest (``run``, ``selection``) and summarises it
(``report``); ``init`` scaffolds a repository's suites from its pytest
configuration; ``cli`` is the ``harness`` command. It shares only the spec
(``harness.spec``) and the device table (``harness.devices``) with the launch
side.
"""
