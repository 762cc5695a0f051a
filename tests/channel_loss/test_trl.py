"""TRL's SFTTrainer and DPOTrainer with ``ChannelLossCallback(meter).attach(trainer)``.

Real TRL runs (CPU, a tiny Llama built from a config, a word-level tokenizer built in
memory, three optimizer steps of two accumulated micro-batches). The observed run's
logged losses and every gradient before every optimizer step are bitwise (``==``) those
of the same run unobserved; the per-source metrics match a float64 reference computed in
the test from the model's own logits (``rel=1e-4``: TRL's fused head forms fp32 logits
chunk by chunk).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from channel_loss import ChannelLossMeter, PackedLayout  # noqa: E402
from channel_loss.integrations.transformers import (  # noqa: E402
    ChannelLossCallback,
    UnsupportedModelError,
    patch_model,
)
from tests.channel_loss.test_transformers import VOCAB, tiny_llama  # noqa: E402

SOURCES = ("web", "code", "日本語")


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Words ``w0 ... w{VOCAB-3}``, ``<pad>`` and ``</s>``: no hub download."""
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="</s>"
    )


def sft_dataset(n: int = 24) -> datasets.Dataset:
    """Pre-tokenized samples of 3-9 tokens; ``token_sources`` (one id per token) packs with them."""
    g = torch.Generator().manual_seed(5)
    rows = {"input_ids": [], "token_sources": []}
    for i in range(n):
        length = 3 + int(torch.randint(0, 7, (1,), generator=g))
        rows["input_ids"].append(torch.randint(0, VOCAB - 2, (length,), generator=g).tolist())
        rows["token_sources"].append([i % len(SOURCES)] * length)
    return datasets.Dataset.from_dict(rows)


def dpo_dataset(n: int = 12) -> datasets.Dataset:
    g = torch.Generator().manual_seed(6)

    def words(k):
        return " ".join(f"w{int(t)}" for t in torch.randint(0, VOCAB - 2, (k,), generator=g))

    return datasets.Dataset.from_dict(
        {
            "prompt": [words(3 + i % 3) for i in range(n)],
            "chosen": [words(2 + i % 4) for i in range(n)],
            "rejected": [words(3 + i % 2) for i in range(n)],
            "source": [i % len(SOURCES) for i in range(n)],
        }
    )


class SFTCollator:
    """TRL's padding-free collator, plus one source id per packed sample."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples):
        out = self.inner(examples)
        sources = torch.cat([torch.tensor(e["token_sources"]) for e in examples])
        starts = out["position_ids"][0, : sources.numel()] == 0
        out["source_ids"] = [SOURCES[i] for i in sources[starts].tolist()]
        return out


class DPOCollator:
    """TRL's preference collator, plus ``pair ids + pair ids`` (chosen rows, then rejected)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples):
        out = self.inner(examples)
        pairs = [SOURCES[e["source"]] for e in examples]
        out["source_ids"] = pairs + pairs
        return out


def layout_of(inputs) -> PackedLayout:
    """Packed (``position_ids``) or padded rows (``attention_mask``), one sample per row then:
    written out here, the reference for ``batch_layout``."""
    if "position_ids" in inputs:
        return PackedLayout.from_position_ids(inputs["position_ids"])
    mask = inputs["attention_mask"]
    positions = torch.arange(mask.shape[1]).expand(mask.shape)
    return PackedLayout.from_position_ids(
        positions, tail_padding_length=(mask.shape[1] - mask.sum(1)).tolist()
    )


def reference_sums(model, inputs, source_ids) -> dict:
    """Per source: float64 (NLL sum, scored tokens) of the model's own logits on ``inputs``."""
    if "completion_mask" in inputs:  # DPO: TRL scores the completion tokens
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        forward = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    else:
        labels = inputs["labels"]
        forward = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}
    with torch.no_grad():
        logits = model(**forward).logits.double()
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    nll = nll.view(targets.shape)
    layout = layout_of(inputs)
    sample = layout.sample_index.view(targets.shape)
    sums: dict = defaultdict(lambda: [0.0, 0])
    for b, t in (targets != -100).nonzero().tolist():
        source = source_ids[int(sample[b, t])]
        sums[source][0] += float(nll[b, t])
        sums[source][1] += 1
    return sums


class Grads(transformers.TrainerCallback):
    """Every parameter's gradient before every optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )


def run(kind: str, tmp_path, *, observe: bool, short: bool = False, **config):
    """One TRL run: (logged losses, gradients per step, metrics per step, reference per step).

    ``short``: TRL's own trainer class, measured by ``attach(source_ids_key=...)`` (no
    reference then)."""
    torch.manual_seed(0)
    model = tiny_llama(seed=8, tie_word_embeddings=False).train()
    distributed = dist.is_available() and dist.is_initialized()
    meter = ChannelLossMeter(dp_group=dist.group.WORLD if distributed else None)
    references: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    base = trl.SFTTrainer if kind == "sft" else trl.DPOTrainer

    class ChannelLossTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            source_ids = inputs.pop("source_ids")
            if not observe or not model.training:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with meter.micro_batch(source_ids=source_ids, layout=layout_of(inputs)):
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            step = references[self.state.global_step + 1]
            for source, (total, count) in reference_sums(model, inputs, source_ids).items():
                step[source][0] += total
                step[source][1] += count
            return loss

    common = dict(
        output_dir=str(tmp_path / f"{kind}-{observe}"), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, learning_rate=1e-2,
        seed=0, bf16=False,
    )  # fmt: skip
    grads = Grads()
    if kind == "sft":
        # TRL's own packing keeps only input_ids and labels: pack here (trl.pack_dataset packs
        # every per-token column, so the sources travel with the tokens) and skip preparation.
        args = trl.SFTConfig(
            **common, padding_free=True, max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True}, **config,
        )  # fmt: skip
        data = trl.pack_dataset(sft_dataset(), 24, "bfd")
        collator, extra = None, {}  # padding-free SFT takes no custom collator: wrapped below
    else:
        args = trl.DPOConfig(**common, max_length=24, **config)
        data = dpo_dataset()
        collator = DPOCollator(
            trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=VOCAB - 2)
        )
        extra = {"ref_model": copy.deepcopy(model)}
    trainer = (base if short else ChannelLossTrainer)(
        model=model, args=args, train_dataset=data, processing_class=word_tokenizer(),
        data_collator=collator, callbacks=[grads], **extra,
    )  # fmt: skip
    if kind == "sft":
        trainer.data_collator = SFTCollator(trainer.data_collator)
    if observe:
        ChannelLossCallback(meter).attach(trainer, source_ids_key="source_ids" if short else None)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    metrics = [{k: v for k, v in e.items() if k.startswith("channel_loss")} for e in logs]
    return [e["loss"] for e in logs], grads.steps, metrics, references


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainer_per_source_metrics_with_loss_and_gradients_bitwise_unchanged(kind, tmp_path):
    losses, grads, metrics, references = run(kind, tmp_path, observe=True)
    plain_losses, plain_grads, plain_metrics, _ = run(kind, tmp_path, observe=False)
    assert losses == plain_losses
    # The short recipe (no Trainer subclass) measures the same.
    short_losses, _, short_metrics, _ = run(kind, tmp_path / "short", observe=True, short=True)
    assert short_losses == losses
    assert short_metrics == metrics
    assert len(grads) == len(plain_grads) == 3
    for step, plain in zip(grads, plain_grads, strict=True):
        assert step.keys() == plain.keys()
        for name, grad in step.items():
            assert torch.equal(grad, plain[name]), name
    assert not any(plain_metrics)
    assert len(metrics) == 3
    for number, logged in enumerate(metrics, start=1):
        assert logged["channel_loss_dropped_micro_batches"] == 0.0
        want = references[number]
        assert want, "the reference saw scored tokens"
        for source, (total, count) in want.items():
            assert logged[f"channel_loss_tokens/{source}"] == count
            assert logged[f"channel_loss/{source}"] == pytest.approx(total / count, rel=1e-4)
        assert not math.isnan(sum(v for v in logged.values()))


def test_patch_model_fused_on_a_trl_model_is_refused_naming_trl(tmp_path):
    model = tiny_llama(seed=8).train()
    trainer = trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=24),
        train_dataset=sft_dataset(4),
        processing_class=word_tokenizer(),
    )
    with pytest.raises(UnsupportedModelError, match=r"TRL.*attach\(trainer\)"):
        patch_model(trainer.model, fused=True)
    # Patched before the trainer wrapped its forward: refused when attaching.
    other = tiny_llama(seed=8).train()
    with patch_model(other, fused=True):
        trainer = trl.SFTTrainer(
            model=other,
            args=trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=24),
            train_dataset=sft_dataset(4),
            processing_class=word_tokenizer(),
        )
        with pytest.raises(UnsupportedModelError, match=r"TRL.*fused_lm_head|TRL's fused LM head"):
            ChannelLossCallback(ChannelLossMeter()).attach(trainer)


@pytest.mark.launch(nproc=2, timeout=300)
def test_trl_sft_two_ranks_log_the_global_metrics_once_per_logging_step(tmp_path):
    """Under DDP (2 Gloo ranks) each logging step carries the metrics of both ranks' batches."""
    rank = dist.get_rank()
    _, _, metrics, references = run("sft", tmp_path / f"rank{rank}", observe=True)
    assert len(metrics) == 3
    for number, logged in enumerate(metrics, start=1):
        # Every rank logs the same, global metrics: the sum of both ranks' references.
        local = references[number]
        gathered = [None, None]
        dist.all_gather_object(gathered, {k: list(v) for k, v in local.items()})
        total: dict = defaultdict(lambda: [0.0, 0])
        for part in gathered:
            for source, (s, c) in part.items():
                total[source][0] += s
                total[source][1] += c
        for source, (s, c) in total.items():
            assert logged[f"channel_loss_tokens/{source}"] == c
            assert logged[f"channel_loss/{source}"] == pytest.approx(s / c, rel=1e-4)
