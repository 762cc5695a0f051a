"""What a test case needs to run: its device, rank count and deadline."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any

from harness.devices import ACCELERATOR_NAMES as ACCELERATORS
from harness.devices import BACKEND_DEVICES, DEVICE_NAMES, device_type
from harness.errors import HarnessError
from harness.validation import check_int, check_seconds


class LaunchSpecError(HarnessError, ValueError):
    """A ``LaunchSpec`` field or ``launch`` marker holds a value the harness cannot run."""


@dataclass(frozen=True)
class LaunchSpec:
    """How one test case is launched.

    ``device``: a device type of the device table (``cpu``, ``cuda``, ``npu``); ``nproc``:
    rank processes (>= 1); ``timeout``: the case deadline in seconds (None: the session
    default); ``backend``: the ``torch.distributed`` backend, one the table knows (default
    gloo / nccl / hccl by device); ``reuse``: kept rank processes (True), fresh ones
    (False), or as the session says (None: ini ``harness_reuse`` / ``--harness-reuse``,
    fresh by default); ``nnodes``: nodes of ``nproc`` ranks each (>= 1; ``cards`` is per
    node), more than one under torch's elastic launcher (torchrun), emulated on this host
    or across hosts (``harness.launcher.nodes``), on fresh ranks only. Invalid values raise
    ``LaunchSpecError`` (a ``ValueError``) naming the field and the value.
    """

    device: str = "cpu"
    nproc: int = 1
    timeout: float | None = None
    backend: str | None = None
    reuse: bool | None = None
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICE_NAMES:
            raise LaunchSpecError(
                f"LaunchSpec.device must be one of {', '.join(DEVICE_NAMES)}; got {self.device!r}"
            )
        # numpy ints stored as plain ints: equal specs compare, hash and pickle alike.
        for name in ("nproc", "nnodes"):
            value = check_int(
                getattr(self, name), f"LaunchSpec.{name}", minimum=1, error=LaunchSpecError
            )
            object.__setattr__(self, name, value)
        timeout = check_seconds(
            self.timeout, "LaunchSpec.timeout", allow_none=True, error=LaunchSpecError
        )
        object.__setattr__(self, "timeout", timeout)
        if self.backend is not None and (
            not isinstance(self.backend, str) or self.backend not in BACKEND_DEVICES
        ):
            raise LaunchSpecError(
                f"LaunchSpec.backend must be None or one of "
                f"{', '.join(BACKEND_DEVICES)}; got {self.backend!r}"
            )
        if self.reuse is not None and not isinstance(self.reuse, bool):
            raise LaunchSpecError(f"LaunchSpec.reuse must be None or a bool; got {self.reuse!r}")
        if self.nnodes > 1 and self.reuse:
            raise LaunchSpecError(
                f"LaunchSpec.reuse=True cannot keep the ranks of a multi-node case "
                f"(nnodes={self.nnodes}): torch's elastic launcher starts fresh ranks per case"
            )

    @property
    def cards(self) -> int:
        """Accelerator cards the case needs: 0 on cpu, one per rank otherwise."""
        return self.nproc if self.device in ACCELERATORS else 0

    @property
    def world_size(self) -> int:
        """Ranks of the case on all its nodes together (``nnodes * nproc``)."""
        return self.nnodes * self.nproc

    @property
    def dist_backend(self) -> str:
        """The ``torch.distributed`` backend the ranks initialise."""
        return self.backend or device_type(self.device).backend


def _device_param(item: Any) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    value = callspec.params.get("device")
    return value if isinstance(value, str) and value in DEVICE_NAMES else None


def spec_from_marker(args: tuple, kwargs: dict, device_param: str | None = None) -> LaunchSpec:
    """The spec a ``launch`` marker declares: ``launch(LaunchSpec(...))`` or
    ``launch(nproc=..., nnodes=..., timeout=..., ...)``, whose device is, when not given,
    ``device_param`` (the test's ``device`` parameter) or ``cpu``. Any other form raises
    ``LaunchSpecError`` (a ``ValueError``)."""
    names = [f.name for f in fields(LaunchSpec)]
    if args:
        if len(args) != 1 or not isinstance(args[0], LaunchSpec) or kwargs:
            raise LaunchSpecError(
                "@pytest.mark.launch takes one LaunchSpec or keyword arguments "
                f"({', '.join(names)}); got args={args!r} kwargs={kwargs!r}"
            )
        return args[0]
    unknown = set(kwargs) - set(names)
    if unknown:
        raise LaunchSpecError(f"@pytest.mark.launch got unknown keyword(s) {sorted(unknown)}")
    return LaunchSpec(**{"device": device_param or "cpu", **kwargs})


def is_launched(item: Any) -> bool:
    """True when the case carries a ``launch`` marker (its body runs in rank processes)."""
    return item.get_closest_marker("launch") is not None


def spec_for_item(item: Any) -> LaunchSpec:
    """The spec of a collected pytest item: its ``launch`` marker's, else one rank on the
    device of its ``device`` parameter (cpu when it has none), so a plain test
    parametrized with an accelerator needs one card."""
    marker = item.get_closest_marker("launch")
    if marker is None:
        return LaunchSpec(device=_device_param(item) or "cpu", nproc=1)
    return spec_from_marker(marker.args, marker.kwargs, _device_param(item))


def launch_refusal(item: Any) -> str | None:
    """Why the ``launch`` marker of this collected test cannot be honoured (None: its body
    can run on ranks); the plugin fails such a test, the inventory lists ``bad-launch-spec``."""
    unittest = sys.modules.get("unittest")
    cls = getattr(item, "cls", None)
    if unittest is not None and isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        return (
            f"@pytest.mark.launch cannot run the unittest.TestCase method "
            f"{cls.__qualname__}.{item.name} on ranks (unittest runs it itself, in this "
            "process); write it as a pytest test function or a method of a plain class"
        )
    if "subtests" in getattr(item, "fixturenames", ()):
        return (
            "@pytest.mark.launch cannot run a test using the `subtests` fixture on ranks "
            "(each subtest reports to this pytest session, which ranks have none of); "
            "parametrize the test (@pytest.mark.parametrize) or assert in a loop instead"
        )
    info = getattr(item, "_fixtureinfo", None)
    captures = sorted(_CAPTURE_FIXTURES.intersection(getattr(info, "argnames", ())))
    if captures:
        return (
            f"@pytest.mark.launch cannot hand pytest's `{captures[0]}` fixture to ranks (it "
            "captures this pytest process's output or log records, not a rank's); a rank's "
            "output is shown per rank in the report and its log records under 'Captured log "
            "call': check them in the body instead (contextlib.redirect_stdout, a "
            "logging.Handler)"
        )
    return _data_refusal(getattr(item, "obj", None))


_CAPTURE_FIXTURES = frozenset({"capsys", "capsysbinary", "capfd", "capfdbinary", "caplog"})


def _data_refusal(test: Any) -> str | None:
    """Why a ``@given`` test drawing with ``st.data()`` is refused (None: it is not one)."""
    given = getattr(getattr(test, "hypothesis", None), "_given_kwargs", None)
    core = sys.modules.get("hypothesis.strategies._internal.core")
    if not isinstance(given, dict) or core is None:
        return None
    names = [
        name
        for name, strategy in given.items()
        if isinstance(getattr(strategy, "wrapped_strategy", strategy), core.DataStrategy)
    ]
    if not names:
        return None
    return (
        "@pytest.mark.launch cannot run a @given test drawing with st.data() on ranks "
        f"(argument {', '.join(repr(n) for n in names)}: the body draws on the ranks, where "
        "Hypothesis, which runs in this process, cannot shrink or replay the draws); draw "
        "the values in @given instead (a @st.composite strategy, or .flatmap for draws "
        "that depend on others)"
    )
