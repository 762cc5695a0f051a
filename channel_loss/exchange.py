"""Per-key sums across a process group in two fixed-shape collectives, without pickling.

Ranks may hold different keys (data-parallel ranks see different sources), so
a plain ``all_reduce`` of per-key rows cannot line them up. The exchange runs
in two ``all_reduce`` calls whose shapes every rank can compute on its own:

1. ``gather_headers``: every rank writes a fixed-size int64 header into its
   own row of a ``[world, H]`` tensor; the sum is everybody's header. Headers
   carry the sizes of what each rank sends next (and whatever else the caller
   needs to agree on).
2. ``all_reduce_rows``: one float64 vector laid out as ``[rows of keys every
   rank already agrees on | rank 0's new keys | rank 1's new keys | ...]``.
   A rank writes its own region and leaves the others zero, so the sum
   carries every rank's new keys, encoded as numbers, next to their rows.

Keys are ``int`` or ``str`` and travel as UTF-8 bytes with a type tag; counts
travel as float64, exact below 2**53.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_DEVICES",
    "SourceId",
    "all_reduce_rows",
    "comm_device",
    "decode_entries",
    "encode_entries",
    "gather_headers",
    "group_size",
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
