"""Card inventory: HARNESS_CARDS overrides, runtime ids, DEVICES params."""

from __future__ import annotations

import re

import pytest

from harness import DEVICES, LaunchSpec
from harness.devices import (
    ACCELERATOR_NAMES,
    BACKEND_DEVICES,
    DEVICE_NAMES,
    Card,
    inventory,
    is_simulated,
    local_index,
    parse_cards,
)

#: Every accelerator with no cards: what the table's other rows add to ``parse_cards``.
NO_CARDS = {name: [] for name in ACCELERATOR_NAMES}


def test_parse_cards():
    assert parse_cards("cuda:0,1,2,3") == {
        **NO_CARDS,
        "cuda": [Card("cuda", str(i)) for i in range(4)],
    }
    assert parse_cards(" cuda:2;npu:0,5 ") == {
        **NO_CARDS,
        "cuda": [Card("cuda", "2")],
        "npu": [Card("npu", "0"), Card("npu", "5")],
    }
    assert parse_cards("none") == parse_cards("") == NO_CARDS


@pytest.mark.parametrize(
    "text", ["gpu:0", "cuda", "cuda:0,,1", "cuda:0,0", "cpu:0", "cuda:-1", "cuda:0,-1", "npu:+1"]
)
def test_malformed_cards_are_rejected_quoting_the_value(text):
    with pytest.raises(ValueError, match="HARNESS_CARDS="):
        parse_cards(text)


def test_override_is_the_whole_inventory(monkeypatch):
    monkeypatch.setenv("HARNESS_CARDS", "cuda:1,3")
    assert is_simulated()
    assert inventory("cuda") == [Card("cuda", "1"), Card("cuda", "3")]
    assert inventory("npu") == []
    assert inventory("cpu") == []


def test_runtime_inventory_without_override(monkeypatch):
    monkeypatch.delenv("HARNESS_CARDS", raising=False)
    import torch

    assert len(inventory("cuda")) == torch.cuda.device_count()


def test_local_index_follows_the_visibility_variable(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,2")
    assert local_index(Card("cuda", "2")) == 1
    assert local_index(Card("cuda", "0")) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_index(Card("cuda", "3")) == 3


def test_devices_params():
    # The public contract: cpu, cuda and npu first, in that order (a new row comes after).
    assert [p.values for p in DEVICES][:3] == [("cpu",), ("cuda",), ("npu",)]
    assert [p.id for p in DEVICES] == [p.values[0] for p in DEVICES]


def test_everything_device_shaped_derives_from_the_table():
    from harness import devices, spec

    names = tuple(d.name for d in devices.DEVICE_TABLE)
    assert [p.values[0] for p in DEVICES] == list(names)
    assert names == devices.DEVICE_NAMES
    assert tuple(d.name for d in devices.DEVICE_TABLE if d.is_accelerator) == spec.ACCELERATORS
    assert [LaunchSpec(d.name).dist_backend for d in devices.DEVICE_TABLE] == [
        d.backend for d in devices.DEVICE_TABLE
    ]
    assert all((d.visibility_env is not None) == d.is_accelerator for d in devices.DEVICE_TABLE)
    assert set(parse_cards("none")) == set(spec.ACCELERATORS)
    # harness init's suite names and the workflows' titles are table columns too.
    assert [(d.suite, d.title) for d in devices.DEVICE_TABLE][:3] == [
        ("cpu", "CPU"),
        ("gpu", "CUDA"),
        ("npu", "Ascend NPU"),
    ]
    assert devices.DeviceType("abacus", "gloo", ("gloo",)).suite == "abacus"  # default: the name
    for d in devices.DEVICE_TABLE:
        assert devices.BACKEND_DEVICES[d.backend] == d.name
        assert LaunchSpec(device=d.name, nproc=2).cards == (2 if d.is_accelerator else 0)


def test_unknown_device_or_backend_raises_naming_the_known_ones():
    from harness import devices

    known = re.escape(", ".join(DEVICE_NAMES))
    with pytest.raises(ValueError, match=rf"unknown device 'abacus'; known: {known}$"):
        devices.device_type("abacus")
    with pytest.raises(ValueError, match=r"unknown device 'tpu'"):
        inventory("tpu")
    assert list(BACKEND_DEVICES)[:4] == ["gloo", "mpi", "nccl", "hccl"]
    known = re.escape(", ".join(BACKEND_DEVICES))
    with pytest.raises(ValueError, match=rf"backend must be None or one of {known}; got .ucc.$"):
        LaunchSpec(backend="ucc")


def test_suite_schema_device_enum_is_the_table():
    import json
    from importlib.resources import files

    from harness import devices

    schema = json.loads(files("harness.suites").joinpath("schema.json").read_text())
    assert schema["$defs"]["manifest"]["properties"]["device"]["enum"] == [
        d.name for d in devices.DEVICE_TABLE
    ]


def test_channel_loss_collectives_place_tensors_where_the_table_says():
    from channel_loss import exchange
    from harness.devices import BACKEND_DEVICES

    # channel_loss may not import harness, so it keeps its own map: the two must agree.
    assert dict(exchange.BACKEND_DEVICES) == BACKEND_DEVICES
