"""The fused path inside the model's own forward, and what ``patch_model`` refuses.

Tiny random HF models on CPU (float32). Tolerances: the fused loss against
the model's own ``rtol=1e-5, atol=1e-6``, gradients ``rtol=1e-4, atol=1e-6``
(the same fp32 logits computed chunk by chunk in another matmul shape);
``patch_model`` without ``fused`` is bitwise (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from channel_loss import ChannelLossMeter, capture  # noqa: E402
from channel_loss.integrations.transformers import (  # noqa: E402
    ObservingLoss,
    UnsupportedModelError,
    fused_causal_lm_loss,
    patch_model,
)
from tests.channel_loss.test_hf_sweep import VOCAB, build, packed_batch  # noqa: E402


def reference(model, batch):
    """The unpatched model's loss and gradients (dropout re-seeded like every other path)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = model(**batch.inputs, labels=batch.labels).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def fused(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = fused_causal_lm_loss(model, **batch.inputs, labels=batch.labels, chunk_size=8, **kwargs)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_same(got, want):
    loss, grads = got
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-6)
    assert grads.keys() == want[1].keys()  # every parameter the model trains gets a gradient
    for name, grad in want[1].items():
        torch.testing.assert_close(
            grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
def test_fused_loss_keeps_the_moe_router_aux_loss(name):
    # Mixtral with router_aux_loss_coef=0.5 gave HF 5.574 and a fused CE-only 4.570, with
    # router-gate gradients off by up to 1.2 relative.
    model = build(name)
    assert model.config.output_router_logits
    batch = packed_batch(name)
    want = reference(model, batch)
    assert_same(fused(model, batch), want)
    with patch_model(model, fused=True):
        assert_same(fused(model, batch), want)


def test_fused_loss_of_a_model_whose_base_model_is_itself():
    # Llama 4 text: the old path ran model.base_model (the whole model) and fed its logits to
    # the CE as hidden states.
    model = build("llama4_text")
    batch = packed_batch("llama4_text")
    assert_same(fused(model, batch), reference(model, batch))


def test_fused_loss_through_a_peft_wrapper():
    model = build("peft_lora")
    batch = packed_batch("peft_lora")
    want = reference(model, batch)
    assert_same(fused(model, batch), want)
    assert any("lora_A" in name for name in want[1])  # the adapters train through the fused path


def test_fused_loss_trains_a_decoder_head_with_layers_before_its_linear():
    # RoBERTa's LM head is dense + gelu + LayerNorm + decoder Linear: the old path started from
    # last_hidden_state and those layers got no gradient.
    model = build("roberta_decoder")
    batch = packed_batch("roberta_decoder")
    want = reference(model, batch)
    assert {"lm_head.dense.weight", "lm_head.layer_norm.weight"} <= want[1].keys()
    assert_same(fused(model, batch), want)


@pytest.mark.parametrize("name", ["recurrent_gemma", "falcon_h1"])
def test_capped_and_scaled_logits_are_fused_exactly(name):
    # RecurrentGemma (logits_soft_cap): the old path returned the uncapped loss (63.15 where
    # HF gave 30.84); FalconH1 multiplies its logits by lm_head_multiplier.
    model = build(name)
    batch = packed_batch(name)
    assert_same(fused(model, batch), reference(model, batch))


class DoubledLogits(transformers.LlamaForCausalLM):
    """A model that transforms its logits in a way no config field announces."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = 2.0 * self.lm_head(hidden)
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class OwnCrossEntropy(transformers.LlamaForCausalLM):
    """A model that computes its loss without ``self.loss_function``."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def tiny(cls):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return cls(config).train()


def test_the_first_fused_forward_refuses_logits_that_are_not_the_head_output():
    model = tiny(DoubledLogits)
    batch = packed_batch("llama")
    want = model(**batch.inputs, labels=batch.labels).loss
    handle = patch_model(model, fused=True)
    with pytest.raises(UnsupportedModelError, match=r"refuses DoubledLogits: the logits .* not "):
        model(**batch.inputs, labels=batch.labels)
    # It keeps refusing (never a silently different loss) until removed.
    with pytest.raises(UnsupportedModelError, match="DoubledLogits"):
        model(**batch.inputs, labels=batch.labels)
    handle.remove()
    assert torch.equal(model(**batch.inputs, labels=batch.labels).loss, want)


def test_the_first_fused_forward_refuses_a_loss_computed_without_loss_function():
    model = tiny(OwnCrossEntropy)
    batch = packed_batch("llama")
    with (
        patch_model(model, fused=True),
        pytest.raises(UnsupportedModelError, match=r"never called self\.loss_function"),
    ):
        model(**batch.inputs, labels=batch.labels)


def test_the_first_fused_forward_refuses_a_custom_loss_function():
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    original = model.loss_function

    def doubled(logits, labels, vocab_size, **kwargs):
        return 2 * original(logits, labels, vocab_size, **kwargs)

    model.loss_function = doubled
    with (
        patch_model(model, fused=True),
        pytest.raises(UnsupportedModelError, match=r"loss_function doubled gives"),
    ):
        model(**batch.inputs, labels=batch.labels)


def test_fused_patch_leaves_eval_and_label_free_forwards_alone():
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    model.eval()
    want = model(**batch.inputs, labels=batch.labels)
    plain = model(**batch.inputs).logits
    with patch_model(model, fused=True) as handle:
        got = model(**batch.inputs, labels=batch.labels)  # eval: the model's ordinary forward
        assert torch.equal(got.loss, want.loss)
        assert torch.equal(got.logits, want.logits)
        model.train()
        assert torch.equal(model(**batch.inputs).logits, plain)  # training, but no labels
        assert model(**batch.inputs, labels=batch.labels).logits.shape == (2, 14, 0)
        assert "forward" in vars(model)
        assert "forward" in vars(model.lm_head)
    assert not handle.active
    assert "forward" not in vars(model)
    assert "forward" not in vars(model.lm_head)
    assert "_loss_function" not in vars(model)


def test_patch_model_observes_a_peft_model_on_the_model_that_owns_the_loss():
    # patch_model(peft_model) installed on the wrapper: 0 observations, every micro-batch dropped.
    model = build("peft_lora")
    batch = packed_batch("peft_lora")
    want = reference(model, batch)
    meter = ChannelLossMeter()
    with patch_model(model) as handle:
        assert handle.model is model.get_base_model()
        meter.begin_step()
        with meter.micro_batch(source_ids=batch.sources, layout=batch.layout):
            got = reference(model, batch)
        metrics = meter.end_step()
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][n], g) for n, g in want[1].items())
    assert metrics["channel_loss_dropped_micro_batches"] == 0.0
    assert metrics["channel_loss_tokens/web"] > 0


def tiny_roberta(cls):
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1,
        num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("fused_path", [False, True], ids=["observer", "fused"])
@pytest.mark.parametrize(
    ("cls", "labels"),
    [
        ("RobertaForMaskedLM", torch.randint(2, VOCAB, (2, 10))),
        ("RobertaForSequenceClassification", torch.tensor([0, 2])),
    ],
)
def test_non_causal_heads_are_refused_and_left_untouched(cls, labels, fused_path):
    # A MaskedLM was observed with a shift (wrong per-token losses); a SequenceClassification
    # model's own forward raised TypeError once patched.
    model = tiny_roberta(getattr(transformers, cls))
    input_ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=input_ids, labels=labels).loss
    with pytest.raises(
        UnsupportedModelError, match=rf"{cls} computes its loss with .*not the causal"
    ):
        patch_model(model, fused=fused_path)
    assert not {"_loss_function", "loss_function", "forward"} & vars(model).keys()
    assert torch.equal(model(input_ids=input_ids, labels=labels).loss, want)


def test_observing_loss_forwards_exactly_the_arguments_it_was_given():
    calls = []

    def custom(logits, labels, vocab_size, ignore_index=0, **kwargs):  # another default
        calls.append((vocab_size, ignore_index, kwargs))
        return logits.sum() * 0

    loss = ObservingLoss(custom)
    logits = torch.randn(1, 4, 8)
    labels = torch.tensor([[1, 2, -100, 3]])
    with capture() as cap:
        loss(logits, labels, 8, ignore_index=-100)  # explicit -100, positional head
        loss(logits=logits, labels=labels, vocab_size=8, num_items_in_batch=3)
    assert calls == [(8, -100, {}), (8, 0, {"num_items_in_batch": 3})]
    assert len(cap.observations) == 2
    assert cap.observations[0].ignore_index == -100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_pass_the_verifying_forward(dtype):
    # The model caps its 16-bit logits in 16-bit; the op caps fp32 logits: the verification
    # tolerance (5e-2 bf16, 1e-2 fp16 per token) must not refuse that rounding.
    model = build("gemma2").to(dtype)
    batch = packed_batch("gemma2")
    want = model(**batch.inputs, labels=batch.labels).loss
    with patch_model(model, fused=True) as handle:
        got = model(**batch.inputs, labels=batch.labels).loss
        assert handle.loss.verified
    torch.testing.assert_close(got, want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_fused_loss_of_an_fp32_model_under_autocast(name):
    # Mixed-precision training (fp32 parameters, bf16 autocast, as the HF Trainer's
    # bf16=True): the fused head takes its operands as autocast casts the model's own
    # lm_head, so it tracks the model's autocast loss and gradients, and every gradient
    # reaches the fp32 parameters in fp32.
    model, batch = build(name), packed_batch(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(model, batch)
        with patch_model(model, fused=True) as handle:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1234)
            loss = model(**batch.inputs, labels=batch.labels).loss
            assert handle.loss.verified
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(loss.detach(), want[0], rtol=1e-3, atol=0)
    assert grads.keys() == want[1].keys()
    for n, g in want[1].items():
        assert grads[n].dtype == torch.float32, n
        assert (grads[n] - g).norm() <= 2e-2 * g.norm(), n
