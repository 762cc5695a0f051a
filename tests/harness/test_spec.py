"""LaunchSpec: its values, what it needs, and how tests declare it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from harness import LaunchSpec
from harness.spec import spec_for_item, spec_from_marker


def test_defaults():
    spec = LaunchSpec()
    assert (spec.device, spec.nproc, spec.timeout, spec.backend, spec.reuse) == (
        "cpu",
        1,
        None,
        None,
        None,
    )


# Not named "device": the plugin would treat cuda / npu as needing a card.
@pytest.mark.parametrize(
    ("kind", "nproc", "cards", "backend"),
    [
        ("cpu", 4, 0, "gloo"),
        ("cuda", 1, 1, "nccl"),
        ("cuda", 3, 3, "nccl"),
        ("npu", 2, 2, "hccl"),
    ],
)
def test_cards_and_backend_follow_the_device(kind, nproc, cards, backend):
    spec = LaunchSpec(device=kind, nproc=nproc)
    assert spec.cards == cards
    assert spec.dist_backend == backend
    assert LaunchSpec(device=kind, nproc=nproc, backend="gloo").dist_backend == "gloo"


def test_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchSpec().nproc = 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "tpu"),
        ("device", "CUDA"),
        ("device", None),
        ("nproc", 0),
        ("nproc", -1),
        ("nproc", 1.5),
        ("nproc", True),
        ("nproc", "2"),
        ("timeout", 0),
        ("timeout", -5),
        ("timeout", float("nan")),
        ("timeout", float("inf")),
        # Regression: math.isfinite raised OverflowError on it.
        pytest.param("timeout", 10**400, id="timeout-huge-int"),
        ("timeout", "10"),
        ("timeout", True),
        ("backend", ""),
        ("backend", 3),
        ("backend", "nccl2"),
        ("reuse", "yes"),
        ("nnodes", 0),
        ("nnodes", 1.5),
        ("nnodes", "2"),
    ],
)
def test_bad_value_is_a_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"LaunchSpec\.{field} .*got {value!r}"):
        LaunchSpec(**{field: value})


def test_nodes_default_to_one_and_cards_stay_per_node():
    assert LaunchSpec().nnodes == 1
    spec = LaunchSpec(device="cuda", nproc=2, nnodes=3)
    assert (spec.cards, spec.world_size) == (2, 6)
    assert spec_from_marker((), {"nnodes": 2, "nproc": 2}) == LaunchSpec(nproc=2, nnodes=2)


def test_a_multi_node_case_cannot_keep_its_ranks():
    with pytest.raises(ValueError, match=r"LaunchSpec\.reuse=True .*nnodes=2"):
        LaunchSpec(nproc=2, nnodes=2, reuse=True)
    assert LaunchSpec(nproc=2, nnodes=2, reuse=False).reuse is False


def test_marker_forms():
    spec = LaunchSpec(nproc=2, timeout=5)
    assert spec_from_marker((spec,), {}) is spec
    assert spec_from_marker((), {"nproc": 2, "timeout": 5}) == spec
    assert spec_from_marker((), {"nproc": 2}, device_param="cuda") == LaunchSpec("cuda", 2)
    assert spec_from_marker((), {"nproc": 2, "device": "cpu"}, device_param="cuda").device == "cpu"
    with pytest.raises(ValueError, match="unknown keyword"):
        spec_from_marker((), {"ranks": 2})
    with pytest.raises(ValueError, match="takes one LaunchSpec"):
        spec_from_marker((2,), {})
    with pytest.raises(ValueError, match=r"LaunchSpec\.nproc"):
        spec_from_marker((), {"nproc": 0})


def test_spec_of_collected_items(pytester):
    items = pytester.getitems("""
        import pytest
        from harness import LaunchSpec

        def test_plain():
            pass

        @pytest.mark.parametrize("device", ["cpu", "cuda"])
        def test_plain_device(device):
            pass

        @pytest.mark.parametrize("device", ["cpu", "npu"])
        @pytest.mark.launch(nproc=2, timeout=9)
        def test_launched_device(device):
            pass

        @pytest.mark.launch(LaunchSpec(device="cuda", nproc=3))
        def test_launched_spec():
            pass
    """)
    specs = {item.name: spec_for_item(item) for item in items}
    assert specs == {
        "test_plain": LaunchSpec(),
        "test_plain_device[cpu]": LaunchSpec(),
        "test_plain_device[cuda]": LaunchSpec("cuda", 1),
        "test_launched_device[cpu]": LaunchSpec("cpu", 2, 9),
        "test_launched_device[npu]": LaunchSpec("npu", 2, 9),
        "test_launched_spec": LaunchSpec("cuda", 3),
    }
    assert [s.cards for s in specs.values()] == [0, 0, 1, 0, 2, 3]


def test_the_suite_side_never_imports_the_launcher():
    # The launcher's pool keeper registers an exit hook at import: the suite
    # commands (inventory, run, matrix) must not pay for or carry it.
    code = (
        "import sys, harness.suites.cli\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('harness.launcher'))\n"
        "assert not loaded, loaded\n"
        "from harness import LaunchSpec, DEVICES\n"
        "assert not any(m.startswith('harness.launcher') for m in sys.modules)\n"
        "from harness import launch, LaunchError, LeaseTimeout\n"
        "assert 'harness.launcher.pool' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_no_suite_module_imports_the_launcher_even_where_it_is_used():
    # Regression: harness run imported the launcher's settings inside a function (for the
    # CPU count), which the import test above cannot see. Every import statement of the
    # suite side, at any depth, names shared ground only.
    import ast
    from pathlib import Path

    import harness.suites

    found = []
    for path in sorted(Path(harness.suites.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {m}" for m in modules if "launcher" in m]
    assert not found, found


def test_unknown_public_name_is_an_attribute_error():
    import harness

    with pytest.raises(AttributeError, match="no attribute 'lanch'"):
        harness.lanch
    assert set(harness.__all__) <= set(dir(harness))


def test_integer_likes_of_any_kind_are_plain_ints_in_the_spec():
    np = pytest.importorskip("numpy")
    from harness.errors import HarnessError

    spec = LaunchSpec(nproc=np.int64(2), timeout=np.float64(5))
    assert type(spec.nproc) is int
    assert spec == LaunchSpec(nproc=2, timeout=5)
    assert hash(spec) == hash(LaunchSpec(nproc=2, timeout=5.0))
    with pytest.raises(HarnessError, match=r"LaunchSpec\.nproc"):
        LaunchSpec(nproc=np.bool_(True))
