"""The GEMM dtype policy of the LM-head products (``gemm_policy``) and the products
themselves (``_Products``), with the build probes and the fp16 row lifts they use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

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


def _row_scaled(x: torch.Tensor, row_factor: torch.Tensor | None) -> torch.Tensor:
    """``row_factor[:, None] * x`` (``x`` itself for None)."""
    return x if row_factor is None else x * row_factor.unsqueeze(1)
