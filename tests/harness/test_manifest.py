"""Suite manifests: the schema, pointers in errors, includes, paths, and the real suites."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jsonschema
import pytest
from suite_project import CPU_RUNNER, manifest

from harness import names
from harness.suites.manifest import (
    Flaky,
    ManifestError,
    Quarantine,
    duplicate_entries,
    expired_quarantines,
    load_manifest,
    load_suites,
    path_matches,
)

REPO = Path(__file__).resolve().parents[2]


def write(root: Path, rel: str, doc: object) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
    return p


def problems_of(root: Path, rel: str = "suites/cpu.json") -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(root / rel, root)
    return [str(p) for p in info.value.problems]


def cpu_doc(**entry: object) -> dict:
    return manifest("cpu", "cpu", [{"id": "a", "paths": ["tests"], **entry}])


# --------------------------------------------------------------------------- the real suites


def test_schema_is_valid_draft_2020_12():
    schema = json.loads((REPO / "harness/suites/schema.json").read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_real_manifests_validate_with_plain_jsonschema_and_carry_schema_key():
    schema = json.loads((REPO / "harness/suites/schema.json").read_text())
    files = sorted((REPO / "suites").glob("*.json")) + sorted(
        (REPO / "suites/cases").glob("*.json")
    )
    files = [f for f in files if f.name != "schema.json"]
    assert {f.stem for f in files} >= {"cpu", "gpu", "npu"}
    for f in files:
        doc = json.loads(f.read_text())
        assert "$schema" in doc, f
        jsonschema.Draft202012Validator(schema).validate(doc)


def test_real_suites_load_and_gpu_npu_share_one_case_list():
    manifests, problems = load_suites(REPO)
    assert problems == []
    by = {m.suite: m for m in manifests}
    assert by["cpu"].device == "cpu"
    assert by["gpu"].device == "cuda"
    assert by["npu"].device == "npu"
    # One source, not a copy: every accelerator entry is defined in the shared file.
    assert by["gpu"].entries == by["npu"].entries
    assert {e.source for e in by["gpu"].entries} == {"suites/cases/accelerator.json"}


# --------------------------------------------------------------------------- schema errors


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d["entries"][0].update(timeout_s=-1), "suites/cpu.json /entries/0/timeout_s:"),
        (lambda d: d["entries"][0].update(timeout_s="10"), "suites/cpu.json /entries/0/timeout_s:"),
        (
            lambda d: d["entries"][0].update(estimated_s=0),
            "suites/cpu.json /entries/0/estimated_s:",
        ),
        (lambda d: d["entries"][0].update(paths=[]), "suites/cpu.json /entries/0/paths:"),
        (lambda d: d["entries"][0].update(id="has space"), "suites/cpu.json /entries/0/id:"),
        (lambda d: d["entries"][0].update(bogus=1), "suites/cpu.json /entries/0:"),
        (lambda d: d["entries"].append({"include": 3}), "suites/cpu.json /entries/1/include:"),
        (lambda d: d.update(device="tpu"), "suites/cpu.json /device:"),
        (lambda d: d["runner"].update(cards="two"), "suites/cpu.json /runner/cards:"),
        (
            lambda d: d.update(runner=[{**CPU_RUNNER, "timeout_minutes": 0}]),
            "suites/cpu.json /runner/0/timeout_minutes:",
        ),
        (lambda d: d.pop("runner"), "suites/cpu.json <root>:"),
    ],
)
def test_schema_error_names_file_and_json_pointer(tmp_path, mutate, where):
    doc = cpu_doc()
    mutate(doc)
    write(tmp_path, "suites/cpu.json", doc)
    found = problems_of(tmp_path)
    assert any(p.startswith(where) and "[schema]" in p for p in found), found


def test_every_schema_error_is_reported_not_just_the_first(tmp_path):
    doc = cpu_doc(timeout_s=-1, estimated_s=-2)
    write(tmp_path, "suites/cpu.json", doc)
    found = problems_of(tmp_path)
    assert len(found) == 2
    assert "/entries/0/estimated_s" in found[0]
    assert "/entries/0/timeout_s" in found[1]


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("timeout_s", "Infinity"),
        ("timeout_s", "NaN"),
        ("timeout_s", "-Infinity"),
        ("timeout_s", "1e999"),
        ("estimated_s", "NaN"),
        # Regression (issue 45): integers too large for a float passed the schema, then
        # raised OverflowError in harness run.
        ("timeout_s", "1" + "0" * 400),
        ("estimated_s", "-1" + "0" * 400),
    ],
)
def test_numbers_that_are_not_finite_are_rejected_naming_file_and_literal(tmp_path, field, literal):
    # Python's JSON reader takes these (JSON does not); the schema alone let them through.
    text = json.dumps(cpu_doc(**{field: 7}), indent=2).replace(
        f'"{field}": 7', f'"{field}": {literal}'
    )
    write(tmp_path, "suites/cpu.json", text)
    shown = literal if len(literal) < 20 else f"{literal[:12]}... ({len(literal)} digits)"
    assert problems_of(tmp_path) == [
        f"suites/cpu.json: [json] not valid JSON: {shown} is not a finite number"
    ]


def test_non_finite_number_in_an_included_case_list_names_it(tmp_path):
    write(
        tmp_path,
        "suites/cases/acc.json",
        '{"entries": [{"id": "x", "paths": ["tests"], "estimated_s": NaN}]}',
    )
    write(
        tmp_path, "suites/cpu.json", manifest("cpu", "cpu", [{"include": "suites/cases/acc.json"}])
    )
    assert problems_of(tmp_path) == [
        "suites/cases/acc.json: [json] not valid JSON: NaN is not a finite number"
    ]


def test_not_json_names_file_line_and_column(tmp_path):
    write(
        tmp_path, "suites/cpu.json", '{\n  "suite": "cpu",\n  "device": "cpu"\n  "entries": []\n}\n'
    )
    (found,) = problems_of(tmp_path)
    assert found.startswith("suites/cpu.json:4:3: [json] not valid JSON")


def test_duplicate_json_key_is_rejected(tmp_path):
    write(tmp_path, "suites/cpu.json", '{"suite": "cpu", "suite": "cpu"}')
    (found,) = problems_of(tmp_path)
    assert "duplicate key 'suite'" in found


def test_suite_name_must_match_file(tmp_path):
    write(tmp_path, "suites/cpu.json", {**cpu_doc(), "suite": "other"})
    assert any("/suite" in p and "must match the file name" in p for p in problems_of(tmp_path))


def test_bad_marker_expression_points_at_it(tmp_path):
    write(tmp_path, "suites/cpu.json", cpu_doc(markers="slow and"))
    (found,) = problems_of(tmp_path)
    assert found.startswith("suites/cpu.json /entries/0/markers:")
    assert "bad -m expression" in found


def test_schema_key_is_allowed(tmp_path):
    write(tmp_path, "suites/cpu.json", {"$schema": "./schema.json", **cpu_doc()})
    assert load_manifest(tmp_path / "suites/cpu.json", tmp_path).suite == "cpu"


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize("bad", ["../elsewhere", "/etc", "tests/../../x", "../x.py::test_a"])
def test_paths_outside_the_repository_are_rejected(tmp_path, bad):
    write(
        tmp_path, "suites/cpu.json", manifest("cpu", "cpu", [{"id": "a", "paths": ["tests", bad]}])
    )
    (found,) = problems_of(tmp_path)
    assert found.startswith("suites/cpu.json /entries/0/paths/1: [path]")


def test_symlink_leaving_the_repository_is_rejected(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    outside.mkdir()
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "link").symlink_to(outside)
    write(repo, "suites/cpu.json", manifest("cpu", "cpu", [{"id": "a", "paths": ["tests/link"]}]))
    (found,) = problems_of(repo)
    assert "through a symlink" in found


def test_depends_on_outside_is_rejected(tmp_path):
    write(tmp_path, "suites/cpu.json", cpu_doc(depends_on=["../../**"]))
    (found,) = problems_of(tmp_path)
    assert "/entries/0/depends_on/0: [path]" in found


@pytest.mark.parametrize(
    ("path", "pattern", "hit"),
    [
        ("tests/a/test_x.py", "tests", True),
        ("tests/a/test_x.py", "tests/a/test_x.py", True),
        ("tests/ab/test_x.py", "tests/a", False),
        ("tests/a/b/test_x.py", "tests/**/test_*.py", True),
        ("tests/test_x.py", "tests/**/test_*.py", True),
        ("tests/a/x.py", "tests/**/test_*.py", False),
        ("tests/a/test_x.py", "tests/*/test_x.py", True),
        ("tests/a/b/test_x.py", "tests/*/test_x.py", False),
        ("channel_loss/ops.py", "channel_loss/**", True),
        ("harness/x.py", "*", True),  # under a directory that matches
        ("a/b/conftest.py", "**/conftest.py", True),
        ("conftest.py", "**/conftest.py", True),
        # Regression: a newline in a file name (git -z gives it as it is) matched no glob.
        ("src/e/new\nline.py", "src/e/**", True),
        ("a\nb/conftest.py", "**/conftest.py", True),
        ("src/e/new\nline.py", "src/e/*.py", True),
        # Regression: git names a changed submodule by its folder, which DIR/** missed.
        ("libs/util", "libs/util/**", True),
        ("libs/utility", "libs/util/**", False),
    ],
)
def test_path_matching(path, pattern, hit):
    assert path_matches(path, pattern) is hit


# --------------------------------------------------------------------------- includes


def test_include_splices_shared_entries_and_keeps_their_source(tmp_path):
    write(tmp_path, "suites/cases/acc.json", {"entries": [{"id": "ops", "paths": ["tests/ops"]}]})
    for suite, device in (("gpu", "cuda"), ("npu", "npu")):
        write(
            tmp_path,
            f"suites/{suite}.json",
            manifest(
                suite,
                device,
                [
                    {"include": "suites/cases/acc.json"},
                    {"id": f"{suite}-only", "paths": ["tests/x"]},
                ],
            ),
        )
    gpu = load_manifest(tmp_path / "suites/gpu.json", tmp_path)
    npu = load_manifest(tmp_path / "suites/npu.json", tmp_path)
    assert [e.id for e in gpu.entries] == ["ops", "gpu-only"]
    assert gpu.entries[0] == npu.entries[0]
    assert gpu.entries[0].source == "suites/cases/acc.json"
    assert gpu.entries[0].pointer == "/entries/0"


def test_include_of_another_manifest_takes_its_entries(tmp_path):
    write(tmp_path, "suites/gpu.json", manifest("gpu", "cuda", [{"id": "ops", "paths": ["tests"]}]))
    write(tmp_path, "suites/npu.json", manifest("npu", "npu", [{"include": "suites/gpu.json"}]))
    npu = load_manifest(tmp_path / "suites/npu.json", tmp_path)
    assert [e.id for e in npu.entries] == ["ops"]
    assert npu.entries[0].source == "suites/gpu.json"


def test_include_errors_point_into_the_included_file(tmp_path):
    write(
        tmp_path,
        "suites/cases/acc.json",
        {"entries": [{"id": "ops", "paths": ["tests"], "timeout_s": 0}]},
    )
    write(
        tmp_path, "suites/gpu.json", manifest("gpu", "cuda", [{"include": "suites/cases/acc.json"}])
    )
    (found,) = problems_of(tmp_path, "suites/gpu.json")
    assert found.startswith("suites/cases/acc.json /entries/0/timeout_s: [schema]")


@pytest.mark.parametrize(
    ("include", "message"),
    [("suites/cases/none.json", "does not exist"), ("../acc.json", "outside the repository")],
)
def test_bad_include_is_named(tmp_path, include, message):
    write(tmp_path, "suites/gpu.json", manifest("gpu", "cuda", [{"include": include}]))
    (found,) = problems_of(tmp_path, "suites/gpu.json")
    assert found.startswith("suites/gpu.json /entries/0/include:")
    assert message in found


def test_include_cycle_is_named(tmp_path):
    write(tmp_path, "suites/cases/a.json", {"entries": [{"include": "suites/cases/b.json"}]})
    write(tmp_path, "suites/cases/b.json", {"entries": [{"include": "suites/cases/a.json"}]})
    write(
        tmp_path, "suites/gpu.json", manifest("gpu", "cuda", [{"include": "suites/cases/a.json"}])
    )
    (found,) = problems_of(tmp_path, "suites/gpu.json")
    assert (
        "include cycle: suites/gpu.json -> suites/cases/a.json -> suites/cases/b.json -> suites/cases/a.json"
        in found
    )


def test_duplicate_entry_ids_are_reported_with_both_places(tmp_path):
    write(tmp_path, "suites/cases/acc.json", {"entries": [{"id": "ops", "paths": ["tests"]}]})
    write(
        tmp_path,
        "suites/gpu.json",
        manifest(
            "gpu",
            "cuda",
            [
                {"id": "ops", "paths": ["tests/a"]},
                {"include": "suites/cases/acc.json"},
            ],
        ),
    )
    (dup,) = duplicate_entries(load_manifest(tmp_path / "suites/gpu.json", tmp_path))
    assert dup.rule == "duplicate-entry-id"
    assert str(dup).startswith("suites/cases/acc.json /entries/0/id:")
    assert "already used at suites/gpu.json /entries/0" in str(dup)


def test_load_suites_reports_unknown_names(tmp_path):
    write(tmp_path, "suites/cpu.json", cpu_doc())
    manifests, problems = load_suites(tmp_path, ["cpu", "tpu"])
    assert [m.suite for m in manifests] == ["cpu"]
    assert [p.rule for p in problems] == ["unknown-suite"]
    assert "known: cpu" in problems[0].message
    # The root it looked in: the nearest folder holding suites/ may not be the one meant.
    assert f"no such suite in {tmp_path / 'suites'} " in problems[0].message


# --------------------------------------------------------------------------- flaky, quarantine


def test_flaky_quarantine_and_run_everything_on_load(tmp_path):
    doc = cpu_doc(
        flaky={"retries": 2, "reason": "issue 7"},
        quarantine={"reason": "issue 8", "until": "2999-12-31"},
    )
    doc["run_everything_on"] = ["uv.lock", "vendor/**"]
    write(tmp_path, "suites/cpu.json", doc)
    m = load_manifest(tmp_path / "suites/cpu.json", tmp_path)
    (e,) = m.entries
    assert e.flaky == Flaky(2, "issue 7")
    assert e.quarantine == Quarantine("issue 8", datetime.date(2999, 12, 31))
    assert m.run_everything_on == ("uv.lock", "vendor/**")
    write(tmp_path, "suites/cpu.json", cpu_doc())
    m = load_manifest(tmp_path / "suites/cpu.json", tmp_path)
    assert m.run_everything_on is None
    assert m.entries[0].flaky is None
    assert m.entries[0].quarantine is None


@pytest.mark.parametrize(
    ("entry", "where", "says"),
    [
        ({"flaky": {"retries": 0, "reason": "r"}}, "/entries/0/flaky/retries", "minimum"),
        ({"flaky": {"retries": 1.5, "reason": "r"}}, "/entries/0/flaky/retries", "integer"),
        ({"flaky": {"retries": 2}}, "/entries/0/flaky", "'reason' is a required"),
        ({"flaky": {"retries": 2, "reason": ""}}, "/entries/0/flaky/reason", ""),
        ({"quarantine": {"until": "2999-01-01"}}, "/entries/0/quarantine", "'reason' is a"),
        ({"quarantine": {"reason": "r"}}, "/entries/0/quarantine", "'until' is a required"),
        ({"quarantine": {"reason": "r", "until": "soon"}}, "/entries/0/quarantine/until", ""),
        ({"quarantine": {"reason": "r", "until": "2026-02-30"}}, "/entries/0/quarantine/until", ""),
    ],
)
def test_bad_flaky_or_quarantine_is_named_with_file_and_pointer(tmp_path, entry, where, says):
    write(tmp_path, "suites/cpu.json", cpu_doc(**entry))
    (found,) = problems_of(tmp_path)
    assert found.startswith(f"suites/cpu.json {where}: [schema]"), found
    assert says in found, found


def test_run_everything_on_outside_the_repository_is_named(tmp_path):
    doc = cpu_doc()
    doc["run_everything_on"] = ["uv.lock", "../other/**"]
    write(tmp_path, "suites/cpu.json", doc)
    (found,) = problems_of(tmp_path)
    assert found.startswith("suites/cpu.json /run_everything_on/1: [path]"), found


def test_an_expired_quarantine_is_a_blocking_problem_where_it_is_defined(tmp_path):
    entries = [
        {"id": "q", "paths": ["tests"], "quarantine": {"reason": "r", "until": "2026-03-01"}}
    ]
    write(tmp_path, "suites/cases/shared.json", {"entries": entries})
    write(
        tmp_path,
        "suites/cpu.json",
        manifest("cpu", "cpu", [{"include": "suites/cases/shared.json"}]),
    )
    m = load_manifest(tmp_path / "suites/cpu.json", tmp_path)
    assert expired_quarantines(m, datetime.date(2026, 3, 1)) == []  # its last day
    (p,) = expired_quarantines(m, datetime.date(2026, 3, 2))
    assert (p.rule, p.file, p.where, p.suite) == (
        names.QUARANTINE_EXPIRED,
        "suites/cases/shared.json",
        "/entries/0/quarantine/until",
        "cpu",
    )
    assert p.rule in names.BLOCKING_RULES
    _, problems = load_suites(tmp_path)  # today is past 2026-03-01 only some day: pin it
    assert [q.rule for q in problems] == (
        [names.QUARANTINE_EXPIRED] if datetime.date.today() > datetime.date(2026, 3, 1) else []
    )


def test_runner_classes_are_sorted_and_budget_defaults_to_three_quarters(tmp_path):
    runners = [
        {"labels": ["big"], "cards": 8, "timeout_minutes": 60},
        {"labels": ["small"], "cards": 1, "timeout_minutes": 40, "budget_minutes": 20},
    ]
    write(
        tmp_path,
        "suites/gpu.json",
        manifest("gpu", "cuda", [{"id": "a", "paths": ["tests"]}], runners),
    )
    m = load_manifest(tmp_path / "suites/gpu.json", tmp_path)
    assert [r.cards for r in m.runners] == [1, 8]
    assert [r.budget_minutes for r in m.runners] == [20, 45]
    assert m.max_cards == 8


def test_json_nested_past_the_recursion_limit_is_named_not_a_traceback(tmp_path):
    write(
        tmp_path, "suites/cpu.json", '{"suite": "cpu", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    (found,) = problems_of(tmp_path)
    assert found.startswith("suites/cpu.json: [json] nested too deeply")


def test_deeply_nested_manifest_fails_every_command_clearly(tmp_path, capsys):
    from harness.suites.cli import main

    write(tmp_path, "suites/cpu.json", "[" * 100_000 + "]" * 100_000)
    assert main(["--root", str(tmp_path), "inventory"]) == 1
    assert main(["--root", str(tmp_path), "matrix", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("suites/cpu.json: [json] nested too deeply") == 2


# --------------------------------------------------------------------------- device, cards, env


def test_entry_device_cards_and_env_load(tmp_path):
    doc = manifest(
        "gpu",
        "cuda",
        [
            {"id": "a", "paths": ["tests"], "device": "cuda", "cards": 2, "env": {"X": "1"}},
            {"id": "b", "paths": ["tests/b"]},
        ],
    )
    write(tmp_path, "suites/gpu.json", doc)
    a, b = load_manifest(tmp_path / "suites/gpu.json", tmp_path).entries
    assert (a.device, a.cards, a.env, a.accelerator) == ("cuda", 2, {"X": "1"}, "cuda")
    assert (b.device, b.cards, b.env, b.accelerator) == (None, 1, {}, None)


# --------------------------------------------------------------------------- command entries


def command_doc(**entry: object) -> dict:
    return manifest("cpu", "cpu", [{"id": "smoke", **entry}])


def test_a_command_entry_loads_with_its_argv_and_expected_output(tmp_path):
    argv = ["torchrun", "--nproc-per-node", "2", "train.py"]
    write(tmp_path, "suites/cpu.json", command_doc(command=argv, expect_output=r"^step \d+"))
    (entry,) = load_manifest(tmp_path / "suites/cpu.json", tmp_path).entries
    assert entry.command == tuple(argv)
    assert entry.expect_output == r"^step \d+"
    assert entry.paths == ()


@pytest.mark.parametrize(
    ("entry", "where", "words"),
    [
        ({"device": "cpu", "cards": 2}, "/entries/0/cards", "cpu entry"),
        ({"cards": 2}, "/entries/0/cards", "needs the entry's `device`"),
        ({"env": {"X": 1}}, "/entries/0/env/X", "is not of type 'string'"),
        ({"env": ["X=1"]}, "/entries/0/env", "is not of type 'object'"),
        ({"device": "tpu"}, "/entries/0/device", "'tpu' is not one of"),
        ({"device": "cuda", "cards": 0}, "/entries/0/cards", "less than the minimum"),
        ({"device": "cuda"}, "/entries/0/device", "suite 'cpu' runs on cpu"),
    ],
)
def test_bad_device_cards_env_are_named_with_file_and_pointer(tmp_path, entry, where, words):
    write(tmp_path, "suites/cpu.json", cpu_doc(**entry))
    found = problems_of(tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith(f"suites/cpu.json {where}: [schema]"), found
    assert words in found[0]


def test_entry_device_of_another_suite_is_named_in_the_included_case_list(tmp_path):
    write(
        tmp_path,
        "suites/cases/acc.json",
        {"entries": [{"id": "a", "paths": ["t"], "device": "cuda"}]},
    )
    write(
        tmp_path, "suites/npu.json", manifest("npu", "npu", [{"include": "suites/cases/acc.json"}])
    )
    write(
        tmp_path, "suites/gpu.json", manifest("gpu", "cuda", [{"include": "suites/cases/acc.json"}])
    )
    assert load_manifest(tmp_path / "suites/gpu.json", tmp_path).entries[0].device == "cuda"
    found = problems_of(tmp_path, "suites/npu.json")
    assert found == [
        "suites/cases/acc.json /entries/0/device: [schema] entry 'a' says device 'cuda', but "
        "suite 'npu' runs on npu: give it the suite's device or leave `device` out"
    ]


@pytest.mark.parametrize(
    ("entry", "where", "words"),
    [
        (
            {"command": ["python", "x.py"], "paths": ["tests"]},
            "/entries/0/paths",
            "either paths or a command",
        ),
        (
            {"command": ["python", "x.py"], "markers": "slow"},
            "/entries/0/markers",
            "either paths or a command",
        ),
        ({"command": []}, "/entries/0/command", "non-empty"),
        ({"command": ["python", 3]}, "/entries/0/command/1", "not of type 'string'"),
        ({"command": ["python", ""]}, "/entries/0/command/1", ""),
        ({"command": "python x.py"}, "/entries/0/command", "not of type 'array'"),
        (
            {"command": ["python"], "expect_output": "loss ("},
            "/entries/0/expect_output",
            "not a regular expression",
        ),
        (
            {"paths": ["tests"], "expect_output": "ok"},
            "/entries/0/expect_output",
            "applies to a command entry",
        ),
        ({}, "/entries/0", "'paths' is a required property"),
    ],
)
def test_a_bad_command_entry_is_named_by_file_and_pointer(tmp_path, entry, where, words):
    write(tmp_path, "suites/cpu.json", command_doc(**entry))
    found = problems_of(tmp_path)
    assert any(p.startswith(f"suites/cpu.json {where}:") and words in p for p in found), found


def test_a_bad_command_entry_in_a_shared_case_list_points_into_that_list(tmp_path):
    write(tmp_path, "suites/cases/e2e.json", {"entries": [{"id": "e", "command": ["x", 1]}]})
    write(
        tmp_path, "suites/cpu.json", manifest("cpu", "cpu", [{"include": "suites/cases/e2e.json"}])
    )
    assert any(
        p.startswith("suites/cases/e2e.json /entries/0/command/1:") for p in problems_of(tmp_path)
    )
