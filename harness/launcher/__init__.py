"""The launch side: leasing cards and process slots, starting and supervising rank processes.

Given a :class:`harness.LaunchSpec`, this room leases what the case needs
(``lease``), starts its ranks fresh or hands the case to kept ranks
(``launch``, ``pool``, ``rank``, ``reset``), enforces the deadline, reaps every
process (``procs``) and turns what the ranks reported into one outcome
(``outcome``). ``plugin`` is the pytest face of all that. It shares only the
spec (``harness.spec``) and the device table (``harness.devices``) with the
suite side.
"""
