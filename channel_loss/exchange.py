"""The wire protocol of channel_loss: per-key sums across a process group, without pickling.

Ranks may hold different keys (data-parallel ranks see different sources), so
a plain ``all_reduce`` of per-key rows cannot line them up. ``KeyedExchange``
reduces them in two ``all_reduce`` calls whose shapes every rank can compute
on its own:

1. headers: every rank writes a fixed-size int64 header into its own row of
   a ``[world, H]`` tensor; the sum is everybody's header. A header carries
   the sizes of what the rank sends next, then whatever else the caller needs
   every rank to agree on (the meter's ``StepHeader``).
2. rows: one float64 vector laid out as ``[rows of keys every rank already
   agrees on | rank 0's new keys | rank 1's new keys | ...]``. A rank writes
   its own region and leaves the others zero, so the sum carries every rank's
   new keys, encoded as numbers, next to their rows.

Everything that travels is defined here: keys (``int`` or ``str``) and names
as UTF-8 bytes with a type tag (``encode_entries``), text packed 8 bytes to an
int64 word (``text_to_words``), the meter's step header (``StepHeader``),
counts as float64 (exact below 2**53). The number of columns is whatever the
caller's rows have: ``SourceTotals`` and the meter pass ``len(COLUMNS)``.
``count_collectives`` checks from outside how many collectives a block ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_DEVICES",
    "COLLECTIVES",
    "RUNS",
    "SLOTS",
    "KeyedExchange",
    "KeyedRows",
    "SourceId",
    "StepHeader",
    "all_reduce_rows",
    "comm_device",
    "count_collectives",
    "decode_entries",
    "encode_entries",
    "failure_runs",
    "gather_headers",
    "group_size",
    "text_to_words",
    "words_to_text",
]

SourceId = int | str

_INT, _STR = 0, 1


def group_size(group) -> int:
    """Ranks in ``group``; ``None`` stands for "no group": this process alone."""
    return 1 if group is None else dist.get_world_size(group)


#: The device type whose tensors each ``torch.distributed`` backend reduces.
#: An accelerator backend takes tensors on the calling process's current device.
BACKEND_DEVICES: dict[str, str] = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "hccl": "npu"}


def comm_device(group) -> torch.device:
    """The device a collective on ``group`` takes its tensors on (host for Gloo).

    The backend's device type comes from ``BACKEND_DEVICES``; a composite
    backend (``"cpu:gloo,cuda:nccl"``) uses the host when it has a host
    backend. An unknown backend raises ``ValueError`` naming it: a guess
    could hand a collective tensors on the wrong device.
    """
    if group is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "device:backend" pairs, as init_process_group accepts them
        devices = [pair.partition(":")[0].strip() for pair in backend.split(",")]
        device_type = "cpu" if "cpu" in devices else devices[0]
    elif backend in BACKEND_DEVICES:
        device_type = BACKEND_DEVICES[backend]
    else:
        raise ValueError(
            f"channel_loss does not know which device the {backend!r} process-group backend "
            f"reduces on; known backends: {sorted(BACKEND_DEVICES)} (add it to "
            "channel_loss.exchange.BACKEND_DEVICES)"
        )
    if device_type == "cpu":
        return torch.device("cpu")
    runtime = getattr(torch, device_type, None)
    if runtime is None or not hasattr(runtime, "current_device"):
        raise ValueError(
            f"the {backend!r} backend reduces {device_type} tensors, but torch has no "
            f"torch.{device_type} runtime in this process"
        )
    return torch.device(device_type, runtime.current_device())


def gather_headers(header: Sequence[int], group) -> list[list[int]]:
    """Collective 1: every rank's int64 header, in group-rank order.

    All ranks must pass headers of the same length.
    """
    world = group_size(group)
    if world == 1:
        return [list(header)]
    rows = torch.zeros(world, len(header), dtype=torch.int64)
    rows[dist.get_rank(group)] = torch.tensor(list(header), dtype=torch.int64)
    rows = rows.to(comm_device(group))
    dist.all_reduce(rows, group=group)
    return rows.cpu().tolist()


def encode_entries(entries: Sequence[tuple[SourceId, str]]) -> list[int]:
    """``(key, name)`` pairs as a flat list of small ints: tag, lengths, UTF-8 bytes."""
    words: list[int] = []
    for key, name in entries:
        text = str(key).encode("utf-8")
        label = name.encode("utf-8")
        words += [_STR if isinstance(key, str) else _INT, len(text), len(label), *text, *label]
    return words


def decode_entries(words: Sequence[int], count: int) -> list[tuple[SourceId, str]]:
    """Inverse of ``encode_entries`` for ``count`` entries."""
    entries: list[tuple[SourceId, str]] = []
    at = 0
    for _ in range(count):
        tag, key_len, name_len = words[at : at + 3]
        at += 3
        text = bytes(words[at : at + key_len]).decode("utf-8")
        at += key_len
        name = bytes(words[at : at + name_len]).decode("utf-8")
        at += name_len
        entries.append((text if tag == _STR else int(text), name))
    return entries


def text_to_words(text: str, words: int) -> tuple[int, list[int]]:
    """``text`` as UTF-8 in exactly ``words`` int64 words: ``(byte length, words)``, cut to fit.

    Unencodable characters travel backslash-escaped: a message quoting bad
    text must still reach every rank.
    """
    data = text.encode("utf-8", errors="backslashreplace")[: 8 * words]
    padded = data.ljust(8 * words, b"\0")
    return len(data), [
        int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)
    ]


def words_to_text(words: Sequence[int], length: int) -> str:
    """Inverse of ``text_to_words`` (a cut multi-byte character decodes as U+FFFD)."""
    data = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return data[:length].decode("utf-8", errors="replace")


def all_reduce_rows(
    known: torch.Tensor,
    new_rows: torch.Tensor,
    new_words: Sequence[int],
    sizes: Sequence[tuple[int, int]],
    group,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, list[int]]]]:
    """Collective 2: sum ``known`` rows, and hand every rank's new rows and key words to all.

    ``known`` is ``[K, C]`` float64 in an order all ranks agree on;
    ``new_rows`` ``[n, C]`` are the rows of this rank's new keys, encoded in
    ``new_words``. ``sizes[r]`` is rank ``r``'s ``(n, len(new_words))``, as
    exchanged by ``gather_headers``. Returns the summed ``known`` (on the
    host) and, per rank in group-rank order, its ``(rows, words)``.
    """
    if group_size(group) == 1:
        return known.detach().cpu(), [(new_rows.detach().cpu(), list(new_words))]
    columns, me, device = known.shape[1], dist.get_rank(group), comm_device(group)
    regions = [n * columns + words for n, words in sizes]
    begin = known.numel() + sum(regions[:me])
    payload = torch.zeros(known.numel() + sum(regions), dtype=torch.float64, device=device)
    payload[: known.numel()] = known.reshape(-1).to(device, torch.float64)
    rows_end = begin + new_rows.numel()
    payload[begin:rows_end] = new_rows.reshape(-1).to(device, torch.float64)
    payload[rows_end : rows_end + len(new_words)] = torch.tensor(
        list(new_words), dtype=torch.float64
    ).to(device)
    dist.all_reduce(payload, group=group)
    payload = payload.cpu()
    arrivals = []
    at = known.numel()
    for (n, _), size in zip(sizes, regions, strict=True):
        rows = payload[at : at + n * columns].reshape(n, columns)
        arrivals.append((rows, [int(v) for v in payload[at + n * columns : at + size].tolist()]))
        at += size
    return payload[: known.numel()].reshape(known.shape), arrivals


@dataclass
class KeyedRows:
    """What ``KeyedExchange.reduce`` returns, the same on every rank.

    ``rows`` is float64 ``[K + len(new_keys), C]`` on the host: the ``K``
    known rows summed over the group, then one summed row per new key.
    ``new_keys`` is the union of every rank's new keys, first seen in
    group-rank order. ``names[key]`` lists the non-empty names given for a
    new key as ``(group rank, name)``, in group-rank order.
    """

    rows: torch.Tensor
    new_keys: list[SourceId]
    names: dict[SourceId, list[tuple[int, str]]] = field(default_factory=dict)


class KeyedExchange:
    """Sum per-key rows over ``group`` in two collectives, the ranks holding different keys.

    Construction runs collective 1: it sends ``header`` (ints, the same
    length on every rank) and the sizes of this rank's new ``entries``;
    ``headers`` then holds every rank's ``header`` in group-rank order, so
    every rank can take the same decisions before the rows are summed.
    ``entries`` are ``(key, name)`` pairs for the keys no rank agrees on yet,
    grouped by key (a key may come with several names; name ``""`` is none).
    ``reduce`` runs collective 2. With ``group`` None (or of one rank)
    nothing is communicated.
    """

    def __init__(self, entries: Sequence[tuple[SourceId, str]], header: Sequence[int], group):
        self._group = group
        self._entries = list(entries)
        self._words = encode_entries(self._entries)
        keys = _distinct_in_order(key for key, _ in self._entries)
        rows = gather_headers([len(keys), len(self._entries), len(self._words), *header], group)
        self._sizes = [(row[0], row[1], row[2]) for row in rows]
        self.headers: list[list[int]] = [row[3:] for row in rows]

    def reduce(self, known: torch.Tensor, new_rows: torch.Tensor) -> KeyedRows:
        """Collective 2: ``known`` ``[K, C]`` (rows of the agreed keys, in the agreed order)
        summed, and ``new_rows`` (one row per distinct key of ``entries``, in order) merged by key.
        """
        summed, arrivals = all_reduce_rows(
            known, new_rows, self._words, [(n, words) for n, _, words in self._sizes], self._group
        )
        new_keys: dict[SourceId, int] = {}
        names: dict[SourceId, list[tuple[int, str]]] = {}
        targets: list[int] = []
        parts: list[torch.Tensor] = []
        for rank, ((_, count, _), (rows, words)) in enumerate(
            zip(self._sizes, arrivals, strict=True)
        ):
            entries = decode_entries(words, count)
            for key in _distinct_in_order(key for key, _ in entries):
                targets.append(new_keys.setdefault(key, len(new_keys)))
            for key, name in entries:
                if name:
                    names.setdefault(key, []).append((rank, name))
            parts.append(rows)
        merged = torch.zeros(len(new_keys), summed.shape[1], dtype=torch.float64)
        if targets:
            merged.index_add_(0, torch.tensor(targets, dtype=torch.int64), torch.cat(parts))
        return KeyedRows(torch.cat([summed, merged]), list(new_keys), names)


def _distinct_in_order(keys) -> list[SourceId]:
    # Entries of one key are consecutive; the same key on two ranks is merged by the caller.
    out: list[SourceId] = []
    for key in keys:
        if not out or out[-1] != key:
            out.append(key)
    return out


#: A rank's failed micro-batches travel as up to RUNS runs [start, start + length).
RUNS = 16
_MESSAGE_WORDS = 32  # an error message travels cut to 8 * 32 bytes
#: Words of a step header's micro-batch fingerprints: micro-batch m goes to slot m % SLOTS.
SLOTS = 16


def failure_runs(failed: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted failed indices as at most ``RUNS`` runs ``(start, length)``.

    Past ``RUNS`` runs the last one stretches from the start of the
    ``RUNS``-th to the last failure: its micro-batches in between are
    dropped too (and counted as dropped), so every rank still agrees.
    """
    runs: list[list[int]] = []
    for m in failed:
        if runs and runs[-1][0] + runs[-1][1] == m:
            runs[-1][1] += 1
        else:
            runs.append([m, 1])
    if len(runs) > RUNS:
        start = runs[RUNS - 1][0]
        runs[RUNS - 1 :] = [[start, failed[-1] + 1 - start]]
    return [(start, length) for start, length in runs]


@dataclass
class StepHeader:
    """What one rank of a ``ChannelLossMeter`` tells every other rank at the end of a step.

    A fixed number of int64 words (``pack``), whatever the step held: the
    failed micro-batches as ``failure_runs``, the micro-batches' fingerprints
    in ``SLOTS`` words (micro-batch m hashed into slot ``m % SLOTS``, failed
    ones left out, so that peers compare the slots no rank failed in), the
    first metadata error's message cut to 256 bytes.
    """

    rank: int
    sp_id: int  # lowest global rank of the rank's SP group: equal ids = same SP group
    micro_batches: int
    fingerprint: list[int]  # SLOTS words of (num_samples, shape): SP peers must agree
    failed: list[tuple[int, int]]  # runs (start, length) of failed micro-batches, at most RUNS
    error_at: int = -1  # micro-batch of the first metadata error, -1 for none
    error: str = ""
    registry: tuple[int, int] = (0, 0)  # (sources, hash) of the source registry: all must agree

    def pack(self) -> list[int]:
        """The header as int64 words; ``unpack`` reads them back."""
        length, message = text_to_words(self.error, _MESSAGE_WORDS)
        runs = [v for run in self.failed for v in run] + [0, 0] * (RUNS - len(self.failed))
        return [
            self.rank,
            self.sp_id,
            self.micro_batches,
            self.error_at,
            length,
            len(self.failed),
            *self.registry,
            *self.fingerprint,
            *runs,
            *message,
        ]

    @classmethod
    def unpack(cls, row: Sequence[int]) -> StepHeader:
        """Inverse of ``pack``."""
        rank, sp_id, micro_batches, error_at, length, count, sources, digest = row[:8]
        fingerprint = list(row[8 : 8 + SLOTS])
        runs = row[8 + SLOTS : 8 + SLOTS + 2 * RUNS]
        failed = [(runs[2 * i], runs[2 * i + 1]) for i in range(count)]
        message = words_to_text(row[8 + SLOTS + 2 * RUNS :], length)
        return cls(
            rank, sp_id, micro_batches, fingerprint, failed, error_at, message, (sources, digest)
        )


#: Every torch.distributed entry point that communicates.
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Record the name of every ``torch.distributed`` collective (``COLLECTIVES``) called in the block.

    For tests and benchmarks of the communication budget (the meter's step:
    at most two). It replaces the functions on the ``torch.distributed``
    module for the duration of the block, so it sees calls made through
    ``dist.<name>``, in this thread and any other; restored on exit.
    """
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
