"""The fused patch over a model's life: unscored batches, copies and pickles, its signature.

Tiny random HF models on CPU (float32). Tolerances as in ``test_hf_fused``:
the fused loss against the model's own ``rtol=1e-5, atol=1e-6``, gradients
``rtol=1e-4, atol=1e-6``; the Trainer's training loss ``rel=1e-5`` (``rel=1e-2``
under bf16 autocast, where the two paths round their logits differently).
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from channel_loss import ChannelLossMeter  # noqa: E402
from channel_loss.integrations.transformers import (  # noqa: E402
    FusedLoss,
    UnsupportedModelError,
    patch_model,
)
from tests.channel_loss.test_hf_fused import DoubledLogits, tiny  # noqa: E402
from tests.channel_loss.test_hf_sweep import IGNORE, VOCAB, build, packed_batch  # noqa: E402


def loss_and_grads(model, batch, labels=None, *, owner=None):
    """One training forward + backward: the loss, the logits' width and ``owner``'s gradients."""
    owner = model if owner is None else owner
    model.zero_grad(set_to_none=True)
    out = model(**batch.inputs, labels=batch.labels if labels is None else labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.shape[-1], grads


def check_grads(grads: dict, want: dict) -> None:
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


# --------------------------------------------------------------------------- unscored batches


def test_a_first_batch_without_scored_targets_defers_verification():
    # The first fused forward compared HF's 0/0 = NaN with the op's 0.0 and refused the
    # model for good ("gives nan on its own logits, chunk_cross_entropy 0").
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, want_grads = loss_and_grads(model, batch)
    unscored = torch.full_like(batch.labels, IGNORE)
    with patch_model(model, fused=True) as handle:
        loss, width, grads = loss_and_grads(model, batch, unscored)
        assert loss.item() == 0.0
        assert width == 0
        assert all(not g.any() for g in grads.values())  # zero gradients
        assert not handle.loss.verified
        assert handle.loss.refusal is None
        loss, width, grads = loss_and_grads(model, batch)  # verifies now, and passes
        assert handle.loss.verified
        assert width == 0
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        check_grads(grads, want_grads)
        assert loss_and_grads(model, batch, unscored)[0].item() == 0.0


def test_a_real_difference_is_still_refused_after_unscored_batches():
    model = tiny(DoubledLogits)
    batch = packed_batch("llama")
    unscored = torch.full_like(batch.labels, IGNORE)
    with patch_model(model, fused=True) as handle:
        assert model(**batch.inputs, labels=unscored).loss.item() == 0.0
        assert handle.loss.refusal is None
        with pytest.raises(UnsupportedModelError, match=r"refuses DoubledLogits: the logits"):
            model(**batch.inputs, labels=batch.labels)


def test_a_first_batch_with_non_finite_activations_defers_verification():
    # An inf activation in step 1 (an fp16 overflow a loss scaler skips) refused the model
    # for good, blaming its loss_function ("gives nan on its own logits").
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, _ = loss_and_grads(model, batch)

    def overflow(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.index_fill(1, torch.tensor([3]), float("inf"))
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    with patch_model(model, fused=True) as handle:
        hook = model.model.layers[0].register_forward_hook(overflow)
        try:
            assert model(**batch.inputs, labels=batch.labels).loss.isnan()
        finally:
            hook.remove()
        assert not handle.loss.verified
        assert handle.loss.refusal is None
        loss = model(**batch.inputs, labels=batch.labels).loss  # verifies now, and passes
        assert handle.loss.verified
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=1e-6)


class NaNLogits(transformers.LlamaForCausalLM):
    """A model that spoils its own logits at one token, its hidden states finite."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = logits.index_fill(1, torch.tensor([3]), float("nan"))
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class MaskedAndCapped(transformers.LlamaForCausalLM):
    """Masks its last vocabulary row with -inf (as models mask padded rows) and softcaps
    its logits at 5, announced by no config field."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        z = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        z = 5 * torch.tanh(z / 5)
        z = torch.cat([z[..., :-1], torch.full_like(z[..., -1:], float("-inf"))], -1)
        loss = self.loss_function(z, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=z)


def test_a_masked_vocabulary_row_does_not_hide_a_transform():
    # Regression: the allowance for the logits' rounding was eps x the row's largest
    # |logit|: one -inf made it infinite, and every transform (here a softcap) verified,
    # the fused loss 5.73 against the model's 5.06.
    model = tiny(MaskedAndCapped)
    with torch.no_grad():
        model.lm_head.weight *= 20
    batch = packed_batch("llama")
    labels = batch.labels.masked_fill(batch.labels == VOCAB - 1, IGNORE)  # never the masked id
    with (
        patch_model(model, fused=True),
        pytest.raises(UnsupportedModelError, match=r"refuses MaskedAndCapped: the logits"),
    ):
        model(**batch.inputs, labels=labels)


def test_a_loss_function_that_is_not_the_mean_cross_entropy_is_refused_in_bf16():
    # Regression: the loss check allowed the tokens' largest rounding allowance as an
    # absolute error (0.47 at logits of 60): a doubled loss (0.70 against 0.35) verified.
    model = tiny(transformers.LlamaForCausalLM)
    with torch.no_grad():
        model.lm_head.weight *= 120
    model = model.to(torch.bfloat16)
    batch = packed_batch("llama")
    with torch.no_grad():  # targets the model predicts: a small loss next to large logits
        logits = model(**batch.inputs).logits
    labels = batch.labels.clone()
    labels[:, 1:] = torch.where(batch.labels[:, 1:] == IGNORE, IGNORE, logits[:, :-1].argmax(-1))
    assert float(logits.float().abs().max()) > 40
    own = model.loss_function

    def doubled(*args, **kwargs):
        return 2 * own(*args, **kwargs)

    model.loss_function = doubled
    scored = int((labels[:, 1:] != IGNORE).sum())
    with (
        patch_model(model, fused=True),
        pytest.raises(UnsupportedModelError, match=r"its loss_function doubled gives"),
    ):
        model(**batch.inputs, labels=labels, num_items_in_batch=torch.tensor(8 * scored))


def test_logits_non_finite_where_the_fused_ones_are_finite_are_refused():
    model = tiny(NaNLogits)
    batch = packed_batch("llama")
    with (
        patch_model(model, fused=True) as handle,
        pytest.raises(UnsupportedModelError, match=r"its cross-entropy is nan, the fused one \d"),
    ):
        model(**batch.inputs, labels=batch.labels)
    assert handle.loss.refusal is not None


@pytest.mark.parametrize("policy", ["fp32", "model_dtype"])
def test_large_bf16_logits_near_a_tie_pass_the_verifying_forward(policy):
    # bf16 rounds logits near 40 to a multiple of 0.25: two logits 0.19 apart became a tie,
    # the model's own cross-entropy ln 2 = 0.693 against the fused (fp32 logits) 0.603, and
    # the per-token tolerance (0.05 + 0.05 x CE) refused a correct model.
    from channel_loss.ops import gemm_policy

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        u = torch.randn(32)
        model.lm_head.weight[0] = 20 * u / u.norm()
        model.lm_head.weight[1] = model.lm_head.weight[0] + 0.05 * torch.randn(32)
    model = model.to(torch.bfloat16).train()
    ids = torch.randint(2, 64, (4, 64))
    with torch.no_grad():
        top = model(input_ids=ids).logits.float()[:, :-1, 0]
    labels = torch.full_like(ids, IGNORE)
    labels[:, 1:] = torch.where(
        top > 13, 0, IGNORE
    )  # the near-tied token, where its logit is large
    assert int((labels != IGNORE).sum()) > 10
    assert float(top.max()) > 32
    with gemm_policy(policy), patch_model(model, fused=True) as handle:
        model(input_ids=ids, labels=labels)
        assert handle.loss.verified


class UpcastLogits(transformers.LlamaForCausalLM):
    """Upcasts its bf16 logits before the loss, as transformers' Beam does before its
    softcap: fp32 logits that carry bf16 rounding."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state).float()
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("policy", ["fp32", "model_dtype"])
def test_bf16_logits_upcast_before_the_loss_pass_the_verifying_forward(policy):
    # Regression: the tolerance followed the dtype of the logits the loss function got
    # (fp32), not the bf16 the output embeddings rounded them to: a correct model was
    # refused where the op's logits are not rounded (accelerators, CPUs without bf16
    # units), "its cross-entropy is 5.83421, the fused one 5.83516" (Beam, bf16).
    from channel_loss.ops import gemm_policy

    model = tiny(UpcastLogits)
    with torch.no_grad():
        model.lm_head.weight *= 20  # logits of a few units, as a trained model's
    model = model.to(torch.bfloat16)
    batch = packed_batch("llama")
    with gemm_policy(policy), patch_model(model, fused=True) as handle:
        model(**batch.inputs, labels=batch.labels)
        assert handle.loss.verified


def test_a_real_difference_is_refused_in_bf16():
    # The allowance for the logits' rounding grows with their size; a doubling does more.
    model = tiny(DoubledLogits)
    with torch.no_grad():
        model.lm_head.weight *= 20  # logits of a few units, as a trained model's (std ~0.2 here)
    model = model.to(torch.bfloat16)
    batch = packed_batch("llama")
    with (
        patch_model(model, fused=True),
        pytest.raises(UnsupportedModelError, match=r"refuses DoubledLogits: the logits"),
    ):
        model(**batch.inputs, labels=batch.labels)


@pytest.mark.launch(nproc=2, timeout=240)
def test_ddp_ranks_whose_first_batch_is_unscored_keep_training():
    # Verification is rank-local: the rank with the unscored batch refused and the job died
    # (the other rank waited in DDP's all-reduce). Now it defers and both ranks train.
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny(transformers.LlamaForCausalLM)
    batches = [packed_batch("llama", seed=s) for s in range(world)]
    reference = copy.deepcopy(model)
    want = []  # each rank's scored batch: loss and gradients
    for batch in batches:
        want.append(loss_and_grads(reference, batch))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(ddp, fused=True) as handle:
        # Step 1: rank 0's micro-batch scores nothing.
        labels = torch.full_like(batches[0].labels, IGNORE) if rank == 0 else None
        meter.begin_step()
        with meter.micro_batch(source_ids=batches[rank].sources, layout=batches[rank].layout):
            loss, width, grads = loss_and_grads(ddp, batches[rank], labels, owner=model)
        metrics = meter.end_step()
        assert width == 0
        assert (loss.item() == 0.0) == (rank == 0)
        assert handle.loss.verified == (rank != 0)
        # DDP averages rank 1's gradients with rank 0's zeros.
        check_grads(grads, {n: sum(want[r][2][n] for r in range(1, world)) / world for n in grads})
        assert metrics["channel_loss_tokens/web"] > 0  # rank 1's tokens, on every rank
        # Step 2: every rank scores; rank 0 verifies now.
        loss, width, grads = loss_and_grads(ddp, batches[rank], owner=model)
        assert handle.loss.verified
        assert width == 0
        torch.testing.assert_close(loss, want[rank][0], rtol=1e-5, atol=1e-6)
        check_grads(grads, {n: sum(w[2][n] for w in want) / world for n in grads})


# --------------------------------------------------------------------------- copies and pickles


def assert_patched_on(model, original) -> None:
    """``model`` carries its own fused patch, tied to itself, none of ``original``'s objects."""
    loss = model.loss_function
    assert isinstance(loss, FusedLoss)
    assert loss is not original.loss_function
    assert loss._model() is model
    assert loss.head is model.lm_head
    assert vars(model)["forward"] is loss.patched_forward
    assert vars(model)["forward"] is not vars(original)["forward"]
    assert model.lm_head.forward.__self__ is loss


def test_a_deep_copy_of_a_fused_model_is_a_patched_copy_of_its_own():
    # copy.deepcopy raised TypeError: cannot pickle '_contextvars.ContextVar' object.
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, want_grads = loss_and_grads(copy.deepcopy(model), batch)
    handle = patch_model(model, fused=True)
    loss_and_grads(model, batch)  # verified before the copy: the copy is too
    twin = copy.deepcopy(model)
    assert_patched_on(twin, model)
    assert twin.loss_function.verified
    # The copy reads its own training flag and trains its own parameters.
    model.eval()
    model.zero_grad(set_to_none=True)
    loss, width, grads = loss_and_grads(twin, batch)
    assert width == 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    check_grads(grads, want_grads)
    assert all(p.grad is None for p in model.parameters())
    assert model(**batch.inputs, labels=batch.labels).logits.shape[-1] == VOCAB  # eval: unfused
    twin.eval()
    model.train()
    assert twin(**batch.inputs, labels=batch.labels).logits.shape[-1] == VOCAB
    assert model(**batch.inputs, labels=batch.labels).logits.shape[-1] == 0
    # Removing the original's patch leaves the copy's alone.
    handle.remove()
    assert "forward" not in vars(model)
    assert "forward" not in vars(model.lm_head)
    twin.train()
    assert twin(**batch.inputs, labels=batch.labels).logits.shape[-1] == 0


def test_a_fused_model_round_trips_through_torch_save():
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, want_grads = loss_and_grads(copy.deepcopy(model), batch)
    patch_model(model, fused=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_patched_on(loaded, model)
    assert not loaded.loss_function.verified  # the original never ran a fused forward
    loss, width, grads = loss_and_grads(loaded, batch)  # verifies the loaded model
    assert width == 0
    assert loaded.loss_function.verified
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    check_grads(grads, want_grads)


def test_a_deep_copy_of_a_fused_peft_model_trains_its_own_adapters():
    model = build("peft_lora")
    batch = packed_batch("peft_lora")
    want_loss, _, want_grads = loss_and_grads(copy.deepcopy(model), batch)
    patch_model(model, fused=True)
    twin = copy.deepcopy(model)
    assert_patched_on(twin.get_base_model(), model.get_base_model())
    loss, width, grads = loss_and_grads(twin, batch)
    assert width == 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    check_grads(grads, want_grads)
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- the forward's signature


@pytest.mark.parametrize("name", ["llama", "peft_lora"])
def test_the_fused_forward_presents_the_model_forward_signature(name, tmp_path):
    # model.forward became FusedLoss.model_forward(*args, **kwargs): the Trainer kept no
    # input column and _supports_logits_to_keep() turned False.
    model = build(name)
    inner = model.get_base_model() if name == "peft_lora" else model
    want = inspect.signature(inner.forward)
    assert "input_ids" in want.parameters
    assert "logits_to_keep" in want.parameters
    with patch_model(model, fused=True):
        assert inspect.signature(inner.forward) == want
        assert inner._supports_logits_to_keep()
        args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args)
        trainer._set_signature_columns_if_needed()
        assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    assert inspect.signature(inner.forward) == want


@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_with_remove_unused_columns_trains_a_fused_model(tmp_path, bf16):
    # remove_unused_columns=True (the default) dropped input_ids; with bf16, accelerate's
    # native AMP rebinds ``model.forward.__func__`` to the model, which broke the bound-method
    # patch ("'LlamaForCausalLM' object has no attribute '_model'").
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (12,), generator=generator)
        data.append(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        )
        data[-1]["source"] = 3  # a column the model does not take: the Trainer drops it

    def train(fused: bool) -> float:
        model = tiny(transformers.LlamaForCausalLM)
        if fused:
            patch_model(model, fused=True)
        # remove_unused_columns=True, the default.
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
            use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-3,
            bf16=bf16,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        assert trainer.accelerator.native_amp == bf16
        return trainer.train().training_loss

    # bf16 autocast: the two losses round their logits differently.
    assert train(fused=True) == pytest.approx(train(fused=False), rel=1e-2 if bf16 else 1e-5)


@pytest.mark.parametrize(("name", "at"), [("llama", 1), ("mixtral", 2)])
def test_tuple_outputs_of_every_fused_forward_carry_no_logits(name, at):
    # Regression: with return_dict=False the verifying forward returned the real logits
    # and later fused forwards an empty [..., 0] tensor; a MoE model's tuple is
    # (loss, aux_loss, logits, ...), and its verifying forward still returned them.
    model = build(name).train()
    batch = packed_batch(name)
    want = model(**batch.inputs, labels=batch.labels, return_dict=False)
    assert want[at].shape[-1] == VOCAB
    with patch_model(model, fused=True) as handle:
        for _ in range(2):
            got = model(**batch.inputs, labels=batch.labels, return_dict=False)
            assert isinstance(got, tuple)
            assert len(got) == len(want)
            assert got[at].shape == (*want[at].shape[:-1], 0)
            for i in range(at):  # the loss, and a MoE model's router loss
                torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-6)
        assert handle.loss.verified


def test_a_fused_model_unwrapped_by_accelerate_still_runs():
    # Regression: accelerate's unwrap_model(keep_fp32_wrapper=False) rebinds a forward
    # with no __wrapped__ to the model as a method: the patched forward got the model as
    # its first input ("got multiple values for argument 'input_ids'").
    accelerate = pytest.importorskip("accelerate")
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want = model(**batch.inputs, labels=batch.labels).loss
    # accelerate's state is per process: a Trainer that ran before in this worker
    # refuses a new mixed precision ("AcceleratorState has already been initialized").
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    prepared = acc.prepare(model)
    with patch_model(prepared, fused=True):
        unwrapped = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
        out = unwrapped(**batch.inputs, labels=batch.labels)
        assert out.logits.shape[-1] == 0
        # bf16 autocast may still wrap the model's own forward: bf16's tolerance.
        torch.testing.assert_close(out.loss, want, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- the head changes


def test_a_lora_adapter_put_on_lm_head_after_patching_is_refused_at_once():
    # Regression: LoRA's zero-initialised delta passed verification, the adapter got no
    # gradient in the first step, and the next forward failed with "The size of tensor a
    # (0) must match the size of tensor b (64)".
    peft = pytest.importorskip("peft")
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    patch_model(model, fused=True)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    wrapped = peft.get_peft_model(model, lora).train()
    for _ in range(2):  # refused from the first forward on, every time
        with pytest.raises(UnsupportedModelError) as refused:
            wrapped(**batch.inputs, labels=batch.labels)
        message = str(refused.value)
        assert "refuses LlamaForCausalLM: its output embeddings were replaced after" in message
        assert "torch.nn.modules.linear.Linear is now peft.tuners.lora" in message


def test_output_embeddings_resized_after_patching_are_named_as_the_cause():
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    with patch_model(model, fused=True):
        model.resize_token_embeddings(VOCAB + 16)
        with pytest.raises(UnsupportedModelError, match="output embeddings were replaced after"):
            model(**batch.inputs, labels=batch.labels)
    # Patched after the change, the resized model runs fused.
    want = model(**batch.inputs, labels=batch.labels).loss
    with patch_model(model, fused=True):
        got = model(**batch.inputs, labels=batch.labels).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_lora_wrapped_head_is_refused_by_its_qualified_class_name():
    # PEFT's LoRA layer is also called Linear: "its output embeddings are Linear, not a
    # plain torch.nn.Linear" read as a contradiction.
    peft = pytest.importorskip("peft")
    model = tiny(transformers.LlamaForCausalLM)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    wrapped = peft.get_peft_model(model, lora)
    with pytest.raises(UnsupportedModelError, match=r"are peft\.tuners\.lora\.\S*Linear, not a"):
        patch_model(wrapped, fused=True)


@pytest.mark.parametrize("wrap", ["compile", "checkpoint"])
def test_a_head_wrapped_by_a_forwarding_wrapper_after_patching_still_runs_fused(wrap):
    # The replaced-head check looks through torch.compile's and activation checkpointing's
    # wrappers: their forward is the patched head's.
    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, want = loss_and_grads(copy.deepcopy(model), batch)
    with patch_model(model, fused=True):
        if wrap == "compile":
            model.lm_head = torch.compile(model.lm_head, backend="eager")
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            apply_activation_checkpointing(model, check_fn=lambda m: m is model.lm_head)
        for _ in range(2):  # the verifying forward, then a fused one
            loss, width, grads = loss_and_grads(model, batch)
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            check_grads(
                {
                    n.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""): g
                    for n, g in grads.items()
                },
                want,
            )
        assert width == 0


def test_a_head_wrapped_for_activation_checkpointing_before_patching_runs_fused():
    """Regression: checkpoint_wrapper(lm_head) applied before patch_model(fused=True) was
    refused with "use fused=False", though it is the wrapping-after case's very set-up."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = tiny(transformers.LlamaForCausalLM)
    batch = packed_batch("llama")
    want_loss, _, want = loss_and_grads(copy.deepcopy(model), batch)
    apply_activation_checkpointing(model, check_fn=lambda m: m is model.lm_head)
    with patch_model(model, fused=True):
        for _ in range(2):  # the verifying forward, then a fused one
            loss, width, grads = loss_and_grads(model, batch)
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            check_grads(
                {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads.items()}, want
            )
        assert width == 0
    assert type(model.lm_head).__name__ == "CheckpointWrapper"
    assert "forward" not in vars(model.lm_head._checkpoint_wrapped_module)  # patch removed
