"""The launch side: leasing cards and process slots, starting and supervising rank processes.

A launched case, from its ``@pytest.mark.launch`` marker to its ranks:
``plugin`` (the pytest face: the marker, its spec and deadline, derived once)
-> ``case`` (the lifecycle: prepare -> lease -> run -> conclude, also behind
``harness.launch``) -> ``ranks`` (start, supervise, wind down the rank
processes; ``pool`` keeps them across cases when reuse is opted in) ->
``rank`` (the code inside a rank process). A multi-node case
(``LaunchSpec.nnodes > 1``) goes from ``case`` to ``nodes`` instead (one
process tree per emulated node: torch's elastic agent, ``node``, whose ranks
run the same ``rank`` code); in a pytest process torchrun started on a real
node, ``plugin`` runs it through ``torchrun``.

Around that path: ``lease`` (host-wide card and process-slot locks),
``supervisor`` (nothing a case starts outlives it), ``reset`` (what a kept rank
restores between cases), ``groups`` (``harness.kept_group``), ``outcome``
(what the ranks did, their bounded output, one verdict and report),
``coverage`` (coverage in ranks), ``explain`` (pytest's assertion explanations
in ranks), ``target`` (naming the function ranks import) and ``command`` (a manifest
entry's ``command`` run as one case, under a supervisor). It shares only the spec (``harness.spec``) and the device table
(``harness.devices``) with the suite side.
"""
