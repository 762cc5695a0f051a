"""``python -m channel_loss.demo``: its outputs, that the easy source learns, and SP=2 == SP=1.

The ``--sp 2`` run starts two Gloo ranks with torch's elastic launcher, and
``torchrun --nproc-per-node 2 -m channel_loss.demo`` starts them from outside;
neither touches the harness. Their metrics must equal the ``--sp 1`` run's
(same seed): token and sample counts exactly, means and losses within
``rel=1e-5`` — sharding only changes the order of float sums (each rank's
partial loss sums, the gradient all-reduce); the observed gap after 3 steps
is ~1e-7.
"""

from __future__ import annotations

import ast
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from channel_loss import demo

NAMES = tuple(demo.SOURCES.values())


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_structure(records: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in records] == steps
    for record in records:
        for name in NAMES:
            for kind in (
                "channel_loss",
                "channel_loss_tokens",
                "channel_loss_samples",
                "channel_loss_weighted",
            ):
                assert f"{kind}/{name}" in record, (kind, name)
        assert record["channel_loss_dropped_micro_batches"] == 0.0
        assert all(math.isfinite(v) for v in record.values())
        # The weighted shares add up to the step's training loss (both over all scored tokens).
        weighted = sum(record[f"channel_loss_weighted/{name}"] for name in NAMES)
        assert weighted == pytest.approx(record["loss"], rel=1e-5)


def test_demo_writes_metrics_tables_and_plot(tmp_path, capsys):
    assert demo.main(["--steps", "3", "--interval", "1", "--out", str(tmp_path)]) == 0
    records = read_metrics(tmp_path)
    check_structure(records, [0, 1, 2])
    # Robust at 3 steps: counting sequences are learnable at once, uniform tokens never
    # (the gap at step 2 is >= 0.19 nats over seeds 0-7, 0.5 for seed 0).
    last = records[-1]
    assert last["channel_loss/pattern"] < last["channel_loss/random"] - 0.1
    out = capsys.readouterr().out
    assert "[   3/3] loss" in out  # progress
    assert out.count("per-source loss") == 3  # one table per measured step
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped the plot" in out
    else:
        assert (tmp_path / "channel_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_without_matplotlib_skips_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert demo.main(["--steps", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert "skipped the plot" in capsys.readouterr().out
    assert not (tmp_path / "channel_loss.png").exists()
    check_structure(read_metrics(tmp_path), [0])


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key, value in ra.items():
            if "_tokens/" in key or "_samples/" in key or key == "step":
                assert rb[key] == value, key
            else:
                assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


COMMON = ["--steps", "2", "--interval", "1", "--quiet"]


@pytest.fixture(scope="module")
def sp1_records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sp1")
    assert demo.main([*COMMON, "--out", str(out)]) == 0
    return read_metrics(out)


def test_sp2_metrics_equal_sp1(tmp_path, sp1_records):
    # Ranks started by torch's elastic launcher from this very process.
    handler = signal.getsignal(signal.SIGINT)
    assert demo.main([*COMMON, "--sp", "2", "--out", str(tmp_path)]) == 0
    assert signal.getsignal(signal.SIGINT) is handler  # the launcher's handlers are undone
    b = read_metrics(tmp_path)
    check_structure(b, [0, 1])
    assert_same_run(sp1_records, b)


def test_torchrun_starts_the_ranks(tmp_path, sp1_records):
    # The way PyTorch users start ranks. Each rank must join torchrun's group
    # (before, each trained alone as sp=1 and both wrote the outputs).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "channel_loss.demo",
            "--steps",
            "2",
            "--interval",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("(sp=2)") == 1, proc.stdout  # rank 0 alone reports, on 2 ranks
    assert proc.stdout.count("wrote") == 2  # metrics and plot (or the skip line), once
    assert_same_run(sp1_records, read_metrics(tmp_path))


def test_torchrun_with_a_different_sp_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        demo.main(["--sp", "3", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "torchrun started 2 ranks" in capsys.readouterr().err


def test_channel_loss_never_imports_the_harness():
    # Regression: the demo imported harness (inside run(), for --sp) to start its ranks; the
    # library must not depend on its own test tool, at import time or later.
    package = Path(demo.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.name}:{node.lineno} {name}"
                for name in names
                if name.split(".")[0] == "harness"
            ]
    assert offenders == []


def test_cli_entry_point(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "channel_loss.demo",
            "--steps",
            "2",
            "--quiet",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "metrics.jsonl" in proc.stdout
    check_structure(read_metrics(tmp_path), [0])


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_sp_mode_choices_are_the_shard_mode_registry():
    from channel_loss.layout import SHARD_MODES

    parser = demo._parser()
    (action,) = [a for a in parser._actions if "--sp-mode" in a.option_strings]
    assert tuple(action.choices) == tuple(SHARD_MODES)
    for mode in SHARD_MODES:
        assert parser.parse_args(["--sp-mode", mode]).sp_mode == mode
