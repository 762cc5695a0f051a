"""Scopes that receive the per-token losses the chunked loss computes anyway."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

__all__ = ["Capture", "TokenObservation", "active_capture", "capture"]


@dataclass(frozen=True)
class TokenObservation:
    """One loss call's per-token view.

    ``token_losses``: detached fp32 cross-entropy per target, with the leading
    shape of the targets, exactly 0.0 where the target is ignored.
    ``targets``: the int64 targets the loss was computed against, owned by the
    observation (a caller reusing its label buffer does not change it).
    ``ignore_index``: the value in ``targets`` that the loss ignored; every
    metric ignores exactly those targets.
    """

    token_losses: torch.Tensor
    targets: torch.Tensor
    ignore_index: int = -100

    @property
    def scored(self) -> torch.Tensor:
        """Bool mask, shape of ``targets``: True where the loss scored the target."""
        return self.targets != self.ignore_index


@dataclass
class Capture:
    """The receiver of one ``capture()`` scope; ``observations`` is in call order."""

    observations: list[TokenObservation] = field(default_factory=list)


_ACTIVE: ContextVar[Capture | None] = ContextVar("channel_loss_capture", default=None)


def active_capture() -> Capture | None:
    """The innermost open ``capture()`` scope of the current context, or None."""
    return _ACTIVE.get()


def _in_backward() -> bool:
    # A loss re-run by activation checkpointing runs inside the autograd
    # engine; it must not be recorded a second time.
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


def record(token_losses: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> None:
    """Hand one loss call's per-token losses to the innermost open scope.

    Does nothing outside a scope and during a backward-pass recompute.
    """
    cap = _ACTIVE.get()
    if cap is None or _in_backward():
        return
    # The targets are copied: callers often reuse (prefetch into) their label buffer.
    cap.observations.append(
        TokenObservation(token_losses.detach(), targets.detach().clone(), int(ignore_index))
    )


@contextmanager
def capture() -> Iterator[Capture]:
    """Open a scope: every ``chunk_cross_entropy`` call inside appends a ``TokenObservation``.

    Scopes are per context (threads and tasks do not see each other's), the
    innermost open scope receives. If the body raises, the scope's
    observations are dropped and the exception propagates unchanged.
    """
    cap = Capture()
    token = _ACTIVE.set(cap)
    try:
        yield cap
    except BaseException:
        cap.observations.clear()
        raise
    finally:
        _ACTIVE.reset(token)
