"""scripts/device_check.sh, the one-shot accelerator qualification, proven on CPU.

The dry run (``DEVICE_CHECK_DRY=1``) is the real script end to end: an offline
install of this checkout from a wheel folder into a throwaway venv, the
inventory, a narrowed cpu suite run through ``harness run``, the claims and the
benchmark of ``scripts/bench/cuda_qualify.py`` on the CPU at a tiny shape, and
the verdict. The CUDA-only parts (profiler kernel counts, sync debug mode,
peak device memory, Liger) need a card and are not run here. Elsewhere the
benchmark script is driven through its command line in this process
(``cuda_qualify.main(argv)``): a subprocess would only add a torch import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from scripts import device_wheels
from scripts._common import write_outer_site_pth
from scripts.bench import cuda_qualify

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device_check.sh"
PROBE = "dc-outer-probe"


def qualify(*args: str) -> int:
    """``scripts/bench/cuda_qualify.py ARGS``, its command line run in this process (a
    subprocess would import torch again): its exit status."""
    try:
        return cuda_qualify.main(list(args))
    except SystemExit as e:  # argparse's usage errors
        return e.code


def phases_of(out: Path) -> list[dict]:
    """The phases the report read from ``phases.tsv`` (``device_check.json``)."""
    return json.loads((out / "device_check.json").read_text())["phases"]


def virtualenv_python(root: Path) -> Path:
    """A virtualenv made the way users make one (no ``--system-site-packages``) that sees this
    interpreter's packages through a ``.pth`` and holds one distribution of its own, ``PROBE``,
    which the base interpreter lacks: what the device check's venv must see from there."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
    )
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    write_outer_site_pth(Path(purelib))
    dist = Path(purelib) / "dc_outer_probe-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 1.0\n")
    (dist / "RECORD").write_text("")
    return python


def _env(tmp_path: Path, python: Path | str = sys.executable, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DEVICE_CHECK", "DEVICE_WHEELS", "PIP_"))
    }
    env.pop("OUT", None)
    env.update(PYTHON=str(python), TMPDIR=str(tmp_path), **extra)
    return env


def test_dry_run_end_to_end(tmp_path):
    """One dry run (the slow part, so one test: xdist workers would each repeat a
    shared fixture): it passes, installs the checkout offline, and leaves every file.

    ``$PYTHON`` is a virtualenv, as users run it: the throwaway venv must see that
    virtualenv's packages, not its base interpreter's."""
    python = virtualenv_python(tmp_path / "user-venv")
    # What the dry run needs that this machine lacks: nothing (jsonschema, pytest,
    # setuptools are installed), so an empty folder proves the "already there" path
    # and that the checkout itself installs with --no-index.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
        env=_env(tmp_path, python, DEVICE_CHECK_DRY="1", DEVICE_WHEELS=str(wheels)),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in (
        "env.txt",
        "install.log",
        "pip-freeze.txt",
        "inventory.txt",
        "suite/junit.xml",
        "suite/summary.md",
        "suite/summary.json",
        "durations.json",
        "claims.json",
        "bench.json",
        "bench.md",
        "device_check.json",
        "device_check.md",
        "phases.tsv",
    ):
        assert (out / name).is_file(), name
    phases = phases_of(out)
    assert [p["phase"] for p in phases] == ["install", "inventory", "suite", "claims", "bench"]
    assert all(p["rc"] == 0 for p in phases), phases
    assert (out / "device_check.md").read_text().startswith("# device check: PASSED")
    assert json.loads((out / "device_check.json").read_text())["passed"] is True
    assert not list(tmp_path.glob("device-check-venv.*")), "the throwaway venv outlived the run"

    # The checkout (both distributions) was installed from source with no index;
    # what this interpreter already has was kept.
    log = (out / "install.log").read_text()
    assert f"channel_loss from {REPO / 'channel_loss'}" in log
    assert f"harness from {REPO / 'harness'}" in log
    assert "Successfully installed channel-loss" in log
    assert "Requirement already satisfied: jsonschema" in log
    freeze = (out / "pip-freeze.txt").read_text().lower().replace("_", "-")
    assert "channel-loss" in freeze
    assert f"{PROBE}==1.0" in freeze, "the throwaway venv does not see $PYTHON's own packages"

    # The suite ran through harness run, the claims held, the benchmark has every row.
    total = json.loads((out / "suite" / "summary.json").read_text())["total"]
    assert total["passed"] >= 1
    assert total["failed"] == 0
    assert json.loads((out / "durations.json").read_text())
    claims = {c["name"]: c for c in json.loads((out / "claims.json").read_text())["claims"]}
    assert claims["observed == plain (loss, grads, bitwise)"]["status"] == "held"
    assert claims["no extra matmul under capture"]["status"] == "held"
    assert claims["no extra matmul under capture"]["data"]["aten_matmuls_plain"] > 0
    # CUDA-only claims say why they did not run on the CPU.
    assert claims["capture adds no host sync"]["status"] == "skipped"
    assert "cpu" in claims["capture adds no host sync"]["detail"]
    bench = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in bench["shapes"][0]["rows"]}
    assert {"naive", "torch_native", "liger", "ours", "ours_capture", "ours[autocast]"} <= set(rows)
    assert bench["shapes"][0]["ratios"]["ours[autocast] / ours time"]["value"] > 0
    assert [m for m in rows if m.startswith("ours[chunk=")] == ["ours[chunk=32]", "ours[chunk=64]"]
    # Every row of ours ran but the compiled chunk math, which the CPU dry run skips.
    compiled = "ours[chunk_math=compiled]"
    assert rows[compiled]["status"] == "skipped"
    assert all(
        rows[m]["status"] == "ok" and rows[m]["ms"] > 0
        for m in rows
        if m.startswith("ours") and m != compiled
    )
    assert rows["liger"]["status"] == "skipped"
    assert "CUDA" in rows["liger"]["note"]
    assert "| ours_capture |" in (out / "bench.md").read_text()


def test_missing_wheel_folder_is_a_setup_error(tmp_path):
    missing = tmp_path / "no-such-folder"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(tmp_path, DEVICE_CHECK_DRY="1", DEVICE_WHEELS=str(missing)),
    )
    assert done.returncode == 2
    assert str(missing) in done.stderr
    assert "device_wheels.py" in done.stderr


def test_phases_out_of_budget_are_cut_and_fail_the_run(tmp_path):
    """Every phase runs under a limit carved from the budget: a budget that
    leaves no phase its minimum runs none of them, the verdict names each, and
    the run fails without hanging. (A budget that lets a phase start would make
    the outcome depend on this machine's speed: a tiny phase may finish in it.)"""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(
            tmp_path, DEVICE_CHECK_DRY="1", DEVICE_WHEELS=str(wheels), DEVICE_CHECK_BUDGET_S="10"
        ),
    )
    assert done.returncode == 1, done.stdout[-3000:]
    phases = phases_of(out)
    assert [p["phase"] for p in phases] == ["install", "inventory", "suite", "claims", "bench"]
    assert all(p["rc"] == 124 and p["limit_s"] < 5 for p in phases), phases
    reasons = json.loads((out / "device_check.json").read_text())["reasons"]
    assert reasons == [
        f"phase {p['phase']} not run: no time left in the budget" for p in phases
    ] + ["suite summary missing", "claims.json missing", "bench.json missing"]
    assert (out / "device_check.md").read_text().startswith("# device check: FAILED")
    assert not list(tmp_path.glob("device-check-venv.*"))


def _write(
    out: Path, phases: list[tuple[str, int]], claims: list[dict] | None, bench: bool = True
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "phases.tsv").write_text("".join(f"{n}\t{rc}\t1\t60\n" for n, rc in phases))
    (out / "suite").mkdir()
    (out / "suite" / "summary.md").write_text("### harness run gpu\n\nnothing to run\n")
    if claims is not None:
        (out / "claims.json").write_text(json.dumps({"env": ENV, "claims": claims}))
    if bench:
        (out / "bench.json").write_text(
            json.dumps({"env": ENV, "dtype": "bfloat16", "repeats": 1, "shapes": []})
        )


ENV = {"device": "cpu", "torch": "2.4.0"}
HELD = {"name": "observed == plain", "status": "held", "detail": "equal", "data": {}}


def report(out: Path) -> tuple[int, dict]:
    """``cuda_qualify.py report --out OUT``: its exit status and ``device_check.json``."""
    code = qualify("report", "--out", str(out))
    assert code in (0, 1)
    return code, json.loads((out / "device_check.json").read_text())


def test_report_passes_only_when_every_phase_and_claim_held(tmp_path):
    _write(tmp_path / "ok", [("install", 0), ("suite", 0)], [HELD, {**HELD, "status": "skipped"}])
    assert report(tmp_path / "ok")[0] == 0

    _write(tmp_path / "timeout", [("install", 0), ("suite", 124)], [HELD])
    code, v = report(tmp_path / "timeout")
    assert code == 1
    assert not v["passed"]
    assert v["reasons"] == ["phase suite timed out after 60s"]
    assert (
        (tmp_path / "timeout" / "device_check.md").read_text().startswith("# device check: FAILED")
    )

    failed = {**HELD, "status": "failed", "detail": "differ: weight.grad"}
    _write(tmp_path / "claim", [("suite", 0)], [HELD, failed])
    assert report(tmp_path / "claim")[1]["reasons"] == [
        "claim failed: observed == plain: differ: weight.grad"
    ]

    _write(tmp_path / "missing", [("suite", 0)], None, bench=False)
    assert report(tmp_path / "missing")[1]["reasons"] == [
        "claims.json missing",
        "bench.json missing",
    ]


def test_bad_shape_is_named(capsys):
    for shape in ("16384x4096", "1x0x3"):
        assert qualify("bench", "--out", "x", "--device", "cpu", "--shape", shape) == 2
        assert shape in capsys.readouterr().err


def test_wheel_folder_carries_what_the_checkout_needs_but_never_torch():
    reqs = [device_wheels._name(r) for r in device_wheels.project_requirements(REPO)]
    # jsonschema is what the card image lacks; setuptools builds the checkout offline.
    assert {"jsonschema", "pytest", "pytest-xdist", "hypothesis", "setuptools"} <= set(reqs)
    assert not {"torch", "numpy", "triton"} & set(reqs)
