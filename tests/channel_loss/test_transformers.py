"""The Hugging Face integration on a tiny, randomly initialised LlamaForCausalLM (no downloads).

Exactness claims and their tolerances:

* ``patch_model``: loss and every parameter gradient ``torch.equal`` to the
  unpatched model's, outside and inside a meter micro-batch;
* meter means vs a float64 reference from the model's logits: the observer
  computes fp32 log-sum-exp per token, so ``rel=1e-5, abs=1e-5`` (token and
  sample counts exactly);
* fused vs unfused loss: the fused path computes the same logits chunk by
  chunk in a different matmul shape, so ``rtol=1e-5, atol=1e-6`` for the
  loss and ``rtol=1e-4, atol=1e-6`` for gradients.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from channel_loss import ChannelLossMeter, PackedLayout, capture  # noqa: E402
from channel_loss.integrations.transformers import (  # noqa: E402
    ChannelLossCallback,
    LogitTransform,
    ObservingLoss,
    UnsupportedModelError,
    fused_causal_lm_loss,
    merge_step_metrics,
    patch_model,
)

VOCAB = 64
IGNORE = -100


def tiny_llama(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()  # eval: no dropout randomness


def packed_batch(seed: int = 0, rows=((5, 7, 3), (9, 4)), row_length: int = 16):
    """A ``[B, T]`` packed batch: input_ids, position_ids, labels (sample starts masked), tails, sources."""
    g = torch.Generator().manual_seed(seed)
    position_ids, labels_mask, tails = [], [], []
    for lengths in rows:
        pos, mask = [], []
        for length in lengths:
            pos += list(range(length))
            mask += [False] + [True] * (length - 1)  # never score a sample's first token
        tail = row_length - len(pos)
        tails.append(tail)
        pos += list(range(tail))
        mask += [False] * tail
        position_ids.append(pos)
        labels_mask.append(mask)
    input_ids = torch.randint(0, VOCAB, (len(rows), row_length), generator=g)
    labels = torch.where(torch.tensor(labels_mask), input_ids, IGNORE)
    sources = ["web", "code", "web", "math", "code"][: sum(len(r) for r in rows)]
    return SimpleNamespace(
        input_ids=input_ids,
        position_ids=torch.tensor(position_ids),
        labels=labels,
        tails=tails,
        sources=sources,
    )


def layout_of(batch) -> PackedLayout:
    return PackedLayout.from_position_ids(batch.position_ids, tail_padding_length=batch.tails)


def forward_backward(model, batch, **loss_kwargs):
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        labels=batch.labels,
        **loss_kwargs,
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads


def hf_targets(batch, shift_labels=None) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    return torch.nn.functional.pad(batch.labels, (0, 1), value=IGNORE)[..., 1:]


LOSS_KWARGS = [
    pytest.param({}, id="labels"),
    pytest.param({"num_items_in_batch": 17}, id="num_items_in_batch"),
    pytest.param({"shift_labels": "custom"}, id="shift_labels"),
]


def resolve_kwargs(kwargs: dict, batch) -> dict:
    if kwargs.get("shift_labels") == "custom":
        # Different from the HF shift of labels, so the test sees which one was used.
        shift = hf_targets(batch).clone()
        shift[:, ::3] = IGNORE
        return {"shift_labels": shift}
    return dict(kwargs)


@pytest.mark.parametrize("kwargs", LOSS_KWARGS)
def test_patch_leaves_loss_and_grads_bitwise_unchanged(kwargs):
    model = tiny_llama()
    batch = packed_batch()
    kwargs = resolve_kwargs(kwargs, batch)
    reference, reference_grads = forward_backward(model, batch, **kwargs)

    handle = patch_model(model)
    try:
        outside, outside_grads = forward_backward(model, batch, **kwargs)
        meter = ChannelLossMeter()
        meter.begin_step()
        with capture() as cap:
            inside, inside_grads = forward_backward(model, batch, **kwargs)
        with meter.micro_batch(source_ids=batch.sources, layout=layout_of(batch)):
            in_meter, in_meter_grads = forward_backward(model, batch, **kwargs)
        metrics = meter.end_step()
    finally:
        handle.remove()

    for out, grads in (
        (outside, outside_grads),
        (inside, inside_grads),
        (in_meter, in_meter_grads),
    ):
        assert torch.equal(out.loss, reference.loss)
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, reference_grads[name]), name
    # The observation used the targets HF used, and the meter got exactly one.
    (observed,) = cap.observations
    assert torch.equal(observed.targets, hf_targets(batch, kwargs.get("shift_labels")))
    assert not observed.token_losses.requires_grad
    assert metrics["channel_loss_dropped_micro_batches"] == 0.0


def reference_metrics(logits: torch.Tensor, targets: torch.Tensor, batch) -> dict:
    """Per-source mean CE in float64 straight from the logits, walking samples by position_ids."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    sums: dict = {}
    sample = 0
    for b in range(batch.position_ids.shape[0]):
        real = batch.position_ids.shape[1] - batch.tails[b]
        for t in range(real):
            if batch.position_ids[b, t] == 0:
                source = batch.sources[sample]
                sample += 1
                entry = sums.setdefault(source, [0.0, 0, 0])
                entry[2] += 1
            target = int(targets[b, t])
            if target != IGNORE:
                entry[0] -= float(logp[b, t, target])
                entry[1] += 1
    return sums


def test_meter_means_match_a_float64_reference_from_the_logits():
    model = tiny_llama(seed=1)
    batches = [packed_batch(seed=2), packed_batch(seed=3, rows=((16,), (2, 2, 6)))]
    batches[1].sources = ["math", "web", "code", "web"]
    total_items = sum(int((hf_targets(b) != IGNORE).sum()) for b in batches)
    meter = ChannelLossMeter()
    expected: dict = {}
    with patch_model(model):
        meter.begin_step()
        for batch in batches:  # two micro-batches of one step, as under gradient accumulation
            with meter.micro_batch(source_ids=batch.sources, layout=layout_of(batch)):
                out = model(
                    input_ids=batch.input_ids,
                    position_ids=batch.position_ids,
                    labels=batch.labels,
                    num_items_in_batch=total_items,
                )
            out.loss.backward()
            for source, (loss, tokens, samples) in reference_metrics(
                out.logits.detach(), hf_targets(batch), batch
            ).items():
                entry = expected.setdefault(source, [0.0, 0, 0])
                entry[0] += loss
                entry[1] += tokens
                entry[2] += samples
        metrics = meter.end_step()
    all_tokens = sum(tokens for _, tokens, _ in expected.values())
    assert all_tokens == total_items
    for source, (loss, tokens, samples) in expected.items():
        assert metrics[f"channel_loss/{source}"] == pytest.approx(loss / tokens, rel=1e-5, abs=1e-5)
        assert metrics[f"channel_loss_tokens/{source}"] == tokens
        assert metrics[f"channel_loss_samples/{source}"] == samples
        assert metrics[f"channel_loss_weighted/{source}"] == pytest.approx(
            loss / all_tokens, rel=1e-5, abs=1e-5
        )


def test_handle_removal_restores_the_original():
    model = tiny_llama()
    batch = packed_batch()
    original = model.loss_function
    assert "_loss_function" not in vars(model)

    handle = patch_model(model)
    assert isinstance(model.loss_function, ObservingLoss)
    with pytest.raises(RuntimeError, match="already patched"):
        patch_model(model)
    handle()
    handle.remove()  # idempotent
    assert not handle.active
    assert "_loss_function" not in vars(model)
    assert model.loss_function is original
    with capture() as cap:
        model(input_ids=batch.input_ids, labels=batch.labels)
    assert cap.observations == []

    # A loss function the user set before patching comes back after removal.
    calls = []

    def custom(logits, labels, vocab_size, **kwargs):
        calls.append(kwargs)
        return original(logits, labels, vocab_size, **kwargs)

    model.loss_function = custom
    with patch_model(model), capture() as cap:
        model(input_ids=batch.input_ids, labels=batch.labels)
    assert len(cap.observations) == 1
    assert calls == [{}]  # HF's defaults were not forced onto the original
    assert model.loss_function is custom


def test_removal_keeps_a_later_replacement_and_switches_the_observer_off(caplog):
    model = tiny_llama()
    handle = patch_model(model)
    observer = model.loss_function
    replacement = ObservingLoss(observer)  # e.g. another tool wrapping ours
    model.loss_function = replacement
    with caplog.at_level(logging.WARNING):
        handle.remove()
    assert model.loss_function is replacement
    assert "replaced after patch_model" in caplog.text
    assert not observer.active


def test_patch_model_rejects_a_model_without_loss_function():
    with pytest.raises(TypeError, match="loss_function"):
        patch_model(torch.nn.Linear(2, 2))


def test_fused_path_matches_the_unfused_loss():
    model = tiny_llama(seed=4)
    batch = packed_batch(seed=5)
    total = 23
    reference, reference_grads = forward_backward(model, batch, num_items_in_batch=total)

    meter = ChannelLossMeter()
    meter.begin_step()
    model.zero_grad(set_to_none=True)
    with meter.micro_batch(source_ids=batch.sources, layout=layout_of(batch)):
        fused = fused_causal_lm_loss(
            model,
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            labels=batch.labels,
            num_items_in_batch=total,
            chunk_size=8,
        )
    fused.backward()
    fused_metrics = meter.end_step()
    torch.testing.assert_close(fused, reference.loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad,
            reference_grads[name],
            rtol=1e-4,
            atol=1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )

    # The fused path's own observation gives the metrics the logits path gives.
    with patch_model(model):
        meter.begin_step()
        with meter.micro_batch(source_ids=batch.sources, layout=layout_of(batch)):
            model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
        logits_metrics = meter.end_step()
    assert fused_metrics.keys() == logits_metrics.keys()
    for key, value in logits_metrics.items():
        assert fused_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_fused_path_refuses_a_config_transform_the_model_does_not_apply():
    # Llama's forward never caps: whether the op could cap or not, the fused path refuses,
    # naming the field (when the op can, the verifying first forward finds the difference).
    # (A cap of 0.5 changes the small logits of a random model a lot; 30 would hardly change them.)
    model = tiny_llama(final_logit_softcapping=0.5)
    batch = packed_batch()
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*final_logit_softcapping"):
        fused_causal_lm_loss(model, input_ids=batch.input_ids, labels=batch.labels)


def test_merge_step_metrics_is_token_weighted():
    a = {
        "cl/x": 2.0,
        "cl_tokens/x": 2.0,
        "cl_samples/x": 1.0,
        "cl_weighted/x": 1.0,
        "cl_tokens/y": 0.0,
        "cl_samples/y": 1.0,
        "cl_weighted/y": 0.0,
        "cl_dropped_micro_batches": 0.0,
    }
    b = {
        "cl/x": 5.0,
        "cl_tokens/x": 1.0,
        "cl_samples/x": 1.0,
        "cl_weighted/x": 5.0 / 4,
        "cl/y": 1.0,
        "cl_tokens/y": 3.0,
        "cl_samples/y": 2.0,
        "cl_weighted/y": 3.0 / 4,
        "cl_dropped_micro_batches": 1.0,
    }
    merged = merge_step_metrics([a, b], prefix="cl")
    assert merged == {
        "cl/x": 3.0,
        "cl_tokens/x": 3.0,
        "cl_samples/x": 2.0,
        "cl_weighted/x": 9.0 / 6,
        "cl/y": 1.0,
        "cl_tokens/y": 3.0,
        "cl_samples/y": 3.0,
        "cl_weighted/y": 3.0 / 6,
        "cl_dropped_micro_batches": 1.0,
    }
    assert merge_step_metrics([a], prefix="cl") == a
    assert merge_step_metrics([], prefix="cl") == {}


class Recorder(transformers.TrainerCallback):
    """A reporter: what a TensorBoard / W&B callback would receive in on_log."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_callback_lifecycle_with_real_trainer_state():
    """Drive a real CallbackHandler as Trainer.train does, with logging every 2 steps."""
    model = tiny_llama(seed=6)
    batch = packed_batch(seed=7)
    meter = ChannelLossMeter(interval=1)
    callback = ChannelLossCallback(meter)
    recorder = Recorder()
    handler = transformers.trainer_callback.CallbackHandler(
        [callback, recorder], model, None, None, None
    )
    args = SimpleNamespace()  # neither callback reads TrainingArguments
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    per_step = []
    with patch_model(model):
        handler.on_train_begin(args, state, control)
        for _ in range(4):
            handler.on_step_begin(args, state, control)
            assert meter.sampled
            for _ in range(2):  # gradient accumulation: two micro-batches per step
                with meter.micro_batch(source_ids=batch.sources, layout=layout_of(batch)):
                    loss = model(
                        input_ids=batch.input_ids,
                        position_ids=batch.position_ids,
                        labels=batch.labels,
                    ).loss
                loss.backward()
            # Keep each step's metrics as the callback will see them.
            state.global_step += 1
            handler.on_step_end(args, state, control)
            per_step.append(callback._pending[-1])
            if state.global_step % 2 == 0:
                logs = {"loss": float(loss.detach()), "learning_rate": 0.0}
                state.log_history.append({**logs, "step": state.global_step})
                handler.on_log(args, state, control, logs)
        handler.on_train_end(args, state, control)

    assert len(recorder.logs) == 2
    for i, logged in enumerate(recorder.logs):
        expected = merge_step_metrics(per_step[2 * i : 2 * i + 2])
        assert {k: v for k, v in logged.items() if k.startswith("channel_loss")} == expected
        # Same batch every micro-batch: a 2-step window has twice one step's tokens.
        assert logged["channel_loss_tokens/web"] == 2 * per_step[0]["channel_loss_tokens/web"]
        assert state.log_history[i]["channel_loss/web"] == expected["channel_loss/web"]
    assert not callback._pending


def test_callback_aligns_interval_with_trainer_steps():
    meter = ChannelLossMeter(interval=3)
    callback = ChannelLossCallback(meter)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    sampled = []
    for _ in range(6):
        callback.on_step_begin(None, state, control)
        sampled.append(meter.sampled)
        state.global_step += 1
        callback.on_step_end(None, state, control)
    # Trainer global steps 3 and 6 (the ones logging_steps=3 logs) are measured.
    assert sampled == [False, False, True, False, False, True]


class PackedDataset(torch.utils.data.Dataset):
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        b = self.batches[i]  # one packed row
        return {
            "input_ids": b.input_ids[0],
            "position_ids": b.position_ids[0],
            "labels": b.labels[0],
            "source_ids": b.sources,
            "tail": b.tails[0],
        }


def collate(items):
    (item,) = items  # one packed row per micro-batch
    return {
        "input_ids": item["input_ids"][None],
        "position_ids": item["position_ids"][None],
        "labels": item["labels"][None],
        "source_ids": item["source_ids"],
        "tail": [item["tail"]],
    }


def tiny_paligemma(final_logit_softcapping):
    """A tiny PaliGemma whose Gemma 2 text model keeps its soft-capping in ``text_config``."""
    text = dict(
        model_type="gemma2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=final_logit_softcapping,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    config = transformers.PaliGemmaConfig(
        text_config=text, vision_config=vision, image_token_index=VOCAB - 1, projection_dim=32
    )
    torch.manual_seed(0)
    return transformers.PaliGemmaForConditionalGeneration(config).eval()


def assert_fused_matches(model, **inputs) -> None:
    """The fused loss equals the model's own (the op applies the model's cap and scale)."""
    with torch.no_grad():
        want = model(**inputs).loss
        got = fused_causal_lm_loss(model, chunk_size=4, **inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_path_reads_the_text_config_of_composite_models():
    # A PaliGemma with final_logit_softcapping=2.0 in text_config was accepted and returned the
    # loss of uncapped logits (29.96 where model(...).loss was 6.66).
    input_ids = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    capped = tiny_paligemma(final_logit_softcapping=2.0)
    assert LogitTransform.of(capped).fields == (
        "config.get_text_config(decoder=True).final_logit_softcapping=2.0",
    )
    assert_fused_matches(capped, input_ids=input_ids, labels=input_ids)

    # Without soft-capping the same composite model is fine: its logits are lm_head(hidden).
    plain = tiny_paligemma(final_logit_softcapping=None)
    with torch.no_grad():
        reference = plain(input_ids=input_ids, labels=input_ids).loss
        fused = fused_causal_lm_loss(plain, input_ids=input_ids, labels=input_ids, chunk_size=4)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("config_class", "field", "value"),
    [
        ("GraniteConfig", "logits_scaling", 8.0),
        ("CohereConfig", "logit_scale", 0.0625),
        ("Gemma2Config", "final_logit_softcapping", 2.0),
    ],
)
def test_fused_path_applies_every_logit_transform_field(config_class, field, value):
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **{field: value},
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    assert LogitTransform.of(model).fields == (f"config.{field}={value!r}",)
    assert_fused_matches(model, input_ids=ids, labels=ids)
