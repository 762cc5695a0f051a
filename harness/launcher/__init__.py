"""The launch side: leasing cards and process slots, starting and supervising rank processes.

Given a :class:`harness.LaunchSpec`, this room runs one case lifecycle
(``launch.run_case`` runs a case ``case.prepare_case`` assembled, for the
plugin and for ``harness.launch`` alike) with one of two rank strategies:
fresh ranks per case (``fresh``) or kept ranks (``pool``). A run on ranks goes
through the phases of ``caserun.CaseRun``; ranks are started and stopped by
``spawn`` only. The jobs around a case have a module each: ``deadline``,
``enclosing`` (the case as its ranks see it), ``fds`` (inherited lease
descriptors), ``signals``, ``output`` (bounded rank output) and ``args``
(pickling what ranks receive). ``lease`` holds the host-wide card and
process-slot locks; ``rank`` is the code inside a rank and its typed
messages; ``supervisor`` keeps every process a case starts below the rank's
supervisor, so none escapes; ``reset`` puts kept ranks back between cases;
``groups`` makes the sub-groups a kept rank keeps (``harness.kept_group``)
and counts process groups; ``procs`` finds and kills process trees;
``outcome`` turns what the ranks did into one verdict and report;
``target`` names the function ranks import; ``settings`` holds the
session's settings; ``routing`` sends launched cases to as few xdist
workers as can hold their pools at once; ``plugin`` is the pytest face of
all that. It shares only the spec (``harness.spec``) and the device table
(``harness.devices``) with the suite side.
"""
