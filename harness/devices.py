"""The device table (everything device-shaped derives from ``DEVICE_TABLE``), the host's
cards (from the device runtime, or ``HARNESS_CARDS``: ``cuda:0,1;npu:0``, ``none``), and
how a process is pointed at one. Nothing here imports torch at module import time.
"""

from __future__ import annotations

import csv
import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

CARDS_ENV = "HARNESS_CARDS"
#: Set in every process that runs test code on a leased card: ``cuda:2``.
CARD_ENV = "HARNESS_CARD"


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware): the host's CPU process slots."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


#: A process on a card as a device's tool reports it: ``(pid, card, memory_mb, name)``.
BusyRow = tuple[int, str, "int | None", str]


def _nvidia_smi_apps(text: str) -> list[BusyRow]:
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) >= 4 and row[0].strip().isdigit():
            memory = re.match(r"\d+", row[3].strip())
            out.append((int(row[0]), row[2].strip(), int(memory[0]) if memory else None, row[1]))
    return out


# `npu-smi info`'s process table: | NPU  Chip | Process id | Process name | Process memory(MB) |
_NPU_PROCESS = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*(\d+)\s*\|")


def _npu_smi_info(text: str) -> list[BusyRow]:
    matches = filter(None, map(_NPU_PROCESS.match, text.splitlines()))
    return [(int(m[3]), f"{m[1]}/{m[2]}", int(m[5]), m[4]) for m in matches]


@dataclass(frozen=True)
class DeviceType:
    """Everything the harness knows about one device type (one row of ``DEVICE_TABLE``).

    ``backend``: its ranks' default ``torch.distributed`` backend; ``backends``: every
    backend whose collectives take tensors on it; ``visibility_env``: the variable that pins
    a process to cards (None: no cards); ``runtime``: the ``torch.<runtime>`` namespace;
    ``extension``: a module registering it; ``cheap_probe``: whether, without importing
    torch, any card can exist; ``title`` (workflows) and ``suite`` (``harness init``)
    default to ``name``; ``busy_query``: the argv listing the processes on its cards, and
    ``parse_busy`` its parser (``harness/busy.py``).
    """

    name: str
    backend: str
    backends: tuple[str, ...]
    visibility_env: str | None = None
    runtime: str | None = None
    extension: str | None = None
    cheap_probe: Callable[[], bool] | None = None
    title: str = ""
    suite: str = ""
    busy_query: tuple[str, ...] = ()
    parse_busy: Callable[[str], list[BusyRow]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "title", self.title or self.name)  # frozen: set once, here
        object.__setattr__(self, "suite", self.suite or self.name)

    @property
    def is_accelerator(self) -> bool:
        """Whether a rank of this device needs a card of its own (cpu: no)."""
        return self.visibility_env is not None

    def torch_runtime(self) -> Any:
        """The ``torch.<runtime>`` module of an accelerator (imports torch and the extension)."""
        import torch

        if self.extension is not None:
            importlib.import_module(self.extension)
        return getattr(torch, self.runtime)

    def initialised_runtime(self) -> Any:
        """The runtime if this process already initialised it, else None (never initialises one)."""
        runtime = getattr(sys.modules.get("torch"), self.runtime or "", None)
        return runtime if runtime is not None and runtime.is_initialized() else None

    def card_count(self) -> int:
        """Cards the runtime reports in this process (0: none, no runtime, or a broken driver)."""
        if self.runtime is None:
            return 0
        try:
            if self.cheap_probe is not None and not self.cheap_probe():
                return 0
            return int(self.torch_runtime().device_count())
        except Exception:  # a broken driver: skipped, or failed under --harness-require
            return 0

    def set_device(self, index: int) -> None:
        """Make runtime device ``index`` current in this process (imports torch)."""
        if self.runtime is not None:
            self.torch_runtime().set_device(index)


def _torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA / ROCm, read from its ``version.py``:
    importing torch would cost every pytest process a second, and pytester's in-process
    runs undo imports, which torch does not survive."""
    if "torch" in sys.modules:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return True  # unknown: ask the runtime
    values = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, re.MULTILINE))
    return not values or any(v != "None" for v in values.values())


#: One row per device type, in ``DEVICES`` order.
DEVICE_TABLE: tuple[DeviceType, ...] = (
    DeviceType("cpu", backend="gloo", backends=("gloo", "mpi"), title="CPU"),
    DeviceType(
        "cuda",
        backend="nccl",
        backends=("nccl",),
        visibility_env="CUDA_VISIBLE_DEVICES",
        runtime="cuda",
        cheap_probe=_torch_has_gpu_build,
        title="CUDA",
        suite="gpu",
        busy_query=(
            "nvidia-smi",
            "--query-compute-apps=pid,process_name,gpu_bus_id,used_memory",
            "--format=csv,noheader",
        ),
        parse_busy=_nvidia_smi_apps,
    ),
    DeviceType(
        "npu",
        backend="hccl",
        backends=("hccl",),
        visibility_env="ASCEND_RT_VISIBLE_DEVICES",
        runtime="npu",
        extension="torch_npu",
        cheap_probe=lambda: importlib.util.find_spec("torch_npu") is not None,
        title="Ascend NPU",
        busy_query=("npu-smi", "info"),
        parse_busy=_npu_smi_info,
    ),
)

_BY_NAME: dict[str, DeviceType] = {d.name: d for d in DEVICE_TABLE}

#: Device type names, in table order (``cpu`` first).
DEVICE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
#: Device types whose ranks need a card each.
ACCELERATOR_NAMES: tuple[str, ...] = tuple(d.name for d in DEVICE_TABLE if d.is_accelerator)
#: ``torch.distributed`` backend -> the device type its collectives take tensors on.
BACKEND_DEVICES: dict[str, str] = {b: d.name for d in DEVICE_TABLE for b in d.backends}


def device_type(name: str) -> DeviceType:
    """The table row of device ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_NAMES)}") from None


def accelerators() -> Iterator[DeviceType]:
    """The table rows of device types that have cards."""
    return (d for d in DEVICE_TABLE if d.is_accelerator)


#: ``@pytest.mark.parametrize("device", DEVICES)``: cpu, cuda, npu; the plugin skips (or,
#: under ``--harness-require``, fails) the accelerator params on hosts without such cards.
DEVICES: list = [pytest.param(d.name, id=d.name) for d in DEVICE_TABLE]


@dataclass(frozen=True, order=True)
class Card:
    """One accelerator card: its device type and its runtime id."""

    device: str
    id: str

    def __str__(self) -> str:
        return f"{self.device}:{self.id}"


def parse_cards(text: str) -> dict[str, list[Card]]:
    """A ``HARNESS_CARDS`` value as cards per accelerator type (every one a key), ids in
    their order; a malformed value (a signed id included) raises ``ValueError`` quoting it."""
    cards: dict[str, list[Card]] = {device: [] for device in ACCELERATOR_NAMES}
    text = text.strip()
    if text.lower() in ("", "none"):
        return cards
    for group in filter(None, text.replace(" ", ";").split(";")):
        device, sep, ids = group.partition(":")
        if not sep or device not in ACCELERATOR_NAMES:
            raise ValueError(
                f"{CARDS_ENV}={text!r}: expected groups like 'cuda:0,1,2' or 'npu:0,1' "
                f"separated by ';', got {group!r}"
            )
        for card_id in (i.strip() for i in ids.split(",")):
            if not card_id:
                raise ValueError(f"{CARDS_ENV}={text!r}: empty card id in {group!r}")
            if card_id[0] in "+-":
                # A signed index is no card: the runtime stops reading its visibility
                # variable at -1, hiding every card listed after it.
                raise ValueError(
                    f"{CARDS_ENV}={text!r}: card id {card_id!r} in {group!r} is not a card "
                    "index >= 0 (or a card UUID)"
                )
            card = Card(device, card_id)
            if card in cards[device]:
                raise ValueError(f"{CARDS_ENV}={text!r}: {card} listed twice")
            cards[device].append(card)
    return cards


def is_simulated() -> bool:
    """True when the inventory comes from ``HARNESS_CARDS`` instead of the runtime."""
    return CARDS_ENV in os.environ


def inventory(device: str) -> list[Card]:
    """The cards of ``device`` this host offers to tests, in order: exactly those
    ``HARNESS_CARDS`` names when set, else those the runtime reports (honouring the
    visibility variable). ``cpu`` has none; an unknown device raises ``ValueError``."""
    kind = device_type(device)
    if not kind.is_accelerator:
        return []
    if is_simulated():
        return parse_cards(os.environ[CARDS_ENV])[device]
    return list(_runtime_cards(device, os.environ.get(kind.visibility_env)))


@functools.cache
def _runtime_cards(device: str, visible: str | None) -> tuple[Card, ...]:
    # The runtime numbers the visible cards 0..n-1; the lease and the ranks'
    # visibility variable need the ids the variable itself uses.
    count = device_type(device).card_count()
    ids = [str(i) for i in range(count)] if visible is None else visible.split(",")
    return tuple(Card(device, i.strip()) for i in ids if i.strip())[:count]


def runtime_available(device: str) -> bool:
    """Whether this process's torch can use ``device`` (may import torch)."""
    kind = device_type(device)
    return not kind.is_accelerator or kind.card_count() > 0


def local_index(card: Card) -> int | None:
    """The runtime index of ``card`` inside this process (None: not visible here)."""
    env = device_type(card.device).visibility_env
    visible = os.environ.get(env) if env else None
    if visible is not None:
        ids = [i.strip() for i in visible.split(",")]
        return ids.index(card.id) if card.id in ids else None
    return int(card.id) if card.id.isdigit() else None


def set_device(card: Card, index: int) -> None:
    """Make runtime device ``index`` current in this process (imports torch)."""
    device_type(card.device).set_device(index)


def visible(cards: Sequence[Card]) -> dict[str, str]:
    """The environment that shows a process (and what it starts) exactly ``cards``: their
    device's visibility variable listing their ids; empty for no cards."""
    if not cards:
        return {}
    return {str(device_type(cards[0].device).visibility_env): ",".join(c.id for c in cards)}


def visibility(card: Card) -> dict[str, str]:
    """The environment that pins a process to ``card`` (its visibility variable, and
    ``HARNESS_CARD``)."""
    return {**visible([card]), CARD_ENV: str(card)}


def describe_inventory() -> str:
    """One line naming the cards per accelerator and where they came from."""
    parts = []
    for kind in accelerators():
        ids = ",".join(c.id for c in inventory(kind.name))
        parts.append(f"{kind.name}:{ids}" if ids else f"{kind.name}: none")
    source = CARDS_ENV if is_simulated() else "device runtime"
    return f"{'; '.join(parts)} (from {source})"
