"""A training demo: per-source loss curves of a tiny causal LM on packed data from three sources.

Run ``python -m channel_loss.demo [--steps N] [--out DIR] [--sp W] [--interval K]``,
or start the ranks yourself, the way PyTorch users do:
``torchrun --nproc-per-node W -m channel_loss.demo [...]`` (the ranks and the
rendezvous come from torchrun's environment; rank 0 writes the outputs).

Three synthetic sources of different difficulty are packed into each row:

* ``pattern`` — counting sequences (``t, t+1, t+2, ...`` mod V): fully
  predictable after the first token, so its loss falls towards 0;
* ``noisy`` — the same with a quarter of the tokens replaced at random: its
  loss falls, but stays well above ``pattern``;
* ``random`` — uniform random tokens: nothing to learn, its loss stays near
  ``ln(V)`` (the model, fitting the other sources, ends up above it).

A single training loss averages these away; the per-source ("channel") loss
shows each. The model is a plain-PyTorch transformer (no ``transformers``
needed); its loss is ``chunk_cross_entropy`` inside
``ChannelLossMeter.micro_batch`` with a ``PackedLayout`` built from the
``position_ids``, so the metrics come from the loss pass itself.

With ``--sp W`` the step runs on W ranks over Gloo, started with torch's own
launcher (``torch.distributed.launcher.elastic_launch``, what ``torchrun``
runs), as sequence parallelism of the loss: every rank runs the
(tiny) model on the whole packed row, takes its ``Shard`` (``--sp-mode``:
zigzag by default, or any other mode of ``SHARD_MODES``) of the hidden states and of the globally
pre-shifted labels, computes the loss of its tokens
only, and the ranks sum their gradients. The meter attributes each rank's
partial per-token losses and reduces them over the SP group, so the metrics
equal the ``--sp 1`` run's up to float rounding.

Writes ``DIR/metrics.jsonl`` (one JSON object per measured step: ``step``,
``loss`` and the ``channel_loss*/<source>`` keys) and, when matplotlib is
installed (extra ``plot``), ``DIR/channel_loss.png`` with the per-source curves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from channel_loss.attribution import COLUMNS
from channel_loss.layout import SHARD_MODES, PackedLayout
from channel_loss.meter import MEAN, WEIGHTED, ChannelLossMeter, columns_from_metrics, metric_key
from channel_loss.ops import chunk_cross_entropy

__all__ = ["SOURCES", "DemoConfig", "TinyCausalLM", "main", "make_micro_batch", "run"]

#: Source id -> name, easiest first.
SOURCES: dict[int, str] = {0: "pattern", 1: "noisy", 2: "random"}
IGNORE_INDEX = -100
MIN_SAMPLE, MAX_SAMPLE = 8, 48
#: A stuck collective raises in the ranks after this long instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
#: How long the launcher waits for every rank to join the rendezvous.
RENDEZVOUS_TIMEOUT_S = 120
PLOT_NAME = "channel_loss.png"
METRICS_NAME = "metrics.jsonl"


@dataclass(frozen=True)
class DemoConfig:
    """Everything that determines a demo run; equal configs give equal runs (per rank count)."""

    steps: int = 40
    interval: int = 5
    sp: int = 1
    sp_mode: str = "zigzag"
    seed: int = 0
    micro_batches: int = 2
    seq_len: int = 256
    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    noise: float = 0.25
    chunk_size: int = 128
    quiet: bool = False


# --------------------------------------------------------------------------- data


def make_micro_batch(config: DemoConfig, step: int, micro: int) -> dict:
    """One packed row of ``config.seq_len`` tokens, the same on every rank.

    Returns ``input_ids``, ``position_ids`` (restarting at 0 for each sample,
    then for the tail padding), ``shift_labels`` (each token's next token
    within its sample, ``-100`` at sample ends and on padding: the global
    shift, done before any sharding), ``tail`` (padding length) and
    ``source_ids`` (one per sample).
    """
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1_009 + micro)
    ids, pos, targets, sources = [], [], [], []
    filled = 0
    while config.seq_len - filled >= MIN_SAMPLE:
        hi = min(MAX_SAMPLE, config.seq_len - filled)
        length = int(torch.randint(MIN_SAMPLE, hi + 1, (), generator=g))
        source = int(torch.randint(0, len(SOURCES), (), generator=g))
        if SOURCES[source] == "random":
            tokens = torch.randint(0, config.vocab, (length,), generator=g)
        else:
            start = torch.randint(0, config.vocab, (), generator=g)
            tokens = (start + torch.arange(length)) % config.vocab
            if SOURCES[source] == "noisy":
                swap = torch.rand(length, generator=g) < config.noise
                tokens = torch.where(
                    swap, torch.randint(0, config.vocab, (length,), generator=g), tokens
                )
        ids.append(tokens)
        pos.append(torch.arange(length))
        # The last token of a sample is never scored against the next sample's first.
        targets.append(torch.cat([tokens[1:], torch.tensor([IGNORE_INDEX])]))
        sources.append(source)
        filled += length
    tail = config.seq_len - filled
    ids.append(torch.zeros(tail, dtype=torch.int64))
    pos.append(torch.arange(tail))
    targets.append(torch.full((tail,), IGNORE_INDEX))
    return {
        "input_ids": torch.cat(ids),
        "position_ids": torch.cat(pos),
        "shift_labels": torch.cat(targets),
        "tail": tail,
        "source_ids": sources,
    }


# --------------------------------------------------------------------------- model


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, h // self.heads).unbind(1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = x + self.proj(attn.transpose(0, 1).reshape(t, h))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """A small pre-norm transformer over one packed row; attention stays inside each sample.

    ``forward(input_ids [T], position_ids [T]) -> hidden [T, H]`` (final-normed);
    the LM head is ``lm_head.weight`` ``[V, H]``, applied by the loss.
    """

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[T, H]``; samples (restarts of ``position_ids``) never see each other."""
        sample = torch.cumsum(position_ids == 0, 0)
        t = input_ids.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal & (sample[:, None] == sample[None, :])
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)


# --------------------------------------------------------------------------- training


def _print_table(step: int, metrics: dict[str, float], prefix: str = "channel_loss") -> None:
    columns, _ = columns_from_metrics(metrics, prefix=prefix)
    shown = [(i, c.metric) for i, c in enumerate(COLUMNS) if c.metric is not None]
    print(f"  step {step}: per-source loss (mean CE over scored tokens)")
    print(
        f"    {'source':<10}{'mean CE':>10}"
        + "".join(f"{m:>9}" for _, m in shown)
        + f"{'weighted':>10}"
    )
    for name in SOURCES.values():
        if name not in columns:
            continue
        mean = metrics.get(metric_key(prefix, MEAN, name), float("nan"))
        counts = "".join(f"{columns[name][i]:>9.0f}" for i, _ in shown)
        print(
            f"    {name:<10}{mean:>10.4f}{counts}{metrics[metric_key(prefix, WEIGHTED, name)]:>10.4f}"
        )
    sys.stdout.flush()


def train(config: DemoConfig) -> list[dict[str, float]]:
    """Train for ``config.steps`` steps; return one record per measured step (same on every rank).

    With ``config.sp > 1`` it must run on every rank of an initialised
    ``config.sp``-rank process group (that group is the SP group). A record is
    ``{"step": i, "loss": <training loss of step i>, **meter metrics}``, where
    step ``i`` (from 0) is measured when ``i % config.interval == 0``.
    Runs single-threaded (the previous thread count is restored afterwards).
    """
    # The model is so small that intra-op threads cost more than they gain, and
    # on a busy 2-core host their spin-waits made steps ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(config)
    finally:
        torch.set_num_threads(threads)


def _train(config: DemoConfig) -> list[dict[str, float]]:
    world = dist.get_world_size() if config.sp > 1 else 1
    if world != config.sp:
        raise RuntimeError(f"config.sp={config.sp} but the process group has {world} ranks")
    rank = dist.get_rank() if config.sp > 1 else 0
    talk = rank == 0 and not config.quiet
    torch.manual_seed(config.seed)  # identical initial weights on every rank
    model = TinyCausalLM(config.vocab, config.hidden, config.layers, config.heads, config.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    meter = ChannelLossMeter(
        sp_group=dist.group.WORLD if config.sp > 1 else None, interval=config.interval
    )
    records = []
    started = time.perf_counter()
    for step in range(config.steps):
        tick = time.perf_counter()
        batches = [make_micro_batch(config, step, m) for m in range(config.micro_batches)]
        # Normalise by the step's scored tokens over all micro-batches and ranks, so the
        # summed gradients are those of the mean CE of the whole step.
        items = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batches)
        meter.begin_step()
        step_loss = torch.zeros(())
        for batch in batches:
            layout = PackedLayout.from_position_ids(
                batch["position_ids"], tail_padding_length=batch["tail"]
            )
            shard = layout.shard(world, rank, config.sp_mode) if config.sp > 1 else None
            with meter.micro_batch(
                source_ids=batch["source_ids"], layout=layout, shard=shard, source_names=SOURCES
            ):
                hidden = model(batch["input_ids"], batch["position_ids"])
                targets = batch["shift_labels"]
                if shard is not None:
                    # Labels were shifted globally above; slicing must not shift again.
                    hidden = shard.take(hidden, 0.0)
                    targets = shard.take(targets, IGNORE_INDEX)
                loss = chunk_cross_entropy(
                    hidden,
                    model.lm_head.weight,
                    shift_labels=targets,
                    num_items_in_batch=items,
                    chunk_size=config.chunk_size,
                )
            loss.backward()
            step_loss += loss.detach()
        if config.sp > 1:
            for param in model.parameters():
                dist.all_reduce(param.grad)
            dist.all_reduce(step_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = meter.end_step()
        if talk:
            print(
                f"[{step + 1:>4}/{config.steps}] loss {float(step_loss):.4f}  "
                f"{1000 * (time.perf_counter() - tick):5.0f} ms/step",
                flush=True,
            )
        if metrics:
            records.append({"step": step, "loss": float(step_loss), **metrics})
            if talk:
                _print_table(step, metrics)
    if talk:
        print(
            f"trained {config.steps} steps in {time.perf_counter() - started:.1f} s "
            f"(sp={config.sp})",
            flush=True,
        )
    return records


def _sp_rank(config: dict) -> list[dict[str, float]]:
    """Rank entry point under torch's elastic launcher: join its process group, train on it."""
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)  # env:// set by the launcher
    try:
        records = train(DemoConfig(**config))
        _all_done()
        return records
    finally:
        dist.destroy_process_group()


def _all_done() -> None:
    """Return once every rank has finished training, before any tears its process group
    down. Under torchrun in CI a gloo rank once aborted at its exit ("terminate called
    without an active exception"); the cause was not found (24 reruns, quiet and loaded,
    did not show it), and this rules out one candidate: a rank destroying its group while
    its peer still finishes the last collective."""
    dist.barrier()


@contextmanager
def _launcher_side_effects_undone() -> Iterator[None]:
    """Restore the signal handlers and environment the elastic agent changes in its own process.

    The agent installs handlers for SIGTERM/SIGINT/SIGHUP/SIGQUIT that raise
    in whatever runs next; a caller (a test run, a notebook) keeps its own.
    """
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    numbers = [getattr(signal, name) for name in names if hasattr(signal, name)]
    handlers = {number: signal.getsignal(number) for number in numbers}
    environ = dict(os.environ)
    try:
        yield
    finally:
        for number, handler in handlers.items():
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(number, handler)
        os.environ.clear()
        os.environ.update(environ)


def _launch(config: DemoConfig) -> list[dict[str, float]]:
    """Run ``config.sp`` ranks on this host with torch's elastic launcher; return rank 0's records."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Import this module under its real name: run as ``python -m``, this code is
    # ``__main__``, which the spawned ranks could not import by that name.
    from channel_loss import demo

    with (
        tempfile.TemporaryDirectory(prefix="channel_loss_demo_") as logs,
        _launcher_side_effects_undone(),
    ):
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=config.sp,
            run_id=f"channel_loss_demo_{uuid.uuid4().hex}",
            # torchrun --standalone: a rendezvous on a free local port held by this process.
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            rdzv_configs={"timeout": RENDEZVOUS_TIMEOUT_S},
            max_restarts=0,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        results = elastic_launch(launch, demo._sp_rank)(asdict(config))
    return results[0]  # the meter gives every rank the same metrics


def run(config: DemoConfig) -> list[dict[str, float]]:
    """Train and return one record per measured step.

    ``sp == 1``: in this process. ``sp > 1``: if this process is already one
    rank of an initialised ``sp``-rank process group (e.g. started by
    ``torchrun``), train on it; otherwise start ``sp`` Gloo ranks on this
    host with torch's elastic launcher (as ``torchrun --standalone`` does).
    """
    if config.sp < 1:
        raise ValueError(f"sp must be >= 1; got {config.sp}")
    if config.sp == 1 or (dist.is_available() and dist.is_initialized()):
        return train(config)
    return _launch(config)


def _torchrun_world() -> int | None:
    """The world size when torchrun (or another env:// launcher) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


# --------------------------------------------------------------------------- output


def write_metrics(records: Sequence[dict], out: Path) -> Path:
    """Write one JSON object per record to ``out/metrics.jsonl``; return the path."""
    path = out / METRICS_NAME
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    return path


def plot(
    records: Sequence[dict], out: Path, *, vocab: int, prefix: str = "channel_loss"
) -> Path | None:
    """Plot per-source mean CE (and the training loss) against step into ``out/channel_loss.png``.

    Returns the path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    steps = [r["step"] for r in records]
    for name in SOURCES.values():
        key = metric_key(prefix, MEAN, name)
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name)
    ax.plot(
        steps,
        [r["loss"] for r in records],
        color="grey",
        linestyle="--",
        label="training loss (all sources)",
    )
    ax.axhline(
        math.log(vocab),
        color="black",
        linestyle=":",
        linewidth=1,
        label=f"uniform guess ln {vocab}",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("Per-source (channel) loss")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / PLOT_NAME
    fig.savefig(path)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m channel_loss.demo",
        description="Train a tiny causal LM on packed data from three sources and plot the "
        "per-source (channel) loss.",
    )
    p.add_argument(
        "--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("channel_loss_demo"),
        help="output directory (default %(default)s)",
    )
    p.add_argument(
        "--sp",
        type=int,
        default=None,
        help=f"sequence-parallel ranks over Gloo, started with torch's elastic launcher "
        f"(default {defaults.sp}; under torchrun: its ranks)",
    )
    p.add_argument(
        "--sp-mode",
        choices=tuple(SHARD_MODES),
        default=defaults.sp_mode,
        help="how the packed row is sharded under --sp (default %(default)s)",
    )
    p.add_argument(
        "--interval",
        type=int,
        default=defaults.interval,
        help="measure and log every K-th step (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--quiet", action="store_true", help="no progress or tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: train, print progress and tables, write metrics.jsonl and the plot.

    Under ``torchrun`` the ranks are torchrun's (``--sp``, if given, must
    equal its world size) and rank 0 alone prints and writes the outputs.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    world = _torchrun_world()
    if world is not None and args.sp not in (None, world):
        parser.error(f"--sp {args.sp} but torchrun started {world} ranks: they are the SP ranks")
    sp = world or args.sp or 1
    if args.steps < 1 or sp < 1 or args.interval < 1:
        parser.error("--steps, --sp and --interval must be >= 1")
    config = replace(
        DemoConfig(),
        steps=args.steps,
        sp=sp,
        sp_mode=args.sp_mode,
        interval=args.interval,
        seed=args.seed,
        quiet=args.quiet,
    )
    joined = world is not None and world > 1
    if joined:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        lead = not joined or dist.get_rank() == 0
        if lead and not args.quiet:
            print(
                f"channel_loss demo: {config.steps} steps, sources {', '.join(SOURCES.values())}, "
                f"sp={config.sp}, measuring every {config.interval} step(s)",
                flush=True,
            )
        records = run(config)
        if joined:
            _all_done()
    finally:
        if joined:
            dist.destroy_process_group()
    if not lead:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_metrics(records, args.out)
    print(f"wrote {path} ({len(records)} measured steps)")
    image = plot(records, args.out, vocab=config.vocab)
    if image is None:
        print("matplotlib is not installed: skipped the plot (pip install 'channel-loss[plot]')")
    else:
        print(f"wrote {image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
