"""Coverage in ranks: when the launcher measures coverage (``pytest --cov``, ``coverage
run``), each rank measures the same way and saves its data (before ``os._exit``, which
skips coverage's exit hook) next to the launcher's data file, for ``coverage combine`` /
pytest-cov.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

_active: list[Any] = []
#: Measured since the data was last written (a kept rank's second write after pytest-cov
#: combined the files would leave an empty file behind).
_unsaved: list[bool] = [False]


@dataclass(frozen=True)
class CoverageSpec:
    """How the launcher measures: its config file, data file and the settings a
    command line may have given (``--cov=SOURCE``, ``--cov-branch``)."""

    config_file: str | None
    data_file: str
    source: tuple[str, ...] | None
    branch: bool
    include: tuple[str, ...] | None
    omit: tuple[str, ...] | None

    @classmethod
    def of_launcher(cls) -> CoverageSpec | None:
        """The measurement running in this process now (None: none)."""
        coverage = sys.modules.get("coverage")
        current = getattr(getattr(coverage, "Coverage", None), "current", None)
        cov = current() if current is not None else None
        if cov is None:
            return None
        config = cov.config

        def listed(value: Any) -> tuple[str, ...] | None:
            return tuple(value) if value else None

        return cls(
            config_file=config.config_file or None,
            data_file=_data_file(cov),
            source=listed(config.source),
            branch=bool(config.branch),
            include=listed(config.run_include),
            omit=listed(config.run_omit),
        )


def _data_file(cov: Any) -> str:
    """The absolute name of ``cov``'s data file. Never ``cov.get_data()``: on a live
    measurement it runs coverage's end-of-run checks, whose warnings fail every launched
    test under ``-W error``."""
    data = getattr(cov, "_data", None)
    base = getattr(data, "base_filename", None)
    return base() if base is not None else os.path.abspath(cov.config.data_file)


def start(spec: CoverageSpec | None) -> None:
    """Start measuring in this rank as ``spec`` says (nothing when None)."""
    if spec is None or _active:
        return
    import coverage

    cov = coverage.Coverage(
        data_file=spec.data_file,
        data_suffix=True,
        config_file=spec.config_file or False,
        source=list(spec.source) if spec.source else None,
        branch=spec.branch,
        include=list(spec.include) if spec.include else None,
        omit=list(spec.omit) if spec.omit else None,
        auto_data=False,
    )
    cov.start()
    _active.append(cov)
    _unsaved[0] = True


def case_started() -> None:
    """A case starts: there will be data to write."""
    _unsaved[0] = True


def checkpoint() -> None:
    """Write the data measured so far (measuring goes on)."""
    for cov in _active:
        try:
            cov.save()
        except Exception as exc:
            print(f"harness: saving this rank's coverage data failed: {exc}", file=sys.stderr)
    _unsaved[0] = False


def save() -> None:
    """Stop measuring and write this rank's data file (before ``os._exit``), unless no
    case ran since the last ``checkpoint``."""
    while _active:
        cov = _active.pop()
        try:
            cov.stop()
            if _unsaved[0]:
                cov.save()
        except Exception as exc:  # the rank's verdict stands; say what coverage lost
            print(f"harness: saving this rank's coverage data failed: {exc}", file=sys.stderr)
    _unsaved[0] = False
