"""Chunked cross-entropy over an LM head that hands out per-token losses from the same pass.

The op never materialises ``[tokens, vocab]`` logits: it walks the tokens in
chunks of ``chunk_size`` rows, and from each chunk's fp32 logits takes the
per-token loss and the gradients of every input at once, keeping only the
gradients for backward. Because the per-token loss falls out of the same
log-sum-exp the gradient needs, observing it costs no extra pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from channel_loss import _fused
from channel_loss._fused import CHUNK_MATH, CHUNK_MATH_ENV, chunk_math
from channel_loss.capture import record
from channel_loss.validation import check_int, is_real

__all__ = [
    "CHUNK_MATH",
    "CHUNK_MATH_ENV",
    "GEMM_POLICIES",
    "chunk_cross_entropy",
    "chunk_math",
    "cpu_has_bf16_gemm",
    "default_chunk_size",
    "default_gemm_policy",
    "gemm_policy",
    "per_token_cross_entropy",
]


# --------------------------------------------------------------------------- input checking


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _require(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the 0-d bool ``ok`` holds, without a host sync.

    On the CPU the check is immediate. On an accelerator reading ``ok`` would
    stall the host until the device catches up, so the check is queued on the
    device instead (``torch._assert_async``): a failure surfaces as a
    device-side assertion carrying ``message`` at the next synchronisation.
    """
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ValueError(message)
    elif ok.device.type != "meta":
        torch._assert_async(ok, message)


def resolve_targets(
    lead: torch.Size,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
    vocab: int,
    what: str,
) -> torch.Tensor:
    """The int64 targets every op here scores against, with leading shape ``lead``.

    ``shift_labels`` as given (``labels`` is then not read, as in HF's
    causal-LM loss), else ``labels`` shifted left by one with ``ignore_index``
    appended (the HF convention). Raises ``ValueError`` unless one is given,
    integer-typed, shaped ``lead`` (the leading shape of ``what``), with every
    target in ``[0, vocab)`` or ``ignore_index``. On the
    CPU the error names the first bad target; on an accelerator the range
    check costs no host sync: it runs on the device and fails at the next
    synchronisation (see ``_require``). ``ignore_index`` must be an integer
    (a bool is not: ``True`` would silently ignore class 1).
    """
    check_int(ignore_index, "ignore_index", minimum=-(2**63), maximum=2**63 - 1)  # int64 targets
    if labels is None and shift_labels is None:
        raise ValueError("pass labels or shift_labels; got neither")
    if shift_labels is not None:
        labels = None
    name, given = ("labels", labels) if labels is not None else ("shift_labels", shift_labels)
    if not isinstance(given, torch.Tensor):
        raise ValueError(f"{name} must be a tensor; got {type(given).__name__}")
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor; got dtype {given.dtype}")
    if given.shape != lead:
        raise ValueError(
            f"{name} shape {_shape(given)} must equal the leading shape of {what} {tuple(lead)}"
        )
    if given.numel() == 0:
        return given.to(torch.int64)
    if labels is not None:
        targets = F.pad(labels.to(torch.int64), (0, 1), value=ignore_index)[..., 1:]
    else:
        targets = shift_labels.to(torch.int64)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.device.type == "cpu":
        if bool(bad.any()):
            first = targets[bad][0].item()
            raise ValueError(
                f"{name} holds target {first} outside [0, {vocab}) that is not "
                f"ignore_index={ignore_index}"
            )
    else:
        _require(
            ~bad.any(),
            f"{name} holds a target outside [0, {vocab}) that is not ignore_index={ignore_index}",
        )
    return targets


#: The dtypes autocast casts to its lower precision for a matmul (never float64).
_AUTOCAST_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives a matmul on ``device`` here, or None where it is off."""
    kind = device.type
    try:
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    except (AttributeError, TypeError, RuntimeError):  # a torch before the device_type forms
        if kind == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        if kind == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


def _as_autocast_would(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bias_weight: torch.Tensor | None,
) -> tuple[tuple, contextlib.AbstractContextManager]:
    """The operands of the LM-head products as autocast would hand them to ``F.linear``
    (cast, differentiably, to its dtype where it is on for their device; float64 kept),
    and a context that turns autocast off for the op itself, so that none of its own
    matmuls is cast again (the op forms them under its dtype policy). An additive
    ``logits_bias`` (no ``bias_weight``) is not an operand: it is added as given."""
    amp = _autocast_dtype(hidden.device) if isinstance(hidden, torch.Tensor) else None
    if amp is None:
        return (hidden, weight, bias, bias_weight), contextlib.nullcontext()

    def cast(t):
        castable = isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CASTABLE
        return t.to(amp) if castable and t.dtype != amp else t

    operands = (cast(hidden), cast(weight))
    operands += (cast(bias), cast(bias_weight)) if bias_weight is not None else (bias, None)
    return operands, torch.autocast(hidden.device.type, enabled=False)


def _check_hidden_weight(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(
            "hidden_states must be a [B, T, H] or [T, H] tensor; got "
            + (_shape(hidden) if isinstance(hidden, torch.Tensor) else type(hidden).__name__)
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            "weight must be a [V, H] tensor; got "
            + (_shape(weight) if isinstance(weight, torch.Tensor) else type(weight).__name__)
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {_shape(weight)} does not match hidden_states width: "
            f"hidden_states {_shape(hidden)} has H={hidden.shape[-1]}, weight has "
            f"H={weight.shape[1]}"
        )
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        amp = _autocast_dtype(hidden.device)
        under = (
            ""
            if amp is None
            else f" (under torch.autocast({hidden.device.type!r}, {amp}), which casts float32 / "
            f"float16 / bfloat16 operands to {amp} and leaves float64 as it is)"
        )
        raise ValueError(
            f"hidden_states and weight must share one floating dtype; got {hidden.dtype} "
            f"and {weight.dtype}{under}"
        )


def _check_broadcast_rows(bias: torch.Tensor, name: str, lead: torch.Size, width: int) -> None:
    """``bias`` must broadcast to ``lead + (width,)`` without adding leading dims beyond it."""
    target = (*lead, width)
    if bias.dim() < 1 or bias.dim() > len(target) or bias.shape[-1] != width:
        raise ValueError(f"{name} shape {_shape(bias)} cannot broadcast to {target}")
    for have, want in zip(reversed(bias.shape[:-1]), reversed(lead), strict=False):
        if have not in (1, want):
            raise ValueError(f"{name} shape {_shape(bias)} cannot broadcast to {target}")


@dataclass(frozen=True)
class _Bias:
    """A logits bias, flattened to rows with a map from token row to bias row."""

    full: torch.Tensor | None  # [rows, V]
    factor: torch.Tensor | None  # [rows, R]
    factor_weight: torch.Tensor | None  # [V, R]
    row_of_token: torch.Tensor | None  # [N] int64, or None when bias rows == token rows


def _resolve_bias(
    logits_bias: torch.Tensor | None,
    logits_bias_weight: torch.Tensor | None,
    lead: torch.Size,
    vocab: int,
    device: torch.device,
) -> _Bias:
    if logits_bias is None:
        if logits_bias_weight is not None:
            raise ValueError(
                f"logits_bias_weight {_shape(logits_bias_weight)} was given without logits_bias"
            )
        return _Bias(None, None, None, None)
    if not isinstance(logits_bias, torch.Tensor) or not logits_bias.dtype.is_floating_point:
        raise ValueError("logits_bias must be a floating tensor")
    if logits_bias_weight is None:
        _check_broadcast_rows(logits_bias, "logits_bias", lead, vocab)
        width = vocab
    else:
        if logits_bias_weight.dim() != 2 or logits_bias_weight.shape[0] != vocab:
            raise ValueError(
                f"logits_bias_weight must be [V={vocab}, R]; got {_shape(logits_bias_weight)}"
            )
        width = logits_bias_weight.shape[1]
        _check_broadcast_rows(logits_bias, "logits_bias (factored form, [..., R])", lead, width)
        if logits_bias_weight.dtype != logits_bias.dtype:
            raise ValueError(
                f"logits_bias and logits_bias_weight must share a dtype; got "
                f"{logits_bias.dtype} and {logits_bias_weight.dtype}"
            )
    padded = logits_bias.reshape((1,) * (len(lead) + 1 - logits_bias.dim()) + logits_bias.shape)
    rows = padded.flatten(0, -2)  # not reshape(-1, width): a factored width may be 0
    if tuple(padded.shape[:-1]) == tuple(lead):
        row_of_token = None
    else:
        # Map each token row to the bias row it broadcasts from: broadcast dims
        # contribute index 0, the others their own index.
        bias_index = torch.arange(rows.shape[0], device=device).reshape(padded.shape[:-1])
        row_of_token = bias_index.expand(lead).reshape(-1)
    if logits_bias_weight is None:
        return _Bias(rows, None, None, row_of_token)
    return _Bias(None, rows, logits_bias_weight, row_of_token)


def _checked_arguments(arguments: dict) -> _Features:
    """The loss features of a public call's ``arguments`` (its ``locals()`` on entry), after
    refusing DTensor inputs with advice instead of torch's mixed-tensor error."""
    _refuse_dtensor(arguments)
    return _resolve_features(
        arguments["logit_scale"],
        arguments["softcap"],
        arguments["label_smoothing"],
        arguments["lse_square_scale"],
        arguments["reduction"],
    )


def _refuse_dtensor(arguments: dict) -> None:
    """Raise ``ValueError`` for a DTensor among ``arguments``' values, naming it.

    No DTensor can exist unless ``torch.distributed.tensor`` was imported, so
    the check imports nothing.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return
    for name, t in arguments.items():
        if isinstance(t, dtensor):
            raise ValueError(
                f"{name} is a DTensor (placements {tuple(t.placements)}): the chunked loss works "
                "on local tensors. Call it inside the model's forward, where FSDP has "
                f"unsharded the parameters, or pass {name}.full_tensor()"
            )


REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class _Features:
    """Loss features on top of plain CE; each ``None`` / 0 when off."""

    logit_scale: float | None = None
    softcap: float | None = None
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0

    @property
    def changes_loss(self) -> bool:
        """Whether the training loss differs from the per-token NLL summed."""
        return self.label_smoothing != 0.0 or self.lse_square_scale != 0.0


def _real(
    value, what: str, *, low: float, high: float = math.inf, open_low: bool = False, hint: str = ""
) -> float:
    ok = is_real(value) and math.isfinite(float(value))
    if ok:
        value = float(value)
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = (f"> {low}" if open_low else f">= {low}") + (
            f" and <= {high}" if high != math.inf else ""
        )
        raise ValueError(f"{what} must be a finite number {bound}{hint}; got {value!r}")
    return value


def _resolve_features(
    logit_scale, softcap, label_smoothing, lse_square_scale, reduction
) -> _Features:
    """Checked loss features; ``ValueError`` names the argument and the allowed values."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if logit_scale is not None:
        logit_scale = _real(
            logit_scale, "logit_scale", low=0.0, open_low=True, hint=" (None: no scaling)"
        )
    if softcap is not None:
        softcap = _real(softcap, "softcap", low=0.0, open_low=True, hint=" (None: no cap)")
    smoothing = _real(label_smoothing, "label_smoothing", low=0.0, high=1.0)
    z_scale = _real(lse_square_scale, "lse_square_scale", low=0.0)
    return _Features(logit_scale, softcap, smoothing, z_scale)


# --------------------------------------------------------------------------- the chunk kernel


def _chunks(n: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


@dataclass(frozen=True)
class _Span:
    """The token rows of one chunk: flat rows ``[start, end)``, or, where the walk skips
    ignored targets, the flat rows that ``index`` lists."""

    start: int
    end: int
    index: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def sub(self, rows: torch.Tensor) -> _Span:
        """The span of this chunk's rows ``rows`` (int64 positions within the chunk)."""
        index = self.start + rows if self.index is None else self.index.index_select(0, rows)
        return _Span(0, rows.shape[0], index)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This chunk's rows of ``x`` (a view for a plain range, a copy for an index)."""
        return x[self.start : self.end] if self.index is None else x.index_select(0, self.index)

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` into this chunk's rows of ``out``."""
        if self.index is None:
            out[self.start : self.end] = value
        else:
            out.index_copy_(0, self.index, value)

    def add(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Add ``value`` to this chunk's rows of ``out``."""
        if self.index is None:
            out[self.start : self.end] += value
        else:
            out.index_add_(0, self.index, value)

    def fill(self, out: torch.Tensor, produce: Callable[[torch.Tensor], None]) -> None:
        """Have ``produce(rows)`` write this chunk's rows of ``out`` (in place for a range)."""
        if self.index is None:
            produce(out[self.start : self.end])
            return
        rows = out.new_empty((self.size, *out.shape[1:]))
        produce(rows)
        out.index_copy_(0, self.index, rows)


def _skips_ignored(device: torch.device) -> bool:
    """Whether a walk on ``device`` leaves out the rows whose target is ignored.

    Their loss is 0 and their gradient is zero by definition, so computing
    their logits is wasted work (in fine-tuning, masked prompts are often
    most of the rows). Finding the scored rows needs their count on the host:
    free on the CPU, a device sync elsewhere, so accelerators compute every
    row and zero the ignored ones.
    """
    return device.type == "cpu"


def _spans(valid: torch.Tensor, chunk_size: int) -> tuple[list[_Span], bool]:
    """The chunks of one walk, and whether they skip ignored rows (see ``_skips_ignored``).

    Skipping, a chunk holds ``chunk_size`` scored rows; rows that no span
    covers keep a zero loss and a zero hidden gradient.
    """
    n = valid.shape[0]
    if _skips_ignored(valid.device):
        scored = valid.nonzero().squeeze(1)
        if scored.shape[0] < n:
            return [_Span(s, e, scored[s:e]) for s, e in _chunks(scored.shape[0], chunk_size)], True
    return [_Span(s, e) for s, e in _chunks(n, chunk_size)], False


def _bias_rows(bias: _Bias, rows: torch.Tensor, span: _Span) -> torch.Tensor:
    if bias.row_of_token is None:
        return span.take(rows)
    return rows.index_select(0, span.take(bias.row_of_token))


# --------------------------------------------------------------------------- GEMM dtype policy


#: ``gemm_policy`` names: "auto" picks the device's default (see ``gemm_policy``).
GEMM_POLICIES = ("auto", "fp32", "model_dtype", "mixed")
_GEMM_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar(
    "channel_loss_gemm_policy", default="auto"
)


@contextlib.contextmanager
def gemm_policy(policy: str) -> Iterator[str]:
    """Force how the three LM-head products treat bf16 / fp16 data inside the scope.

    - ``"model_dtype"`` (the accelerator default): every product takes its
      operands in the model dtype (hidden, weight and the logits gradient
      rounded to it) and accumulates in fp32 (``torch.mm(..., out_dtype=
      torch.float32)`` / ``torch.addmm(..., out=fp32 accumulator)`` where the
      build has them: tensor-core GEMMs, never an fp32 GEMM of bf16 data). The
      logits and the weight gradient come out in fp32, the hidden gradient in
      the model dtype. Where the build lacks ``out_dtype``: on the CPU the
      same products are formed exactly from fp32 copies of the operands (so
      CPU tests check this policy's numerics); on accelerators each product
      is a model-dtype GEMM rounded once to the model dtype, then accumulated
      in fp32.
    - ``"mixed"`` (the CPU default for bf16 where the CPU has bf16 matrix
      instructions, ``cpu_has_bf16_gemm``): the two products whose results the
      standard path rounds to the model dtype once are torch's plain
      model-dtype GEMMs (fp32 accumulation, one rounding): the logits, which
      are ``F.linear(h, W).float()`` as the standard path forms them, and the
      hidden gradient, from the logits gradient rounded to the model dtype.
      The products accumulated over chunks (the weight and bias-factor
      gradients) are fp32 GEMMs of the fp32 logits gradient and upcast
      operands, as under ``"fp32"``: rounding each chunk's partial would add a
      rounding per chunk to the standard path's one.
    - ``"fp32"`` (the CPU default otherwise, measured fastest there: a CPU
      without bf16 units runs an fp32 GEMM many times faster than a bf16 one,
      and none of those measured runs fp16 GEMMs fast): operands are upcast to
      fp32 (the weight once per call) and the logits gradient stays fp32.
    - ``"auto"``: the default of the device the inputs live on (and, on the
      CPU, of its instruction set and the dtype).

    fp32 and float64 inputs are unaffected (float64 products run in float64,
    their logits rounded to fp32 once, as ``F.linear(h, W).float()`` does).
    Scopes are per context (a ``ContextVar``) and nest; the policy must be the
    same for a ``chunk_cross_entropy`` call and the ``per_token_cross_entropy``
    call that reproduces its observation.
    Raises ``ValueError`` for a name outside ``GEMM_POLICIES``.
    """
    if policy not in GEMM_POLICIES:
        raise ValueError(f"gemm_policy must be one of {GEMM_POLICIES}; got {policy!r}")
    token = _GEMM_POLICY.set(policy)
    try:
        yield policy
    finally:
        _GEMM_POLICY.reset(token)


def cpu_has_bf16_gemm() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX tiles), where
    torch's bf16 GEMMs run faster than fp32 ones instead of many times slower."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def default_gemm_policy(device: torch.device | str, dtype: torch.dtype) -> str:
    """The policy ``"auto"`` resolves to for inputs of ``dtype`` on ``device``.

    Accelerators: ``"model_dtype"``. CPU: ``"mixed"`` for bf16
    where ``cpu_has_bf16_gemm()`` (measured on an AVX512-BF16 CPU at 256 x 256 x
    32000: a bf16 GEMM 2.3-2.9x faster than the fp32 one), else ``"fp32"``.
    """
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind != "cpu":
        return "model_dtype"
    if dtype == torch.bfloat16 and cpu_has_bf16_gemm():
        return "mixed"
    return "fp32"


#: What this torch build can do, probed once per process (see ``_probe``).
_PROBED: dict[tuple[str, str], bool] = {}


def _probe(name: str, device_type: str, check: Callable[[], bool]) -> bool:
    """``check()``, once per process and device type: False where it raises.

    Runs outside any active ``TorchDispatchMode`` (a user's or a test's operation
    counter must not see the probe's tiny operations, whichever call comes first).
    """
    key = (name, device_type)
    known = _PROBED.get(key)
    if known is None:
        try:
            with _outside_dispatch_modes():
                known = bool(check())
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            known = False
        _PROBED[key] = known
    return known


def _outside_dispatch_modes() -> contextlib.AbstractContextManager:
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # a torch without it: probe where we are
        return contextlib.nullcontext()
    return _disable_current_modes()


def _has_out_dtype(device: torch.device) -> bool:
    """Whether this build runs ``mm`` / ``addmm`` with ``out_dtype=float32`` on ``device``."""

    def check() -> bool:
        x = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
        torch.mm(x, x, out_dtype=torch.float32)
        torch.mm(x, x, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return True

    return _probe("out_dtype", device.type, check)


class _Products:
    """The LM-head products of one call under its dtype policy (see ``gemm_policy``)."""

    def __init__(self, weight: torch.Tensor, factor_weight: torch.Tensor | None) -> None:
        policy = _GEMM_POLICY.get()
        if policy == "auto":
            policy = default_gemm_policy(weight.device, weight.dtype)
        self.dtype = weight.dtype
        # float64 is not low precision: its products run in float64, as the standard
        # path's do (only its logits are rounded to fp32, by ``.float()``).
        low = weight.dtype in (torch.bfloat16, torch.float16)
        self.upcast = low and policy == "fp32"
        self.round_logits = low and policy == "mixed"
        self.native = low and not self.upcast and _has_out_dtype(weight.device)
        # Without out_dtype, the CPU forms the same products exactly in fp32; an
        # accelerator rounds each product to the model dtype.
        self.emulate = low and not self.upcast and not self.native and weight.device.type == "cpu"
        self.weight = weight.float() if self.upcast else weight
        self.factor_weight = (
            factor_weight.float() if self.upcast and factor_weight is not None else factor_weight
        )

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden or bias-factor rows as a product operand."""
        return x.float() if self.upcast else x

    def grad_operand_dtype(self) -> torch.dtype:
        """The dtype ``grad_operand`` returns."""
        return torch.float32 if self.upcast else self.dtype

    def grad_operand(self, dlogits: torch.Tensor) -> torch.Tensor:
        """The fp32 logits gradient as a product operand: fp32, or rounded to the model dtype."""
        return dlogits if self.upcast else dlogits.to(self.dtype)

    def mm32(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``a @ b`` in fp32 (accumulated in fp32), written into ``out`` (fp32) when given;
        a float64 product is formed in float64 and rounded to fp32 once."""
        into = {} if out is None else {"out": out}
        if torch.float64 in (a.dtype, b.dtype):
            return _rounded_mm(a.double(), b.double(), out)
        if torch.float32 in (a.dtype, b.dtype) or self.emulate:
            return torch.mm(a.float(), b.float(), **into)
        if self.native:
            return torch.mm(a, b, out_dtype=torch.float32, **into)
        return _rounded_mm(a, b, out)

    def logits(self, h_rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The row-major fp32 logits ``h_rows @ weight.T``, written into ``out`` when given:
        rounded to the model dtype first under ``"mixed"``, else as ``mm32`` forms them.

        fp32 logits come from ``torch.mm``, the GEMM the standard path's
        ``F.linear`` runs. oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``)
        was 1.3-1.9x faster on an AVX512 EPYC at 256 rows, H=256, V=32000, but
        accumulates less precisely: its logits were 1.4x further from float64 at
        H=256, 1.7x at H=1024 and 2.2x at H=4096, and every gradient followed.
        """
        if self.round_logits:
            return _rounded_mm(h_rows, self.weight.t(), out)
        return self.mm32(h_rows, self.weight.t(), out)

    def mm_wide(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` as ``mm32`` forms it, but in float64 where an operand is float64 (the
        standard path's backward products of float64 inputs)."""
        if torch.float64 in (a.dtype, b.dtype):
            return torch.mm(a.double(), b.double())
        return self.mm32(a, b)

    def addmm32_(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``acc += a @ b`` into the accumulator ``acc`` (``_accumulator_dtype``), with no
        full-size temporary where the build allows it."""
        if acc.dtype == torch.float64:
            acc.addmm_(a.double(), b.double())
        elif torch.float32 in (a.dtype, b.dtype) or self.emulate:
            acc.addmm_(a.float(), b.float())
        elif self.native:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            acc.add_(torch.mm(a, b))

    def accumulated_grad_operand(
        self, dlogits: torch.Tensor | None, dl: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The logits-gradient operand of the products accumulated in fp32 (the weight and
        bias-factor gradients): the fp32 gradient itself under ``"mixed"`` (where it
        exists), else ``dl``, the operand of the hidden gradient."""
        return dlogits if self.round_logits and dlogits is not None else dl

    def grad_hidden(
        self,
        dl: torch.Tensor,
        out: torch.Tensor,
        row_factor: torch.Tensor | None = None,
        lifted: bool = False,
        dl_lift: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``out = row_factor[:, None] * (dl @ weight)`` in the hidden dtype (``dl`` from
        ``grad_operand``; ``row_factor`` None: no factor); a hidden dtype other than the
        product's is rounded to once, after the factor.

        ``lifted``: each row is rounded times the power of two :func:`_fp16_lift` gives it
        (formed in fp32 first), and the factors the rows of ``out`` carry are returned
        (times ``dl_lift``, the factors ``dl``'s rows already carry); else None."""
        if lifted:
            product = _row_scaled(self.mm32(dl, self.weight), row_factor)
            lift = _fp16_lift(product)
            out.copy_(product.mul_(lift.unsqueeze(1)))
            return lift if dl_lift is None else lift * dl_lift
        if dl.dtype == self.weight.dtype == out.dtype:
            product = torch.mm(dl, self.weight, out=out)
            if row_factor is not None:
                product.mul_(row_factor.unsqueeze(1))
        else:
            out.copy_(_row_scaled(torch.mm(dl, self.weight), row_factor))


# fp16's largest finite value is 65504 (just under 2**16); a lifted row's largest magnitude
# lands in [2**13, 2**14), with room for the upcast and the rounding of what follows.
_LIFT_TOP = 14


def _fp16_lift(rows: torch.Tensor, top: int = _LIFT_TOP) -> torch.Tensor:
    """Per row of fp32 ``rows``, the power of two that brings its largest magnitude into
    ``[2**(top - 1), 2**top)``. At the default ``top`` fp16 holds every value of the row
    down to 2**-10 of its largest with full precision, and more with less (a confident
    token's gradient, ~1e-6 of another's, would otherwise round to fp16's subnormals or to
    zero before the loss scale arrives in backward). Rows of zeros or non-finite values get
    a harmless power too."""
    if rows.shape[1] == 0:
        return torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
    # The largest magnitude without an |rows| temporary; = m * 2**exponent, m in [0.5, 1).
    _, exponent = torch.frexp(torch.maximum(rows.amax(1), rows.amin(1).neg()))
    shift = (top - exponent).clamp(-100, 100)  # 2**±100: within fp32, far past fp16
    return torch.ldexp(torch.ones(shift.shape, dtype=torch.float32, device=rows.device), shift)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of an input of ``dtype`` is accumulated in over the chunks."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rounded_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` as a GEMM in the operands' dtype (fp32 accumulation, one rounding to that
    dtype), upcast to fp32 into ``out`` when given."""
    return torch.mm(a, b).float() if out is None else out.copy_(torch.mm(a, b))


def _chunk_logits(
    h_rows: torch.Tensor,
    products: _Products,
    bias: _Bias,
    span: _Span,
    buffer: torch.Tensor | None,
) -> torch.Tensor:
    """Row-major fp32 logits ``[rows, V]`` of ``span``'s token rows (``h_rows``, as a
    product operand); the only place the LM head is applied.

    Written into the flat fp32 ``buffer`` when one is given (one buffer for
    every chunk of a walk spares the allocator a fresh chunk-sized block per
    chunk), else a new tensor (rows recomputed alone).
    """
    vocab = products.weight.shape[0]
    out = None if buffer is None else buffer[: span.size * vocab].view(-1, vocab)
    logits = products.logits(h_rows, out)
    if bias.full is not None:
        logits.add_(_bias_rows(bias, bias.full, span).float())
    elif bias.factor is not None:
        factor = products.operand(_bias_rows(bias, bias.factor, span))
        logits.add_(products.mm32(factor, products.factor_weight.t()))
    return logits


def _final_rows(
    h_rows: torch.Tensor, products: _Products, bias: _Bias, span: _Span, features: _Features
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows -> final logits of those rows of the chunk`` (recomputed from the LM head)."""

    def final(rows: torch.Tensor) -> torch.Tensor:
        logits = _chunk_logits(h_rows.index_select(0, rows), products, bias, span.sub(rows), None)
        _final_logits_(logits, features, keep_cap_slope=False)
        return logits

    return final


def _final_logits_(
    logits: torch.Tensor, features: _Features, keep_cap_slope: bool
) -> torch.Tensor | None:
    """Apply ``logit_scale`` then ``softcap`` to fp32 ``logits`` in place.

    Returns, when ``keep_cap_slope`` and a cap is set, ``d softcap / d input``
    (``1 - tanh**2``, a second chunk-sized buffer) for backward; else None.
    """
    if features.logit_scale is not None:
        logits.mul_(features.logit_scale)
    if features.softcap is None:
        return None
    logits.div_(features.softcap).tanh_()
    slope = torch.square(logits).neg_().add_(1.0) if keep_cap_slope else None
    logits.mul_(features.softcap)
    return slope


def _softmax_ce_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    features: _Features = _Features(),
    final_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """Per-token CE of fp32 ``logits`` (0.0 where not ``valid``); turns ``logits`` into softmax.

    Returns ``(token_nll, sumexp, lse, train_loss)``; afterwards ``logits``
    holds the softmax times ``sumexp``: ``exp(logits - rowmax)`` from the
    passes, the softmax itself (``sumexp`` all ones) from the fused kernel.
    ``train_loss`` is the per-token loss with label smoothing and z-loss
    (``token_nll`` itself when neither is on). ``final_rows(rows)``, which
    recomputes the given rows' final logits, is what the fused softmax (see
    ``_fused_softmax``) needs for rows whose target probability underflows;
    without it the passes run.
    """
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    target_logit = logits.gather(1, safe).squeeze(1)
    smoothing = features.label_smoothing
    logit_sum = logits.sum(dim=1) if smoothing else None
    if final_rows is not None and _fused_softmax(logits):
        torch.ops.aten._softmax.out(logits, 1, False, out=logits)
        # -log p_t is the NLL, without the cancellation of lse - x_t; where p_t
        # underflows (an NLL above ~87) the row's lse comes from its recomputed logits.
        token_loss = logits.gather(1, safe).squeeze(1).log_().neg_()
        lse = target_logit + token_loss
        lost = ((token_loss > _NLL_LIMIT) & valid).nonzero().squeeze(1)
        if lost.shape[0]:
            lse[lost] = torch.logsumexp(final_rows(lost), dim=1)
            token_loss[lost] = lse[lost] - target_logit[lost]
        token_loss = torch.where(valid, token_loss, 0.0)
        sumexp = torch.ones_like(lse)
    else:
        rowmax = logits.amax(dim=1)
        logits.sub_(rowmax.unsqueeze(1)).exp_()
        sumexp = logits.sum(dim=1)
        lse = sumexp.log() + rowmax
        token_loss = torch.where(valid, lse - target_logit, 0.0)
    if not features.changes_loss:
        return token_loss, sumexp, lse, token_loss
    train = token_loss
    if smoothing:
        # F.cross_entropy's definition: (1 - e) * nll + e * mean_j(-log softmax_j).
        smooth = lse - logit_sum / logits.shape[1]
        train = (1.0 - smoothing) * train + smoothing * smooth
    if features.lse_square_scale:
        train = train + features.lse_square_scale * lse.square()
    return token_loss, sumexp, lse, torch.where(valid, train, 0.0)


#: An NLL above this came from a target probability at or below fp32's smallest
#: normal number (-log(2**-126) = 87.3), so it lost digits or is inf.
_NLL_LIMIT = 87.0


def _fused_softmax(logits: torch.Tensor) -> bool:
    """Whether the chunk math turns ``logits`` into its softmax by torch's fused kernel
    in place (the CPU) rather than by max / subtract / exp / sum passes.

    On the CPU the kernel reads each row about once from memory (the row stays
    in cache between its max, exp-sum and scale), the passes four times:
    measured (with the logits from oneDNN's linear, since replaced by
    ``torch.mm``) at N=4096 H=256 V=32000 fp32, a whole step 0.80x the time
    of the passes over vocabulary-major blocks (median of 6 alternating
    pairs). Finding rows whose target probability underflowed needs their
    count on the host, free only on the CPU. The kernel writing
    over its own input is probed once against the out-of-place softmax.
    """
    if logits.device.type != "cpu" or not logits.is_contiguous():
        return False

    def check() -> bool:
        x = torch.tensor([[0.5, -1.0, 3.0, 2.0], [1.0, 1.0, -30.0, 0.0]])
        want = torch.softmax(x, dim=1)
        torch.ops.aten._softmax.out(x, 1, False, out=x)
        return torch.equal(x, want)

    return _probe("softmax_in_place", "cpu", check)


def _final_logit_rows(logits: torch.Tensor, features: _Features, rows: torch.Tensor):
    """The final fp32 logits of ``rows`` of given ``logits`` (the logits path's ``final_rows``)."""
    chosen = logits.index_select(0, rows).to(torch.float32, copy=True)
    _final_logits_(chosen, features, keep_cap_slope=False)
    return chosen


def _chunked_pass(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: _Bias,
    targets: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor | None,
    chunk_size: int,
    needs: tuple[bool, bool, bool, bool, bool],
    features: _Features = _Features(),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """One walk over the chunks: per-token NLL [N], per-token training loss [N], the
    gradients ``needs`` asks for, and the per-row powers of two an fp16 hidden gradient's
    rows are stored times (``_fp16_lift``; None for any other).

    The chunk math runs as ``_fused.chunk_math`` says: compiled kernels or
    the eager passes. A compilation failure reruns the whole walk eagerly
    (with a warning), so one call never mixes the two.

    The NLL is the CE of the final logits (after ``logit_scale`` and
    ``softcap``); the training loss adds label smoothing and z-loss (it is the
    NLL tensor itself when neither is on). Gradients are those of
    ``sum(training loss) * scale`` for (hidden rows, weight, full bias rows,
    bias factor rows, bias factor weight), in fp32 except the hidden one,
    which has the hidden dtype.
    """
    args = (h, weight, bias, targets, valid, scale, chunk_size, needs, features)
    if _fused.use_compiled(h.device):
        try:
            return _walk(*args, fused=True)
        except Exception as exc:
            if not _fused.compile_failed(h.device, exc):
                raise
    return _walk(*args, fused=False)


def _walk(
    *args, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], torch.Tensor | None]:
    """``_chunked_pass`` (same positional arguments) with the chunk math ``fused`` or eager."""
    h, weight, bias, targets, valid, scale, chunk_size, needs, features = args
    n = targets.shape[0]
    need_h, need_w, need_full, need_factor, need_factor_w = needs

    def zeros(t: torch.Tensor | None, need: bool, *, wide: bool = True) -> torch.Tensor | None:
        # Accumulated in fp32, or in float64 for a float64 input whose gradient the
        # standard path forms by float64 products (``wide``).
        dtype = _accumulator_dtype(t.dtype) if need and wide else torch.float32
        return torch.zeros(t.shape, dtype=dtype, device=h.device) if need else None

    spans, skipping = _spans(valid, chunk_size)
    # Skipped rows are never written: their loss and hidden gradient start at zero.
    rows_of = torch.zeros if skipping else torch.empty
    token_losses = rows_of(n, dtype=torch.float32, device=h.device)
    train_losses = (
        rows_of(n, dtype=torch.float32, device=h.device) if features.changes_loss else token_losses
    )
    grad_h = rows_of(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    # fp16 hidden-gradient rows are stored lifted (see _fp16_lift); skipped rows are zeros.
    lifts = (
        torch.ones(n, dtype=torch.float32, device=h.device)
        if need_h and h.dtype == torch.float16
        else None
    )
    grad_w = zeros(weight, need_w)
    # The standard path sums a full bias's gradient in fp32 (``logits_bias.float()``).
    grad_full = zeros(bias.full, need_full, wide=False)
    grad_factor = zeros(bias.factor, need_factor)
    grad_factor_w = zeros(bias.factor_weight, need_factor_w)
    any_grad = any(needs)
    products = _Products(weight, bias.factor_weight)
    # One chunk of fp32 logits for the whole walk (see _chunk_logits).
    widest = max((span.size for span in spans), default=0)
    buffer = torch.empty(widest * weight.shape[0], dtype=torch.float32, device=h.device)
    for span in spans:
        h_rows = products.operand(span.take(h))
        logits = _chunk_logits(h_rows, products, bias, span, buffer)
        t, v = span.take(targets), span.take(valid)
        if fused:
            nll, train, *row_stats = _fused.stats(logits, t, v, features)
        else:
            cap_slope = _final_logits_(logits, features, keep_cap_slope=any_grad)
            final = _final_rows(h_rows, products, bias, span, features)
            nll, sumexp, lse, train = _softmax_ce_(logits, t, v, features, final)
        span.put(token_losses, nll)
        if train_losses is not token_losses:
            span.put(train_losses, train)
        if not any_grad:
            del logits
            continue
        # The gradient is row_factor[:, None] * dlogits (row_factor None: dlogits itself).
        row_factor = None
        if fused:
            dlogits, dl = _fused_dlogits(
                logits, t, v, row_stats, scale, features, products, needs, lifts is not None
            )
        else:
            # Folding the row factor into the products needs fp32 operands (a
            # model-dtype operand would be rounded twice) and no full bias
            # gradient (which takes the block itself).
            fold = products.grad_operand_dtype() == torch.float32 and not need_full
            dlogits, row_factor = _eager_dlogits(
                logits, t, v, sumexp, lse, cap_slope, scale, features, fold=fold
            )
            dl = (
                products.grad_operand(dlogits)
                if need_h or need_w or bias.factor is not None
                else None
            )
            del cap_slope
        acc = products.accumulated_grad_operand(dlogits, dl)
        if need_h:
            dl_h, dl_lift = dl, None
            if lifts is not None and dl.dtype != torch.float32:
                # The operand is rounded to fp16 too: lift its rows first (max into
                # [0.5, 1), so that the product stays in range); the weight's keeps dl.
                dl_lift = _fp16_lift(dlogits, top=0)
                # Lifted in place and back (exact: powers of two), not into an fp32
                # temporary; rounded over dl where the other products take the fp32
                # gradient instead ("mixed").
                dl_h = dl if acc is not dl else torch.empty_like(dl)
                dl_h.copy_(dlogits.mul_(dl_lift.unsqueeze(1)))
                dlogits.div_(dl_lift.unsqueeze(1))
            _fill_grad_hidden(grad_h, lifts, span, products, dl_h, row_factor, dl_lift)
            del dl_h
        if need_w:
            products.addmm32_(grad_w, acc.t(), _row_scaled(h_rows, row_factor))
        if need_full:
            _scatter_rows(grad_full, bias, dlogits, span)
        if need_factor:
            d_factor = _row_scaled(products.mm_wide(acc, products.factor_weight), row_factor)
            _scatter_rows(grad_factor, bias, d_factor, span)
        if need_factor_w:
            factor = products.operand(_bias_rows(bias, bias.factor, span))
            products.addmm32_(grad_factor_w, acc.t(), _row_scaled(factor, row_factor))
        # This chunk's model-dtype operand goes before the next chunk makes its own.
        del logits, dlogits, dl, acc, h_rows, row_factor
    grads = [grad_h, grad_w, grad_full, grad_factor, grad_factor_w]
    return token_losses, train_losses, grads, lifts


def _fill_grad_hidden(
    grad_h: torch.Tensor,
    lifts: torch.Tensor | None,
    span: _Span,
    products: _Products,
    dl: torch.Tensor,
    row_factor: torch.Tensor | None,
    dl_lift: torch.Tensor | None = None,
) -> None:
    """Write ``span``'s rows of the hidden gradient, lifted (and their lifts recorded in
    ``lifts``) where ``lifts`` is given (see ``_Products.grad_hidden``)."""

    def produce(out: torch.Tensor) -> None:
        lift = products.grad_hidden(dl, out, row_factor, lifted=lifts is not None, dl_lift=dl_lift)
        if lifts is not None:
            span.put(lifts, lift)

    span.fill(grad_h, produce)


def _eager_dlogits(
    logits, t, v, sumexp, lse, cap_slope, scale, features, *, fold: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits gradient, written over ``logits`` (which ``_softmax_ce_`` left holding
    the softmax times ``sumexp``), as ``(block, row_factor)``: the gradient is
    ``row_factor[:, None] * block``, or ``block`` itself where ``row_factor`` is None.

    With ``fold`` the per-row factor is left out of the block for the products to
    apply to their ``[rows, H]`` operands and results, which spares a pass over the
    ``[rows, V]`` block; without, ``row_factor`` is None.
    """
    smoothing, z_scale = features.label_smoothing, features.lse_square_scale
    # d(training loss)/d(final logits) on valid rows, times the loss scale:
    # softmax * (1 + 2 s lse) - (1 - e) onehot - e / V, where softmax = E / sumexp.
    row_scale = torch.where(v, scale, 0.0)
    safe = torch.where(v, t, 0).unsqueeze(1)
    target_e = logits.gather(1, safe)
    if fold:
        # = (row_scale / sumexp) * (E (1 + 2 s lse) - sumexp ((1 - e) onehot + e / V)):
        # a factor that is finite on every row (sumexp >= 1) and zero on ignored ones.
        row_factor = row_scale / sumexp
        unit = sumexp
        if z_scale:
            logits.mul_((1.0 + 2.0 * z_scale * lse).unsqueeze(1))
    else:
        row_factor = None
        unit = row_scale
        coef = row_scale / sumexp
        if z_scale:
            coef = coef * (1.0 + 2.0 * z_scale * lse)
        logits.mul_(coef.unsqueeze(1))
    if smoothing:
        logits.sub_((unit * (smoothing / logits.shape[1])).unsqueeze(1))
    target = _target_grad(target_e, sumexp, row_scale, lse, features, fold, logits.shape[1])
    logits.scatter_(1, safe, target)
    # Back through the cap and the scale to the logits of the LM head.
    if cap_slope is not None:
        logits.mul_(cap_slope)
    if features.logit_scale is not None:
        if row_factor is not None:
            row_factor = row_factor * features.logit_scale
        else:
            logits.mul_(features.logit_scale)
    return logits, row_factor


def _target_grad(
    target_e, sumexp, row_scale, lse, features, fold: bool, vocab: int
) -> torch.Tensor:
    """The target column of ``_eager_dlogits``'s block, ``[rows, 1]``:
    ``(p_t - (1 - e)) + 2 s lse p_t - e / V``, in the block's units.

    Formed from the target's ``E`` before any scaling, as
    ``(E_t - (1 - e) sumexp + 2 s lse E_t - e sumexp / V) / sumexp``: the
    cancellation of a confident target (p_t near 1) happens in ``E_t -
    sumexp``, exactly, leaving only the rounding ``sumexp`` already has, as in
    the standard path's CE gradient. Scaling ``E_t`` first and subtracting
    the one-hot after lost those digits: with z-loss, 470x the standard path's
    error at V = 1; without, 1.3x at V = 8.
    """
    smoothing, z_scale = features.label_smoothing, features.lse_square_scale
    e = target_e.squeeze(1)
    value = e - (1.0 - smoothing) * sumexp
    if z_scale:
        value = value + (2.0 * z_scale * lse) * e
    if smoothing:
        value = value - sumexp * (smoothing / vocab)
    # fold: the block is in units of sumexp (its row factor comes later); else scaled.
    return (value if fold else value * (row_scale / sumexp)).unsqueeze(1)


def _row_scaled(x: torch.Tensor, row_factor: torch.Tensor | None) -> torch.Tensor:
    """``row_factor[:, None] * x`` (``x`` itself for None)."""
    return x if row_factor is None else x * row_factor.unsqueeze(1)


def _fused_dlogits(logits, t, v, row_stats, scale, features, products, needs, keep_fp32):
    """``(fp32 logits gradient or None, its product operand)`` from the compiled kernel.

    The fp32 gradient is written over ``logits`` when the products take fp32,
    the full bias needs its gradient (``needs[2]``) or ``keep_fp32`` asks for it;
    otherwise the kernel writes the model-dtype operand directly and the fp32
    gradient is never formed.
    """
    operand = products.grad_operand_dtype()
    if operand == torch.float32 or needs[2] or keep_fp32:
        dlogits = _fused.dlogits_(logits, t, v, row_stats, scale, features, None)
        return dlogits, products.grad_operand(dlogits)
    return None, _fused.dlogits_(logits, t, v, row_stats, scale, features, operand)


# Rows of a gradient rescaled per step in backward: an fp32 temporary of at
# most this many elements instead of one as large as the gradient.
_RESCALE_BLOCK = 1 << 20


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _rescaled(
    g: torch.Tensor,
    factor: torch.Tensor,
    dtype: torch.dtype,
    reuse: bool,
    in_fp32: bool,
    row_lifts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g * factor`` (``g * factor / row_lifts[:, None]`` where ``row_lifts`` is given) as
    ``dtype``, written into ``g`` itself when ``reuse``.

    ``in_fp32``: multiply in fp32 even though ``g`` is low precision (an
    fp16 gradient times a factor that may lie below fp16's range). Otherwise
    the arithmetic is ``g * factor`` in ``g``'s dtype, as autograd would do it.
    Never allocates an fp32 temporary larger than ``_RESCALE_BLOCK`` elements.
    """
    if row_lifts is not None:
        in_fp32 = True
    if g.dtype == dtype and not in_fp32:
        return g.mul_(factor) if reuse else g * factor
    if reuse and not in_fp32:
        return g.mul_(factor).to(dtype)
    out = g if reuse and g.dtype == dtype else torch.empty(g.shape, dtype=dtype, device=g.device)
    rows = max(1, _RESCALE_BLOCK // max(1, math.prod(g.shape[1:])))
    for s in range(0, g.shape[0], rows):
        f = factor if row_lifts is None else factor / row_lifts[s : s + rows].unsqueeze(1)
        out[s : s + rows] = g[s : s + rows].float() * f
    return out


_SECOND_ORDER = (
    "chunk_cross_entropy is once differentiable (trying to differentiate twice a function "
    "that was marked with @once_differentiable): its backward returns gradients computed "
    "in the forward pass, so create_graph=True / second-order gradients through it are "
    "not supported"
)


class _ChunkedCE(torch.autograd.Function):
    """Loss, per-token losses and input gradients from one chunked pass.

    Forward returns ``(loss, token_losses)``; token_losses is non-differentiable.
    Only the finished gradients are saved for backward, so saved-tensor hooks
    (offload, checkpoint) see a few long-lived tensors and never the chunk
    intermediates.

    fp16 (``defer``): the saved gradients are those of the *summed* CE; the
    divisor is applied in backward together with the upstream factor (a
    ``GradScaler`` scale), so values that fp16 can hold are never divided
    into its underflow range first. Other dtypes keep the divisor folded in.

    Backward writes into the saved gradients (holding each one once) unless
    the graph is being retained, and is not differentiable itself: a
    backward with ``create_graph=True`` (second-order gradients) raises
    ``RuntimeError`` with the standard ``once_differentiable`` wording.
    """

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        bias_full,
        bias_factor,
        bias_factor_weight,
        targets,
        valid,
        denom,
        bias_map,
        chunk_size,
        needs,
        features,
    ):
        bias = _Bias(bias_full, bias_factor, bias_factor_weight, bias_map)
        defer = h.dtype == torch.float16
        scale = torch.ones_like(denom) if defer else denom.reciprocal()
        token_losses, train_losses, grads, lifts = _chunked_pass(
            h, weight, bias, targets, valid, scale, chunk_size, needs, features
        )
        loss = train_losses.sum() / denom
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(token_losses)
        inputs = (h, weight, bias_full, bias_factor, bias_factor_weight)
        ctx.dtypes = [None if g is None else x.dtype for g, x in zip(grads, inputs, strict=True)]
        ctx.defer = defer
        ctx.lifted = lifts is not None
        ctx.save_for_backward(
            denom, *([lifts] if ctx.lifted else []), *(g for g in grads if g is not None)
        )
        return loss, token_losses

    @staticmethod
    def backward(ctx, grad_loss, _grad_token_losses):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients returned here are constants of the
            # forward, so any derivative taken of them would be silently wrong.
            raise RuntimeError(_SECOND_ORDER)
        return _ChunkedCE._backward(ctx, grad_loss)

    @staticmethod
    @once_differentiable
    def _backward(ctx, grad_loss):
        denom, *saved = ctx.saved_tensors
        lifts = saved.pop(0) if ctx.lifted else None
        grads = [None] * len(ctx.dtypes)
        if grad_loss is not None:
            # Multiply unconditionally: testing grad_loss == 1 would sync the host.
            factor = grad_loss.float() / denom if ctx.defer else grad_loss
            reuse = not _keep_graph()
            saved_grads = iter(saved)
            for i, dtype in enumerate(ctx.dtypes):
                if dtype is not None:
                    g = next(saved_grads)
                    grads[i] = _rescaled(
                        g,
                        factor,
                        dtype,
                        reuse,
                        in_fp32=ctx.defer and g.dtype != torch.float32,
                        row_lifts=lifts if i == 0 else None,
                    )
        return (*grads, None, None, None, None, None, None, None)


def _scatter_rows(grad_rows: torch.Tensor, bias: _Bias, d: torch.Tensor, span: _Span) -> None:
    if bias.row_of_token is None:
        span.add(grad_rows, d)
    else:
        grad_rows.index_add_(0, span.take(bias.row_of_token), d)


# --------------------------------------------------------------------------- chunk size


#: Bounds of the default chunk (rows) on the CPU and on accelerators.
CPU_CHUNK_BOUNDS = (8, 4096)
ACCELERATOR_CHUNK_BOUNDS = (512, 8192)
#: Largest default chunk of fp32 logits for the logits fallback (elements).
LOGITS_CHUNK_ELEMENTS = 1 << 24


def _floor_pow2(x: float) -> int:
    return 1 << max(0, math.floor(math.log2(x))) if x >= 1 else 1


def default_chunk_size(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> int:
    """The ``chunk_size`` that ``chunk_cross_entropy(chunk_size=None)`` uses.

    The rule: the largest power of two ``c`` such that one chunk's fp32 logits
    (``c x vocab x 4`` bytes) are no larger than the hidden states
    (``tokens x hidden x dtype.itemsize`` bytes), clamped to the device's
    bounds: ``CPU_CHUNK_BOUNDS`` = [8, 4096] rows on the CPU,
    ``ACCELERATOR_CHUNK_BOUNDS`` = [512, 8192] elsewhere (CUDA, NPU). On the
    CPU the chunk may also grow to ``hidden`` rows, i.e. fp32 logits of the
    size of the fp32 weight gradient that the op holds anyway.

    Why: every chunk reads the weight twice and reads and writes the whole
    fp32 weight gradient (``16 x vocab x hidden`` bytes) for ``6 x c x vocab x
    hidden`` FLOPs, so small chunks are bound by memory traffic, not compute.
    On the CPU below ~``hidden`` rows that traffic and the GEMMs' short
    inner dimension dominate (measured at H=256, V=32000: 32 rows 4-6x slower
    than 128, and 128 rows 1.2x slower than 256), while the extra memory stays
    under 2x the weight gradient plus two hidden-state copies. Larger chunks
    are faster still (512 rows 0.85x the step time of 256 at N=32768, fp32)
    but there cost more memory than torch's chunked ``linear_cross_entropy``
    (127.0 against 126.4 MiB extra peak). On
    accelerators the floor of 512 rows is where, at H200-class bandwidth and
    tensor-core rates, the weight-gradient traffic stops
    setting the time (a roofline estimate; ``scripts/bench/cuda_qualify.py`` measures
    the default against other chunk sizes). Depends only on the arguments,
    so calls with the same shapes chunk alike (the bitwise
    ``per_token_cross_entropy`` contract).
    """
    on_cpu = torch.device(device).type == "cpu"
    low, high = CPU_CHUNK_BOUNDS if on_cpu else ACCELERATOR_CHUNK_BOUNDS
    rows = tokens * hidden * dtype.itemsize / (4 * max(vocab, 1))
    if on_cpu:
        rows = max(rows, hidden)
    return min(max(_floor_pow2(rows), low), high)


def _resolve_chunk_size(chunk_size, hidden_states: torch.Tensor, vocab: int) -> int:
    if chunk_size is None:
        tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1)
        return default_chunk_size(
            tokens, hidden_states.shape[-1], vocab, hidden_states.dtype, hidden_states.device
        )
    return _check_chunk_size(chunk_size)


def _check_chunk_size(chunk_size) -> int:
    return check_int(chunk_size, "chunk_size", minimum=1)


# --------------------------------------------------------------------------- num_items_in_batch


def _denominator(num_items_in_batch, valid: torch.Tensor) -> torch.Tensor:
    """fp32 0-d divisor on ``valid``'s device; the caller's value is never written to.

    One rule for ints, floats, numpy scalars and tensors: a finite number
    >= 0, and 0 only when no target is scored (an empty batch gives loss 0
    and zero gradients, never NaN). ``None``: the local count of scored
    targets. A value the host knows (a Python or numpy number, a CPU tensor)
    is checked at once; a tensor on an accelerator is checked there, without a
    host sync (``_require``), and so is "0 while targets are scored" when the
    targets live on an accelerator.
    """
    what = "num_items_in_batch"
    if num_items_in_batch is None:
        denom = valid.sum().to(torch.float32)
        return torch.where(denom == 0, torch.ones_like(denom), denom)
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"{what} must be a scalar; got shape {_shape(num_items_in_batch)}")
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.dtype.is_complex:
            raise ValueError(f"{what} must be a real number; got dtype {num_items_in_batch.dtype}")
        given = num_items_in_batch.detach().reshape(())
        # A CPU tensor's value is already on the host: reading it syncs nothing.
        host = float(given.item()) if given.device.type == "cpu" else None
    elif is_real(num_items_in_batch):
        given, host = None, float(num_items_in_batch)
    else:
        raise ValueError(
            f"{what} must be an int, a float, a numpy scalar, a scalar tensor or None; "
            f"got {type(num_items_in_batch).__name__}"
        )
    zero_msg = f"{what} is 0 while some targets are scored (the loss would be inf)"
    if host is None:
        denom = given.to(valid.device, torch.float32)
        _require(
            torch.isfinite(denom) & (denom >= 0) & ((denom != 0) | ~valid.any()),
            f"{what} must be a finite number >= 0, and not 0 while targets are scored",
        )
    else:
        if not math.isfinite(host) or host < 0:
            raise ValueError(f"{what} must be a finite number >= 0; got {num_items_in_batch!r}")
        # torch.full fills on the device; torch.tensor(host, device=...) would copy and sync.
        denom = torch.full((), host, dtype=torch.float32, device=valid.device)
        if host == 0:
            if valid.device.type == "cpu":
                if bool(valid.any()):
                    raise ValueError(zero_msg)
            else:
                _require(~valid.any(), zero_msg)
    return torch.where(denom == 0, torch.ones_like(denom), denom)


# --------------------------------------------------------------------------- public API


_COMPILE_NOTE = (
    "channel_loss ops run eagerly under torch.compile: a traced chunk loop loses the "
    "O(chunk_size x V) memory bound (it grows with the token count like full logits)"
)
_EAGER: dict[Callable, Callable] = {}


def _eager_under_compile(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, made on the first call so importing stays cheap.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (seconds). Under
    ``torch.compile`` the call is a graph break and ``fn`` runs eagerly; with
    ``fullgraph=True`` compilation fails with ``_COMPILE_NOTE`` in the message
    (also when the very first call is being traced, via the ``raise`` below).
    """

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        disabled = _EAGER.get(fn)
        if disabled is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILE_NOTE)
            disabled = _EAGER[fn] = torch.compiler.disable(fn, reason=_COMPILE_NOTE)
        return disabled(*args, **kwargs)

    return eager


_FEATURES_DOC = """
    Loss features (keyword-only, off by default), in the order applied:
    ``logit_scale`` multiplies the fp32 logits (Cohere's ``logit_scale``,
    Granite's ``1 / logits_scaling``); ``softcap`` then maps them to
    ``softcap * tanh(logits / softcap)`` (Gemma 2/3). The result is the
    *final logits*. ``label_smoothing`` mixes the NLL with the uniform
    target as ``F.cross_entropy`` defines it; ``lse_square_scale`` adds the
    z-loss ``lse_square_scale * logsumexp(final logits)**2`` per scored token,
    reduced like the CE. ``reduction="sum"`` returns the sum over scored
    tokens (no divisor; ``num_items_in_batch`` must then be None).

    The observation (``capture()``, ``per_token_cross_entropy``) is always
    the per-token NLL of the final logits, never the smoothing or z-loss
    terms, so channel metrics stay comparable across recipes.
"""


def _loss_features_doc(fn: Callable) -> Callable:
    fn.__doc__ = (fn.__doc__ or "") + _FEATURES_DOC
    return fn


@_eager_under_compile
@_loss_features_doc
def chunk_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    logits_bias: torch.Tensor | None = None,
    logits_bias_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean token cross-entropy of ``F.linear(hidden_states, weight)`` logits, chunked.

    Targets are ``shift_labels`` or ``labels`` shifted left by one (last
    position ignored). Logits are the fp32 product ``h @ weight.T`` plus
    ``logits_bias.float()`` (broadcastable to ``[..., V]``) or plus the fp32
    product ``logits_bias @ logits_bias_weight.T`` (factored); for bf16 /
    fp16 inputs the products accumulate in fp32, and only the CPU's bf16
    policy on CPUs with bf16 units rounds the logits to the model dtype, as
    the standard ``F.linear(h, W).float()`` does (``gemm_policy`` says how
    each product is formed per device). Under ``torch.autocast`` for the inputs'
    device, ``hidden_states``, ``weight`` and a factored bias pair are first cast to
    its dtype, as autocast casts ``F.linear``'s operands (float64 kept; an additive
    ``logits_bias`` is added as given); the op's own matmuls never are.

    Returns a 0-d fp32 tensor: the CE summed over targets that are not
    ``ignore_index``, divided by ``num_items_in_batch`` (never modified) or by
    the local count of such targets. With no valid target the loss is 0.0 and
    every gradient zero. Gradients reach every input that requires grad; the
    weight gradient accumulates in fp32; fp16 gradients are as accurate as
    the standard ``F.linear(...).float()`` + CE path under loss scaling (the
    divisor is applied in backward, with the upstream factor). Extra memory is
    O(chunk_size x V) plus the gradients; ``chunk_size=None`` picks it from
    the shapes (``default_chunk_size``), an int wins. Inside ``capture()`` the
    per-token losses of this very pass are recorded; loss and gradients are
    bitwise the same with or without a scope.

    Not differentiable twice (second-order gradients raise). Under
    ``torch.compile`` the call runs eagerly (one graph break; with
    ``fullgraph=True`` compilation fails naming this op), which keeps the
    memory bound; inside, the per-chunk softmax / CE / gradient math runs as
    ``chunk_math`` says (compiled kernels on CUDA, eager passes on the CPU by
    default). On accelerators the checks of target range and of
    ``num_items_in_batch`` values cost no host sync: they run on the device
    and a failure surfaces as a device-side assertion at the next sync.

    Raises ``ValueError`` naming the argument for inconsistent shapes, dtypes,
    targets outside ``[0, V)``, ``chunk_size < 1``, a ``num_items_in_batch``
    that is negative, not finite, or 0 while targets are scored, a loss
    feature out of range (``softcap`` or ``logit_scale`` <= 0,
    ``label_smoothing`` outside [0, 1], ``lse_square_scale`` < 0, a
    ``reduction`` other than "mean" / "sum"), or a DTensor input (call the
    op where FSDP has unsharded the weight, inside the model's forward, or
    pass ``.full_tensor()``).
    """
    features = _checked_arguments(locals())
    if reduction == "sum" and num_items_in_batch is not None:
        raise ValueError(
            "num_items_in_batch divides the summed loss: pass it with reduction='mean' "
            f"(the default), not with reduction='sum'; got {num_items_in_batch!r}"
        )
    (hidden_states, weight, logits_bias, logits_bias_weight), own_precision = _as_autocast_would(
        hidden_states, weight, logits_bias, logits_bias_weight
    )
    _check_hidden_weight(hidden_states, weight)
    vocab = weight.shape[0]
    chunk_size = _resolve_chunk_size(chunk_size, hidden_states, vocab)
    lead = hidden_states.shape[:-1]
    targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "hidden_states")
    bias = _resolve_bias(logits_bias, logits_bias_weight, lead, vocab, hidden_states.device)
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    if reduction == "sum":
        denom = torch.ones((), dtype=torch.float32, device=valid.device)
    else:
        denom = _denominator(num_items_in_batch, valid)
    h = hidden_states.flatten(0, -2)  # not reshape(-1, H): H may be 0
    inputs = (h, weight, bias.full, bias.factor, bias.factor_weight)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and t is not None and t.requires_grad for t in inputs)
    with own_precision:
        loss, token_losses = _ChunkedCE.apply(
            *inputs, flat_targets, valid, denom, bias.row_of_token, chunk_size, needs, features
        )
    record(token_losses.reshape(lead), targets, ignore_index)
    return loss


@_eager_under_compile
@_loss_features_doc
def per_token_cross_entropy(
    *,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    logits_bias: torch.Tensor | None = None,
    logits_bias_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Detached fp32 per-token CE with the leading shape of the targets, 0.0 where ignored.

    Give either ``logits`` (``[..., V]``, as a logits-returning model produces)
    or ``hidden_states`` and ``weight`` (with optional bias, as for
    ``chunk_cross_entropy``). For the hidden path and the same ``chunk_size``
    and loss features (also when both calls leave the chunk None, since the
    default depends only on the shapes, dtype and device), the result is
    bitwise equal to what ``capture()`` records for ``chunk_cross_entropy``.
    For logits the default chunk keeps each fp32 working copy at most
    ``LOGITS_CHUNK_ELEMENTS`` elements; ``logit_scale`` / ``softcap`` are
    applied to the given logits (pass them only if the model has not). Never
    builds an autograd graph. ``label_smoothing``, ``lse_square_scale`` and
    ``reduction`` are checked and accepted so a caller can pass the same
    arguments as to ``chunk_cross_entropy``; they do not change the
    per-token NLL returned here.
    """
    checked = _checked_arguments(locals())
    if logits is not None:
        # Only the terms that change the final logits matter to the NLL.
        features = _Features(checked.logit_scale, checked.softcap)
        if hidden_states is not None or weight is not None:
            raise ValueError("pass either logits or hidden_states + weight, not both")
        if logits_bias is not None or logits_bias_weight is not None:
            raise ValueError("logits_bias applies to the hidden_states path only; add it to logits")
        if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
            raise ValueError(
                f"logits must be a [..., V] tensor; got {getattr(logits, 'shape', logits)}"
            )
        if not logits.dtype.is_floating_point:
            raise ValueError(f"logits must be floating point; got dtype {logits.dtype}")
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        chunk_size = (
            max(1, LOGITS_CHUNK_ELEMENTS // max(vocab, 1))
            if chunk_size is None
            else _check_chunk_size(chunk_size)
        )
        targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "logits")
        flat_logits = logits.detach().flatten(0, -2)  # V may be 0
        flat_targets = targets.reshape(-1)
        valid = flat_targets != ignore_index
        out = torch.zeros(flat_targets.shape[0], dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            # V == 0: every target is ignored (``resolve_targets``), every loss 0.0.
            for s, e in _chunks(flat_targets.shape[0] if vocab else 0, chunk_size):
                # .float() of fp32 logits is the caller's tensor: clone before the in-place softmax.
                chunk = flat_logits[s:e].to(torch.float32, copy=True)
                _final_logits_(chunk, features, keep_cap_slope=False)
                final = functools.partial(_final_logit_rows, flat_logits[s:e], features)
                out[s:e] = _softmax_ce_(chunk, flat_targets[s:e], valid[s:e], final_rows=final)[0]
        return out.reshape(lead)
    if hidden_states is None or weight is None:
        raise ValueError("pass logits, or both hidden_states and weight")
    with torch.no_grad():
        (hidden_states, weight, logits_bias, logits_bias_weight), own_precision = (
            _as_autocast_would(hidden_states, weight, logits_bias, logits_bias_weight)
        )
    _check_hidden_weight(hidden_states, weight)
    lead = hidden_states.shape[:-1]
    vocab = weight.shape[0]
    chunk_size = _resolve_chunk_size(chunk_size, hidden_states, vocab)
    targets = resolve_targets(lead, labels, shift_labels, ignore_index, vocab, "hidden_states")
    with torch.no_grad(), own_precision:
        bias = _resolve_bias(logits_bias, logits_bias_weight, lead, vocab, hidden_states.device)
        flat_targets = targets.reshape(-1)
        h = hidden_states.flatten(0, -2)  # not reshape(-1, H): H may be 0
        out, _, _, _ = _chunked_pass(
            h,
            weight,
            bias,
            flat_targets,
            flat_targets != ignore_index,
            None,
            chunk_size,
            (False,) * 5,
            # All the features, not only those that change the final logits: the
            # compiled chunk math is then the very kernel the loss call ran.
            checked,
        )
    return out.reshape(lead)
