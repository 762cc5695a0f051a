"""Which accelerator cards this host has, and how a process is pointed at one.

The inventory comes from the device runtime (``torch.cuda`` / ``torch_npu``)
unless ``HARNESS_CARDS`` overrides it, e.g. ``HARNESS_CARDS=cuda:0,1,2,3`` to
run on a subset of the cards, or to exercise the leasing logic on a CPU-only
machine (a *simulated* inventory). Several device types are separated by ``;``
(``cuda:0,1;npu:0``); ``none`` or an empty value means "no cards at all".

Card ids are the ids the runtime's visibility variable understands
(``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``), so a rank is
pinned to a card by setting that variable to the id.

Nothing here imports torch at module import time: the plugin is loaded into
every pytest process and torch costs over a second to import.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

import pytest

from harness.spec import ACCELERATORS

CARDS_ENV = "HARNESS_CARDS"
#: Set in every process that runs test code on a leased card: ``cuda:2``.
CARD_ENV = "HARNESS_CARD"

VISIBILITY_ENV: dict[str, str] = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
}

#: ``@pytest.mark.parametrize("device", DEVICES)``: cpu, cuda, npu. The harness
#: plugin skips (or, under ``--harness-require``, fails) the accelerator
#: params on hosts without such cards, before any fixture runs.
DEVICES: list = [pytest.param(device, id=device) for device in ("cpu", *ACCELERATORS)]


@dataclass(frozen=True, order=True)
class Card:
    """One accelerator card: its device type and its runtime id."""

    device: str
    id: str

    def __str__(self) -> str:
        return f"{self.device}:{self.id}"


def parse_cards(text: str) -> dict[str, list[Card]]:
    """Parse a ``HARNESS_CARDS`` value into cards per accelerator type.

    Guarantees every accelerator type is a key (possibly with no cards), ids
    keep their order, and a malformed value raises ``ValueError`` quoting it.
    """
    cards: dict[str, list[Card]] = {device: [] for device in ACCELERATORS}
    text = text.strip()
    if text.lower() in ("", "none"):
        return cards
    for group in text.replace(" ", ";").split(";"):
        if not group:
            continue
        device, sep, ids = group.partition(":")
        if not sep or device not in ACCELERATORS:
            raise ValueError(
                f"{CARDS_ENV}={text!r}: expected groups like 'cuda:0,1,2' or 'npu:0,1' "
                f"separated by ';', got {group!r}"
            )
        for card_id in (i.strip() for i in ids.split(",")):
            if not card_id:
                raise ValueError(f"{CARDS_ENV}={text!r}: empty card id in {group!r}")
            card = Card(device, card_id)
            if card in cards[device]:
                raise ValueError(f"{CARDS_ENV}={text!r}: {card} listed twice")
            cards[device].append(card)
    return cards


def is_simulated() -> bool:
    """True when the inventory comes from ``HARNESS_CARDS`` instead of the runtime."""
    return CARDS_ENV in os.environ


def inventory(device: str) -> list[Card]:
    """The cards of ``device`` this host offers to tests, in id order as listed.

    ``cpu`` has none. With ``HARNESS_CARDS`` set, exactly the cards it names;
    otherwise the cards the device runtime reports (honouring the process's
    visibility variable). A missing runtime means no cards, never an error.
    """
    if device not in ACCELERATORS:
        return []
    if is_simulated():
        return parse_cards(os.environ[CARDS_ENV])[device]
    return list(_runtime_cards(device, os.environ.get(VISIBILITY_ENV[device])))


@functools.cache
def _runtime_cards(device: str, visible: str | None) -> tuple[Card, ...]:
    count = _runtime_count(device)
    if visible is not None:
        # The runtime numbers the visible cards 0..n-1; the lease and the
        # ranks' visibility variable need the ids the variable itself uses.
        ids = [i.strip() for i in visible.split(",") if i.strip()][:count]
    else:
        ids = [str(i) for i in range(count)]
    return tuple(Card(device, i) for i in ids)


def _runtime_count(device: str) -> int:
    try:
        if device == "cuda":
            if "torch" not in sys.modules and not _torch_has_gpu_build():
                return 0
            import torch

            return torch.cuda.device_count()
        if device == "npu":
            if importlib.util.find_spec("torch_npu") is None:
                return 0
            import torch
            import torch_npu  # noqa: F401  (registers torch.npu)

            return torch.npu.device_count()
    except Exception:
        # A broken driver is "no cards": the plugin then skips, or fails the
        # case under --harness-require, which is the signal a runner needs.
        return 0
    return 0


def _torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA / ROCm, read from its
    ``version.py`` without importing torch (a CPU build has ``cuda = None``).

    Importing torch only to learn that a CPU build has no cards would cost
    every pytest process over a second, and an import from inside a pytester
    in-process run is undone afterwards, which torch does not survive.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return True  # unknown: ask the runtime
    values = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, re.MULTILINE))
    if not values:
        return True
    return any(v != "None" for v in values.values())


def runtime_available(device: str) -> bool:
    """Whether this process's torch can use ``device`` (may import torch)."""
    if device == "cpu":
        return True
    return _runtime_count(device) > 0


def local_index(card: Card) -> int | None:
    """The runtime index of ``card`` inside this process (None: not visible here)."""
    visible = os.environ.get(VISIBILITY_ENV[card.device])
    if visible is not None:
        ids = [i.strip() for i in visible.split(",")]
        return ids.index(card.id) if card.id in ids else None
    return int(card.id) if card.id.isdigit() else None


def set_device(card: Card, index: int) -> None:
    """Make runtime device ``index`` current in this process (imports torch)."""
    import torch

    if card.device == "cuda":
        torch.cuda.set_device(index)
    elif card.device == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(index)


def describe_inventory() -> str:
    """One line naming the cards per accelerator and where they came from."""
    parts = []
    for device in ACCELERATORS:
        cards = inventory(device)
        ids = ",".join(c.id for c in cards)
        parts.append(f"{device}:{ids}" if cards else f"{device}: none")
    source = CARDS_ENV if is_simulated() else "device runtime"
    return f"{'; '.join(parts)} (from {source})"
