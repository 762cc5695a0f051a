"""The suite side: manifests, inventory, planning, change selection, whole runs and their
reports, ``harness init`` and the ``harness`` command (docs/architecture.md has the module
table). It shares only the shared ground (``harness/*.py``) with the launch side, never a
``harness.launcher`` module.
"""
