"""Card inventory: HARNESS_CARDS overrides, runtime ids, DEVICES params."""

from __future__ import annotations

import pytest

from harness import DEVICES
from harness.devices import Card, inventory, is_simulated, local_index, parse_cards


def test_parse_cards():
    assert parse_cards("cuda:0,1,2,3") == {"cuda": [Card("cuda", str(i)) for i in range(4)], "npu": []}
    assert parse_cards(" cuda:2;npu:0,5 ") == {"cuda": [Card("cuda", "2")],
                                               "npu": [Card("npu", "0"), Card("npu", "5")]}
    assert parse_cards("none") == parse_cards("") == {"cuda": [], "npu": []}


@pytest.mark.parametrize("text", ["gpu:0", "cuda", "cuda:0,,1", "cuda:0,0", "cpu:0"])
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
    assert [p.values for p in DEVICES] == [("cpu",), ("cuda",), ("npu",)]
    assert [p.id for p in DEVICES] == ["cpu", "cuda", "npu"]
