"""What benchmarks and tests put in place of the measured dispatch: `with forced(prefill="prefill_ws"):`
runs every attention call of the block on that prefill. The bench's `--overrides` (its `attention`
entry) and the tests use it instead of replacing the dispatch's functions.

One `Forced` value is in force at a time. Each plan reads it when the plan is made (plans are dropped
when a block is entered and when it is left, so none outlives it), and `tile_config` applies its tile
fields. Blocks nest, and the inner one adds to the outer one. Not thread-safe: a process-wide setting,
like the environment variables.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

FORCED_MULTI_ROWS = 256  # multi=True: multi-token decode up to this many packed rows per KV head


@dataclass(frozen=True)
class Forced:
    prefill: str | None = None  # this prefill above one decode tile of rows (also where the SM80 prefill would run)
    multi: bool | None = None   # False: no multi-token decode; True: up to FORCED_MULTI_ROWS rows
    tma: bool | None = None     # False: decode (and what follows from it) without TMA, the cp.async loader
    tiles: tuple = ()           # (mode, ((field, value), ...)) pairs laid over tile_config's answer
    narrow: bool | None = None  # True: 16-bit caches at head dims 80 and 96 (NARROW_HEAD_DIMS) through the
    #                             TMA modes at those head dims, in 32- / 16-column panels: decode_tma and
    #                             multi_tma (heuristics.tma_ok), prefill_ws not on the 128 tile (wgmma_head_dim)

    def tiles_for(self, mode: str) -> dict:
        return {k: v for m, fields in self.tiles if m == mode for k, v in fields}


_blocks: list[tuple[dict, tuple]] = []  # the open blocks, oldest first: (options given, tile pairs)
_current = Forced()


def current() -> Forced:
    return _current


def _fold() -> Forced:
    out = Forced()
    for given, tiles in _blocks:
        out = dataclasses.replace(out, **given, tiles=out.tiles + tiles)
    return out


@contextlib.contextmanager
def forced(prefill: str | None = None, multi: bool | None = None, tma: bool | None = None,
           tiles: dict[str, dict] | None = None, narrow: bool | None = None):
    """Force the dispatch inside the block; `tiles` maps a mode to the tile fields it takes (e.g.
    {"prefill_ws": {"kStages": 3}}). Options left at None keep the outer block's (or the dispatch's).
    What is in force is the open blocks folded oldest first, so blocks may also close out of order
    (two pytest fixtures torn down in their set-up order): closing one drops its options only."""
    global _current
    from . import _PLANS

    given = {k: v for k, v in dict(prefill=prefill, multi=multi, tma=tma, narrow=narrow).items()
             if v is not None}
    block = (given, tuple((mode, tuple(sorted(fields.items()))) for mode, fields in (tiles or {}).items()))
    _blocks.append(block)
    _current = _fold()
    _PLANS.clear()
    try:
        yield _current
    finally:
        del _blocks[next(i for i, b in enumerate(_blocks) if b is block)]  # this block, not an equal one
        _current = _fold()
        _PLANS.clear()
