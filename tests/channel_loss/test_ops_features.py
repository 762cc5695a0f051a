"""Loss features of chunk_cross_entropy / per_token_cross_entropy against float64 references.

``logit_scale``, ``softcap``, ``label_smoothing``, ``lse_square_scale`` and
``reduction`` are checked, loss and every gradient (hidden, weight, both bias
forms), against a float64 reference built from full logits with
``F.cross_entropy``, and against the standard path (``F.linear(h, W).float()``
then the same features, autograd) in fp32 / bf16 / fp16: ours must be at least
about as close to float64 as the standard path (``RATIO``), and within an
absolute bound per dtype. Scenarios follow Liger-Kernel's softcap /
label-smoothing / z-loss tests (input scales 0.1 / 1 / 10, smoothing 0.1 and
0.9, z-loss 1e-4 / 1e-5, a cap of 30, ignore indices inside the vocabulary,
sum reduction, the loss not being the last layer), at CPU-sized shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import channel_loss as cl
from channel_loss.ops import cpu_has_bf16_gemm, default_gemm_policy, gemm_policy
from tests.channel_loss.test_ops import BIAS_FORMS, hf_shift, make_inputs

#: ours may be this much further from float64 than the standard path (rounding noise).
RATIO = 1.25
#: the low-precision hidden gradient is rounded to its dtype in forward, then rescaled by
#: the upstream factor in backward: two roundings where the standard path has one.
HIDDEN_RATIO = 1.5
#: below this relative L2 error a comparison is at the dtype's noise floor (float64 inputs:
#: fp32's, since the standard path rounds their logits to fp32 and runs the CE in fp32).
FLOOR = {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}
#: absolute bound on the relative L2 error against float64, per dtype.
BOUND = {torch.float64: 2e-5, torch.float32: 2e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}

# (id, input scale, chunk_cross_entropy keywords): Liger's scenarios at small shapes.
SCENARIOS = [
    ("plain", 1.0, {}),
    ("smooth_0.1_x0.1", 0.1, {"label_smoothing": 0.1}),
    ("smooth_0.9", 1.0, {"label_smoothing": 0.9}),
    ("smooth_1.0_x10", 10.0, {"label_smoothing": 1.0}),
    ("smooth_ignore_2", 1.0, {"label_smoothing": 0.1, "ignore_index": 2}),
    ("softcap_30_x10", 10.0, {"softcap": 30.0}),
    ("softcap_2", 1.0, {"softcap": 2.0}),
    ("scale_3_softcap_4", 1.0, {"logit_scale": 3.0, "softcap": 4.0}),
    ("zloss_1e-4_x10", 10.0, {"lse_square_scale": 1e-4}),
    ("zloss_0.1", 1.0, {"lse_square_scale": 0.1}),
    ("sum", 1.0, {"reduction": "sum"}),
    (
        "all_ignore_42_sum",
        1.0,
        {
            "logit_scale": 0.5,
            "softcap": 30.0,
            "label_smoothing": 0.1,
            "lse_square_scale": 1e-4,
            "ignore_index": 42,
            "reduction": "sum",
        },
    ),
    (
        "all_num_items",
        10.0,
        {
            "softcap": 30.0,
            "label_smoothing": 0.2,
            "lse_square_scale": 1e-2,
            "num_items_in_batch": 77,
        },
    ),
]
FEATURE_KEYS = ("logit_scale", "softcap", "label_smoothing", "lse_square_scale", "reduction")


def feature_loss(inputs, targets, kw, *, float64: bool):
    """The loss by its definition, from full logits: float64, or the standard path."""
    if float64:
        x = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    else:
        x = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    logits = F.linear(x["hidden_states"], x["weight"])
    logits = logits if float64 else logits.float()
    if "logits_bias_weight" in x:
        extra = F.linear(x["logits_bias"], x["logits_bias_weight"])
        logits = logits + (extra if float64 else extra.float())
    elif "logits_bias" in x:
        logits = logits + (x["logits_bias"] if float64 else x["logits_bias"].float())
    if kw.get("logit_scale") is not None:
        logits = logits * kw["logit_scale"]
    if kw.get("softcap") is not None:
        logits = kw["softcap"] * torch.tanh(logits / kw["softcap"])
    ignore = kw.get("ignore_index", -100)
    flat, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ce = F.cross_entropy(
        flat,
        t,
        ignore_index=ignore,
        reduction="none",
        label_smoothing=kw.get("label_smoothing", 0.0),
    )
    z = kw.get("lse_square_scale", 0.0) * torch.logsumexp(flat, dim=-1).square()
    per_token = torch.where(t != ignore, ce + z, 0.0)
    nll = torch.where(t != ignore, F.cross_entropy(flat, t.clamp(min=0), reduction="none"), 0.0)
    total = per_token.sum()
    if kw.get("reduction", "mean") == "mean":
        total = total / kw.get("num_items_in_batch", max(int((t != ignore).sum()), 1))
    return total, nll.reshape(targets.shape), x


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    scale = ref.norm()
    return float((got - ref).norm() / scale) if scale > 0 else float(got.norm())


def upstream(loss: torch.Tensor, dtype: torch.dtype, kw, scale: float) -> torch.Tensor:
    """A non-trivial upstream gradient: a GradScaler-sized factor for fp16, else 3.7 + 2 loss.

    The fp16 scale is 2**16 where no gradient overflows fp16 at it; a summed loss
    (~40x a mean one) or inputs scaled by 10 get 2**10, as a GradScaler would back off.
    """
    if dtype == torch.float16:
        small = kw.get("reduction") == "sum" or scale > 1
        return loss * (2.0**10 if small else 2.0**16)
    return loss * 3.7 + loss.pow(2)


def shift(labels, kw):
    """The HF shift with the scenario's ignore index appended."""
    shifted = torch.full_like(labels, kw.get("ignore_index", -100))
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def make_problem(dtype, bias, scale, kw, seed=0):
    inputs, labels = make_inputs(lead=(2, 24), H=16, V=48, bias=bias, dtype=dtype, seed=seed)
    with torch.no_grad():
        inputs["hidden_states"].mul_(scale)
    ignore = kw.get("ignore_index", -100)
    labels[0, 3:6] = ignore
    if ignore >= 0:
        labels[1, ::5] = ignore  # an ignore index inside the vocabulary: those are skipped too
    return inputs, labels


def check_against_float64_and_standard(dtype, bias, scale, kw, policy="auto"):
    """Loss and every gradient: ours at least about as close to float64 as the standard path."""
    inputs, labels = make_problem(dtype, bias, scale, kw)
    targets = shift(labels, kw)
    with gemm_policy(policy):
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=7, **kw)
        upstream(loss, dtype, kw, scale).backward()
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    ref, _, ref_x = feature_loss(inputs, targets, kw, float64=True)
    upstream(ref, dtype, kw, scale).backward()
    std, _, std_x = feature_loss(inputs, targets, kw, float64=False)
    upstream(std, dtype, kw, scale).backward()
    checks = [("loss", loss.detach(), std.detach(), ref.detach())]
    checks += [(k, v.grad, std_x[k].grad, ref_x[k].grad) for k, v in inputs.items()]
    for name, ours, standard, exact in checks:
        if name != "loss":
            assert ours.dtype == dtype, name
        ours_err, std_err = rel_l2(ours, exact), rel_l2(standard, exact)
        ratio = HIDDEN_RATIO if name == "hidden_states" and dtype != torch.float32 else RATIO
        assert ours_err <= max(ratio * std_err, FLOOR[dtype]), (name, ours_err, std_err)
        assert ours_err <= BOUND[dtype], (name, ours_err)
    return {k: v.grad for k, v in inputs.items()}


DTYPES = pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16],
    ids=["fp64", "fp32", "bf16", "fp16"],
)


@DTYPES
@pytest.mark.parametrize("bias", ["none", "full", "factored"])
@pytest.mark.parametrize(("scale", "kw"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_features_match_float64_and_the_standard_path(dtype, bias, scale, kw):
    check_against_float64_and_standard(dtype, bias, scale, kw)


POLICY_SCENARIOS = [s for s in SCENARIOS if s[0] in ("plain", "softcap_2", "all_num_items")]


@DTYPES
@pytest.mark.parametrize("bias", ["none", "full", "factored"])
@pytest.mark.parametrize(
    ("scale", "kw"), [s[1:] for s in POLICY_SCENARIOS], ids=[s[0] for s in POLICY_SCENARIOS]
)
def test_accelerator_gemm_policy_is_as_accurate_as_the_standard_path(dtype, bias, scale, kw):
    """The accelerator policy (products of model-dtype operands, fp32 accumulation), forced
    on the CPU where it is formed exactly from fp32 copies of those operands."""
    forced = check_against_float64_and_standard(dtype, bias, scale, kw, policy="model_dtype")
    if dtype in (torch.bfloat16, torch.float16) and bias == "factored":
        # The policies really differ for low-precision data (the logits gradient is
        # rounded to the model dtype before the weight-gradient product).
        cpu = check_against_float64_and_standard(dtype, bias, scale, kw, policy="fp32")
        assert not torch.equal(forced["weight"], cpu["weight"])


@DTYPES
@pytest.mark.parametrize("bias", ["none", "full", "factored"])
@pytest.mark.parametrize(("scale", "kw"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_mixed_gemm_policy_is_as_accurate_as_the_standard_path(dtype, bias, scale, kw):
    """The CPU's bf16 policy where it has bf16 units: the logits and the hidden gradient
    from model-dtype GEMMs, the accumulated products in fp32. Rounding each chunk's
    weight-gradient partial instead was measured at 1.4-1.5x the standard path's error."""
    check_against_float64_and_standard(dtype, bias, scale, kw, policy="mixed")


def test_float64_products_run_in_float64_under_every_policy():
    """float64 inputs are not low precision: their products run in float64 as the standard
    path's do (only the logits are rounded to fp32), whatever the policy. They were once
    upcast-to-fp32 copies, 12x further from float64 than the standard path at H=1024."""
    torch.manual_seed(0)
    N, H, V = 256, 512, 1000
    h = torch.randn(N, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) * 0.05
    t = torch.randint(0, V, (N,))

    def grads(policy):
        x, y = h.clone().requires_grad_(), w.clone().requires_grad_()
        if policy is None:
            loss = F.cross_entropy(F.linear(x, y).float(), t)
        elif policy == "exact":
            loss = F.cross_entropy(x @ y.t(), t)
        else:
            with gemm_policy(policy):
                loss = cl.chunk_cross_entropy(x, y, shift_labels=t, chunk_size=64)
        loss.backward()
        return x.grad, y.grad

    exact, standard = grads("exact"), grads(None)
    ours = {policy: grads(policy) for policy in ("auto", "fp32", "mixed", "model_dtype")}
    for policy, got in ours.items():
        assert all(torch.equal(a, b) for a, b in zip(got, ours["auto"], strict=True)), policy
    for name, o, s, e in zip(("hidden", "weight"), ours["auto"], standard, exact, strict=True):
        assert o.dtype == torch.float64
        assert rel_l2(o, e) <= RATIO * rel_l2(s, e), (name, rel_l2(o, e), rel_l2(s, e))


def lm_head_errors(h, w, t, *, bias=None, **kw):
    """Relative L2 errors against float64 of (hidden, weight) gradients: ours, the standard
    path's. ``kw``: only ``lse_square_scale`` (z-loss, mean reduction)."""
    z = kw.get("lse_square_scale", 0.0)

    def grads(kind):
        dtype = torch.float64 if kind == "exact" else torch.float32
        x = h.to(dtype, copy=True).requires_grad_()
        y = w.to(dtype, copy=True).requires_grad_()
        b = None if bias is None else bias.to(dtype)
        if kind == "ours":
            loss = cl.chunk_cross_entropy(x, y, shift_labels=t, logits_bias=b, **kw)
        else:
            logits = x @ y.t() if kind == "exact" else F.linear(x, y).float()
            logits = logits if b is None else logits + b
            loss = F.cross_entropy(logits, t) + z * torch.logsumexp(logits, -1).square().mean()
        loss.backward()
        return x.grad, y.grad

    exact = grads("exact")
    return [
        [rel_l2(got, ref) for got, ref in zip(grads(kind), exact, strict=True)]
        for kind in ("ours", "standard")
    ]


@pytest.mark.parametrize("hidden", [256, 1024])
def test_fp32_products_are_as_accurate_as_the_standard_path(hidden):
    """At the hidden sizes of real models, where fp32 accumulation order shows: the CPU's
    fp32 logits once came from oneDNN's linear, which accumulates less precisely than the
    standard path's GEMM (1.5x its gradient error at H=256, 1.6x at H=1024)."""
    torch.manual_seed(0)
    N, V = 256, 2000
    h, w = torch.randn(N, hidden), torch.randn(V, hidden) * 3 / hidden**0.5
    t = torch.randint(0, V, (N,))
    ours, standard = lm_head_errors(h, w, t)
    for name, o, s in zip(("hidden", "weight"), ours, standard, strict=True):
        assert o <= RATIO * s, (name, o, s)


@pytest.mark.parametrize("bias", ["none", "full"])
def test_a_confident_target_keeps_its_digits_under_z_loss(bias):
    """p_t (1 + 2 s lse) - 1 once lost the digits of a confident target (p_t near 1) that
    the standard path keeps, computing p_t - 1 before adding the z-loss term: 470x its
    error with one class (p_t = 1, the CE gradient exactly 0)."""
    torch.manual_seed(0)
    N, H, vocab = 256, 64, 1
    h, w = torch.randn(N, H), torch.randn(vocab, H) * 0.3
    t = torch.randint(0, vocab, (N,))
    full = None
    if bias == "full":  # the non-folded block (the bias takes its gradient)
        full = torch.zeros(N, vocab)
        full[torch.arange(N), t] = 8.0
    ours, standard = lm_head_errors(h, w, t, bias=full, lse_square_scale=1e-4)
    for name, o, s in zip(("hidden", "weight"), ours, standard, strict=True):
        assert o <= RATIO * s, (name, o, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixed_policy_rounds_the_logits_as_the_standard_path_does(dtype):
    """Under "mixed" the observed NLL is that of ``F.linear(h, W).float()`` logits, the
    standard path's; under "model_dtype" the logits are not rounded and it differs."""
    inputs, labels = make_problem(dtype, "none", 4.0, {})
    targets = shift(labels, {})
    _, standard_nll, _ = feature_loss(inputs, targets, {}, float64=False)
    observed = {}
    for policy in ("mixed", "model_dtype"):
        with gemm_policy(policy), cl.capture() as cap:
            cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=7)
        observed[policy] = cap.observations[0].token_losses
    assert torch.allclose(observed["mixed"], standard_nll, rtol=0, atol=1e-5)
    assert not torch.allclose(observed["model_dtype"], standard_nll, rtol=0, atol=1e-3)


def test_default_gemm_policy_follows_the_device_the_dtype_and_the_cpu(monkeypatch):
    assert default_gemm_policy("cuda", torch.bfloat16) == "model_dtype"
    assert default_gemm_policy("npu", torch.float16) == "model_dtype"
    for dtype in (torch.float32, torch.float16):
        assert default_gemm_policy("cpu", dtype) == "fp32"
    bf16 = "mixed" if cpu_has_bf16_gemm() else "fp32"
    assert default_gemm_policy("cpu", torch.bfloat16) == bf16
    # The CPU probes as the seam: with bf16 units the bf16 default is "mixed", without "fp32".
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert default_gemm_policy("cpu", torch.bfloat16) == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert default_gemm_policy("cpu", torch.bfloat16) == "mixed"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_auto_gemm_policy_is_the_default_policy_bit_for_bit(dtype):
    inputs, labels = make_problem(dtype, "factored", 1.0, {})
    runs = []
    for policy in ("auto", default_gemm_policy("cpu", dtype)):
        x = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        with gemm_policy(policy):
            loss = cl.chunk_cross_entropy(**x, labels=labels, chunk_size=7)
        loss.backward()
        runs.append([loss, *(v.grad for v in x.values())])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_gemm_policy_names_are_checked():
    with (
        pytest.raises(
            ValueError,
            match=r"gemm_policy must be one of \('auto', 'fp32', "
            r"'model_dtype', 'mixed'\); got 'tf32'",
        ),
        gemm_policy("tf32"),
    ):
        pass


def check_capture_bitwise_invisible(inputs, labels, kw):
    """Loss and gradients bitwise equal with and without ``capture()``, and the observation
    bitwise equal to ``per_token_cross_entropy`` at the same chunk; returns the observation
    and the observed loss."""
    runs = []
    for observe in (False, True):
        for x in inputs.values():
            x.grad = None
        with cl.capture() as cap:
            if observe:
                loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=5, **kw)
        if not observe:
            loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=5, **kw)
        (loss * 1.3).backward()
        runs.append(
            (loss.detach(), {k: v.grad.clone() for k, v in inputs.items()}, cap.observations)
        )
    (plain_loss, plain_grads, none), (obs_loss, obs_grads, (obs,)) = runs
    assert none == []
    assert torch.equal(plain_loss, obs_loss)
    for name, g in plain_grads.items():
        assert torch.equal(g, obs_grads[name]), name
    features = {k: kw[k] for k in FEATURE_KEYS if k in kw}
    again = cl.per_token_cross_entropy(**inputs, labels=labels, chunk_size=5, **features)
    assert torch.equal(again, obs.token_losses)
    return obs, obs_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_features_keep_capture_bitwise_invisible(dtype, bias):
    """Observed vs unobserved: the same bits; the observation is the NLL of the final logits."""
    _, scale, kw = SCENARIOS[-1]
    inputs, labels = make_problem(dtype, bias, scale, kw, seed=3)
    obs, obs_loss = check_capture_bitwise_invisible(inputs, labels, kw)
    # The NLL of the capped logits: neither smoothing nor z-loss, unlike the loss itself.
    _, nll, _ = feature_loss(inputs, shift(labels, kw), kw, float64=True)
    bound = 1e-5 if dtype == torch.float32 else 5e-2
    assert rel_l2(obs.token_losses, nll) <= bound
    assert not torch.allclose(
        obs.token_losses.sum() / kw["num_items_in_batch"], obs_loss, rtol=1e-2
    )


@pytest.mark.parametrize(
    "kw", [{"softcap": 3.0}, {"logit_scale": 0.25, "softcap": 5.0}, {"logit_scale": 2.0}]
)
def test_per_token_from_logits_applies_scale_then_cap(kw):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 9, 15, generator=g) * 6
    labels = torch.randint(0, 15, (2, 9), generator=g)
    before = logits.clone()
    out = cl.per_token_cross_entropy(logits=logits, labels=labels, chunk_size=4, **kw)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    final = logits.double() * kw.get("logit_scale", 1.0)
    if "softcap" in kw:
        final = kw["softcap"] * torch.tanh(final / kw["softcap"])
    ref = F.cross_entropy(
        final.reshape(-1, 15), hf_shift(labels).reshape(-1), ignore_index=-100, reduction="none"
    ).reshape(2, 9)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_sum_reduction_is_the_mean_times_the_count():
    inputs, labels = make_problem(torch.float32, "none", 1.0, {})
    count = int((hf_shift(labels) != -100).sum())
    total = cl.chunk_cross_entropy(**inputs, labels=labels, reduction="sum", chunk_size=7)
    mean = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=7)
    torch.testing.assert_close(total, mean * count, rtol=1e-6, atol=0)
    labels[...] = -100
    empty = cl.chunk_cross_entropy(**inputs, labels=labels, reduction="sum")
    empty.backward()
    assert empty.item() == 0.0
    assert bool((inputs["weight"].grad == 0).all())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"softcap": -1.0}, r"softcap must be a finite number > 0\.0 \(None: no cap\); got -1\.0"),
        ({"softcap": 0}, r"softcap must be a finite number > 0\.0"),
        ({"softcap": float("inf")}, r"softcap must be a finite number > 0\.0"),
        ({"softcap": "30"}, r"softcap must be a finite number > 0\.0.*got '30'"),
        ({"logit_scale": 0.0}, r"logit_scale must be a finite number > 0\.0"),
        ({"logit_scale": True}, r"logit_scale must be a finite number > 0\.0.*got True"),
        (
            {"label_smoothing": 1.5},
            r"label_smoothing must be a finite number >= 0\.0 and "
            r"<= 1\.0; got 1\.5",
        ),
        ({"label_smoothing": -0.1}, r"label_smoothing must be a finite number >= 0\.0"),
        ({"label_smoothing": None}, r"label_smoothing must be a finite number"),
        ({"lse_square_scale": -1e-4}, r"lse_square_scale must be a finite number >= 0\.0"),
        ({"lse_square_scale": float("nan")}, r"lse_square_scale must be a finite number"),
        ({"reduction": "none"}, r"reduction must be one of \('mean', 'sum'\); got 'none'"),
        (
            {"reduction": "sum", "num_items_in_batch": 8},
            r"num_items_in_batch divides the summed loss: pass it with reduction='mean'",
        ),
    ],
)
def test_bad_feature_values_name_the_argument(kw, match):
    h, w, labels = torch.randn(2, 5, 4), torch.randn(7, 4), torch.randint(0, 7, (2, 5))
    with pytest.raises(ValueError, match=match):
        cl.chunk_cross_entropy(h, w, labels, **kw)
    per_token_kw = {k: v for k, v in kw.items() if k != "num_items_in_batch"}
    if per_token_kw == {"reduction": "sum"}:
        return
    with pytest.raises(ValueError, match=match):
        cl.per_token_cross_entropy(hidden_states=h, weight=w, labels=labels, **per_token_kw)


def test_features_are_keyword_only_and_off_by_default():
    inputs, labels = make_problem(torch.float32, "full", 1.0, {})
    plain = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=7)
    off = cl.chunk_cross_entropy(
        **inputs,
        labels=labels,
        chunk_size=7,
        logit_scale=None,
        softcap=None,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        reduction="mean",
    )
    assert torch.equal(plain, off)
    with pytest.raises(TypeError):
        cl.chunk_cross_entropy(inputs["hidden_states"], inputs["weight"], labels, None)


@pytest.mark.launch(nproc=1, timeout=120)
def test_dtensor_inputs_get_our_error_and_full_tensor_works():
    """A DTensor LM-head weight (FSDP2 outside the forward) is refused with advice, not with
    torch's "mixed torch.Tensor and DTensor" error; its ``.full_tensor()`` gives the loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    inputs, labels = make_problem(torch.float32, "none", 1.0, {})
    h, w = inputs["hidden_states"], inputs["weight"]
    sharded = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
    replicated_h = distribute_tensor(h.detach(), mesh, [Replicate()])
    with pytest.raises(
        ValueError,
        match=r"weight is a DTensor \(placements \(Shard\(dim=0\),\)\)"
        r".*inside the model's forward.*weight\.full_tensor\(\)",
    ):
        cl.chunk_cross_entropy(h, sharded, labels)
    with pytest.raises(ValueError, match=r"hidden_states is a DTensor.*full_tensor"):
        cl.chunk_cross_entropy(replicated_h, w, labels)
    with pytest.raises(ValueError, match=r"weight is a DTensor"):
        cl.per_token_cross_entropy(hidden_states=h, weight=sharded, labels=labels)
    got = cl.chunk_cross_entropy(h, sharded.full_tensor(), labels, chunk_size=7)
    assert torch.equal(got, cl.chunk_cross_entropy(h, w, labels, chunk_size=7))


# --------------------------------------------------------------------------- autocast

AMP_DTYPES = pytest.mark.parametrize(
    "amp", [torch.bfloat16, torch.float16], ids=["autocast_bf16", "autocast_fp16"]
)


def run_ours(inputs, labels, kw=None, *, amp=None, dtype=None, factor=3.7):
    """Loss, observed NLL and gradients of one call (inside ``torch.autocast("cpu", amp)``
    when ``amp``), the inputs first cast to ``dtype`` (differentiably) when given."""
    x = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    cast = {k: v.to(dtype) if dtype and k != "logits_bias" else v for k, v in x.items()}
    if dtype and "logits_bias_weight" in x:
        cast["logits_bias"] = x["logits_bias"].to(dtype)
    region = torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None)
    with region, cl.capture() as cap:
        loss = cl.chunk_cross_entropy(**cast, labels=labels, chunk_size=7, **(kw or {}))
    (loss * factor).backward()
    return loss.detach(), cap.observations[0].token_losses, {k: v.grad for k, v in x.items()}


def assert_same_run(a, b):
    assert torch.equal(a[0], b[0]), "loss"
    assert torch.equal(a[1], b[1]), "observed NLL"
    for k in a[2]:
        assert a[2][k].dtype == b[2][k].dtype, k
        assert torch.equal(a[2][k], b[2][k]), k


@AMP_DTYPES
@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_autocast_runs_the_op_on_the_operands_autocast_would_cast(amp, bias):
    """Under autocast the LM-head products take their operands as autocast hands them to
    ``F.linear``: hidden states, weight and a factored bias pair cast to its dtype, an
    additive ``logits_bias`` added as given. Bitwise the op on those casts outside autocast,
    gradients reaching the fp32 inputs in fp32."""
    inputs, labels = make_problem(torch.float32, bias, 1.0, {})
    under = run_ours(inputs, labels, amp=amp)
    cast = run_ours(inputs, labels, dtype=amp)
    assert_same_run(under, cast)
    for k, g in under[2].items():
        assert g.dtype == torch.float32, k
    # and it is not the fp32 op: the products really ran in the autocast dtype
    assert not torch.equal(under[0], run_ours(inputs, labels)[0])


@pytest.mark.parametrize(
    ("amp", "dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
    + [(amp, torch.float64) for amp in (torch.bfloat16, torch.float16)],
    ids=["bf16_in_bf16", "fp16_in_fp16", "fp64_in_bf16", "fp64_in_fp16"],
)
@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_autocast_leaves_the_op_on_model_dtype_and_float64_inputs_bit_for_bit(amp, dtype, bias):
    """Inputs autocast does not cast (already its dtype, or float64): the op's own matmuls
    are never cast either, they follow its dtype policy (with a factored bias one of them
    was cast to bf16 before, off the policy)."""
    inputs, labels = make_problem(dtype, bias, 1.0, {})
    assert_same_run(run_ours(inputs, labels, amp=amp), run_ours(inputs, labels))


@pytest.mark.parametrize("bias", ["none", "full", "factored"])
@pytest.mark.parametrize(
    ("scale", "kw"), [s[1:] for s in POLICY_SCENARIOS], ids=[s[0] for s in POLICY_SCENARIOS]
)
def test_autocast_is_as_accurate_as_the_standard_path_under_autocast(bias, scale, kw):
    """fp32 parameters under ``torch.autocast("cpu", torch.bfloat16)`` (mixed-precision
    training): loss and every fp32 gradient at least about as close to float64 as
    ``F.linear(h, W).float()`` + CE under the same autocast."""
    inputs, labels = make_problem(torch.float32, bias, scale, kw)
    targets = shift(labels, kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=7, **kw)
        std, _, std_x = feature_loss(inputs, targets, kw, float64=False)
    upstream(loss, torch.bfloat16, kw, scale).backward()
    upstream(std, torch.bfloat16, kw, scale).backward()
    ref, _, ref_x = feature_loss(inputs, targets, kw, float64=True)
    upstream(ref, torch.bfloat16, kw, scale).backward()
    checks = [("loss", loss.detach(), std.detach(), ref.detach())]
    checks += [(k, v.grad, std_x[k].grad, ref_x[k].grad) for k, v in inputs.items()]
    for name, ours, standard, exact in checks:
        assert ours.dtype == torch.float32, name
        ours_err, std_err = rel_l2(ours, exact), rel_l2(standard, exact)
        if name == "loss" or std_err > FLOOR[torch.float32]:  # the standard path rounded it
            ratio = HIDDEN_RATIO if name == "hidden_states" else RATIO
            assert ours_err <= max(ratio * std_err, FLOOR[torch.bfloat16]), (
                name,
                ours_err,
                std_err,
            )
        else:  # an fp32 gradient the standard path never rounds (an additive bias)
            assert ours_err <= BOUND[torch.bfloat16], (name, ours_err, std_err)


def test_autocast_takes_a_hidden_state_and_a_weight_of_different_dtypes():
    """As ``F.linear`` does under autocast: a bf16 hidden state with an fp32 weight is the
    op on both cast to the autocast dtype (outside autocast it is refused)."""
    inputs, labels = make_problem(torch.float32, "none", 1.0, {})
    inputs["hidden_states"] = inputs["hidden_states"].detach().bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="share one floating dtype"):
        run_ours(inputs, labels)
    under = run_ours(inputs, labels, amp=torch.bfloat16)
    assert_same_run(under, run_ours(inputs, labels, dtype=torch.bfloat16))
    assert under[2]["hidden_states"].dtype == torch.bfloat16
    assert under[2]["weight"].dtype == torch.float32


def test_a_dtype_mismatch_left_by_autocast_names_autocast():
    inputs, labels = make_problem(torch.float32, "none", 1.0, {})
    inputs["weight"] = inputs["weight"].detach().double().requires_grad_()
    with pytest.raises(ValueError, match="share one floating dtype") as plain:
        run_ours(inputs, labels)
    assert "autocast" not in str(plain.value)
    with pytest.raises(
        ValueError, match=r"torch.bfloat16 and torch.float64 \(under torch.autocast"
    ):
        run_ours(inputs, labels, amp=torch.bfloat16)


@pytest.mark.parametrize("bias", BIAS_FORMS)
def test_per_token_under_autocast_is_what_capture_records_under_it(bias):
    """``per_token_cross_entropy``'s bitwise contract holds inside one autocast region."""
    inputs, labels = make_problem(torch.float32, bias, 1.0, {})
    _, observed, _ = run_ours(inputs, labels, amp=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per_token = cl.per_token_cross_entropy(**inputs, labels=labels, chunk_size=7)
    assert torch.equal(per_token, observed)
