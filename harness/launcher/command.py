"""Command cases: a manifest entry's ``command`` as one pytest item (``CommandItem``),
collected from the ``--harness-commands`` file ``harness run`` writes (``{"format":
"harness-commands/1", "root": DIR, "cases": [{"id", "argv", "expect_output", "timeout_s",
"device", "cards", "env", "source"}, ...]}``). Its cards leased, its argv run (no shell,
from the root) under a supervisor that stops whatever it leaves; past its deadline, the
stacks of what still runs; its output kept bounded."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import processes
from harness.devices import visible
from harness.launcher import containment
from harness.launcher.outcome import describe_exit, read_bounded
from harness.launcher.plugin import TIMEOUT_KEY, lease_cards, need_cards
from harness.names import COMMANDS_FORMAT as FORMAT
from harness.names import DEFAULT_CASE_TIMEOUT_S

#: Between SIGTERM and SIGKILL for a command's tree.
KILL_AFTER_S = 5.0
#: How long one ``py-spy dump`` may take, and how many processes are dumped.
PY_SPY_TIMEOUT_S = 10.0
PY_SPY_MAX_PROCS = 16


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    option = parent.config.getoption("harness_commands", None)
    if option and os.path.abspath(file_path) == os.path.abspath(option):
        return CommandFile.from_parent(parent, path=file_path)
    return None


class CommandFile(pytest.File):
    """The run's command cases file: one :class:`CommandItem` per case, in order."""

    def collect(self) -> Iterator[CommandItem]:
        doc = json.loads(self.path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:  # another harness's run wrote it
            raise ValueError(f"{self.path}: not a {FORMAT} file (format {doc.get('format')!r})")
        root = doc["root"]
        for case in doc["cases"]:
            where = Path(root, case["source"]) if case.get("source") else self.path
            yield CommandItem.from_parent(
                self, name=case["id"], nodeid=case["id"], path=where, case=case, root=root
            )


class CommandItem(pytest.Item):
    """One command case (``harness_case_id``: ``<suite>::<entry>``): passes when its argv
    exits 0 within its deadline (pytest-timeout's, ``times_itself``) and its output matches
    its ``expect_output``."""

    times_itself = True

    def __init__(self, *, case: dict[str, Any], root: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case
        self.root = root
        self.harness_case_id: str = case["id"]
        self.argv: list[str] = list(case["argv"])
        self.device: str = case.get("device") or "cpu"
        self.cards: int = int(case.get("cards") or 0)
        suite, _, entry = self.harness_case_id.partition("::")
        self.keywords.update({suite: True, entry: True})

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.harness_case_id}: {shlex.join(self.argv)}"

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, CommandFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def runtest(self) -> None:
        need_cards(self, self.device, self.cards)
        env = {**os.environ, **self.case.get("env", {})}
        if _which(self.argv[0], env, self.root) is None:
            where = "from the repository root" if os.sep in self.argv[0] else "on PATH"
            raise CommandFailed(
                f"harness: {self.harness_case_id}: {shlex.join(self.argv)}\n"
                f"PATH={env.get('PATH', '')}\nroot: {self.root}\n"
                f"E   program {self.argv[0]!r} not found {where}"
            )
        with contextlib.ExitStack() as held:
            keep: list[int] = []
            if self.cards:
                lease = held.enter_context(lease_cards(self, self.device, self.cards))
                keep = lease.fds()
                env.update(visible(lease.cards()))
                self.user_properties.append(("harness.cards", ",".join(map(str, lease.cards()))))
            self.user_properties.append(("harness.device", self.device))
            folder = Path(
                held.enter_context(tempfile.TemporaryDirectory(prefix="harness-command-"))
            )
            self._run(env, folder, keep)

    def _run(self, env: dict[str, str], folder: Path, keep: list[int]) -> None:
        """Run and judge the command; its supervisor holds the lease descriptors ``keep``, so
        the cards stay leased until nothing of it runs, even past this process."""
        output, leftovers = folder / "output", folder / "leftovers"
        # pytest-timeout's (the case's marker), else its own timeout_s, else the default.
        given = self.stash.get(TIMEOUT_KEY, None) or self.case.get("timeout_s")
        deadline = float(given or DEFAULT_CASE_TIMEOUT_S)
        wrapper = [sys.executable, "-m", "harness.launcher.supervisor", str(os.getpid())]
        started = time.monotonic()
        with open(output, "wb") as out:
            proc = subprocess.Popen(
                [*wrapper, str(leftovers), ",".join(map(str, keep)), "--", *self.argv],
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=keep,
            )
        stacks = ""
        try:
            code = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            stacks = _stacks(proc.pid)
            processes.kill_trees([proc.pid], grace=KILL_AFTER_S, kill_wait=KILL_AFTER_S)
            code = None
        finally:  # an interrupt included
            processes.kill_trees([proc.pid], grace=0, kill_wait=KILL_AFTER_S)
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: bounded
                proc.wait(timeout=KILL_AFTER_S)
        seconds = time.monotonic() - started
        text = read_bounded(str(output), "the command's output")
        size = output.stat().st_size
        left = leftovers.read_text(encoding="utf-8", errors="replace") if leftovers.exists() else ""
        self.stash.setdefault(containment.RANK_LEAKS, []).extend(
            f"pid {pid}: {cmd}"
            for pid, _, cmd in (ln.partition("\t") for ln in left.splitlines() if ln)
        )
        verdict = None
        if code is None:
            verdict = f"stopped at its deadline of {deadline:g} s (ran {seconds:.1f} s)"
        elif code != 0:
            verdict = describe_exit(code)
            if code == 127:
                verdict += " (the program could not be run: see its output)"
        elif (pattern := self.case.get("expect_output")) and not re.search(
            pattern, output.read_text(encoding="utf-8", errors="replace"), re.MULTILINE
        ):
            verdict = f"exited 0, but its output does not match expect_output {pattern!r}"
        if verdict is None:
            self.add_report_section("call", "output", text)  # shown by -rP
            return
        # The verdict first (pytest's short summary) and last, as an ``E`` line (the run's).
        body = (
            f"harness: {self.harness_case_id}: {verdict}\n"
            f"command: {shlex.join(self.argv)} (from {self.root})\n"
            f"----- output ({size} bytes) -----\n{text}"
        )
        if not text.endswith("\n"):
            body += "\n"
        body += "----- end of output -----\n"
        if stacks:
            body += f"----- still running at the deadline -----\n{stacks}"
        raise CommandFailed(f"{body}E   {verdict}")


class CommandFailed(Exception):
    """A command case failed; the message is its whole report (output, stacks, verdict last)."""


def _which(program: str, env: dict[str, str], root: str) -> str | None:
    """Where ``execvp`` would find ``program`` (a path with a slash: from ``root``)."""
    program = os.path.join(root, program) if os.sep in program else program
    return shutil.which(program, path=env.get("PATH", os.defpath))


def _stacks(supervisor: int) -> str:
    """What still runs below a command's ``supervisor`` (pid, parent, state, command line),
    and ``py-spy dump`` of each where py-spy is installed (else the first line of its error)."""
    import psutil

    tree = [p for p in processes.process_tree(supervisor, own_session=True) if p.pid != supervisor]
    lines = []
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.cmdline()) or proc.name()
            lines.append(f"pid {proc.pid} (parent {proc.ppid()}, {proc.status()}): {cmd}\n")
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        lines.append("(py-spy is not installed: no Python stacks of these processes)\n")
        return "".join(lines)
    for proc in tree[:PY_SPY_MAX_PROCS]:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--pid", str(proc.pid)],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
                check=False,
            )
            said = done.stdout if done.returncode == 0 else done.stderr.strip().split("\n")[0]
        except (OSError, subprocess.TimeoutExpired) as exc:
            said = str(exc)
        lines.append(f"--- py-spy dump --pid {proc.pid} ---\n{said.rstrip()}\n")
    return "".join(lines)
