"""The launch side: leasing cards and process slots, starting and supervising rank processes.

A launched case, from its ``@pytest.mark.launch`` marker to its ranks: ``plugin`` (the
marker, its spec and deadline, derived once) -> ``case`` (the lifecycle: prepare ->
lease -> run -> conclude, also behind ``harness.launch``) -> ``ranks`` (start, supervise,
wind down; ``pool`` keeps them across cases when reuse is opted in) -> ``rank`` (the
code inside a rank process). A multi-node case goes from ``case`` to ``nodes`` instead
(one process tree per emulated node, whose ranks run the same ``rank`` code); on real
nodes torchrun started, ``plugin`` runs it in its own process (``run_here``).

Around that path: ``lease``, ``supervisor``, ``reset``, ``groups``, ``outcome``,
``containment``, ``explain``, ``given``, ``values``, ``target`` and ``command``. It
shares only ``harness/*.py`` with the suite side.
"""
