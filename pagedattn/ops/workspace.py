"""Split-KV scratch memory that CUDA-graph capture can rely on.

One float32 workspace (partial O and LSE) and one int32 arrival-counter buffer per (device, stream),
grown geometrically and allocated outside capture whenever the caller warmed up first. A buffer that
a capture has used is never freed (a graph keeps its address): when it is outgrown it moves to
`_KEPT`. The counters are zero between calls (the last split CTA of a tile re-zeroes its counter);
a counter buffer that had to be allocated during a capture is "dirty" (its zero-fill belongs to that
graph only), so every captured call that uses it zeroes its slice inside the graph and the next eager
call zeroes it once.

Replays run on whatever stream the caller replays on, with the buffers of the stream the graph was
captured on: do not run eager pagedattn calls on the capture stream concurrently with a replay.
"""
from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


class _Buffer:
    __slots__ = ("tensor", "captured", "dirty")

    def __init__(self, tensor, dirty):
        self.tensor = tensor
        self.captured = False
        self.dirty = dirty


_BUFFERS: dict[tuple[str, int, int], _Buffer] = {}
# Bumped whenever split_scratch hands out other buffers for a (device, stream) than the last time (grown,
# or allocated during a capture): a caller that keeps the addresses it got reuses them only while
# GENERATION is the one it got them under (attention's _Launch.run; never while capturing).
GENERATION = 0
_HANDED: dict[tuple[int, int], tuple[_Buffer, _Buffer]] = {}
_KEPT: list[torch.Tensor] = []   # outgrown buffers that a graph may still use
GRAPH_REFS: dict[int, torch.Tensor] = {}   # other device memory graphs hold (tensor maps), by address


def keep_for_graphs(t: torch.Tensor) -> None:
    """During capture: keep `t` alive for as long as the process runs (a graph holds its address)."""
    GRAPH_REFS.setdefault(t.data_ptr(), t)


def _get(kind: str, device: int, stream: int, numel: int, dtype, capturing: bool) -> _Buffer:
    key = (kind, device, stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.tensor.numel() < numel:
        if buf is not None and buf.captured:
            _KEPT.append(buf.tensor)
        size = max(numel, 2 * buf.tensor.numel() if buf is not None else 0, 1024)
        # outside capture: zeroed now, for good; inside, the zero-fill is a node of this graph only
        buf = _BUFFERS[key] = _Buffer(torch.zeros(size, dtype=dtype, device=f"cuda:{device}"), capturing)
    if capturing:
        buf.captured = True
    return buf


def split_scratch(device: int, splits: int, total_q: int, heads: int, head_dim: int, tiles: int,
                  capturing: bool, stream: int | None = None) -> tuple[int, int, int]:
    """Addresses of o_accum float32 [splits, total_q, heads, head_dim], lse_accum float32 [splits,
    heads, total_q] (one workspace; lse_accum 16-byte aligned as head_dim is a multiple of 16) and
    `tiles` int32 arrival counters (attn_fwd.cuh: the last split of a tile merges them all), zero on
    entry. Addresses, not views: a view costs more host time than the whole lookup. `stream`: the
    device's current raw stream, when the caller has it already."""
    global GENERATION
    if stream is None:
        stream = _raw_stream(device)
    n_o = splits * total_q * heads * head_dim
    buffers = (_get("workspace", device, stream, n_o + splits * heads * total_q, torch.float32, capturing),
               _get("counters", device, stream, tiles, torch.int32, capturing))
    if _HANDED.get((device, stream)) != buffers:  # _Buffer compares by identity
        _HANDED[(device, stream)] = buffers
        GENERATION += 1
    work, counters = buffers[0].tensor, buffers[1]
    if counters.dirty:
        if capturing:  # this graph zeroes what it uses, whichever graph allocated the buffer
            counters.tensor[:tiles].zero_()
        else:
            counters.tensor.zero_()
            counters.dirty = False
    base = work.data_ptr()
    return base, base + 4 * n_o, counters.tensor.data_ptr()


def counter_buffers() -> dict[tuple[int, int], torch.Tensor]:
    """(device, stream) -> the split counters in use there (tests and the fuzzer check they are zero)."""
    return {(dev, stream): buf.tensor for (kind, dev, stream), buf in _BUFFERS.items() if kind == "counters"}
