"""``harness init``: scaffold a repository's ``suites/`` (and, with ``--workflows``, its
workflows) from what pytest's own configuration collects (docs/harness.md, "Adopting the
harness in another repository").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.devices import accelerators as device_types
from harness.devices import device_type
from harness.errors import HarnessError
from harness.jsonio import write_text
from harness.names import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from harness.suites.inventory import collect, is_test_module
from harness.suites.manifest import (
    SCHEMA_FILE,
    SUITES_DIR,
    Manifest,
    ManifestError,
    load_suites,
    path_matches,
    read_json,
    rel,
    validate,
)
from harness.suites.workflows import HarnessSourceError, harness_source, init_workflows

SHARED_CASES = "cases/accelerator.json"

CPU_RUNNER = {"name": "linux-cpu", "labels": ["ubuntu-latest"], "cards": 0, "timeout_minutes": 30}
ACCELERATOR_TIMEOUT_MINUTES = 60


class InitError(HarnessError):
    """``harness init`` cannot proceed; ``code`` is the exit status (1, or 2 for usage)."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PytestLayout:
    """What pytest collects in a repository: its configuration file, ``testpaths``, the test
    files (sorted), the most cards an accelerator case needs, collection errors, ``(file,
    device)`` of every case, and the files yielding no case (an import error, a skip)."""

    rootdir: Path
    inifile: Path | None
    testpaths: tuple[str, ...]
    files: tuple[str, ...]
    launched_cards: int = 0
    errors: tuple[str, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()
    unloadable: tuple[str, ...] = ()


def read_pytest_layout(root: Path) -> PytestLayout:
    """Ask pytest (the inventory's collect-only run from ``root``) what it would run; raises
    ``InitError`` when pytest fails, or when its configuration lies in a folder above ``root``
    (suites written here would not be found)."""
    root = root.resolve()
    found = collect(root, None)
    ini = found.inipath
    # pytest falls back to a pyproject.toml without a [tool.pytest...] table: it configures nothing.
    configures = ini is not None and (
        ini.name != "pyproject.toml"
        or re.search(r"^\s*\[\s*tool\s*\.\s*pytest\s*[\].]", ini.read_text(errors="replace"), re.M)
    )
    if configures and ini.parent != root and root.is_relative_to(ini.parent):
        raise InitError(
            f"{root} is inside the project that {ini} configures: run harness init "
            f"in {ini.parent} (or pass --root {ini.parent})",
            EXIT_USAGE,  # where it was run, not what the project holds
        )
    broken = [p for p in found.problems if p.file == "."]
    if broken:
        raise InitError(f"pytest could not collect from {root}: {broken[0].message}")
    return PytestLayout(
        rootdir=root,
        inifile=found.inipath,
        testpaths=tuple(p for p in found.scope if p not in (".", "")),
        files=tuple(sorted({f for f in found.files if not f.startswith(("/", "../"))})),
        launched_cards=max((c.cards for c in found.cases if c.device != "cpu"), default=0),
        errors=tuple(str(p) for p in found.problems),
        cases=tuple(dict.fromkeys((c.file, c.device) for c in found.cases)),
        unloadable=tuple(
            sorted({*found.skipped, *(p.file for p in found.problems if is_test_module(p.file))})
        ),
    )


def owned_paths(layout: PytestLayout) -> list[str]:
    """The paths ``suites/cpu.json`` owns, sorted: the ``testpaths`` holding a collected file,
    else the folders holding the collected files (a top-level file by name); nested ones dropped."""
    files = layout.files
    candidates = [t for t in layout.testpaths if any(path_matches(f, t) for f in files)]
    if not candidates:
        candidates = [f if "/" not in f else f.rsplit("/", 1)[0] for f in files]
    kept: list[str] = []
    for c in sorted(set(candidates), key=lambda p: (p.count("/"), p)):
        if not any(path_matches(c, k) for k in kept):
            kept.append(c)
    return sorted(kept)


def runs_on(layout: PytestLayout, path: str, device: str) -> bool:
    """True when a suite on ``device`` would own something under ``path`` (else the inventory
    says ``entry-matches-nothing``): a case of that device, or on cpu a file yielding no case
    (a file that did not load says nothing of its cases' device)."""
    if any(d == device and path_matches(f, path) for f, d in layout.cases):
        return True
    return device == "cpu" and any(path_matches(f, path) for f in layout.unloadable)


def _entries(paths: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per path, its id the path's words (a second of one id numbered)."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        words = re.sub(r"\.py$", "", p).strip("/").replace("/", "-")
        base = re.sub(r"[^A-Za-z0-9_.-]", "-", words).lstrip("_.-") or "tests"
        seen[base] = seen.get(base, 0) + 1
        out.append({"id": base if seen[base] == 1 else f"{base}-{seen[base]}", "paths": [p]})
    return out


def schema_ref(root: Path, manifest_dir: Path) -> dict[str, str]:
    """``{"$schema": relative path}`` for a manifest in ``manifest_dir`` when the installed
    harness lies inside ``root``; else ``{}`` (it would not resolve on another machine)."""
    schema = Path(__file__).resolve().parent / SCHEMA_FILE
    if not schema.is_relative_to(root.resolve()):
        return {}
    return {"$schema": os.path.relpath(schema, manifest_dir.resolve()).replace(os.sep, "/")}


def _gitignore(root: Path) -> str | None:
    """``.gitignore`` with ``out/`` appended; None when a line already names it."""
    path = root / ".gitignore"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if "out" in (line.strip().strip("/") for line in text.splitlines()):
        return None
    return text + "\n" * (text != "" and not text.endswith("\n")) + "out/\n"


def render(
    root: Path,
    layout: PytestLayout,
    accelerators: Sequence[str],
    workflows: bool,
    notes: list[str] | None = None,
    harness_ref: str | None = None,
    device_paths: Sequence[str] = (),
) -> dict[str, str]:
    """Every file ``harness init`` would write: repository-relative path -> content. Each suite
    gets only entries ``harness inventory`` accepts (:func:`runs_on`), each accelerator suite
    one ``device`` entry per path of ``device_paths`` (with no entry it is not written); a
    suite that loads (for its device), or a case list that validates, is kept. Why goes to
    ``notes``. ``InitError``: pytest found no test file, or the workflows have no harness ref
    to install from (``harness_ref``, else where the installed harness came from)."""
    notes = [] if notes is None else notes
    all_paths = owned_paths(layout)
    paths = [p for p in all_paths if runs_on(layout, p, "cpu")] or all_paths
    if not paths:
        raise InitError(
            f"pytest collects no test file from {root} (see its python_files and testpaths); "
            "add a test (or set testpaths) and run `harness init` again"
        )
    source = rel(layout.inifile, root) if layout.inifile else f"rootdir {rel(layout.rootdir, root)}"
    docs: dict[str, dict[str, Any]] = {
        f"{SUITES_DIR}/cpu.json": {
            "suite": "cpu",
            "description": "Written by `harness init` from pytest's configuration "
            f"({source}): every collected test that runs on CPU.",
            "device": "cpu",
            "runner": dict(CPU_RUNNER),
            "entries": _entries(paths),
        }
    }
    on_disk = {m.suite: m for m in load_suites(root)[0]}  # yours when it loads
    owned = {*accelerators, *(m.device for m in on_disk.values())}
    if unowned := sorted({d for _, d in layout.cases if d not in ("cpu", *owned)}):
        notes.append(
            f"collected cases run on {', '.join(unowned)}, which no suite owns "
            "(`harness inventory` reports them as unowned-case): add "
            f"--accelerators {','.join(unowned)} to write their suites"
        )
    shared = [
        p for p in all_paths if accelerators and all(runs_on(layout, p, d) for d in accelerators)
    ]
    if accelerators:
        # A file that did not load here makes no accelerator entry unless a device path holds it.
        left = [f for f in layout.unloadable if not any(path_matches(f, p) for p in device_paths)]
        if left:
            shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            notes.append(
                f"{len(left)} test file(s) did not load here ({shown}): no accelerator entry is "
                "written for them (the cpu suite owns them); name the folders whose tests run on "
                "an accelerator with --device-paths, or run `harness init` where they load"
            )
        if not shared and not device_paths:
            notes.append(
                f"no collected case runs on {', '.join(accelerators)} (parametrize tests with "
                "harness.DEVICES or mark them launch(device=...), or name the folders whose "
                "tests pick the device at run time with --device-paths): no accelerator suite "
                "written"
            )
            accelerators = []
    if shared:
        docs[f"{SUITES_DIR}/{SHARED_CASES}"] = {
            "description": "Device-sensitive cases shared by the accelerator suites: each "
            "suite keeps the variants for its own device.",
            "entries": _entries(shared),
        }
    cards = max(1, layout.launched_cards)
    plain = _entries(device_paths)  # their plain cases run on the device, one card each
    for device in accelerators:
        suite = device_type(device).suite
        what = [f"the shared accelerator case list, {device} variants"] * bool(shared)
        what += [f"the plain tests of {', '.join(device_paths)}"] * bool(device_paths)
        docs[f"{SUITES_DIR}/{suite}.json"] = {
            "suite": suite,
            "description": f"{device} runners: {'; '.join(what)}.",
            "device": device,
            "runner": {
                "name": f"{suite}-{cards}",
                "labels": ["self-hosted", "linux", suite],
                "cards": cards,
                "timeout_minutes": ACCELERATOR_TIMEOUT_MINUTES,
            },
            "entries": [{"include": f"{SUITES_DIR}/{SHARED_CASES}"}] * bool(shared)
            + [{**e, "id": f"{e['id']}-{device}", "device": device} for e in plain],
        }
    files = {
        path: json.dumps({**schema_ref(root, (root / path).parent), **doc}, indent=2) + "\n"
        for path, doc in docs.items()
    }
    cpu_minutes = CPU_RUNNER["timeout_minutes"]
    for path, wanted in docs.items():
        target = root / path
        if not target.is_file() or target.read_bytes() == files[path].encode("utf-8"):
            continue
        if "suite" in wanted:  # yours when it loads, for the device asked for
            kept = on_disk.get(wanted["suite"])
            if kept is None or kept.device != wanted["device"]:
                continue  # write() refuses it without --force
            if kept.suite == "cpu":
                cpu_minutes = max(r.timeout_minutes for r in kept.runners)
        else:  # the shared case list: yours when it validates
            try:
                if validate(read_json(target, root), root, path, "caseList"):
                    continue
            except ManifestError:
                continue
        del files[path]
        notes.append(
            f"{path} exists with other content: kept as it is (delete it to have it "
            "written anew from pytest's configuration)"
        )
    if workflows:
        files.update(_workflows(root, accelerators, on_disk, cpu_minutes, harness_ref))
    if (gitignore := _gitignore(root)) is not None:
        files[".gitignore"] = gitignore
    return files


def _workflows(
    root: Path,
    accelerators: Sequence[str],
    on_disk: dict[str, Manifest],
    cpu_minutes: int,
    harness_ref: str | None,
) -> dict[str, str]:
    """``--workflows``: those of the cpu suite and of the accelerator suites written or there;
    refused in a folder of a git repository (GitHub reads only the top's)."""
    here = root.resolve()  # a folder of a git repository, not its top: a .git above, none here
    top = next((d for d in here.parents if (d / ".git").exists()), None)
    if top is not None and not (here / ".git").exists():
        raise InitError(
            f"--workflows: {root} is a folder of the git repository {top}, and GitHub "
            f"reads workflows only from {top / '.github/workflows'}. Run `harness init` "
            "here without --workflows, and write the workflow at the top with `defaults: "
            f"run: working-directory: {here.relative_to(top)}`",
            EXIT_USAGE,
        )
    try:
        source = harness_source(harness_ref)
    except HarnessSourceError as e:
        raise InitError(f"--workflows: {e}", EXIT_USAGE) from None
    suites = {device_type(d).suite: (d, ()) for d in accelerators}
    for name, m in sorted(on_disk.items()):
        if m.device != "cpu":
            suites.setdefault(name, (m.device, m.runners))
    listed = [(name, *how) for name, how in suites.items()]
    return init_workflows(root, listed, cpu_timeout_minutes=cpu_minutes, source=source)


def write(root: Path, files: dict[str, str], force: bool) -> list[tuple[str, str]]:
    """Write ``files`` under ``root``; returns ``(path, "written" | "unchanged" | "appended"
    | "overwritten")``. Without ``force``, a file with other content (``.gitignore``: beyond
    the line appended) is refused: ``InitError`` (code 2), nothing written."""
    actions = []
    for path, text in files.items():
        target, new = root / path, text.encode("utf-8")
        old = target.read_bytes() if target.exists() else None
        if old is None:
            actions.append((path, "written"))
        elif old == new:
            actions.append((path, "unchanged"))
        elif path == ".gitignore" and new.startswith(old):  # init only adds a line there
            actions.append((path, "appended"))
        else:
            actions.append((path, "overwritten"))
    clashes = [path for path, action in actions if action == "overwritten"]
    if clashes and not force:
        raise InitError(
            "; ".join(f"{p} exists with other content" for p in clashes)
            + "; not overwriting (rerun with --force to replace)",
            EXIT_USAGE,
        )
    for path, action in actions:
        if action != "unchanged":
            write_text(root / path, files[path])
    return actions


def _devices(text: str) -> list[str]:
    known = {word: d.name for d in device_types() for word in (d.name, d.suite)}
    words = [w.strip() for w in text.split(",") if w.strip()] or [text]
    if bad := [w for w in words if w not in known]:
        raise argparse.ArgumentTypeError(
            f"unknown accelerator {bad[0]!r}; known: {', '.join(known)} (comma-separated, e.g. cuda,npu)"
        )
    return list(dict.fromkeys(known[w] for w in words))


def _paths(text: str) -> list[str]:
    if words := [w.strip().rstrip("/") for w in text.split(",") if w.strip()]:
        return list(dict.fromkeys(words))
    raise argparse.ArgumentTypeError(f"no path in {text!r} (comma-separated, e.g. tests/gpu)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``init`` subcommand to the ``harness`` CLI (its handler as ``handler``)."""
    p = sub.add_parser("init", help="write suites/ (and workflows) from pytest's configuration")
    p.add_argument(
        "--accelerators",
        type=_devices,
        default=[],
        metavar="DEVICES",
        help="also write accelerator suites sharing one case list, e.g. cuda,npu (or gpu,npu)",
    )
    p.add_argument(
        "--device-paths",
        type=_paths,
        default=[],
        metavar="PATHS",
        help="with --accelerators: folders or files (comma-separated) whose plain tests run "
        "on each accelerator (they pick the device at run time): each accelerator suite gets "
        'an entry with "device" for each, whose cases run with exactly their leased cards '
        "visible. Never derived from files that fail to import here",
    )
    p.add_argument(
        "--workflows",
        action="store_true",
        help="also write .github/workflows/harness-SUITE.yml for each suite: those written "
        "and those already in suites/",
    )
    p.add_argument(
        "--harness-ref",
        metavar="REF",
        help="the commit or tag of the harness's git repository the workflows install "
        "(default: the commit the installed harness came from, when it knows one)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite files that exist with other content (not your suite manifests and "
        "case list that still load: delete one to have it written anew)",
    )
    # It writes suites/, so it starts where it is asked to, not at an existing suites/ above.
    p.set_defaults(handler=cmd_init, root_is_cwd=True)


def cmd_init(root: Path, args: argparse.Namespace) -> int:
    """``harness init``: write the files, print what was done; the exit code (0, 1 or 2)."""
    accel, paths, notes = args.accelerators, args.device_paths, []
    try:
        if paths and not accel:
            raise InitError(
                "--device-paths names paths whose tests run on an accelerator: say which with "
                "--accelerators (e.g. --accelerators cuda)",
                EXIT_USAGE,
            )
        for p in paths:
            target = (root / p).resolve()
            if os.path.isabs(p) or not target.is_relative_to(root.resolve()):
                raise InitError(f"--device-paths: {p!r} is not a path inside {root}", EXIT_USAGE)
            if not target.exists():
                raise InitError(f"--device-paths: {p!r} does not exist in {root}", EXIT_USAGE)
        layout = read_pytest_layout(root)
        files = render(root, layout, accel, args.workflows, notes, args.harness_ref, paths)
        actions = write(root, files, args.force)
    except InitError as e:
        print(f"harness init: {e}", file=sys.stderr)
        return e.code
    print(
        f"harness init: pytest rootdir {layout.rootdir}, "
        f"inifile {layout.inifile or 'none'}, testpaths {' '.join(layout.testpaths) or '-'}, "
        f"{len(layout.files)} test file(s)"
    )
    for e in layout.errors:
        print(
            f"harness init: warning: collection error (the file is still owned): {e}",
            file=sys.stderr,
        )
    for note in notes:
        print(f"harness init: note: {note}", file=sys.stderr)
    for path, action in actions:
        print(f"  {action:<11} {path}")
    print("next: harness inventory && harness run cpu")
    return EXIT_OK
