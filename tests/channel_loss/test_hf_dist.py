"""The fused path under real data parallelism: 2 Gloo ranks, DDP and FSDP2.

Every rank builds the same tiny model (same seed) and its own packed batch;
the reference is computed in each rank's process on an unwrapped copy: the
mean over ranks of each batch's gradient (what DDP's and FSDP2's averaging
all-reduce produce). Tolerances: loss ``rtol=1e-5, atol=1e-6``, gradients
``rtol=1e-4, atol=1e-6`` (fp32 logits chunk by chunk, and a float sum over
ranks in another order).

The cases run on kept ranks (``reuse=True``): a fresh pair of ranks per case
would import transformers again each time.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from channel_loss import ChannelLossMeter  # noqa: E402
from channel_loss.integrations.transformers import fused_causal_lm_loss, patch_model  # noqa: E402
from tests.channel_loss.test_hf_sweep import build, packed_batch  # noqa: E402


def averaged_reference(model, batches):
    """Each batch's loss, and the mean over batches of their gradients, from an unwrapped copy."""
    reference = copy.deepcopy(model)
    losses, total = [], {}
    for batch in batches:
        reference.zero_grad(set_to_none=True)
        loss = reference(**batch.inputs, labels=batch.labels).loss
        loss.backward()
        losses.append(loss.detach())
        for name, param in reference.named_parameters():
            if param.grad is not None:
                total[name] = total.get(name, 0) + param.grad / len(batches)
    return losses, total


def meter_reference(model, batches) -> dict:
    """The channel metrics of all ranks' batches as micro-batches of one in-process step."""
    meter = ChannelLossMeter()
    reference = copy.deepcopy(model)
    with patch_model(reference):
        meter.begin_step()
        for batch in batches:
            with meter.micro_batch(source_ids=batch.sources, layout=batch.layout):
                reference(**batch.inputs, labels=batch.labels)
        return meter.end_step()


def check(grads: dict, want: dict) -> None:
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def check_rounded(grads: dict, want: dict) -> None:
    """fp32 gradients within bf16 rounding (2e-2 relative L2) of a low-precision reference."""
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        assert grads[name].dtype == torch.float32, name
        assert (grads[name] - grad.float()).norm() <= 2e-2 * grad.float().norm(), name


def train_step(model, batch, meter):
    meter.begin_step()
    with meter.micro_batch(source_ids=batch.sources, layout=batch.layout):
        out = model(**batch.inputs, labels=batch.labels)
    assert out.logits.shape[-1] == 0  # the fused path ran: no logits were materialised
    out.loss.backward()
    return out.loss.detach(), meter.end_step()


@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
def test_ddp_fused_path_matches_the_all_reduced_reference():
    # fused_causal_lm_loss(ddp_model) raised AttributeError; on ddp_model.module it returned
    # gradients that were never all-reduced (1.6 relative error).
    rank = dist.get_rank()
    model = build("llama")
    batches = [packed_batch("llama", seed=s) for s in range(dist.get_world_size())]
    losses, want = averaged_reference(model, batches)
    expected_metrics = meter_reference(model, batches)

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(ddp, fused=True, chunk_size=8) as handle:
        assert handle.model is model
        for _ in range(2):  # the verifying forward, then a fused one
            ddp.zero_grad(set_to_none=True)
            loss, metrics = train_step(ddp, batches[rank], meter)
            torch.testing.assert_close(loss, losses[rank], rtol=1e-5, atol=1e-6)
            check({n: p.grad for n, p in model.named_parameters()}, want)
            assert metrics.keys() == expected_metrics.keys()
            for key, value in expected_metrics.items():
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

    # The one-call form through the wrapper all-reduces too.
    ddp.zero_grad(set_to_none=True)
    batch = batches[rank]
    fused_causal_lm_loss(ddp, **batch.inputs, labels=batch.labels, chunk_size=8).backward()
    check({n: p.grad for n, p in model.named_parameters()}, want)
    with pytest.warns(UserWarning, match="not all-reduced"):
        fused_causal_lm_loss(model, **batch.inputs, labels=batch.labels)


@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
def test_fsdp2_fused_path_matches_the_all_reduced_reference():
    # fully_shard per layer + root: the old path called model.base_model outside the root
    # forward and crashed with "mixed torch.Tensor and DTensor".
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = build("mixtral")  # MoE: the router aux loss stays the model's own under FSDP2
    batches = [packed_batch("mixtral", seed=s) for s in range(dist.get_world_size())]
    losses, want = averaged_reference(model, batches)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(model, fused=True, chunk_size=8):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss, metrics = train_step(model, batches[rank], meter)
            torch.testing.assert_close(loss, losses[rank], rtol=1e-5, atol=1e-6)
            check({n: p.grad.full_tensor() for n, p in model.named_parameters()}, want)
            assert metrics["channel_loss_dropped_micro_batches"] == 0.0

    # The one-call form on the FSDP2 root runs inside the root forward too.
    model.zero_grad(set_to_none=True)
    batch = batches[rank]
    fused_causal_lm_loss(model, **batch.inputs, labels=batch.labels, chunk_size=8).backward()
    check({n: p.grad.full_tensor() for n, p in model.named_parameters()}, want)


@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
@pytest.mark.parametrize("tied", [False, True], ids=["own-unit", "tied-group"])
def test_fsdp2_output_embeddings_sharded_as_their_own_unit(tied):
    # Regression: with lm_head a fully_shard unit of its own (or grouped with the tied input
    # embeddings, as FSDP2 asks), FSDP2 resharded its weight when its forward returned, and
    # the fused loss got a DTensor ("Call it inside the model's forward ...") on every rank.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.channel_loss.test_hf_sweep import BASE

    rank = dist.get_rank()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **{**BASE, "tie_word_embeddings": tied})
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batches = [packed_batch("llama", seed=s) for s in range(dist.get_world_size())]
    losses, want = averaged_reference(model, batches)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.model.embed_tokens, model.lm_head] if tied else model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(model, fused=True, chunk_size=8):
        for _ in range(2):  # the verifying forward, then a fused one
            model.zero_grad(set_to_none=True)
            loss, metrics = train_step(model, batches[rank], meter)
            torch.testing.assert_close(loss, losses[rank], rtol=1e-5, atol=1e-6)
            check({n: p.grad.full_tensor() for n, p in model.named_parameters()}, want)
            assert metrics["channel_loss_dropped_micro_batches"] == 0.0
            # The head's parameters are sharded again between steps, as FSDP2 left them.
            assert type(model.lm_head.weight).__name__ == "DTensor"


@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
def test_ddp_fused_path_under_autocast_tracks_the_autocast_reference():
    # Mixed-precision DDP (fp32 parameters, bf16 autocast): the fused head casts its
    # operands as the model's own lm_head does under autocast, and DDP all-reduces the
    # fp32 gradients that reach the parameters through those casts.
    rank = dist.get_rank()
    model = build("llama")
    batches = [packed_batch("llama", seed=s) for s in range(dist.get_world_size())]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses, want = averaged_reference(model, batches)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(ddp, fused=True, chunk_size=8):
        for _ in range(2):  # the verifying forward, then a fused one
            ddp.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, metrics = train_step(ddp, batches[rank], meter)
            torch.testing.assert_close(loss, losses[rank], rtol=1e-3, atol=0)
            assert metrics["channel_loss_dropped_micro_batches"] == 0.0
            check_rounded({n: p.grad for n, p in model.named_parameters()}, want)


@pytest.mark.launch(nproc=2, timeout=240, reuse=True)
def test_fsdp2_mixed_precision_policy_fused_path_tracks_a_bf16_reference():
    # FSDP2's own mixed precision (bf16 compute parameters, fp32 gradient reduction): the
    # fused head gets the unsharded bf16 weight and bf16 hidden states, and the sharded
    # fp32 gradients match a bf16 copy of the model within bf16 rounding.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank = dist.get_rank()
    model = build("mixtral")
    batches = [packed_batch("mixtral", seed=s) for s in range(dist.get_world_size())]
    losses, want = averaged_reference(copy.deepcopy(model).to(torch.bfloat16), batches)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    meter = ChannelLossMeter(dp_group=dist.group.WORLD)
    with patch_model(model, fused=True, chunk_size=8):
        for _ in range(2):  # the verifying forward, then a fused one
            model.zero_grad(set_to_none=True)
            loss, metrics = train_step(model, batches[rank], meter)
            torch.testing.assert_close(loss, losses[rank].float(), rtol=1e-3, atol=0)
            assert metrics["channel_loss_dropped_micro_batches"] == 0.0
            check_rounded({n: p.grad.full_tensor() for n, p in model.named_parameters()}, want)
