"""The enclosing case as its ranks see it: ``HARNESS_CASE`` in their environment.

A rank (and a ``harness.launch`` call made inside it) reads this to know
which case it belongs to, how many ranks and which cards that case holds, and
when its deadline falls, so a nested launch stays within all of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: Environment variable describing the enclosing case to its ranks (JSON).
CASE_ENV = "HARNESS_CASE"


@dataclass(frozen=True)
class EnclosingCase:
    """What a set of ranks belongs to, as seen from inside them (for nested launches)."""

    what: str
    nproc: int
    device: str
    cards: tuple[str, ...]
    deadline: float  # wall-clock time
    #: lease directory of the case's own rank slots: nested launches from any
    #: of its ranks and threads lease from it, so together they never run more
    #: ranks at once than the case declared (None: no such bound)
    budget_dir: str | None = None

    def to_env(self) -> str:
        """The value of ``CASE_ENV`` that ``from_env`` reads back."""
        return json.dumps(
            {
                "what": self.what,
                "nproc": self.nproc,
                "device": self.device,
                "cards": list(self.cards),
                "deadline": self.deadline,
                "budget_dir": self.budget_dir,
            }
        )

    @staticmethod
    def from_env() -> EnclosingCase | None:
        """The case whose rank this process is (None: not inside a case)."""
        raw = os.environ.get(CASE_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return EnclosingCase(
            d["what"],
            d["nproc"],
            d["device"],
            tuple(d["cards"]),
            d["deadline"],
            d.get("budget_dir"),
        )
