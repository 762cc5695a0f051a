"""The compiled chunk math (``chunk_math("compiled")``) against float64 and its own contracts.

The suite runs the eager chunk math (the CPU default); these few tests run the
``torch.compile``'d kernels at small shapes. They share two compiled graph
pairs (plain CE, and every loss feature at once) so inductor compiles each
once per process. The compiled path is not bitwise equal to the eager one
(``exp`` is vectorised differently); it is held to the same float64 accuracy
bounds, and its bitwise contracts (observed vs unobserved, checkpoint and
offload, ``per_token_cross_entropy`` vs ``capture()``) hold within it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from channel_loss import _fused
from channel_loss.ops import CHUNK_MATH, chunk_math
from tests.channel_loss.test_ops import make_inputs, run_loss
from tests.channel_loss.test_ops_features import (
    RATIO,
    SCENARIOS,
    check_against_float64_and_standard,
    check_capture_bitwise_invisible,
    lm_head_errors,
    make_problem,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL_FEATURES = SCENARIOS[-1]
assert ALL_FEATURES[0] == "all_num_items"


@pytest.fixture
def compiled():
    """The compiled chunk math, and proof afterwards that it ran (no eager fallback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with chunk_math("compiled"):
            yield
    assert "cpu" not in _fused._FAILED, _fused._FAILED


@pytest.mark.parametrize(
    ("dtype", "bias", "scenario", "policy"),
    [
        (torch.float32, "none", SCENARIOS[0], "auto"),
        (torch.float32, "full", ALL_FEATURES, "auto"),
        (torch.bfloat16, "factored", ALL_FEATURES, "auto"),
        # The accelerator GEMM policy: the kernel writes the bf16 product operand directly.
        (torch.bfloat16, "none", SCENARIOS[0], "model_dtype"),
    ],
    ids=["fp32-plain", "fp32-full-all", "bf16-factored-all", "bf16-plain-model-dtype"],
)
@pytest.mark.usefixtures("compiled")
def test_compiled_matches_float64_like_eager(dtype, bias, scenario, policy):
    _, scale, kw = scenario
    check_against_float64_and_standard(dtype, bias, scale, kw, policy=policy)


@pytest.mark.usefixtures("compiled")
def test_compiled_gradient_keeps_its_accuracy_at_large_logits():
    """The gradient kernel once formed the softmax as exp(x - lse), carrying lse's rounding
    (at the size of the largest logit) into every probability: 45x the standard path's
    error at logits of 2.5e4, 2x at 600."""
    for h_scale, w_scale in ((100.0, 9.0), (10.0, 1.0)):
        torch.manual_seed(0)
        h, w = torch.randn(64, 32) * h_scale, torch.randn(500, 32) * w_scale
        t = torch.randint(0, 500, (64,))
        ours, standard = lm_head_errors(h, w, t)
        for name, o, s in zip(("hidden", "weight"), ours, standard, strict=True):
            assert o <= RATIO * s, (h_scale, name, o, s)


@pytest.mark.usefixtures("compiled")
def test_compiled_keeps_capture_and_per_token_bitwise():
    _, scale, kw = ALL_FEATURES
    inputs, labels = make_problem(torch.float32, "factored", scale, kw, seed=3)
    check_capture_bitwise_invisible(inputs, labels, kw)


@pytest.mark.usefixtures("compiled")
def test_compiled_checkpoint_and_offload_are_bitwise_plain():
    inputs, labels = make_inputs(lead=(2, 9), H=6, V=11, bias="none", seed=2)
    plain_loss, plain_grads, _ = run_loss(inputs, labels, observe=False)

    def checkpointed(body):
        return checkpoint(body, use_reentrant=False)

    def offloaded(body):
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            return body()

    for wrap in (checkpointed, offloaded):
        loss, got, cap = run_loss(inputs, labels, observe=True, wrap=wrap)
        assert torch.equal(loss, plain_loss), wrap.__name__
        for name in plain_grads:
            assert torch.equal(got[name], plain_grads[name]), (wrap.__name__, name)
        assert len(cap.observations) == 1, wrap.__name__


def test_chunk_math_policy_per_device_and_names_checked(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(_fused.CHUNK_MATH_ENV, raising=False)
    # The CPU default is the eager passes, measured faster there; CUDA compiles.
    assert not _fused.use_compiled(cpu)
    assert _fused.use_compiled(cuda)
    with chunk_math("compiled"):
        assert _fused.use_compiled(cpu)
        with chunk_math("eager"):
            assert not _fused.use_compiled(cuda)
    monkeypatch.setenv(_fused.CHUNK_MATH_ENV, "compiled")
    assert _fused.use_compiled(cpu)
    with chunk_math("auto"):
        assert not _fused.use_compiled(cpu)
    monkeypatch.setenv(_fused.CHUNK_MATH_ENV, "fused")
    with pytest.raises(ValueError, match=r"\$CHANNEL_LOSS_CHUNK_MATH must be one of"):
        _fused.use_compiled(cpu)
    assert CHUNK_MATH == ("auto", "compiled", "eager")
    with pytest.raises(ValueError, match=r"chunk_math must be one of .*; got 'triton'"):
        chunk_math("triton").__enter__()


def test_failed_compilation_falls_back_to_eager_with_a_warning(tmp_path):
    """No C++ compiler for inductor: the call warns once and runs the eager passes."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        import channel_loss as cl
        from channel_loss.ops import chunk_math
        from tests.channel_loss.test_ops import make_inputs

        def run(mode):
            inputs, labels = make_inputs(lead=(2, 7), H=4, V=9, bias="none")
            with chunk_math(mode):
                loss = cl.chunk_cross_entropy(**inputs, labels=labels, chunk_size=3)
                loss.backward()
            return [loss.detach(), inputs["hidden_states"].grad, inputs["weight"].grad]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run("compiled")
            again = run("compiled")
        want = run("eager")
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(messages) == 1, messages
        assert "compiling the fused chunk math failed on cpu" in messages[0], messages
        assert "CHANNEL_LOSS_CHUNK_MATH=eager" in messages[0], messages
        for a, b, c in zip(got, again, want):
            assert torch.equal(a, c) and torch.equal(b, c)
        print("FELL BACK")
        """
    )
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-c++"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        PYTHONPATH=os.pathsep.join([ROOT, *sys.path]),
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FELL BACK" in out.stdout, out.stdout
