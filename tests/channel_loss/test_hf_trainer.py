"""Trainer recipes that compute the loss outside the model, through ``ChannelLossCallback``.

Real ``transformers.Trainer`` runs (CPU, tiny random Llama, two optimizer
steps of two accumulated micro-batches). The training loss the Trainer logs
with the observer attached is exactly (``==``) the loss of the same run
without it; the fused run's within ``rel=1e-5``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from channel_loss import ChannelLossMeter, PackedLayout  # noqa: E402
from channel_loss.integrations.transformers import (  # noqa: E402
    ChannelLossCallback,
    ObservingOutputsLoss,
    patch_model,
)
from tests.channel_loss.test_transformers import (  # noqa: E402
    PackedDataset,
    Recorder,
    collate,
    packed_batch,
    tiny_llama,
)


def short_collate(items):
    """``collate`` with the tail under the key ``attach(source_ids_key=...)`` reads."""
    batch = collate(items)
    batch["tail_padding_length"] = batch.pop("tail")
    return batch


def make_trainer(tmp_path, meter, *, max_steps=2, logging_steps=1, short=False, **args):
    """A Trainer whose compute_loss wraps each training micro-batch in ``meter.micro_batch``
    (``short``: a plain Trainer, for ``attach(trainer, source_ids_key=...)`` to do it)."""
    torch.manual_seed(0)
    model = tiny_llama(seed=8).train()
    compute_loss_func = args.pop("compute_loss_func", None)

    class ChannelLossTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            source_ids, tail = inputs.pop("source_ids"), inputs.pop("tail")
            if meter is None or not model.training:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            layout = PackedLayout.from_position_ids(
                inputs["position_ids"], tail_padding_length=tail
            )
            with meter.micro_batch(source_ids=source_ids, layout=layout):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, logging_steps=logging_steps, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, learning_rate=1e-3,
        seed=0, **args,
    )  # fmt: skip
    data = PackedDataset([packed_batch(seed=s, rows=((5, 7, 3),)) for s in range(2 * max_steps)])
    recorder = Recorder()
    trainer = (transformers.Trainer if short else ChannelLossTrainer)(
        model=model, args=training_args, train_dataset=data,
        data_collator=short_collate if short else collate,
        callbacks=[recorder], compute_loss_func=compute_loss_func,
    )  # fmt: skip
    return trainer, recorder


def train_logs(recorder) -> list[dict]:
    return [log for log in recorder.logs if "loss" in log]


def assert_channel_metrics(logs: list[dict], steps: int) -> None:
    assert len(logs) == steps
    for log in logs:
        assert {"channel_loss/web", "channel_loss/code", "channel_loss_tokens/web"} <= log.keys()
        assert log["channel_loss_dropped_micro_batches"] == 0.0
        assert all(math.isfinite(v) for k, v in log.items() if k.startswith("channel_loss"))
        # two micro-batches of one row each: 5 + 7 + 3 tokens, 3 targets ignored per row
        tokens = sum(v for k, v in log.items() if k.startswith("channel_loss_tokens/"))
        assert tokens == 2 * 12


def test_real_trainer_logs_channel_loss_keys_before_every_reporter(tmp_path):
    meter = ChannelLossMeter()
    trainer, recorder = make_trainer(tmp_path, meter)
    callback = ChannelLossCallback(meter).attach(trainer)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names.index("ChannelLossCallback") < names.index("Recorder")
    with patch_model(trainer.model):
        trainer.train()
    assert_channel_metrics(train_logs(recorder), 2)
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all("channel_loss/web" in h for h in history)
    assert not callback._pending


def test_attach_with_source_ids_key_needs_no_trainer_subclass(tmp_path):
    """The short recipe (a collator with source ids, attach(source_ids_key=...)) logs what
    the Trainer-subclass recipe logs, with the same training losses."""
    meter = ChannelLossMeter()
    trainer, recorder = make_trainer(tmp_path / "subclass", meter)
    ChannelLossCallback(meter).attach(trainer)
    with patch_model(trainer.model):
        trainer.train()
    want = train_logs(recorder)

    short, short_recorder = make_trainer(tmp_path / "short", None, short=True)
    ChannelLossCallback(ChannelLossMeter()).attach(short, source_ids_key="source_ids")
    with patch_model(short.model):
        short.train()
    got = train_logs(short_recorder)
    assert_channel_metrics(got, 2)
    assert [{k: v for k, v in log.items() if k != "train_runtime"} for log in got] == [
        {k: v for k, v in log.items() if k != "train_runtime"} for log in want
    ]

    # A training batch without the key is an error naming it, not a silent drop.
    bare, _ = make_trainer(tmp_path / "bare", None, short=True)
    ChannelLossCallback(ChannelLossMeter()).attach(bare, source_ids_key="sources")
    with patch_model(bare.model), pytest.raises(KeyError, match=r"has no 'sources'"):
        bare.train()


@pytest.mark.parametrize("fused", [False, True], ids=["observer", "fused"])
def test_label_smoothing_with_gradient_accumulation_logs_channel_metrics(tmp_path, fused):
    # label_smoothing_factor > 0: the Trainer pops the labels and smooths the logits itself, so
    # the model's loss_function never ran and every micro-batch was dropped.
    plain, plain_recorder = make_trainer(tmp_path / "plain", None, label_smoothing_factor=0.1)
    plain.train()
    want = [log["loss"] for log in train_logs(plain_recorder)]

    meter = ChannelLossMeter()
    trainer, recorder = make_trainer(tmp_path / "run", meter, label_smoothing_factor=0.1)
    with patch_model(trainer.model, fused=fused) as handle:
        ChannelLossCallback(meter).attach(trainer)
        assert isinstance(trainer.label_smoother, ObservingOutputsLoss)
        trainer.train()
        if fused:  # the fused loss smoothed (the labels reached the model: no logits formed)
            assert handle.loss.verified
            assert handle.loss.label_smoothing == 0.0  # only while the Trainer computes a loss
        assert isinstance(trainer.label_smoother, ObservingOutputsLoss)
    logs = train_logs(recorder)
    assert_channel_metrics(logs, 2)
    got = [log["loss"] for log in logs]
    if fused:
        assert got == pytest.approx(want, rel=1e-5)
    else:
        assert got == want


def test_fused_label_smoothing_stays_with_the_trainer_that_asked_for_it(tmp_path):
    # attach once switched the Trainer's smoother off for good and left the smoothing on the
    # model: evaluate() lost it (its eval_loss was the unsmoothed one), and the model kept
    # smoothing in every later training forward, under another Trainer or none.
    data = PackedDataset([packed_batch(seed=s, rows=((5, 7, 3),)) for s in range(2)])
    one = {"label_smoothing_factor": 0.1, "per_device_eval_batch_size": 1}
    plain, _ = make_trainer(tmp_path / "plain", None, **one)
    want = plain.evaluate(eval_dataset=data)["eval_loss"]

    meter = ChannelLossMeter()
    trainer, _ = make_trainer(tmp_path / "run", meter, **one)
    model = trainer.model
    with patch_model(model, fused=True) as handle:
        ChannelLossCallback(meter).attach(trainer)
        assert trainer.evaluate(eval_dataset=data)["eval_loss"] == want
        trainer.train()
        assert handle.loss.label_smoothing == 0.0
        batch = collate([data[0]])
        model.train()
        with torch.no_grad():
            loss = model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                labels=batch["labels"],
            ).loss
            model.eval()
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
        unsmoothed = torch.nn.functional.cross_entropy(logits[0].float(), targets[0])
        assert float(loss) == pytest.approx(float(unsmoothed), rel=1e-5)


class _OwnSmoother(transformers.Trainer):
    """Calls the label smoother itself, as many recipes do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs.pop("source_ids"), inputs.pop("tail")
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = self.label_smoother(outputs, labels, shift_labels=True)
        return (loss, outputs) if return_outputs else loss


class _ModelLoss(transformers.Trainer):
    """Ignores label smoothing: the model's own loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs.pop("source_ids"), inputs.pop("tail")
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


@pytest.mark.parametrize("trainer_class", [_OwnSmoother, _ModelLoss])
def test_a_compute_loss_of_its_own_trains_as_it_would_unattached(tmp_path, trainer_class):
    # Regression: attach switched the smoother off around the whole overriding compute_loss
    # (one calling self.label_smoother got None: TypeError) and smoothed the model's own loss
    # (one ignoring smoothing trained on a smoothed loss).
    def losses(folder, attach):
        torch.manual_seed(0)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / folder), max_steps=2, per_device_train_batch_size=1,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
            remove_unused_columns=False, seed=0, label_smoothing_factor=0.1,
        )  # fmt: skip
        data = PackedDataset([packed_batch(seed=s, rows=((5, 7, 3),)) for s in range(2)])
        recorder = Recorder()
        trainer = trainer_class(
            model=tiny_llama(seed=8).train(), args=args, train_dataset=data,
            data_collator=collate, callbacks=[recorder],
        )  # fmt: skip
        if attach:
            patch_model(trainer.model, fused=True)
            ChannelLossCallback(ChannelLossMeter()).attach(trainer)
        trainer.train()
        return [log["loss"] for log in train_logs(recorder)]

    assert losses("attached", True) == pytest.approx(losses("plain", False), rel=1e-6)


def test_an_attached_trainer_keeps_its_class(tmp_path):
    # Regression: attach swapped the trainer's class for a made-up one of the same name:
    # `type(trainer) is MyTrainer` was False, and pickle could not find the class by name.
    trainer, _ = make_trainer(tmp_path, ChannelLossMeter(), label_smoothing_factor=0.1)
    cls = type(trainer)
    with patch_model(trainer.model, fused=True):
        ChannelLossCallback(ChannelLossMeter()).attach(trainer)
        ChannelLossCallback(ChannelLossMeter()).attach(trainer)
    assert type(trainer) is cls
    # Wrapped once, whatever the number of attaches.
    assert transformers.Trainer.compute_loss.__wrapped__.__name__ == "compute_loss"
    assert not hasattr(transformers.Trainer.compute_loss.__wrapped__, "__channel_loss__")


def test_compute_loss_func_is_observed(tmp_path):
    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"].float()
        targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
            / num_items_in_batch
        )

    meter = ChannelLossMeter()
    trainer, recorder = make_trainer(tmp_path, meter, compute_loss_func=compute_loss_func)
    with patch_model(trainer.model):
        ChannelLossCallback(meter).attach(trainer)
        trainer.train()
    assert_channel_metrics(train_logs(recorder), 2)


def test_an_unattached_callback_warns_about_what_it_cannot_reach(tmp_path):
    callback = ChannelLossCallback(ChannelLossMeter())
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    args = SimpleNamespace(report_to=["tensorboard"], label_smoothing_factor=0.0)
    with pytest.warns(UserWarning, match=r"reporters \['tensorboard'\].*attach\(trainer\)"):
        callback.on_train_begin(args, state, control)

    meter = ChannelLossMeter()
    trainer, _ = make_trainer(tmp_path, meter, label_smoothing_factor=0.1)
    trainer.add_callback(ChannelLossCallback(meter))
    with patch_model(trainer.model), pytest.warns(UserWarning, match="label_smoothing_factor"):
        trainer.train()


def test_interval_follows_fractional_logging_steps(tmp_path):
    # logging_steps=0.5 of max_steps=4 logs steps 2 and 4; ChannelLossMeter(interval=0.5) fails.
    meter = ChannelLossMeter()
    trainer, recorder = make_trainer(tmp_path, meter, max_steps=4, logging_steps=0.5)
    callback = ChannelLossCallback(meter, interval_from_logging_steps=True).attach(trainer)
    with patch_model(trainer.model):
        trainer.train()
    assert meter.interval == 2
    logs = train_logs(recorder)
    assert [log["step"] for log in trainer.state.log_history if "loss" in log] == [2, 4]
    assert_channel_metrics(logs, 2)
    assert not callback._pending


def test_batch_layout_reads_packed_rows_and_right_padded_rows():
    from channel_loss import ChannelLossMetadataError
    from channel_loss.integrations.transformers import batch_layout

    packed = batch_layout({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0]])}, 1)
    assert packed.seqlens.tolist() == [3, 2, 1]  # the last position is the declared tail
    padded = batch_layout({"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])})
    assert padded.seqlens.tolist() == [3, 2]  # one sample per row, the zeros are padding
    with pytest.raises(ChannelLossMetadataError, match="right-padded"):
        batch_layout({"attention_mask": torch.tensor([[0, 1, 1]])})
    with pytest.raises(ChannelLossMetadataError, match="neither position_ids"):
        batch_layout({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
