"""chunk_cross_entropy / capture / per_token_cross_entropy against independent references.

Numeric claims are checked against a float64 reference built from full
logits with ``torch.nn.functional.cross_entropy`` (tolerances stated next to
each check); bitwise claims with ``torch.equal``.
"""

from __future__ import annotations

import functools
import gc
import math
import subprocess
import sys
import textwrap
import threading
import weakref
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import channel_loss as cl
from channel_loss.ops import default_gemm_policy
from harness import DEVICES

IGNORE = -100
BIAS_FORMS = ("none", "full", "row_full", "factored")


@pytest.fixture
def deterministic():
    """Exact comparisons on accelerators need deterministic kernels; restore the mode after."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def make_inputs(*, lead, H, V, bias, dtype=torch.float32, device="cpu", seed=0, R=3):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    inputs = {"hidden_states": rnd(*lead, H), "weight": rnd(V, H)}
    if bias == "full":
        inputs["logits_bias"] = rnd(V)
    elif bias == "row_full":
        inputs["logits_bias"] = rnd(*lead, V)
    elif bias == "factored":
        inputs["logits_bias"] = rnd(*lead, R)
        inputs["logits_bias_weight"] = rnd(V, R)
    labels = torch.randint(0, V, lead, generator=g).to(device)
    return inputs, labels


def reference_loss(inputs, targets, num_items=None):
    """float64 mean CE from full logits; targets already shifted."""
    x = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    logits = x["hidden_states"] @ x["weight"].T
    if "logits_bias_weight" in x:
        logits = logits + x["logits_bias"] @ x["logits_bias_weight"].T
    elif "logits_bias" in x:
        logits = logits + x["logits_bias"]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    denom = num_items if num_items is not None else int((targets != IGNORE).sum())
    return ce.sum() / max(denom, 1), ce.reshape(targets.shape), x


def hf_shift(labels):
    shifted = torch.full_like(labels, IGNORE)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def grads(inputs):
    return {k: v.grad for k, v in inputs.items()}


# ------------------------------------------------------------------ numeric parity


@st.composite
def problems(draw):
    batch = draw(st.sampled_from([None, 1, 2, 3]))
    T = draw(st.integers(1, 64))
    lead = (T,) if batch is None else (batch, T)
    chunk = draw(st.sampled_from([1, max(1, T // 3), T + 5]))
    bias = draw(st.sampled_from(BIAS_FORMS))
    shifted = draw(st.booleans())
    ignore = draw(st.sampled_from(["none", "some", "all"]))
    num_items = draw(st.sampled_from([None, "int", "tensor"]))
    seed = draw(st.integers(0, 2**16))
    return lead, chunk, bias, shifted, ignore, num_items, seed


@given(problems())
def test_matches_float64_reference(problem):
    lead, chunk, bias, shifted, ignore, num_items, seed = problem
    inputs, labels = make_inputs(lead=lead, H=8, V=13, bias=bias, seed=seed)
    if ignore == "some":
        labels[..., ::3] = IGNORE
    elif ignore == "all":
        labels[...] = IGNORE
    targets = labels if shifted else hf_shift(labels)
    valid = int((targets != IGNORE).sum())
    items = {None: None, "int": valid + 3, "tensor": torch.tensor(valid + 3)}[num_items]
    kwargs = {"shift_labels": labels} if shifted else {"labels": labels}
    loss = cl.chunk_cross_entropy(**inputs, **kwargs, num_items_in_batch=items, chunk_size=chunk)
    ref, _, ref_inputs = reference_loss(inputs, targets, None if items is None else valid + 3)
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    # fp32 accumulation over <= 192 tokens of O(10) values: 1e-5 relative.
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    (loss * 2.5).backward()
    (ref * 2.5).backward()
    for name, x in inputs.items():
        torch.testing.assert_close(
            x.grad.double(), ref_inputs[name].grad, rtol=1e-4, atol=1e-5, msg=name
        )
    if valid == 0:
        assert loss.item() == 0.0
        assert all(bool((x.grad == 0).all()) for x in inputs.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_float64(dtype):
    inputs, labels = make_inputs(lead=(2, 40), H=32, V=50, bias="full", dtype=dtype, seed=3)
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=16)
    loss.backward()
    ref, _, ref_inputs = reference_loss(inputs, hf_shift(labels))
    ref.backward()
    # Logits are produced by a low-precision matmul (contract); the rest is fp32.
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-2, atol=2e-2)
    assert inputs["weight"].grad.dtype == dtype
    for name, x in inputs.items():
        torch.testing.assert_close(
            x.grad.double(), ref_inputs[name].grad, rtol=5e-2, atol=5e-3, msg=name
        )


def test_non_uniform_upstream_gradient():
    """The upstream gradient must reach dW and d-bias, not only dH (Liger #1298)."""
    for bias in ("full", "factored"):
        inputs, labels = make_inputs(lead=(3, 9), H=6, V=10, bias=bias, seed=7)
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4)
        (loss * 3.7 + loss.pow(2)).backward()
        ref, _, ref_inputs = reference_loss(inputs, hf_shift(labels))
        (ref * 3.7 + ref.pow(2)).backward()
        for name, x in inputs.items():
            torch.testing.assert_close(
                x.grad.double(), ref_inputs[name].grad, rtol=1e-4, atol=1e-5, msg=f"{bias}:{name}"
            )


@pytest.mark.parametrize("bad", [None, True, 1.0, "x"])
def test_a_bad_ignore_index_is_named(bad):
    # Regression: None raised AttributeError deep inside; True was taken for class 1.
    inputs, labels = make_inputs(lead=(2, 8), H=4, V=7, bias="none")
    with pytest.raises(ValueError, match=r"ignore_index must be an int( .*)?; got "):
        cl.chunk_cross_entropy(**inputs, labels=labels, ignore_index=bad)
    with pytest.raises(ValueError, match=r"ignore_index must be an int( .*)?; got "):
        cl.per_token_cross_entropy(logits=torch.randn(2, 8, 7), labels=labels, ignore_index=bad)


@pytest.mark.parametrize("bad", [2**63, 2**64, -(2**63) - 1])
def test_an_ignore_index_beyond_int64_is_named(bad):
    # Regression: accepted by the int check, then "OverflowError: int too big to convert".
    inputs, labels = make_inputs(lead=(2, 8), H=4, V=7, bias="none")
    with pytest.raises(ValueError, match=r"ignore_index must be an int >= -\d+ and <= \d+; got "):
        cl.chunk_cross_entropy(**inputs, labels=labels, ignore_index=bad)


def test_zero_width_hidden_states_and_logits_are_scored_as_torch_scores_them():
    # Regression: H = 0 (every logit 0, each loss log V) and V = 0 (every target ignored)
    # crashed in reshape(-1, 0); F.linear and F.cross_entropy take them.
    torch.manual_seed(0)
    targets = torch.randint(0, 5, (2, 3))
    h = torch.randn(2, 3, 0, requires_grad=True)
    w = torch.randn(5, 0, requires_grad=True)
    loss = cl.chunk_cross_entropy(h, w, shift_labels=targets)
    expected = F.cross_entropy(F.linear(h, w).reshape(-1, 5), targets.reshape(-1))
    assert torch.equal(loss.detach(), expected.detach())
    loss.backward()
    assert h.grad.shape == h.shape
    assert w.grad.shape == w.shape
    per_token = cl.per_token_cross_entropy(hidden_states=h, weight=w, shift_labels=targets)
    assert torch.equal(per_token, torch.full((2, 3), math.log(5)))
    bias, bias_weight = torch.randn(2, 3, 0), torch.randn(5, 0)  # a factored bias of width 0
    with_bias = cl.chunk_cross_entropy(
        h, w, shift_labels=targets, logits_bias=bias, logits_bias_weight=bias_weight
    )
    assert torch.equal(with_bias, loss)
    ignored = torch.full((2, 3), -100)
    none = cl.per_token_cross_entropy(logits=torch.zeros(2, 3, 0), shift_labels=ignored)
    assert torch.equal(none, torch.zeros(2, 3))


def test_num_items_in_batch_never_overwritten():
    inputs, labels = make_inputs(lead=(2, 8), H=4, V=7, bias="none")
    items = torch.tensor(40)
    before = items.clone()
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=items)
    loss.backward()
    assert torch.equal(items, before)
    ref, _, _ = reference_loss(inputs, hf_shift(labels), num_items=40)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_no_grad_call_still_returns_the_loss():
    inputs, labels = make_inputs(lead=(5,), H=4, V=7, bias="none")
    with torch.no_grad():
        loss = cl.chunk_cross_entropy(**inputs, labels=labels)
    ref, _, _ = reference_loss(inputs, hf_shift(labels))
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ capture: bitwise and lifecycle


def run_loss(inputs, labels, *, observe, chunk_size=5, wrap=None):
    for x in inputs.values():
        x.grad = None

    def body():
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=chunk_size)
        return loss

    if observe:
        # Backward inside the scope, as in a training step: a recompute there must not record.
        with cl.capture() as cap:
            loss = wrap(body) if wrap else body()
            (loss * 1.3).backward()
    else:
        cap, loss = None, (wrap(body) if wrap else body())
        (loss * 1.3).backward()
    return loss.detach(), grads(inputs), cap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", BIAS_FORMS)
@pytest.mark.usefixtures("deterministic")
def test_capture_is_bitwise_invisible(device, dtype, bias):
    inputs, labels = make_inputs(lead=(2, 11), H=8, V=17, bias=bias, dtype=dtype, device=device)
    labels[0, 4] = IGNORE
    plain_loss, plain_grads, _ = run_loss(inputs, labels, observe=False)
    obs_loss, obs_grads, cap = run_loss(inputs, labels, observe=True)
    assert torch.equal(plain_loss, obs_loss)
    for name in plain_grads:
        assert torch.equal(plain_grads[name], obs_grads[name]), name
    (obs,) = cap.observations
    assert obs.token_losses.dtype == torch.float32
    assert not obs.token_losses.requires_grad
    assert obs.token_losses.shape == labels.shape
    targets = hf_shift(labels)
    assert torch.equal(obs.targets, targets)
    assert obs.targets.dtype == torch.int64
    assert bool((obs.token_losses[targets == IGNORE] == 0).all())
    # The recorded per-token losses are the ones the loss was summed from.
    assert torch.equal(obs.token_losses.sum() / (targets != IGNORE).sum(), obs_loss)
    # ... and the eager fallback reproduces them bit for bit at the same chunk size.
    eager = cl.per_token_cross_entropy(
        **{k: v for k, v in inputs.items()}, labels=labels, chunk_size=5
    )
    assert torch.equal(eager, obs.token_losses)


def test_observed_token_losses_match_reference():
    inputs, labels = make_inputs(lead=(3, 10), H=8, V=12, bias="factored", seed=11)
    labels[1, 2:6] = IGNORE
    with cl.capture() as cap:
        cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4)
    _, ref_tokens, _ = reference_loss(inputs, hf_shift(labels))
    torch.testing.assert_close(
        cap.observations[0].token_losses.double(), ref_tokens.detach(), rtol=1e-5, atol=1e-6
    )


def test_per_token_from_logits_matches_reference():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 9, 15, generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, 15, (2, 9), generator=g)
    labels[1, 3] = IGNORE
    before = logits.clone()
    out = cl.per_token_cross_entropy(logits=logits, labels=labels, chunk_size=4)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    ref = F.cross_entropy(
        logits.double().reshape(-1, 15),
        hf_shift(labels).reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).reshape(2, 9)
    assert out.dtype == torch.float32
    assert out.shape == (2, 9)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_checkpoint_and_offload_are_bitwise_plain(bias):
    inputs, labels = make_inputs(lead=(2, 9), H=6, V=11, bias=bias, seed=2)
    plain_loss, plain_grads, _ = run_loss(inputs, labels, observe=False)

    def checkpointed(body):
        return checkpoint(body, use_reentrant=False)

    def checkpointed_full_recompute(body):
        # Without early stop the recompute runs the whole body, record() included.
        with set_checkpoint_early_stop(False):
            return checkpoint(body, use_reentrant=False)

    def offloaded(body):
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            return body()

    packed = []

    def custom_hooks(body):
        def pack(t):
            packed.append(t.shape)
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return body()

    for wrap in (checkpointed, checkpointed_full_recompute, offloaded, custom_hooks):
        for observe in (False, True):
            loss, got, cap = run_loss(inputs, labels, observe=observe, wrap=wrap)
            assert torch.equal(loss, plain_loss), wrap.__name__
            for name in plain_grads:
                assert torch.equal(got[name], plain_grads[name]), (wrap.__name__, name)
            if observe:
                # The checkpoint recompute during backward records nothing.
                assert len(cap.observations) == 1, wrap.__name__
    assert packed, "the custom hooks saw the long-lived gradients"


def test_reentrant_checkpoint_recompute_records_nothing():
    inputs, labels = make_inputs(lead=(7,), H=4, V=9, bias="none")
    with cl.capture() as cap:
        loss = checkpoint(
            lambda h: cl.chunk_cross_entropy(h, inputs["weight"], labels),
            inputs["hidden_states"],
            use_reentrant=True,
        )
        loss.backward()
    assert len(cap.observations) == 1


class MatmulCounter(TorchDispatchMode):
    MATMULS: ClassVar[set[str]] = {
        "mm",
        "addmm",
        "bmm",
        "matmul",
        "linear",
        "baddbmm",
        "_addmm_activation",
        "_linear_pointwise",  # oneDNN's linear
    }

    def __init__(self):
        super().__init__()
        self.matmuls = 0
        self.largest = 0
        self.flops = 0  # of the 2-D products (mm, addmm, addmm_)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.MATMULS:
            self.matmuls += 1
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[:2] if name == "mm" else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif name == "_linear_pointwise":
            x, w = args[:2]
            self.flops += 2 * x.shape[0] * x.shape[1] * w.shape[0]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("bias", ["none", "factored"])
def test_observing_adds_no_matmul_and_never_full_logits(bias):
    T, V, chunk = 64, 97, 8
    inputs, labels = make_inputs(lead=(T,), H=4, V=V, bias=bias)
    counts = {}
    for observe in (False, True):
        with MatmulCounter() as counter:
            run_loss(inputs, labels, observe=observe, chunk_size=chunk)
        counts[observe] = (counter.matmuls, counter.largest)
    assert counts[True][0] == counts[False][0]
    # No tensor of the whole op is bigger than one chunk of logits (or the weight).
    assert counts[True][1] <= chunk * V < T * V


@pytest.mark.parametrize("layout", ["padded_rows", "column_major"])
def test_a_strided_weight_is_exact(layout):
    # A weight with padded rows (a column slice of a wider matrix) once went to oneDNN's
    # linear, which reordered it element by element: 30 s per chunk instead of 24 ms.
    T, H, V = 24, 8, 97
    inputs, labels = make_inputs(lead=(T,), H=H, V=V, bias="none")
    base = inputs["weight"].detach()
    if layout == "padded_rows":
        weight = torch.cat([base, torch.randn(V, 3)], dim=1)[:, :H]
        assert weight.stride() == (H + 3, 1)
    else:
        weight = base.t().contiguous().t()
        assert weight.stride() == (1, V)
    inputs["weight"] = weight.requires_grad_()
    loss, got, _ = run_loss(inputs, labels, observe=False, chunk_size=8)
    ref, _, x = reference_loss(inputs, hf_shift(labels))
    (ref * 1.3).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    for k in ("hidden_states", "weight"):
        torch.testing.assert_close(got[k].double(), x[k].grad, rtol=1e-5, atol=1e-6)


def test_failed_forward_leaves_nothing_and_propagates():
    inputs, labels = make_inputs(lead=(2, 6), H=4, V=9, bias="none")

    class Boom(Exception):
        pass

    refs = []

    def failing_forward(cap):
        loss = cl.chunk_cross_entropy(**inputs, labels=labels)
        refs.append(weakref.ref(cap.observations[0].token_losses))
        refs.append(weakref.ref(loss))
        del loss
        raise Boom("after the loss")

    with pytest.raises(Boom) as info, cl.capture() as cap:
        failing_forward(cap)
    assert str(info.value) == "after the loss"
    assert cap.observations == []
    del info
    gc.collect()
    assert all(r() is None for r in refs), "a tensor of the failed forward is still alive"


def test_nested_scopes_innermost_receives():
    inputs, labels = make_inputs(lead=(6,), H=4, V=9, bias="none")
    with cl.capture() as outer:
        cl.chunk_cross_entropy(**inputs, labels=labels)
        with cl.capture() as inner:
            cl.chunk_cross_entropy(**inputs, labels=labels)
            cl.chunk_cross_entropy(**inputs, labels=labels)
        cl.chunk_cross_entropy(**inputs, labels=labels)
    assert len(outer.observations) == 2
    assert len(inner.observations) == 2
    # Outside any scope nothing is recorded anywhere.
    cl.chunk_cross_entropy(**inputs, labels=labels)
    assert len(outer.observations) == 2


def test_threads_have_separate_scopes():
    inputs, labels = make_inputs(lead=(6,), H=4, V=9, bias="none")
    barrier = threading.Barrier(2, timeout=30)
    results, errors = {}, []

    def worker(name, calls):
        try:
            with cl.capture() as cap:
                barrier.wait()
                for _ in range(calls):
                    cl.chunk_cross_entropy(
                        **{k: v.detach() for k, v in inputs.items()}, labels=labels
                    )
                barrier.wait()
            results[name] = len(cap.observations)
        except Exception as exc:  # surfaced below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n, c)) for n, c in (("a", 1), ("b", 3))]
    with cl.capture() as main_scope:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not errors
    assert results == {"a": 1, "b": 3}
    assert main_scope.observations == []


# ------------------------------------------------------------------ bad input


def _good():
    h = torch.randn(2, 5, 4)
    w = torch.randn(7, 4)
    labels = torch.randint(0, 7, (2, 5))
    return h, w, labels


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "lead_shape",
            r"labels shape \(2, 4\) must equal the leading shape of hidden_states \(2, 5\)",
        ),
        ("width", r"weight shape \(7, 3\) does not match hidden_states width"),
        ("full_bias", r"logits_bias shape \(6,\) cannot broadcast to \(2, 5, 7\)"),
        ("full_bias_rows", r"logits_bias shape \(3, 5, 7\) cannot broadcast"),
        ("factored_bias", r"logits_bias_weight must be \[V=7, R\]; got \(6, 2\)"),
        ("factored_rows", r"logits_bias \(factored form, \[..., R\]\) shape \(2, 4, 2\)"),
        ("weight_only", r"logits_bias_weight \(7, 2\) was given without logits_bias"),
        ("no_labels", r"pass labels or shift_labels; got neither"),
        ("float_labels", r"labels must be an integer tensor; got dtype torch.float32"),
        ("chunk_zero", r"chunk_size must be an int >= 1; got 0"),
        ("target_range", r"labels holds target 7 outside \[0, 7\)"),
        ("negative_target", r"shift_labels holds target -1 outside \[0, 7\)"),
        ("hidden_rank", r"hidden_states must be a \[B, T, H\] or \[T, H\] tensor; got \(5,\)"),
        ("dtype_mismatch", r"share one floating dtype"),
        ("num_items", r"num_items_in_batch must be a scalar"),
    ],
)
def test_bad_input_names_the_argument(case, match):
    h, w, labels = _good()
    kw = {"hidden_states": h, "weight": w, "labels": labels}
    if case == "lead_shape":
        kw["labels"] = labels[:, :4]
    elif case == "width":
        kw["weight"] = torch.randn(7, 3)
    elif case == "full_bias":
        kw["logits_bias"] = torch.randn(6)
    elif case == "full_bias_rows":
        kw["logits_bias"] = torch.randn(3, 5, 7)
    elif case == "factored_bias":
        kw["logits_bias"] = torch.randn(2, 5, 2)
        kw["logits_bias_weight"] = torch.randn(6, 2)
    elif case == "factored_rows":
        kw["logits_bias"] = torch.randn(2, 4, 2)
        kw["logits_bias_weight"] = torch.randn(7, 2)
    elif case == "weight_only":
        kw["logits_bias_weight"] = torch.randn(7, 2)
    elif case == "no_labels":
        del kw["labels"]
    elif case == "float_labels":
        kw["labels"] = labels.float()
    elif case == "chunk_zero":
        kw["chunk_size"] = 0
    elif case == "target_range":
        kw["labels"] = labels.clone()
        kw["labels"][1, 3] = 7
    elif case == "negative_target":
        del kw["labels"]
        kw["shift_labels"] = labels.clone()
        kw["shift_labels"][0, 0] = -1
    elif case == "hidden_rank":
        kw["hidden_states"] = torch.randn(5)
    elif case == "dtype_mismatch":
        kw["weight"] = w.double()
    elif case == "num_items":
        kw["num_items_in_batch"] = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=match):
        cl.chunk_cross_entropy(**kw)


def test_shift_labels_win_over_labels_as_in_hf():
    # DESIGN: targets = shift_labels when given (HF's ForCausalLMLoss reads no labels
    # then); both given was refused.
    h, w, labels = _good()
    shifted = torch.randint(0, 7, (2, 5))
    unreadable = torch.full((2, 5), 99)  # out of range: never read
    ops = (
        functools.partial(cl.chunk_cross_entropy, h, w),
        functools.partial(cl.per_token_cross_entropy, hidden_states=h, weight=w),
    )
    for op in ops:
        want = op(shift_labels=shifted)
        assert torch.equal(op(labels=labels, shift_labels=shifted), want)
        assert torch.equal(op(labels=unreadable, shift_labels=shifted), want)


def test_last_label_is_not_checked_against_vocab():
    """labels[..., 0] is never a target under the HF shift; only real targets are range-checked."""
    h, w, labels = _good()
    labels[:, 0] = 99
    cl.chunk_cross_entropy(h, w, labels)


# ------------------------------------------------------------------ numerics and contracts


def _rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("num_items", [64, 2**10, 2**13, 2**16, 2**18, 2**20])
def test_fp16_loss_scaling_is_as_accurate_as_the_standard_path(num_items):
    """The divisor must not push fp16 gradients into underflow before the scale."""
    T, H, V, scale = 64, 64, 4096, 65536.0
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).half()
    w = (torch.randn(V, H, generator=g) / H**0.5).half()
    targets = torch.randint(0, V, (T,), generator=g)

    def hidden_grad(loss_fn, dtype):
        x = h.to(dtype, copy=True).requires_grad_()
        (scale * loss_fn(x, w.to(dtype))).backward()
        return x.grad

    def standard(x, weight):
        logits = F.linear(x, weight).float()
        return F.cross_entropy(logits, targets, reduction="sum") / num_items

    def ours(x, weight):
        return cl.chunk_cross_entropy(
            x, weight, shift_labels=targets, num_items_in_batch=num_items, chunk_size=16
        )

    ref = hidden_grad(standard, torch.float64)
    std_error = _rel_l2(hidden_grad(standard, torch.float16), ref)
    our_grad = hidden_grad(ours, torch.float16)
    assert our_grad.dtype == torch.float16
    # Before the fix: 1.2e-3 at 2**10 ... 1.9e-1 at 2**20 against 2.6e-4 for the standard path.
    assert _rel_l2(our_grad, ref) <= 3 * std_error, (num_items, std_error)


@pytest.mark.parametrize("policy", ["fp32", "model_dtype", "mixed"])
@pytest.mark.parametrize("margin", [4.0, 6.0])
def test_fp16_hidden_gradient_of_confident_tokens_survives_loss_scaling(policy, margin):
    """A confident token's hidden gradient (softmax minus one-hot ~1e-7) rounded to fp16
    before the loss scale arrived: subnormal or zero, where the standard path, scaled
    first, kept it."""
    N, H, V, scale = 96, 64, 512, 65536.0
    g = torch.Generator().manual_seed(1)
    w = torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (N,), generator=g)
    # Each hidden state points at its target's row: p(target) = 1 - O(e**-margin**2).
    rows = w[targets]
    h = rows * (margin * H**0.5 / rows.norm(dim=1, keepdim=True))
    h = (h + 0.1 * torch.randn(N, H, generator=g)).half()
    w = w.half()
    targets[::7] = -100  # ignored rows, whose gradient is zero, among them

    def hidden_grad(loss_fn, dtype):
        x = h.to(dtype, copy=True).requires_grad_()
        (scale * loss_fn(x, w.to(dtype))).backward()
        return x.grad

    def standard(x, weight):
        return F.cross_entropy(F.linear(x, weight).float(), targets)

    def ours(x, weight):
        with cl.ops.gemm_policy(policy):
            return cl.chunk_cross_entropy(x, weight, shift_labels=targets, chunk_size=32)

    ref = hidden_grad(standard, torch.float64)
    std_error = _rel_l2(hidden_grad(standard, torch.float16), ref)
    our_grad = hidden_grad(ours, torch.float16)
    assert our_grad.dtype == torch.float16
    assert bool((our_grad[::7] == 0).all())
    # Before the fix, under "fp32": 1.8x the standard path's error at margin 4, 5.3x at 6.
    assert _rel_l2(our_grad, ref) <= 1.5 * std_error, (std_error, _rel_l2(our_grad, ref))


def test_fp16_hidden_gradient_does_not_depend_on_the_default_dtype():
    # Regression: the per-row lifts took the default dtype; under fp16 a lift of 2**16 or
    # more was inf and backward returned rows of exact zeros (LLM-sized weights: all rows).
    g = torch.Generator().manual_seed(3)
    h = torch.randn(32, 16, generator=g).half()
    w = (0.02 * torch.randn(64, 16, generator=g)).half()
    targets = torch.randint(0, 64, (32,), generator=g)

    def grad() -> torch.Tensor:
        x = h.clone().requires_grad_()
        cl.chunk_cross_entropy(x, w, shift_labels=targets, chunk_size=8).backward()
        return x.grad

    want = grad()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        got = grad()
    finally:
        torch.set_default_dtype(previous)
    assert bool(want.abs().gt(0).any(dim=1).all())
    assert torch.equal(got, want)


def test_fp16_gradient_buffers_stay_fp16():
    """The fp16 fix holds no wider buffer: the saved hidden gradient keeps the input dtype."""
    inputs, labels = make_inputs(lead=(4, 8), H=8, V=40, bias="none", dtype=torch.float16)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=2**20)
    assert ((32, 8), torch.float16) in saved  # the hidden gradient, [N, H]
    assert ((32, 8), torch.float32) not in saved
    loss.backward()
    assert inputs["hidden_states"].grad.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_no_tokens_gives_zero_loss_and_empty_gradients(dtype):
    h = torch.randn(0, 4, dtype=dtype, requires_grad=True)
    w = torch.randn(7, 4, dtype=dtype, requires_grad=True)
    loss = cl.chunk_cross_entropy(h, w, shift_labels=torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.shape == (0, 4)
    assert h.grad.dtype == dtype
    assert bool((w.grad == 0).all())


def test_second_order_gradients_are_refused():
    """The backward is not differentiable; say so instead of returning wrong numbers."""
    inputs, labels = make_inputs(lead=(2, 6), H=4, V=9, bias="factored", seed=4)
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(loss * loss, inputs["hidden_states"], create_graph=True)
    # Even a constant upstream gradient: a later derivative of .grad would silently miss ours.
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.autograd.grad(loss, inputs["weight"], create_graph=True)
    # The graph is intact: a plain first-order backward still works afterwards.
    loss.backward()
    ref, _, ref_inputs = reference_loss(inputs, hf_shift(labels))
    ref.backward()
    torch.testing.assert_close(
        inputs["weight"].grad.double(), ref_inputs["weight"].grad, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_retain_graph_backward_twice_is_bitwise_twice(dtype, bias):
    """Backward reuses the saved gradients' memory, except when the graph is retained."""
    inputs, labels = make_inputs(lead=(2, 7), H=8, V=13, bias=bias, dtype=dtype, seed=5)
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4, num_items_in_batch=9)
    (loss * 3.0).backward(retain_graph=True)
    once = {k: v.grad.clone() for k, v in inputs.items()}
    for x in inputs.values():
        x.grad = None
    (loss * 3.0).backward(retain_graph=True)
    again = {k: v.grad.clone() for k, v in inputs.items()}
    (loss * 3.0).backward()  # the last one frees: may write into the saved buffers
    for name, x in inputs.items():
        assert torch.equal(again[name], once[name]), name
        assert torch.equal(x.grad, once[name] + once[name]), name
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    # A fresh graph without retain_graph gives the same bits.
    for x in inputs.values():
        x.grad = None
    loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=4, num_items_in_batch=9)
    (loss * 3.0).backward()
    for name, x in inputs.items():
        assert torch.equal(x.grad, once[name]), name


class LiveBytes(TorchDispatchMode):
    """Tensor-size accounting: bytes of storages created under the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.created: list[int] = []  # bytes of each storage created, in order
        self._seen: set[int] = set()

    def _forget(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an argument's storage: not a new allocation.
        arg_storages = {
            id(a.untyped_storage())
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._seen and key not in arg_storages:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.created.append(storage.nbytes())
                    weakref.finalize(storage, self._forget, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_is_held_once(dtype):
    """At large V x H the fp32 weight gradient must not be held twice (saved + scaled copy)."""
    N, H, V = 8, 64, 4096
    inputs, labels = make_inputs(lead=(N,), H=H, V=V, bias="none", dtype=dtype, seed=6)
    fp32_weight_grad = V * H * 4
    with LiveBytes() as mem:
        loss = cl.chunk_cross_entropy(**inputs, shift_labels=labels, chunk_size=2)
        (loss * 2.0).backward()
    # Held once: the fp32 buffer, plus the final gradient when its dtype differs, plus
    # O(chunk x V + N x H) working memory (< 5% here). Before the fix: 2x and 2.5x.
    final = 0 if dtype == torch.float32 else V * H * dtype.itemsize
    # The CPU's "fp32" GEMM policy also holds one fp32 copy of a low-precision weight.
    upcast = 0 if dtype == torch.float32 else V * H * 4
    assert mem.peak <= 1.05 * fp32_weight_grad + final + upcast, mem.peak / fp32_weight_grad
    assert mem.peak >= fp32_weight_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_of_logits_is_alive_at_a_time(dtype):
    """Each chunk's fp32 logits block is gone before the next chunk makes its own."""
    N, H, V, chunk = 16, 8, 4096, 2
    inputs, labels = make_inputs(lead=(N,), H=H, V=V, bias="none", dtype=dtype, seed=6)
    with LiveBytes() as mem:
        loss = cl.chunk_cross_entropy(**inputs, shift_labels=labels, chunk_size=chunk)
        loss.backward()
    block = chunk * V * 4
    # The fp32 weight gradient, the final one when its dtype differs, the fp32 weight
    # copy of the CPU's "fp32" policy for low-precision data; then less than two blocks.
    held = V * H * 4
    if dtype != torch.float32:
        held += V * H * dtype.itemsize
        held += V * H * 4 if default_gemm_policy("cpu", dtype) == "fp32" else 0
    assert mem.created.count(block) >= 1
    assert mem.peak < held + 2 * block, (mem.peak - held) / block


def test_rows_with_ignored_targets_cost_no_lm_head_work():
    """On the CPU the three LM-head products cover the scored rows only: in fine-tuning,
    masked prompts are often most of the batch."""
    T, H, V, chunk = 64, 8, 97, 8
    inputs, labels = make_inputs(lead=(T,), H=H, V=V, bias="none", seed=11)
    labels[torch.arange(T) % 4 != 0] = IGNORE
    with MatmulCounter() as counter:
        cl.chunk_cross_entropy(**inputs, shift_labels=labels, chunk_size=chunk).backward()
    scored = int((labels != IGNORE).sum())
    # Logits, hidden gradient and weight gradient: 2 x rows x H x V each.
    assert counter.flops == 3 * 2 * scored * H * V, counter.flops / (3 * 2 * H * V)


@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_rows_with_ignored_targets_are_never_read(bias):
    """The loss, the observation and every gradient are bitwise the same whatever an
    ignored row's hidden state (or bias row) holds, NaN included; that row's hidden
    gradient is zero."""
    T, H, V, chunk = 24, 6, 31, 4
    inputs, labels = make_inputs(lead=(2, T), H=H, V=V, bias=bias, seed=12)
    labels[:, ::3] = IGNORE
    labels[1, 5:17] = IGNORE
    ignored = labels == IGNORE
    poisoned = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    with torch.no_grad():
        poisoned["hidden_states"][ignored] = float("nan")
        if bias in ("row_full", "factored"):
            poisoned["logits_bias"][ignored] = float("nan")
    results = []
    for x in (inputs, poisoned):
        with cl.capture() as cap:
            loss = cl.chunk_cross_entropy(**x, shift_labels=labels, chunk_size=chunk)
        (loss * 3.0).backward()
        results.append((loss, cap.observations[0].token_losses, grads(x)))
    (loss, tokens, clean), (loss_p, tokens_p, dirty) = results
    assert torch.equal(loss_p, loss)
    assert torch.equal(tokens_p, tokens)
    for name in clean:
        assert torch.equal(dirty[name], clean[name]), name
    assert torch.equal(clean["hidden_states"][ignored], torch.zeros(int(ignored.sum()), H))


def test_observation_owns_its_targets():
    """A caller that reuses its int64 label buffer does not change observations."""
    inputs, labels = make_inputs(lead=(2, 6), H=4, V=9, bias="none")
    buffer = labels.clone()
    buffer[0, :2] = IGNORE
    expected = buffer.clone()
    with cl.capture() as cap:
        cl.chunk_cross_entropy(**inputs, shift_labels=buffer)
    buffer.fill_(IGNORE)  # the next batch is prefetched into the same buffer
    (obs,) = cap.observations
    assert torch.equal(obs.targets, expected)
    assert int(obs.scored.sum()) == 10


def test_observation_carries_ignore_index():
    """What the loss ignored is what the observation says is ignored."""
    inputs, labels = make_inputs(lead=(8,), H=4, V=9, bias="none")
    labels[:3] = -1
    with cl.capture() as cap:
        loss = cl.chunk_cross_entropy(**inputs, shift_labels=labels, ignore_index=-1)
    (obs,) = cap.observations
    assert obs.ignore_index == -1
    assert torch.equal(obs.scored, labels != -1)
    assert torch.equal(obs.token_losses.sum() / obs.scored.sum(), loss.detach())


# ------------------------------------------------------------------ num_items_in_batch and chunk_size


def _np():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (lambda: -3, r"num_items_in_batch must be a finite number >= 0; got -3"),
        (lambda: torch.tensor(-3), r"num_items_in_batch must be a finite number >= 0; got tensor"),
        (lambda: _np().int64(-3), r"num_items_in_batch must be a finite number >= 0"),
        (lambda: float("nan"), r"num_items_in_batch must be a finite number >= 0; got nan"),
        (lambda: torch.tensor(float("nan")), r"must be a finite number >= 0"),
        (lambda: float("inf"), r"must be a finite number >= 0"),
        (lambda: 0, r"num_items_in_batch is 0 while some targets are scored"),
        (lambda: torch.tensor(0), r"num_items_in_batch is 0 while some targets are scored"),
        (lambda: _np().int32(0), r"num_items_in_batch is 0 while some targets are scored"),
        (
            lambda: torch.tensor(True),
            r"num_items_in_batch must be a real number; got dtype torch.bool",
        ),
        (lambda: True, r"num_items_in_batch must be an int, a float, a numpy scalar"),
        (lambda: "8", r"num_items_in_batch must be an int, a float, a numpy scalar"),
    ],
)
def test_num_items_in_batch_one_rule(value, match):
    """Ints, numpy scalars and tensors follow one rule."""
    inputs, labels = make_inputs(lead=(2, 5), H=4, V=7, bias="none")
    with pytest.raises(ValueError, match=match):
        cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=value())


def test_num_items_zero_without_scored_targets_is_an_empty_batch():
    inputs, labels = make_inputs(lead=(2, 5), H=4, V=7, bias="none")
    labels[...] = IGNORE
    for zero in (0, torch.tensor(0), 0.0):
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=zero)
        loss.backward()
        assert loss.item() == 0.0
        assert bool((inputs["weight"].grad == 0).all())


def test_numpy_scalars_are_accepted_like_ints():
    np = _np()
    inputs, labels = make_inputs(lead=(3, 7), H=4, V=7, bias="full", seed=8)
    expected = cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=40, chunk_size=4)
    for items in (np.int64(40), np.int32(40), torch.tensor(40), np.float64(40.0)):
        for chunk in (4, np.int64(4), np.int32(4)):
            got = cl.chunk_cross_entropy(
                **inputs, labels=labels, num_items_in_batch=items, chunk_size=chunk
            )
            assert torch.equal(got, expected), (items, chunk)
    eager = cl.per_token_cross_entropy(**inputs, labels=labels, chunk_size=np.int64(4))
    assert torch.equal(eager, cl.per_token_cross_entropy(**inputs, labels=labels, chunk_size=4))


@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "dtype", "on", "expected"),
    [
        # CPU: fp32 logits of one chunk no larger than the hidden states or the
        # fp32 weight gradient, power of two, within [8, 4096].
        (4096, 256, 32000, torch.float32, "cpu", 256),
        (32768, 256, 32000, torch.float32, "cpu", 256),
        (65536, 256, 32000, torch.bfloat16, "cpu", 256),
        (4096, 256, 128256, torch.float32, "cpu", 256),
        (4096, 96, 32000, torch.float32, "cpu", 64),
        (100, 8, 128256, torch.float32, "cpu", 8),  # lower bound
        (10**6, 8192, 32000, torch.float32, "cpu", 4096),  # upper bound
        # Accelerators: the hidden-states rule within [512, 8192].
        (16384, 4096, 128256, torch.bfloat16, "cuda", 512),  # accelerator floor
        (16384, 4096, 32000, torch.bfloat16, "cuda", 1024),
        (10**6, 8192, 32000, torch.bfloat16, "cuda", 8192),
    ],
)
def test_default_chunk_size_rule(tokens, hidden, vocab, dtype, on, expected):
    # ``on`` is a device string, not the harness's ``device`` parameter: nothing runs there.
    assert cl.default_chunk_size(tokens, hidden, vocab, dtype, on) == expected
    assert cl.default_chunk_size(tokens, hidden, vocab, dtype, torch.device(on)) == expected


def test_default_chunk_size_is_used_and_an_explicit_one_wins():
    inputs, labels = make_inputs(lead=(64,), H=4, V=512, bias="none")
    default = cl.default_chunk_size(64, 4, 512, torch.float32)
    assert default == 8

    def matmuls(**kw):
        with MatmulCounter() as counter:
            cl.chunk_cross_entropy(**inputs, shift_labels=labels, **kw).backward()
        return counter.matmuls

    per_chunk = matmuls(chunk_size=64)  # one chunk
    assert matmuls() == per_chunk * (64 // default)
    assert matmuls(chunk_size=32) == per_chunk * 2
    # Both sides left at the default chunk alike: the bitwise contract holds.
    with cl.capture() as cap:
        cl.chunk_cross_entropy(**inputs, shift_labels=labels)
    eager = cl.per_token_cross_entropy(**inputs, shift_labels=labels)
    assert torch.equal(eager, cap.observations[0].token_losses)


# ------------------------------------------------------------------ compile and host syncs


def test_torch_compile_runs_the_op_eagerly():
    """Compiled callers keep the O(chunk x V) memory bound: the op is an eager region."""
    torch._dynamo.reset()
    inputs, labels = make_inputs(lead=(16,), H=4, V=33, bias="none")

    def step(h, w, t):
        return cl.chunk_cross_entropy(h * 2, w, shift_labels=t, chunk_size=4) + 1

    compiled = torch.compile(step, backend="eager")
    with cl.capture() as cap, MatmulCounter() as counter:
        got = compiled(inputs["hidden_states"], inputs["weight"], labels)
    assert torch.equal(got, step(inputs["hidden_states"], inputs["weight"], labels))
    assert len(cap.observations) == 1
    assert counter.largest <= 4 * 33, "the compiled call materialised more than one chunk"
    torch._dynamo.reset()  # fullgraph=True must trace afresh, not reuse the frame above
    strict = torch.compile(step, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"channel_loss ops run eagerly under torch\.compile"):
        strict(inputs["hidden_states"], inputs["weight"], labels)
    torch._dynamo.reset()


def test_first_call_under_compile_and_cheap_import():
    """A fresh process: importing channel_loss does not import dynamo (seconds), and a
    fullgraph compile whose trace is the op's very first call still fails naming why."""
    code = textwrap.dedent("""
        import sys, torch
        import channel_loss as cl
        print("dynamo imported:", "torch._dynamo" in sys.modules, flush=True)
        h, w, t = torch.randn(6, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 4, 0])
        step = lambda h, w, t: cl.chunk_cross_entropy(h, w, shift_labels=t, chunk_size=2) + 1
        try:
            torch.compile(step, backend="eager", fullgraph=True)(h, w, t)
        except Exception as exc:
            print("refused:", "channel_loss ops run eagerly" in str(exc), flush=True)
        got = torch.compile(step, backend="eager")(h, w, t)
        print("eager result:", torch.equal(got, step(h, w, t)), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamo imported: False" in proc.stdout
    assert "refused: True" in proc.stdout
    assert "eager result: True" in proc.stdout


@pytest.mark.parametrize("device", DEVICES)
def test_target_check_is_immediate_on_cpu_and_sync_free_on_accelerators(device):
    """The target-range check keeps its error but adds no host sync on a card."""
    inputs, labels = make_inputs(lead=(2, 9), H=4, V=11, bias="none", device=device)
    labels[0, 3] = IGNORE
    if device == "cpu":
        bad = labels.clone()
        bad[1, 4] = 11
        with pytest.raises(ValueError, match=r"labels holds target 11 outside \[0, 11\)"):
            cl.chunk_cross_entropy(**inputs, labels=bad)
        return
    runtime = getattr(torch, device)
    if not hasattr(runtime, "set_sync_debug_mode"):
        pytest.skip(f"torch.{device} has no sync debug mode")
    every_items = (None, 17, torch.tensor(17, device=device))  # made before: a copy syncs
    runtime.synchronize()
    runtime.set_sync_debug_mode("error")
    try:
        for items in every_items:
            loss = cl.chunk_cross_entropy(**inputs, labels=labels, num_items_in_batch=items)
            loss.backward()
    finally:
        runtime.set_sync_debug_mode("default")
    runtime.synchronize()
    # A bad target still fails, on the device, at the next sync. A device-side assertion
    # poisons the process's context, so it runs in a process of its own.
    code = textwrap.dedent(f"""
        import torch, channel_loss as cl
        h = torch.randn(4, 3, device="{device}")
        w = torch.randn(5, 3, device="{device}")
        t = torch.tensor([0, 1, 7, 2], device="{device}")
        loss = cl.chunk_cross_entropy(h, w, shift_labels=t)
        print("queued without a host-side check", flush=True)
        torch.{device}.synchronize()
        print("synchronised", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "queued without a host-side check" in proc.stdout, proc.stderr[-2000:]
    assert "synchronised" not in proc.stdout
    assert proc.returncode != 0
    assert "outside [0, 5)" in proc.stderr or "device-side assert" in proc.stderr, proc.stderr[
        -2000:
    ]


def test_targets_whose_probability_underflows_get_their_exact_nll():
    """A target whose softmax probability is below fp32's normal range (an NLL above 87)
    still gets its exact NLL and gradient, from the hidden states and from logits, beside
    rows whose NLL is ordinary."""
    T, H, V = 12, 8, 50
    g = torch.Generator().manual_seed(21)
    hidden = (torch.randn(T, H, generator=g) * 30).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    logits64 = hidden.detach().double() @ weight.detach().double().T
    targets = logits64.argmin(dim=1)  # the least likely token: NLL in the hundreds
    targets[::3] = logits64[::3].argmax(dim=1)  # and some rows with an ordinary NLL
    nll64 = torch.logsumexp(logits64, dim=1) - logits64.gather(1, targets[:, None]).squeeze(1)
    assert nll64[1::3].min() > 200
    assert nll64[::3].max() < 87
    with cl.capture() as cap:
        loss = cl.chunk_cross_entropy(hidden, weight, shift_labels=targets, chunk_size=5)
    loss.backward()
    observed = cap.observations[0].token_losses
    from_logits = cl.per_token_cross_entropy(
        logits=hidden.detach() @ weight.detach().T, shift_labels=targets, chunk_size=5
    )
    for got in (observed, from_logits):
        assert torch.allclose(got.double(), nll64, rtol=1e-5, atol=1e-4), (got, nll64)
    x = hidden.detach().double().requires_grad_()
    F.cross_entropy(x @ weight.detach().double().T, targets).backward()
    assert torch.allclose(hidden.grad.double(), x.grad, rtol=1e-4, atol=1e-6)


def test_capability_probes_are_invisible_to_dispatch_modes(monkeypatch):
    """What this torch can do (the in-place softmax, ``out_dtype``) is
    probed once per process, outside any active dispatch mode: an operation counter sees
    the same work on the first call of a process as on later calls."""
    from channel_loss import _gemm, ops

    inputs, labels = make_inputs(lead=(24,), H=8, V=40, bias="factored", seed=3)
    low = {k: v.detach().bfloat16().requires_grad_() for k, v in inputs.items()}
    monkeypatch.setattr(_gemm, "_PROBED", {})
    seen = []
    for _ in range(2):
        with MatmulCounter() as counter, LiveBytes() as mem:
            run_loss(inputs, labels, observe=True, chunk_size=5)
            with ops.gemm_policy("model_dtype"):
                run_loss(low, labels, observe=True, chunk_size=5)
        seen.append((counter.matmuls, counter.flops, mem.created))
    assert _gemm._PROBED  # the first pass did probe
    assert seen[0] == seen[1]


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_torch_func_transforms_get_an_error_naming_the_op(transform):
    """Regression: torch.func.grad / jvp raised torch's generic "must override the
    setup_context staticmethod", naming neither the op nor what to do."""
    h, w = torch.randn(6, 8), torch.randn(10, 8)
    y = torch.randint(0, 10, (6,))

    def f(x):
        return cl.chunk_cross_entropy(x, w, y)

    calls = {
        "grad": lambda: torch.func.grad(f)(h),
        "jvp": lambda: torch.func.jvp(f, (h,), (torch.ones_like(h),)),
        "vmap": lambda: torch.func.vmap(f)(h[None]),
    }
    with pytest.raises(RuntimeError, match=r"chunk_cross_entropy does not support torch\.func"):
        calls[transform]()
    x = h.clone().requires_grad_()
    (got,) = torch.autograd.grad(f(x), x)  # the advice works
    assert torch.isfinite(got).all()


def test_a_nan_in_an_ignored_rows_hidden_state_stays_out_of_loss_and_gradients_on_the_cpu(
    monkeypatch,
):
    """The decision (docs/channel_loss.md, "Non-finite values in ignored rows"): on the CPU
    an ignored row is never read, so its NaN reaches neither the loss nor any gradient; the
    result is bitwise the one with that row zeroed. The standard path's loss is finite too,
    but its weight gradient and that row's hidden gradient are NaN (the softmax backward of
    the row multiplies NaN by its zero upstream)."""
    torch.manual_seed(4)
    h, w = torch.randn(6, 8), torch.randn(10, 8)
    y = torch.randint(0, 10, (6,))
    y[2] = -100
    results = []
    for row in (float("nan"), 0.0):
        x, wt = h.clone(), w.clone().requires_grad_()
        x[2] = row
        x.requires_grad_()
        loss = cl.chunk_cross_entropy(x, wt, shift_labels=y)
        loss.backward()
        results.append((loss.detach(), x.grad, wt.grad))
    (nan_loss, nan_dh, nan_dw), (zero_loss, zero_dh, zero_dw) = results
    assert torch.equal(nan_loss, zero_loss)
    assert torch.isfinite(nan_loss)
    assert torch.equal(nan_dw, zero_dw)
    assert torch.equal(nan_dh, zero_dh)
    assert not nan_dh[2].any()

    x, wt = h.clone(), w.clone().requires_grad_()
    x[2] = float("nan")
    x.requires_grad_()
    F.cross_entropy(F.linear(x, wt).float(), y).backward()
    assert wt.grad.isnan().any()  # what the standard path does, for contrast
    assert x.grad[2].isnan().all()

    # Accelerators compute every row (finding the scored ones would sync the host): there
    # the NaN propagates as in the standard path. That walk, forced on the CPU:
    from channel_loss import _walk

    monkeypatch.setattr(_walk, "_skips_ignored", lambda device: False)
    x, wt = h.clone(), w.clone().requires_grad_()
    x[2] = float("nan")
    x.requires_grad_()
    loss = cl.chunk_cross_entropy(x, wt, shift_labels=y)
    loss.backward()
    assert torch.equal(loss.detach(), nan_loss)
    assert wt.grad.isnan().any()
    assert x.grad[2].isnan().all()
