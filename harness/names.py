"""Names the harness's modules share: inventory rule names, pytest option names, exit codes.
A leaf module: it imports nothing from the harness."""

from __future__ import annotations

#: Every case passed or skipped (or there was nothing to do).
EXIT_OK = 0
#: A case failed or went missing, nothing passed, the inventory found problems, or pytest failed.
EXIT_FAILED = 1
#: Bad arguments, or a suite that cannot be planned (argparse's convention for usage errors).
EXIT_USAGE = 2

#: The deadline (seconds) of a case that names none: the plugin's ``--harness-timeout``
#: default, and ``harness run``'s for a case whose entry sets no ``timeout_s`` (and that
#: neither the case nor the project bounds through pytest-timeout).
DEFAULT_CASE_TIMEOUT_S = 300.0

#: The launch plugin's process-slot count (default: the CPUs this process may use).
OPT_MAX_PROCS = "--harness-max-procs"
#: The launch plugin's "fail, don't skip, where these accelerators are absent".
OPT_REQUIRE = "--harness-require"
#: The selection plugin's file of planned cases (``harness.suites.selection``).
OPT_SELECT = "--harness-select"
#: The selection plugin's xdist worker count, used unless pytest's own ``-n`` is given.
OPT_WORKERS = "--harness-workers"
#: The selection plugin's JUnit path for the run (a caller's ``--junitxml`` is recorded instead).
OPT_JUNIT = "--harness-junit"
#: The JUnit property (a case's ``user_properties``) naming the processes the case left
#: running after its teardown, which the launch plugin stopped; ``harness run`` lists them.
LEAK_PROPERTY = "harness.leaked"

#: The marker ``harness run``'s selection plugin gives a plain case of an accelerator entry,
#: ``harness_device(device="cuda", cards=2)``: the launch plugin runs its body in a process of
#: its own with exactly those leased cards visible (docs/harness.md).
DEVICE_MARKER = "harness_device"
#: The launch plugin's file of command cases (``harness.launcher.command``), which ``harness
#: run`` writes and also gives pytest to collect.
OPT_COMMANDS = "--harness-commands"
#: The version of that file's format (``harness.launcher.command`` reads it).
COMMANDS_FORMAT = "harness-commands/1"

SCHEMA = "schema"
JSON = "json"
PATH = "path"
INCLUDE = "include"
UNKNOWN_SUITE = "unknown-suite"
NO_SUITES = "no-suites"
DUPLICATE_ENTRY_ID = "duplicate-entry-id"
CPU_CASE_NEEDS_CARDS = "cpu-case-needs-cards"
ACCELERATOR_CASE_WITHOUT_CARDS = "accelerator-case-without-cards"
WRONG_DEVICE = "wrong-device"
CASE_EXCEEDS_RUNNER_CARDS = "case-exceeds-runner-cards"
#: A case needs more nodes (``LaunchSpec.nnodes``) than any runner of its suite provides.
CASE_EXCEEDS_RUNNER_NODES = "case-exceeds-runner-nodes"
ENTRY_MATCHES_NOTHING = "entry-matches-nothing"
UNOWNED_FILE = "unowned-file"
UNOWNED_CASE = "unowned-case"
SYMLINK_OUTSIDE_REPOSITORY = "symlink-outside-repository"
COLLECTION_ERROR = "collection-error"
BAD_LAUNCH_SPEC = "bad-launch-spec"
HIDDEN_TESTS = "tests-under-norecursedirs"
MISSING_DEPENDENCY = "missing-dependency"
#: An entry's ``quarantine`` is past its ``until`` date: lift it or extend it, knowingly.
QUARANTINE_EXPIRED = "quarantine-expired"

#: Problems in a manifest itself: while any is found, ownership cannot be judged.
MANIFEST_RULES = frozenset({SCHEMA, JSON, PATH, INCLUDE})
#: Problems of the repository as a whole (which files some suite owns), not of one suite.
OWNERSHIP_RULES = frozenset({UNOWNED_FILE, UNOWNED_CASE})
#: Reported by ``harness inventory`` without failing it.
WARNING_RULES = frozenset({HIDDEN_TESTS, MISSING_DEPENDENCY})
#: The rules that make a suite impossible to plan or run as written: ``harness run`` and
#: ``harness matrix`` refuse a suite with one of these; any other rule (a new one included)
#: is the inventory's business only.
BLOCKING_RULES = MANIFEST_RULES | frozenset(
    {
        UNKNOWN_SUITE,
        NO_SUITES,
        DUPLICATE_ENTRY_ID,
        CPU_CASE_NEEDS_CARDS,
        ACCELERATOR_CASE_WITHOUT_CARDS,
        WRONG_DEVICE,
        CASE_EXCEEDS_RUNNER_CARDS,
        CASE_EXCEEDS_RUNNER_NODES,
        ENTRY_MATCHES_NOTHING,
        SYMLINK_OUTSIDE_REPOSITORY,
        COLLECTION_ERROR,
        BAD_LAUNCH_SPEC,
        QUARANTINE_EXPIRED,
    }
)
