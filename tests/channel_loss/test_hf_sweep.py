"""``patch_model`` and its fused path across tiny, randomly initialised HF architectures.

For every architecture (float32 weights, train mode, dropout streams re-seeded
identically before every forward):

* ``patch_model(model)``: loss and every gradient ``torch.equal`` to the
  unpatched model's;
* ``patch_model(model, fused=True)``, on the verifying first forward and on a
  fused one: HF's loss within ``rtol=1e-5, atol=1e-6`` and every gradient
  within ``rtol=1e-4, atol=1e-6`` (the chunked op computes the same fp32
  logits chunk by chunk, in another matmul shape), soft-capping and logit
  scaling included (the op applies them: Gemma 2/3, RecurrentGemma, Granite,
  Cohere, FalconH1);
* the per-source metrics of both paths equal an independent float64
  reference computed from the unpatched model's logits (``rel=abs=1e-5``;
  token and sample counts exactly).

The configs are the smallest each architecture accepts (one or two layers,
hidden 32, vocabulary 64), so the whole sweep costs a few seconds per model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from channel_loss import ChannelLossMeter, PackedLayout  # noqa: E402
from channel_loss.integrations.transformers import patch_model  # noqa: E402

VOCAB = 64
IGNORE = -100
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
MOE = dict(
    num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5
)
#: name -> (model_type, config overrides)
CONFIGS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=8)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            decoder_sparse_step=1,
        ),
    ),
    "mixtral": ("mixtral", MOE),
    "mixtral_no_aux": ("mixtral", dict(MOE, output_router_logits=False)),
    "olmoe": (
        "olmoe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            sliding_window=8,
            layer_types=["full_attention"],
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            num_key_value_heads=4,
        ),
    ),
    "gemma": ("gemma", dict(head_dim=8)),
    "gemma2": ("gemma2", dict(head_dim=8, final_logit_softcapping=3.0)),
    "gemma3_text": ("gemma3_text", dict(head_dim=8, final_logit_softcapping=3.0)),
    "recurrent_gemma": (
        "recurrent_gemma",
        dict(
            lru_width=32,
            num_hidden_layers=2,
            block_types=["recurrent", "attention"],
            attention_window_size=16,
            logits_soft_cap=3.0,
        ),
    ),
    "phi3": ("phi3", dict(pad_token_id=0)),
    "gpt2": ("gpt2", dict(n_embd=32, n_layer=1, n_head=4, n_positions=64)),
    "gpt_neox": ("gpt_neox", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(logits_scaling=4.0)),
    "cohere": ("cohere", dict(logit_scale=0.25)),
    "falcon_h1": (
        "falcon_h1",
        dict(
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            lm_head_multiplier=0.5,
        ),
    ),
    "starcoder2": ("starcoder2", {}),
    "llama4_text": (
        "llama4_text",
        dict(
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=64,
            interleave_moe_layer_step=1,
            no_rope_layers=[1],
        ),
    ),
    "roberta_decoder": ("roberta", dict(is_decoder=True, type_vocab_size=1, pad_token_id=1)),
}


def build(name: str, seed: int = 0):
    """A tiny random model of architecture ``name`` (``CONFIGS``, plus ``qwen2_vl`` and ``peft_lora``)."""
    torch.manual_seed(seed)
    if name == "qwen2_vl":
        text = dict(BASE, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
        vision = dict(
            depth=1,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            patch_size=2,
            spatial_merge_size=1,
            temporal_patch_size=1,
        )
        config = transformers.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=VOCAB - 1,
            video_token_id=VOCAB - 2,
            vision_start_token_id=VOCAB - 3,
        )
        return transformers.Qwen2VLForConditionalGeneration(config).train()
    if name == "peft_lora":
        peft = pytest.importorskip("peft")
        base = build("llama", seed)
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
        model = peft.get_peft_model(base, lora)
        for module in model.modules():  # LoRA B starts at zero: make the adapters matter
            if hasattr(module, "lora_B"):
                for layer in module.lora_B.values():
                    torch.nn.init.normal_(layer.weight, std=0.2)
        return model.train()
    model_type, overrides = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config).train()


def packed_batch(name: str, seed: int = 0):
    """Two packed rows (3 and 2 samples, a padding tail), labels masked at sample starts."""
    g = torch.Generator().manual_seed(seed)
    rows, length = ((4, 5, 3), (6, 4)), 14
    position_ids, scored, sample_of = [], [], []  # sample_of: the sample of each token, -1 tail
    for lengths in rows:
        pos, mask = [], []
        for n in lengths:
            pos += list(range(n))
            mask += [False] + [True] * (n - 1)
            sample_of += [max(sample_of, default=-1) + 1] * n
        tail = length - len(pos)
        position_ids.append(pos + list(range(tail)))
        scored.append(mask + [False] * tail)
        sample_of += [-1] * tail
    input_ids = torch.randint(0, VOCAB - 3, (len(rows), length), generator=g)
    labels = torch.where(torch.tensor(scored), input_ids, IGNORE)
    position_ids = torch.tensor(position_ids)
    inputs = {"input_ids": input_ids}
    if name == "qwen2_vl":  # multimodal rope: [3, B, T] (temporal, height, width)
        inputs["position_ids"] = position_ids.expand(3, *position_ids.shape)
    layout = PackedLayout.from_position_ids(
        inputs.get("position_ids", position_ids),
        tail_padding_length=[length - sum(r) for r in rows],
    )
    return SimpleNamespace(
        inputs=inputs,
        labels=labels,
        layout=layout,
        sample_of=sample_of,
        sources=["web", "code", "web", "math", "code"],
    )


def forward_backward(model, batch, *, meter=None):
    """Loss, gradients, logits and the micro-batch's metrics of one training forward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout / router-noise stream for every path
    if meter is not None:
        meter.begin_step()
        with meter.micro_batch(source_ids=batch.sources, layout=batch.layout):
            out = model(**batch.inputs, labels=batch.labels)
    else:
        out = model(**batch.inputs, labels=batch.labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = meter.end_step() if meter is not None else None
    return out.loss.detach(), grads, out.logits.detach(), metrics


def reference_metrics(logits: torch.Tensor, batch) -> dict[str, float]:
    """Per-source metrics in float64 from the logits, walking samples one by one."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.nn.functional.pad(batch.labels, (0, 1), value=IGNORE)[..., 1:]
    sums: dict[str, list] = {}
    for source in batch.sources:
        sums.setdefault(source, [0.0, 0, 0])[2] += 1
    flat_logp, flat_targets = logp.reshape(-1, logp.shape[-1]), targets.reshape(-1)
    for t, sample in enumerate(batch.sample_of):
        target = int(flat_targets[t])
        if sample >= 0 and target != IGNORE:
            entry = sums[batch.sources[sample]]
            entry[0] -= float(flat_logp[t, target])
            entry[1] += 1
    total = sum(tokens for _, tokens, _ in sums.values())
    out = {}
    for source, (loss, tokens, samples) in sums.items():
        out[f"channel_loss/{source}"] = loss / tokens
        out[f"channel_loss_tokens/{source}"] = float(tokens)
        out[f"channel_loss_samples/{source}"] = float(samples)
        out[f"channel_loss_weighted/{source}"] = loss / total
    out["channel_loss_dropped_micro_batches"] = 0.0
    return out


def max_rel_error(got: dict, want: dict) -> float:
    """Largest ``max|got - want| / max|want|`` over the tensors of ``want`` (a report figure).

    Tensors whose true gradient is zero (``max|want| < 1e-6``: e.g. an
    attention key bias, which softmax ignores, holds rounding noise only)
    are left out of the figure; ``assert_close`` still checks them.
    """
    errors = [
        float((got[k] - w).abs().max() / w.abs().max())
        for k, w in want.items()
        if float(w.abs().max()) >= 1e-6
    ]
    return max(errors, default=0.0)


def check_metrics(metrics: dict, expected: dict) -> None:
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def sweep(name: str) -> dict:
    """Run one architecture through both paths; return the report row (asserting every claim)."""
    model = build(name)
    batch = packed_batch(name)
    loss, grads, logits, _ = forward_backward(model, batch)
    expected = reference_metrics(logits, batch)

    with patch_model(model):
        o_loss, o_grads, _, o_metrics = forward_backward(model, batch, meter=ChannelLossMeter())
    assert torch.equal(o_loss, loss)
    assert o_grads.keys() == grads.keys()
    for key, grad in grads.items():
        assert torch.equal(o_grads[key], grad), key
    check_metrics(o_metrics, expected)

    errors = []
    with patch_model(model, fused=True, chunk_size=8):
        for _ in range(2):  # the verifying forward, then a fused one
            f_loss, f_grads, f_logits, f_metrics = forward_backward(
                model, batch, meter=ChannelLossMeter()
            )
            assert f_logits.shape == (*batch.labels.shape, 0)  # no logits were materialised
            torch.testing.assert_close(f_loss, loss, rtol=1e-5, atol=1e-6)
            assert f_grads.keys() == grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(
                    f_grads[key],
                    grad,
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, key=key: f"{name} {key}: {m}",
                )
            check_metrics(f_metrics, expected)
            errors.append(
                max(abs(float(f_loss - loss)) / abs(float(loss)), max_rel_error(f_grads, grads))
            )
    return {"result": "fused", "max_rel_error": max(errors)}


ARCHITECTURES = [*CONFIGS, "qwen2_vl", "peft_lora"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_patch_model_and_fused_path_across_architectures(name):
    sweep(name)
