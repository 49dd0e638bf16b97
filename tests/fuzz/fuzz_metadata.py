"""Fuzz the metadata contract (issue #18): bad metadata never corrupts memory or returns silent garbage.

Random cases (seeded: case i of op X is a function of (seed, X, i) alone) call the kernels with
corrupt metadata and check the contract:
  - attention (`flash_attn_varlen_func`, paged and contiguous): request b's query rows are
    [clamp(cu_q[b], 0, total_q), clamp(cu_q[b+1], start, total_q)); its keys are
    min(max(seqused_k[b], 0), W * block_size) (paged) or the clamped cu_seqlens_k range, capped by
    seqused_k (contiguous); block ids outside [0, num_blocks) read as zero K/V; max_seqlen_q/k and
    num_splits are hints: results are right whatever they say; nothing outside `out` and the LSE is
    written;
  - writer (`reshape_and_cache_flash`): slots < 0 or >= num_blocks * block_size skip their token;
  - legacy (`paged_attention_v1/v2`, `reshape_and_cache`): block ids outside [0, num_blocks) skip
    their block, negative seq_lens give 0, lengths are clamped to the table (max_seq_len is a hint,
    for v2 too);
  - a refusal (ContractError / UnsupportedError / NotImplementedError) touches nothing; any other
    exception, or a CUDA error, is a failure; malformed tensors must be refused.

Every tensor handed to an op is a view in the middle of a guard buffer (class Guarded) whose margins
hold a NaN payload no arithmetic produces: a write past a tensor changes a margin, a read past it
pulls NaN into the result. After each call every input (caches included) must be bit-identical to
before, outputs' margins intact, and the result equal to a float64 torch reference of the clamping
contract (expected_attention: corrupt block ids point at an extra zero page).

Kernel variants (precompile them; JIT compiles a missing one at first use, 10-40 s each): the default
space uses q dtype fp16/bf16, kv_cache_dtype auto/fp8_e4m3 and head dims 64, 128, 72 (72 runs on the
d80 kernels, its sm_90a prefill on the 128 tile); KERNEL_VARIANTS lists the families, `--list-variants`
every variant name. All of them:

  pagedattn precompile --arch sm_90a --ops attn_fwd,kv_write,legacy_attn,legacy_reduce,legacy_cache_write \
      --dtypes fp16,bf16 --kv-cache-dtypes auto,fp8_e4m3 --head-sizes 64,80,128 --jobs 16 --out DIR

Usage (GPU; results JSON in --out; exit status 1 on any failure):
  PAGEDATTN_AOT_DIR=DIR python tests/fuzz/fuzz_metadata.py --cases 2000 --seed 0 --out perf/results
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \
      --error-exitcode 9 python tests/fuzz/fuzz_metadata.py --sanitize --out perf/results
  python tests/fuzz/fuzz_metadata.py --replay RESULTS.json      # rerun the failures of a results file
  python tests/fuzz/fuzz_metadata.py --device cpu --cases 50 --small   # the harness against the torch references

--cases is the total, split 3:1:1 over attn, write and legacy. Cases run in a child process per op
(a sticky CUDA error kills a CUDA context): a child that dies or stops making progress for
--case-timeout seconds is recorded as a failure of its case and a new child resumes after it.
--sanitize runs a small subset (~40 cases, every corruption kind once) in this process, meant to run
under compute-sanitizer (which also sees the reads the guards cannot: LSE and split workspaces; the
mode turns PyTorch's caching allocator off so that each tensor is its own allocation).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

import torch

import pagedattn
from pagedattn import ContractError, UnsupportedError, legacy, legacy_reference, reference
from pagedattn.contract import CacheSpec, fp8_view

# ============================================================================ the space of cases
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 72)                    # 72: a head size that runs on the next larger kernel (80)
KERNEL_HEAD_DIM = {64: 64, 72: 80, 128: 128}
HEADS = ((8, 8), (8, 2), (32, 8), (4, 1))    # (Hq, Hkv)
BLOCK_SIZES = (16, 32, 1, 7)
SPLITS = (0, 1, 3, 16)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
LEGACY_HEAD_DIMS = (64, 128)
LEGACY_BLOCK_SIZES = (8, 16, 32)
LEGACY_VERSIONS = ("v1", "v2", "auto")

# Every kernel variant the default space can launch, per family: (q/input dtype, kv_cache_dtype,
# compiled head dim[, block size]). attn_fwd in each of its modes that exists for the triple (decode,
# decode_tma, prefill, prefill_wgmma); kv_write in each path (flat, span, head). kernel_specs() builds
# the KernelSpecs; the precompile command in the module docstring compiles exactly these families
# narrowed to these values (plus legacy head size 80, unused).
KERNEL_VARIANTS = {
    "attn_fwd": [(t, kv, d) for t in ("fp16", "bf16") for kv in KV_CACHE_DTYPES for d in (64, 80, 128)],
    "kv_write": [(t, kv) for t in ("fp16", "bf16") for kv in KV_CACHE_DTYPES],
    "legacy_attn": [(t, kv, d, bs) for t in ("fp16", "bf16") for kv in KV_CACHE_DTYPES
                    for d in LEGACY_HEAD_DIMS for bs in LEGACY_BLOCK_SIZES],
    "legacy_reduce": [(t, d) for t in ("fp16", "bf16") for d in LEGACY_HEAD_DIMS],
    "legacy_cache_write": [(t, kv) for t in ("fp16", "bf16") for kv in KV_CACHE_DTYPES],
}

INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
MAX_GUARD_ROWS = 512     # margins cover overruns up to this many rows; beyond, the sanitizer sees them


@dataclass(frozen=True)
class Space:
    """The values cases are drawn from (narrowed e.g. to what a test precompiled). small: the sizes of
    the sanitizer subset and of the CPU self-test."""
    dtypes: tuple = ("bf16", "fp16")
    head_dims: tuple = HEAD_DIMS
    kv_cache_dtypes: tuple = KV_CACHE_DTYPES
    small: bool = False


# Corruption kinds. HINT kinds leave the metadata valid (hints, empty requests); META kinds put values
# out of range; "malformed" makes a tensor the validation must refuse (a sub-kind per case).
ATTN_HINT = ("zero_len_q", "zero_len_k", "max_q_small", "max_q_zero", "max_q_huge", "max_k_small",
             "max_k_zero", "max_k_huge", "splits_any")
ATTN_CU_Q = ("cu_q_nonmonotone", "cu_q_last_big", "cu_q_last_small", "cu_q_first_nonzero")
ATTN_PAGED = ("block_id_negative", "block_id_past_end", "block_id_int_max", "seqused_past_table",
              "seqused_negative")
ATTN_CONTIG = ("cu_k_past_total", "cu_k_nonmonotone", "seqused_cap")
ATTN_MALFORMED = {  # sub-kind -> the mode it needs (None: either)
    "table_int64": "paged", "seqused_int64": "paged", "table_rows": "paged", "seqused_len": "paged",
    "cu_q_int64": None, "out_dtype": None, "out_rows": None, "q_fp32": None, "no_descale": None,
    "cu_k_len": "contiguous"}
SLOT_KINDS = ("slot_negative", "slot_past_end", "slot_padding")
WRITE_MALFORMED = ("slots_too_many", "slot_float", "slot_2d", "kv_tokens_differ", "no_scale", "scale_shape")
LEGACY_HINT = ("zero_len", "extra_partitions")
LEGACY_META = ("block_id_negative", "block_id_past_end", "block_id_int_max", "seq_len_negative",
               "seq_len_past_table", "max_seq_len_small")
LEGACY_MALFORMED = ("table_int64", "seq_lens_len", "out_shape", "max_seq_len_past_table", "partials_small",
                    "no_scale", "block_size_arg", "num_kv_heads_arg")
LEGACY_WRITE_MALFORMED = ("slots_too_many", "slot_float", "kv_tokens_differ", "no_scale")
KINDS = {
    "attn": ("clean", *ATTN_HINT, *ATTN_CU_Q, *ATTN_PAGED, *ATTN_CONTIG, "malformed"),
    "write": ("clean", *SLOT_KINDS, "malformed"),
    "legacy": ("clean", *LEGACY_HINT, *LEGACY_META, *SLOT_KINDS, "malformed"),
}
HINT_KINDS = set(ATTN_HINT) | set(LEGACY_HINT) | {"slot_padding"}
OPS = ("attn", "write", "legacy")
OP_WEIGHTS = {"attn": 3, "write": 1, "legacy": 1}

REFUSALS = (ContractError, UnsupportedError, NotImplementedError)
ATTN_TOL = 2e-2                # relative L2 error of the output over its rows (tests/test_attention.py)
ROW_TOL = 0.1                  # relative L2 error of any one row (catches a single wrong row)
LSE_ATOL, LSE_RTOL = 2e-2, 1e-3
LEGACY_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}   # per sequence (tests/test_legacy.py)


def kinds_class(kinds) -> str:
    """clean | hint | meta | malformed: the strongest corruption among a case's kinds."""
    if "malformed" in kinds:
        return "malformed"
    if any(k not in HINT_KINDS and k != "clean" for k in kinds):
        return "meta"
    return "hint" if any(k in HINT_KINDS for k in kinds) else "clean"


# ============================================================================ guard buffers
SENTINEL = {1: 0xFF, 2: 0x7FA5, 4: 0x7FA5A5A5, 8: 0x7FA5A5A5A5A5A5A5}  # NaN in fp8/fp16/bf16/fp32/fp64
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers, for bit-exact comparison (NaN != NaN as floats)."""
    return t.view(INT_OF_SIZE[t.element_size()])


class Guarded:
    """`numel` elements in the middle of a larger buffer whose margins (and, until written, interior)
    hold SENTINEL: a write past either end of the tensor shows in damage(), a read past it returns
    NaN. The sentinel is a NaN payload (0x7FA5 for 16-bit types, not the 0x7FFF/0xFFFF that
    arithmetic produces), so a kernel storing a computed NaN into a margin is still seen.
    snapshot() + changed() / diff() compare the whole buffer bit for bit."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device, pad: int = 4096):
        self.name = name
        self.numel = int(numel)
        self.pad = -(-max(int(pad), 64) // 64) * 64      # whole 64 elements: the view stays 16-byte aligned
        self.buf = torch.empty(self.numel + 2 * self.pad, dtype=dtype, device=device)
        self.sentinel = SENTINEL[self.buf.element_size()]
        as_ints(self.buf).fill_(self.sentinel)
        self._snap = None

    def flat(self, buf: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's elements in `buf` (default: this buffer; or a clone of it)."""
        return (self.buf if buf is None else buf)[self.pad:self.pad + self.numel]

    def view(self, shape, buf: torch.Tensor | None = None) -> torch.Tensor:
        return self.flat(buf).view(shape)

    def snapshot(self) -> None:
        self._snap = self.buf.clone()

    def damage(self) -> str | None:
        """A description of margin elements that are no longer the sentinel, or None."""
        ints = as_ints(self.buf)
        for side, part, first in (("before", ints[:self.pad], -self.pad),
                                  ("after", ints[self.pad + self.numel:], self.numel)):
            bad = (part != self.sentinel).nonzero()
            if bad.numel():
                return (f"{self.name}: {bad.numel()} guard element(s) {side} the tensor overwritten, "
                        f"first at element {first + int(bad[0, 0])} of {self.numel}")
        return None

    def diff(self, want: torch.Tensor) -> str | None:
        """Where this buffer differs bit-wise from `want` (a buffer of the same size), or None."""
        bad = (as_ints(self.buf) != as_ints(want)).nonzero()
        if not bad.numel():
            return None
        i = int(bad[0, 0]) - self.pad
        where = (f"element {i}" if 0 <= i < self.numel else
                 f"the guard {'before' if i < 0 else 'after'} it (element {i} of {self.numel})")
        return f"{self.name}: {bad.numel()} element(s) differ, first at {where}"

    def changed(self) -> str | None:
        return self.diff(self._snap)


def guarded_tensor(name: str, values, dtype, device, pad: int = 64) -> tuple[Guarded, torch.Tensor]:
    """A Guarded copy of `values` (a list or tensor) and its view."""
    src = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    g = Guarded(name, src.numel(), dtype, device, pad)
    t = g.view(tuple(src.shape))
    t.copy_(src.to(device=device, dtype=dtype))
    return g, t


def fill_random(t: torch.Tensor, gen: torch.Generator, kv: str = "auto") -> None:
    """Finite N(0, 1) values; uint8 tensors get them quantised to `kv` (saturated, never NaN)."""
    x = torch.randn(tuple(t.shape), generator=gen, device=t.device)
    if t.dtype == torch.uint8:
        x = reference.quantize_fp8(x, torch.ones((), device=t.device), kv).view(torch.uint8)
    t.copy_(x)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ============================================================================ case generation
def case_rng(seed: int, op: str, index: int) -> random.Random:
    """Case `index` of `op` depends on (seed, op, index) only (str seeds hash with sha512: stable)."""
    return random.Random(f"fuzz_metadata/{seed}/{op}/{index}")


def generate_case(op: str, seed: int, index: int, space: Space = Space()) -> dict:
    """A JSON-serialisable description of one case. The first len(KINDS[op]) cases of an op take one
    kind each, so every run covers every kind; later cases draw theirs."""
    rng = case_rng(seed, op, index)
    kinds = KINDS[op]
    forced = kinds[index] if index < len(kinds) else None
    desc = {"attn": gen_attn, "write": gen_write, "legacy": gen_legacy}[op](rng, space, forced)
    desc.update(op=op, index=index, fuzz_seed=seed)
    desc["class"] = kinds_class(desc["kinds"])
    return desc


def draw_kinds(rng: random.Random, forced: str | None, applicable) -> list[str]:
    if forced is not None:
        return [forced]
    r = rng.random()
    if r < 0.1:
        return ["clean"]
    if r < 0.15:
        return ["malformed"]
    return sorted(rng.sample(list(applicable), rng.randint(1, min(3, len(applicable)))))


def pick_kv(rng: random.Random, space: Space, fp8_share: float = 0.3) -> str:
    fp8 = [k for k in space.kv_cache_dtypes if k != "auto"]
    if fp8 and ("auto" not in space.kv_cache_dtypes or rng.random() < fp8_share):
        return rng.choice(fp8)
    return "auto"


def attn_lengths(rng: random.Random, small: bool) -> tuple[list[int], list[int]]:
    """Query and key lengths of a decode, prefill or mixed batch: total_q <= 300, keys <= 2048 a
    request (4096 in all); small: <= 48 rows and 300 keys."""
    q_cap, k_cap, k_total = (48, 300, 600) if small else (300, 2048, 4096)
    shape = rng.choice(("decode", "prefill", "mixed"))
    B = rng.randint(1, 8)
    k_cap = min(k_cap, k_total // B)
    lens_q, lens_k = [], []
    for _ in range(B):
        kind = shape if shape != "mixed" else rng.choice(("decode", "prefill"))
        if kind == "decode":  # 8 tokens x 4 query heads per KV head: multi-token decode (multi / multi_tma)
            lq = rng.choice((1, 1, 1, 2, 4, 8))
            lk = rng.randint(1, k_cap)
        else:
            lq = rng.randint(1, max(1, q_cap // B))
            lk = rng.randint(0, lq) if rng.random() < 0.1 else rng.randint(min(lq, k_cap), k_cap)
        lens_q.append(lq)
        lens_k.append(lk)
    return lens_q, lens_k


def prefix_sums(lens) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def clamp_spans(cu, total: int) -> list[tuple[int, int]]:
    """THE clamping rule of cu_seqlens: [clamp(cu[b], 0, total), clamp(cu[b+1], start, total))."""
    spans = []
    for b in range(len(cu) - 1):
        start = min(max(int(cu[b]), 0), total)
        spans.append((start, min(max(int(cu[b + 1]), start), total)))
    return spans


def corrupt_cu(rng: random.Random, cu: list[int], kind: str, total: int) -> None:
    """cu_seqlens corruption in place: nonmonotone, last_big, last_small, first_nonzero."""
    B = len(cu) - 1
    if kind == "nonmonotone":
        if B >= 2:
            i = rng.randint(1, B - 1)
            cu[i] = rng.choice((cu[i - 1] - rng.randint(1, 5), cu[i + 1] + rng.randint(1, 20)))
        else:
            cu[1] = cu[0] - rng.randint(1, 3)
    elif kind == "last_big":
        cu[-1] = total + (rng.randint(1, 64) if rng.random() < 0.9 else rng.choice((10**6, INT32_MAX - total)))
    elif kind == "last_small":
        cu[-1] = total - rng.randint(1, max(1, min(total, 20)))
    elif kind == "first_nonzero":
        cu[0] = rng.choice((rng.randint(1, 5), -rng.randint(1, 5), INT32_MIN))


def table_edits(rng: random.Random, kind: str, lens_k, bs: int, N: int, W: int) -> list[list[int]]:
    """1-3 corrupt block ids, mostly where a request reads them."""
    value = {"block_id_negative": lambda: rng.choice((-1, -rng.randint(2, 100), INT32_MIN)),
             "block_id_past_end": lambda: rng.choice((N, N + 1, N + rng.randint(2, 1000))),
             "block_id_int_max": lambda: INT32_MAX}[kind]
    edits = []
    for _ in range(rng.randint(1, 3)):
        b = rng.randrange(len(lens_k))
        used = -(-lens_k[b] // bs)
        j = rng.randrange(used) if used and rng.random() < 0.8 else rng.randrange(W)
        edits.append([b, j, value()])
    return edits


def gen_attn(rng: random.Random, space: Space, forced: str | None) -> dict:
    if forced in ATTN_CONTIG:
        mode = "contiguous"
    elif forced in ATTN_PAGED:
        mode = "paged"
    else:
        mode = "contiguous" if rng.random() < 0.2 else "paged"
    d = dict(mode=mode, dtype=rng.choice(space.dtypes), head_dim=rng.choice(space.head_dims),
             heads=list(rng.choice(HEADS)), block_size=rng.choice(BLOCK_SIZES), layout=rng.choice(("NHD", "HND")),
             kv=pick_kv(rng, space, 0.25), causal=rng.random() < 0.5, out_given=rng.random() < 0.5,
             num_splits=rng.choice(SPLITS), seed=rng.getrandbits(31), malformed=None, table_edits=[])
    if d["kv"] != "auto":
        d["k_descale"], d["v_descale"] = round(rng.uniform(0.3, 1.0), 3), round(rng.uniform(0.3, 1.0), 3)
    lens_q, lens_k = attn_lengths(rng, space.small)
    applicable = ATTN_HINT + ATTN_CU_Q + (ATTN_PAGED if mode == "paged" else ATTN_CONTIG)
    kinds = draw_kinds(rng, forced, applicable)
    B = len(lens_q)
    for name, lens in (("zero_len_q", lens_q), ("zero_len_k", lens_k)):
        if name in kinds:
            for b in rng.sample(range(B), rng.randint(1, B // 2 + 1)):
                lens[b] = 0
    d.update(lens_q=lens_q, lens_k=lens_k, kinds=kinds)
    total_q = sum(lens_q)
    cu_q = prefix_sums(lens_q)
    for kind in ATTN_CU_Q:
        if kind in kinds:
            corrupt_cu(rng, cu_q, kind[len("cu_q_"):], total_q)
    d["cu_q"] = cu_q
    if mode == "paged":
        keys = _gen_paged(rng, d, kinds)
    else:
        keys = _gen_contiguous(rng, d, kinds)
    if "malformed" in kinds:
        _gen_attn_malformed(rng, d)
    true_q = max([e - s for s, e in clamp_spans(cu_q, total_q)] + [0])
    true_k = max(keys + [0])
    d["max_seqlen_q"] = _hint(rng, kinds, "max_q", true_q)
    d["max_seqlen_k"] = _hint(rng, kinds, "max_k", true_k)
    if "splits_any" in kinds:
        d["num_splits"] = rng.randint(0, 300)
    return d


def _hint(rng, kinds, prefix: str, true: int) -> int:
    if prefix + "_small" in kinds:
        return rng.randint(1, true - 1) if true > 1 else 0
    if prefix + "_zero" in kinds:
        return 0
    if prefix + "_huge" in kinds:
        return rng.choice((10**6, 10**7, INT32_MAX))
    return true


def _gen_paged(rng, d, kinds) -> list[int]:
    """Table geometry, corrupt ids and seqused_k of a paged case; returns the clamped key counts."""
    bs, lens_k = d["block_size"], d["lens_k"]
    need = [-(-n // bs) for n in lens_k]
    W = max(need + [1]) + rng.randint(0, 2)
    N = sum(need) + rng.randint(1, 3)
    seqused = list(lens_k)
    for kind in ("block_id_negative", "block_id_past_end", "block_id_int_max"):
        if kind in kinds:
            d["table_edits"] += table_edits(rng, kind, lens_k, bs, N, W)
    if "seqused_past_table" in kinds:
        b = rng.randrange(len(seqused))
        seqused[b] = W * bs + rng.choice((1, rng.randint(2, 100), 10**6, INT32_MAX - W * bs))
    if "seqused_negative" in kinds:
        b = rng.randrange(len(seqused))
        seqused[b] = rng.choice((-1, -rng.randint(2, 1000), INT32_MIN))
    d.update(num_blocks=N, width=W, seqused=seqused)
    return [min(max(n, 0), W * bs) for n in seqused]


def _gen_contiguous(rng, d, kinds) -> list[int]:
    """cu_seqlens_k (and seqused_k) of a contiguous case; returns the clamped key counts."""
    lens_k = d["lens_k"]
    total_k = sum(lens_k)
    cu_k = prefix_sums(lens_k)
    if "cu_k_past_total" in kinds:
        if len(cu_k) > 2 and rng.random() < 0.4:
            cu_k[rng.randint(1, len(cu_k) - 2)] = total_k + rng.randint(1, 50)
        else:
            corrupt_cu(rng, cu_k, "last_big", total_k)
    if "cu_k_nonmonotone" in kinds:
        corrupt_cu(rng, cu_k, rng.choice(("nonmonotone", "first_nonzero")), total_k)
    seqused = None
    if "seqused_cap" in kinds:
        seqused = [rng.choice((n, n // 2, 0, -5, n + 100, INT32_MAX)) for n in lens_k]
    d.update(cu_k=cu_k, seqused=seqused)
    spans = clamp_spans(cu_k, total_k)
    return [e - s if seqused is None else min(e - s, max(seqused[b], 0)) for b, (s, e) in enumerate(spans)]


def _gen_attn_malformed(rng, d) -> None:
    options = [m for m, mode in ATTN_MALFORMED.items() if mode in (None, d["mode"])
               and (m != "no_descale" or d["kv"] != "auto")]
    d["malformed"] = rng.choice(options)
    if d["malformed"].startswith("out_"):
        d["out_given"] = True


def slot_edits(rng: random.Random, kinds, T: int, num_slots: int, int64: bool) -> list[list[int]]:
    """Corrupt slots: negative ones skip their token, ones past the cache must be skipped too."""
    edits = []
    if "slot_negative" in kinds:
        low = -2**63 if int64 else INT32_MIN
        for t in rng.sample(range(T), rng.randint(1, max(1, T // 4))):
            edits.append([t, rng.choice((-1, -rng.randint(2, 1000), low, -2**40 if int64 else -7))])
    if "slot_past_end" in kinds:
        for t in rng.sample(range(T), rng.randint(1, max(1, T // 4))):
            big = (2**40, 2**63 - 1) if int64 else (INT32_MAX,)
            edits.append([t, rng.choice((num_slots, num_slots + rng.randint(1, 100), INT32_MAX, *big))])
    return edits


def gen_write(rng: random.Random, space: Space, forced: str | None, layout: str | None = None) -> dict:
    """A reshape_and_cache_flash case (layout NHD/HND), or a legacy one when layout='legacy'."""
    is_legacy = layout == "legacy"
    kv = pick_kv(rng, space)
    H = rng.choice((1, 2, 8))
    d = dict(dtype=rng.choice(space.dtypes), kv=kv, layout=layout or rng.choice(("NHD", "HND")), heads=H,
             head_dim=rng.choice(_legacy_dims(space) if is_legacy else space.head_dims),
             block_size=rng.choice(LEGACY_BLOCK_SIZES if is_legacy else BLOCK_SIZES),
             scale="head" if kv != "auto" and not is_legacy and H > 1 and rng.random() < 0.5 else "tensor",
             source=rng.choice(("contiguous", "strided", "unaligned")), slot_dtype=rng.choice(("int64", "int32")),
             seed=rng.getrandbits(31), malformed=None)
    many = not space.small and not is_legacy and rng.random() < 0.1
    T = rng.randint(1024, 1400) if many else rng.randint(1, 64 if space.small else 300)
    kinds = draw_kinds(rng, forced, SLOT_KINDS)
    N = -(-T // d["block_size"]) + rng.randint(0, 3)
    d.update(tokens=T, padded_tokens=T + (rng.randint(1, 8) if "slot_padding" in kinds else 0), num_blocks=N,
             kinds=kinds, slot_edits=slot_edits(rng, kinds, T, N * d["block_size"], d["slot_dtype"] == "int64"))
    if "malformed" in kinds:
        options = [m for m in (LEGACY_WRITE_MALFORMED if is_legacy else WRITE_MALFORMED)
                   if m not in ("no_scale", "scale_shape") or kv != "auto"]
        d["malformed"] = rng.choice(options)
    return d


def _legacy_dims(space: Space) -> list[int]:
    return [x for x in space.head_dims if x in LEGACY_HEAD_DIMS] or [64]


def gen_legacy(rng: random.Random, space: Space, forced: str | None) -> dict:
    if forced in SLOT_KINDS or (forced is None and rng.random() < 0.25):
        d = gen_write(rng, space, forced, layout="legacy")
        d["kind"] = "write"
        return d
    d = dict(kind=rng.choice(LEGACY_VERSIONS), dtype=rng.choice(space.dtypes), kv=pick_kv(rng, space),
             head_dim=rng.choice(_legacy_dims(space)), heads=list(rng.choice(HEADS)),
             block_size=rng.choice(LEGACY_BLOCK_SIZES), seed=rng.getrandbits(31), malformed=None, table_edits=[])
    if d["kv"] != "auto":
        d["k_scale"], d["v_scale"] = round(rng.uniform(0.3, 1.0), 3), round(rng.uniform(0.3, 1.0), 3)
    S = rng.randint(1, 8)
    cap = 300 if space.small else 2000
    lens = [rng.choice((rng.randint(1, 64), rng.randint(1, min(600, cap)), rng.randint(min(500, cap), cap)))
            for _ in range(S)]
    kinds = draw_kinds(rng, forced, LEGACY_HINT + LEGACY_META)
    if "zero_len" in kinds:
        for s in rng.sample(range(S), rng.randint(1, S // 2 + 1)):
            lens[s] = 0
    bs = d["block_size"]
    need = [-(-n // bs) for n in lens]
    W, N = max(need + [1]) + rng.randint(0, 3), sum(need) + rng.randint(1, 3)
    seq_lens = list(lens)
    for kind in ("block_id_negative", "block_id_past_end", "block_id_int_max"):
        if kind in kinds:
            d["table_edits"] += table_edits(rng, kind, lens, bs, N, W)
    if "seq_len_negative" in kinds:
        seq_lens[rng.randrange(S)] = rng.choice((-1, -rng.randint(2, 1000), INT32_MIN))
    if "seq_len_past_table" in kinds:
        seq_lens[rng.randrange(S)] = W * bs + rng.choice((1, rng.randint(2, 500), 10**6, INT32_MAX - W * bs))
    max_seq_len = max(lens)
    if "max_seq_len_small" in kinds:
        max_seq_len = rng.randint(0, max(0, max_seq_len - 1))
    parts = legacy.num_partitions(max_seq_len) + (rng.randint(1, 3) if "extra_partitions" in kinds else 0)
    d.update(lens=lens, seq_lens=seq_lens, num_blocks=N, width=W, max_seq_len=max_seq_len, partitions=parts,
             kinds=kinds)
    if "malformed" in kinds:
        options = [m for m in LEGACY_MALFORMED if (m != "partials_small" or d["kind"] == "v2")
                   and (m != "no_scale" or d["kv"] != "auto")]
        d["malformed"] = rng.choice(options)
    return d


def describe(desc: dict) -> str:
    """One line naming a case, for tables and failure lists."""
    op = desc["op"]
    bits = [f"{op}#{desc['index']}", desc.get("mode") or desc.get("kind") or "", desc["dtype"],
            f"d{desc['head_dim']}", f"bs{desc['block_size']}", desc.get("layout", ""), desc["kv"]]
    if op == "attn":
        bits += [f"{desc['heads'][0]}x{desc['heads'][1]}", "causal" if desc["causal"] else "full",
                 f"splits{desc['num_splits']}"]
    bits.append("kinds=" + ",".join(desc["kinds"]) + (f"({desc['malformed']})" if desc.get("malformed") else ""))
    return " ".join(b for b in bits if b)


# ============================================================================ the ops under test
@dataclass
class Ops:
    """The callables under test; reference_ops() swaps in torch references (CPU self-test)."""
    attn: Callable
    write: Callable
    legacy_v1: Callable
    legacy_v2: Callable
    legacy_auto: Callable
    legacy_write: Callable
    after_attn: Callable | None = None      # an extra check after each attention call


def kernel_ops() -> Ops:
    return Ops(pagedattn.flash_attn_varlen_func, pagedattn.reshape_and_cache_flash, legacy.paged_attention_v1,
               legacy.paged_attention_v2, legacy.paged_attention, legacy.reshape_and_cache,
               after_attn=split_counters_problem)


def split_counters_problem() -> str | None:
    """The split-KV arrival counters must be zero between calls (else the next split call merges
    wrongly). Zeroes them again so that later cases stay independent of this one."""
    from pagedattn.ops import workspace

    for key, buf in workspace.counter_buffers().items():
        if bool(buf.any()):
            buf.zero_()
            return f"split-KV counters of {key} are not zero after the call"
    return None


# ============================================================================ running one case
@dataclass
class Case:
    desc: dict
    guards: dict                    # name -> Guarded: every tensor handed to the op
    call: Callable                  # () -> the op's return value
    outputs: tuple = ()             # guards the op may write inside (their margins are checked)
    expected: dict = field(default_factory=dict)


@dataclass
class Outcome:
    status: str                     # ok | refused | error
    value: object = None
    message: str = ""
    fatal: bool = False             # the CUDA context is unusable: stop this process


def cuda_broken(device) -> bool:
    """True once a sticky CUDA error poisons the context (every later call fails)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device=device).add_(1).item()
        return False
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return True


def invoke(call: Callable, device) -> Outcome:
    """Run the op and wait for it: a refusal, another exception, or a CUDA error at the sync."""
    try:
        value = call()
        sync(device)
        return Outcome("ok", value)
    except REFUSALS as exc:
        fatal = cuda_broken(device)    # a refusal must not follow a launch that broke the context
        return Outcome("error" if fatal else "refused", message=f"{type(exc).__name__}: {exc}", fatal=fatal)
    except Exception as exc:  # noqa: BLE001 - every other exception is a failure
        return Outcome("error", message=f"{type(exc).__name__}: {exc}", fatal=cuda_broken(device))


def untouched(case: Case, skip=()) -> list[str]:
    """Every guarded tensor not in `skip` bit-identical to its snapshot."""
    return [p for name, g in case.guards.items() if name not in skip for p in [g.changed()] if p]


def run_case(desc: dict, device="cuda", ops: Ops | None = None) -> dict:
    """One case: build, snapshot, call, check. Returns a result dict (status passed | refused | failed)."""
    ops = ops or kernel_ops()
    t0 = time.perf_counter()
    result = dict(op=desc["op"], index=desc["index"], kinds=desc["kinds"], cls=desc["class"])
    try:
        case = BUILDERS[(desc["op"], desc.get("kind") == "write")](desc, device, ops)
        status, message, fatal = _check(case, device, ops)
    except Exception:  # noqa: BLE001 - a harness error is reported as a failure of its case
        status, message, fatal = "failed", "harness error: " + traceback.format_exc(limit=6), cuda_broken(device)
    result.update(status=status, message=message[:2000], seconds=round(time.perf_counter() - t0, 4))
    if fatal:
        result["fatal"] = True
    if status == "failed":
        result["desc"] = desc
    return result


def _check(case: Case, device, ops: Ops) -> tuple[str, str, bool]:
    for g in case.guards.values():
        g.snapshot()
    sync(device)
    outcome = invoke(case.call, device)
    if outcome.fatal:
        return "failed", "CUDA error (context lost): " + outcome.message, True
    if outcome.status == "error":
        return "failed", "; ".join([outcome.message] + untouched(case)), False
    if outcome.status == "refused":
        problems = untouched(case)
        if problems:
            return "failed", f"refused ({outcome.message}) after writing: " + "; ".join(problems), False
        return "refused", outcome.message, False
    if case.desc.get("malformed"):
        return "failed", f"malformed input ({case.desc['malformed']}) was accepted", False
    problems = untouched(case, skip=case.outputs)
    problems += [p for name in case.outputs for p in [case.guards[name].damage()] if p]
    if not problems:
        problems = VERIFIERS[case.desc["op"], case.desc.get("kind") == "write"](case, outcome.value)
    if case.desc["op"] == "attn" and ops.after_attn is not None:
        problems += [p for p in [ops.after_attn()] if p]
    return ("failed", "; ".join(problems), False) if problems else ("passed", "", False)


# ============================================================================ attention: build, expect, compare
def block_table_rows(seed: int, lens_k, bs: int, N: int, W: int, edits) -> list[list[int]]:
    """Each request's blocks: distinct ids in random order; columns past them hold random valid ids
    (read when seqused_k points past the request's keys); then the corrupt entries."""
    rng = random.Random(seed)
    perm = list(range(N))
    rng.shuffle(perm)
    rows, start = [], 0
    for n in (-(-k // bs) for k in lens_k):
        rows.append(perm[start:start + n] + [rng.randrange(N) for _ in range(W - n)])
        start += n
    for b, j, value in edits:
        rows[b][j] = value
    return rows


def _overrun(cu, total: int) -> int:
    return min(max(max(cu) - total, 0), MAX_GUARD_ROWS)


def build_attn(desc: dict, device, ops: Ops) -> Case:
    gen = torch.Generator(device=device).manual_seed(desc["seed"])
    dtype, D, (Hq, Hkv) = DTYPES[desc["dtype"]], desc["head_dim"], desc["heads"]
    kv, fp8 = desc["kv"], desc["kv"] != "auto"
    total_q, row = sum(desc["lens_q"]), Hq * D
    pad_q = (_overrun(desc["cu_q"], total_q) + 64) * row
    g = {"q": Guarded("q", total_q * row, dtype, device, pad_q)}
    q = g["q"].view((total_q, Hq, D))
    fill_random(q, gen)
    cache_dtype = torch.uint8 if fp8 else dtype
    a = dict(q=q, max_seqlen_q=desc["max_seqlen_q"], max_seqlen_k=desc["max_seqlen_k"], causal=desc["causal"],
             return_softmax_lse=True, num_splits=desc["num_splits"], kv_cache_dtype=kv, out=None)
    if desc["mode"] == "paged":
        N, bs = desc["num_blocks"], desc["block_size"]
        shape = (N, bs, Hkv, D) if desc["layout"] == "NHD" else (N, Hkv, bs, D)
        for name in ("k", "v"):
            g[name] = Guarded(name, N * bs * Hkv * D, cache_dtype, device, max(2 * bs * Hkv * D, 4096))
            t = g[name].view(shape)
            a[name] = t if desc["layout"] == "NHD" else t.permute(0, 2, 1, 3)
            fill_random(a[name], gen, kv)
        rows = block_table_rows(desc["seed"], desc["lens_k"], bs, N, desc["width"], desc["table_edits"])
        g["block_table"], a["block_table"] = guarded_tensor("block_table", rows, torch.int32, device)
    else:
        total_k = sum(desc["lens_k"])
        pad_k = (_overrun(desc["cu_k"], total_k) + 64) * Hkv * D
        for name in ("k", "v"):
            g[name] = Guarded(name, total_k * Hkv * D, cache_dtype, device, pad_k)
            a[name] = g[name].view((total_k, Hkv, D))
            fill_random(a[name], gen, kv)
        g["cu_seqlens_k"], a["cu_seqlens_k"] = guarded_tensor("cu_seqlens_k", desc["cu_k"], torch.int32, device)
    if desc["seqused"] is not None:
        g["seqused_k"], a["seqused_k"] = guarded_tensor("seqused_k", desc["seqused"], torch.int32, device)
    g["cu_seqlens_q"], a["cu_seqlens_q"] = guarded_tensor("cu_seqlens_q", desc["cu_q"], torch.int32, device)
    if fp8:
        for name in ("k_descale", "v_descale"):
            g[name], a[name] = guarded_tensor(name, [desc[name]], torch.float32, device)
    if desc["out_given"]:
        g["out"] = Guarded("out", total_q * row, dtype, device, pad_q)
        a["out"] = g["out"].view((total_q, Hq, D))
    case = Case(desc, g, None, outputs=("out",) if desc["out_given"] else ())
    if desc["malformed"]:
        _malform_attn(desc["malformed"], a, g, device)
    else:
        case.expected["requests"] = expected_attention(
            q, a["k"], a["v"], a["cu_seqlens_q"], causal=desc["causal"], kv=kv, k_descale=a.get("k_descale"),
            v_descale=a.get("v_descale"), block_table=a.get("block_table"), seqused_k=a.get("seqused_k"),
            cu_seqlens_k=a.get("cu_seqlens_k"))
    case.call = lambda: ops.attn(**a)
    case.expected["args"] = a
    return case


def _malform_attn(kind: str, a: dict, g: dict, device) -> None:
    """Replace one argument by a tensor the validation must refuse (guarded too)."""
    def swap(arg, t):
        g[arg + "_bad"], a[arg] = guarded_tensor(arg + "_bad", t, t.dtype, device)

    if kind in ("table_int64", "seqused_int64", "cu_q_int64"):
        arg = {"table_int64": "block_table", "seqused_int64": "seqused_k", "cu_q_int64": "cu_seqlens_q"}[kind]
        swap(arg, a[arg].cpu().long())
    elif kind == "table_rows":
        swap("block_table", torch.cat([a["block_table"].cpu(), a["block_table"][:1].cpu()]))
    elif kind == "seqused_len":
        swap("seqused_k", torch.cat([a["seqused_k"].cpu(), torch.zeros(1, dtype=torch.int32)]))
    elif kind == "cu_k_len":
        swap("cu_seqlens_k", a["cu_seqlens_k"][:-1].cpu())
    elif kind == "out_dtype":
        g["out"] = Guarded("out", a["out"].numel(), torch.float32, device, 4096)
        a["out"] = g["out"].view(tuple(a["out"].shape))
    elif kind == "out_rows":
        shape = (a["out"].shape[0] + 1, *a["out"].shape[1:])
        g["out"] = Guarded("out", math.prod(shape), a["out"].dtype, device, 4096)
        a["out"] = g["out"].view(shape)
    elif kind == "q_fp32":
        swap("q", a["q"].cpu().float())
    elif kind == "no_descale":
        a["k_descale"] = None
    else:
        raise ValueError(f"unknown malformation {kind}")


@dataclass
class Request:
    """The expected result of one request with at least one query row."""
    b: int
    start: int
    stop: int
    out: torch.Tensor      # [rows, Hq, D] float32 (computed in float64)
    lse: torch.Tensor      # [Hq, rows]


def _per_head(descale, b: int, Hkv: int) -> torch.Tensor:
    """[Hkv] factors of request b from a [1], [Hkv] or [B, Hkv] descale."""
    d = descale.float()
    return d.reshape(1).expand(Hkv) if d.numel() == 1 else (d[b] if d.dim() == 2 else d.reshape(Hkv))


def _dequant(x: torch.Tensor, kv: str, descale) -> torch.Tensor:
    if kv == "auto":
        return x.float()
    return fp8_view(x, kv).float() * descale.reshape(1, -1, 1)


def expected_attention(q, k, v, cu_seqlens_q, *, causal: bool, softmax_scale=None, kv: str = "auto",
                       k_descale=None, v_descale=None, block_table=None, seqused_k=None,
                       cu_seqlens_k=None) -> list[Request]:
    """The clamping contract in plain torch, one Request per non-empty request. Paged: keys
    min(max(seqused_k[b], 0), W * block_size) through the table, corrupt ids pointing at an extra
    zero page; contiguous: the clamped cu_seqlens_k range, capped by seqused_k when given.
    The attention itself is pagedattn.reference.attention_rows (float64)."""
    total_q, Hq, D = q.shape
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    seqused = seqused_k.tolist() if seqused_k is not None else None
    if block_table is not None:
        N, bs, Hkv, _ = k.shape
        W = block_table.shape[1]
        zero = lambda c: torch.cat([c, c.new_zeros((1, bs, Hkv, D))])  # noqa: E731 - block N: the zero page
        kz, vz = zero(k), zero(v)
        ids = block_table.long()
        ids = torch.where((ids >= 0) & (ids < N), ids, torch.full_like(ids, N))
        lens = [min(max(n, 0), W * bs) for n in seqused]

        def keys(b):
            kd = _per_head(k_descale, b, Hkv) if kv != "auto" else None
            vd = _per_head(v_descale, b, Hkv) if kv != "auto" else None
            return (reference.gather_kv(kz, ids[b], lens[b], kv, kd),
                    reference.gather_kv(vz, ids[b], lens[b], kv, vd))
    else:
        Hkv = k.shape[1]
        spans = clamp_spans(cu_seqlens_k.tolist(), k.shape[0])

        def keys(b):
            s, e = spans[b]
            if seqused is not None:
                e = s + min(e - s, max(seqused[b], 0))
            kd = _per_head(k_descale, b, Hkv) if kv != "auto" else None
            vd = _per_head(v_descale, b, Hkv) if kv != "auto" else None
            return _dequant(k[s:e], kv, kd), _dequant(v[s:e], kv, vd)
    requests = []
    for b, (s, e) in enumerate(clamp_spans(cu_seqlens_q.tolist(), total_q)):
        if e > s:
            kb, vb = keys(b)
            o, lse = reference.attention_rows(q[s:e], kb, vb, scale, causal, torch.float64)
            requests.append(Request(b, s, e, o, lse))
    return requests


def rel_l2(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-6) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(floor))


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row of [rows, Hq, D] tensors (a floor for rows expected ~0)."""
    got, want = got.double().flatten(1), want.double().flatten(1)
    floor = 1e-3 * math.sqrt(max(want.shape[1], 1))
    return (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(floor)


def lse_problem(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """-inf exactly where the reference has -inf (rows without keys), close elsewhere."""
    empty = torch.isneginf(want)
    if not bool(torch.isneginf(got[empty]).all()):
        return "LSE is not -inf for a row without keys"
    if not bool(torch.isfinite(got[~empty]).all()):
        return "LSE is not finite for a row with keys"
    if not torch.allclose(got[~empty], want[~empty].float(), atol=LSE_ATOL, rtol=LSE_RTOL):
        return f"LSE differs by up to {float((got[~empty] - want[~empty]).abs().max()):.3g}"
    return None


def compare_attention(out: torch.Tensor, lse: torch.Tensor, requests: list[Request]) -> list[str]:
    """out/LSE against the expected requests. Rows of no request are not checked (unspecified); rows
    of two requests (non-monotone cu_seqlens_q) only need to be finite (two CTAs race on them, element
    by element, so a row may mix both); every other row must be its request's, within ATTN_TOL overall
    and ROW_TOL per row, whatever max_seqlen_q said (rows past the grid's row tiles: attn_fwd.cuh,
    attn_rows_past_grid)."""
    total_q = out.shape[0]
    owners = [[] for _ in range(total_q)]
    for r in requests:
        for i in range(r.stop - r.start):
            owners[r.start + i].append((r, i))
    covered = [row for row in range(total_q) if owners[row]]
    if not covered:
        return []
    idx = torch.tensor(covered, device=out.device)
    finite = torch.isfinite(out[idx].float()).flatten(1).all(1)
    if not bool(finite.all()):
        row = covered[int((~finite).nonzero()[0, 0])]
        return [f"non-finite output in row {row} (request {owners[row][0][0].b})"]
    unique = [row for row in covered if len(owners[row]) == 1]
    problems = []
    if unique:
        want = torch.stack([owners[row][0][0].out[owners[row][0][1]] for row in unique])
        want_lse = torch.stack([owners[row][0][0].lse[:, owners[row][0][1]] for row in unique], dim=1)
        ui = torch.tensor(unique, device=out.device)
        got = out[ui]
        err = rel_l2(got, want)
        if err > ATTN_TOL:
            problems.append(f"output relative L2 error {err:.3g} > {ATTN_TOL}")
        errs = row_errors(got, want)
        worst = int(errs.argmax())
        if float(errs[worst]) > ROW_TOL:
            row = unique[worst]
            problems.append(f"row {row} (request {owners[row][0][0].b}) relative error {float(errs[worst]):.3g}"
                            f" > {ROW_TOL}")
        p = lse_problem(lse[:, ui], want_lse)
        if p:
            problems.append(p)
    return problems


def verify_attn(case: Case, value) -> list[str]:
    a = case.expected["args"]
    if not (isinstance(value, tuple) and len(value) == 2):
        return [f"return_softmax_lse=True returned {type(value).__name__}, not (out, lse)"]
    out, lse = value
    q = a["q"]
    if a["out"] is not None and out is not a["out"]:
        return ["out= was given but another tensor was returned"]
    if out.shape != q.shape or out.dtype != q.dtype:
        return [f"out has shape {tuple(out.shape)} {out.dtype}, q {tuple(q.shape)} {q.dtype}"]
    if tuple(lse.shape) != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32:
        return [f"LSE has shape {tuple(lse.shape)} {lse.dtype}, want ({q.shape[1]}, {q.shape[0]}) float32"]
    return compare_attention(out, lse, case.expected["requests"])


# ============================================================================ writers: build, expect
def write_inputs(desc: dict, gen, device) -> tuple[Guarded, torch.Tensor, torch.Tensor]:
    """key/value [T_pad, H, D] from one guarded source: contiguous, slices of a fused QKV tensor, or
    with base pointers off 16-byte alignment."""
    dtype, H, D, Tp = DTYPES[desc["dtype"]], desc["heads"], desc["head_dim"], desc["padded_tokens"]
    if desc["source"] == "strided":
        g = Guarded("key/value", Tp * 3 * H * D, dtype, device)
        qkv = g.view((Tp, 3 * H, D))
        key, value = qkv[:, H:2 * H], qkv[:, 2 * H:]
    else:
        n = Tp * H * D
        off = 1 if desc["source"] == "unaligned" else 0
        g = Guarded("key/value", 2 * n + off, dtype, device)
        flat = g.flat()
        key, value = flat[off:off + n].view(Tp, H, D), flat[off + n:off + 2 * n].view(Tp, H, D)
    fill_random(key, gen)
    fill_random(value, gen)
    mag = torch.where(torch.rand((Tp, H, 1), generator=gen, device=device) < 0.1, 300.0, 1.0)
    key.mul_(mag.to(dtype))   # some beyond the fp8 range: saturation
    value.mul_(mag.to(dtype))
    return g, key, value


def write_slots(desc: dict, num_slots: int) -> list[int]:
    """Distinct valid slots (a permutation), then the corrupt ones."""
    rng = random.Random(desc["seed"])
    slots = rng.sample(range(num_slots), desc["tokens"])
    for t, value in desc["slot_edits"]:
        slots[t] = value
    return slots


def _random_bytes(g: Guarded, gen) -> None:
    """Arbitrary cache contents: every slot the writer must leave alone keeps its random bits."""
    flat = g.flat().view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), generator=gen, device=flat.device, dtype=torch.uint8))


def build_write(desc: dict, device, ops: Ops) -> Case:
    """reshape_and_cache_flash (NHD/HND) or legacy reshape_and_cache: the expected caches are the
    reference writer applied to a copy, with slots outside [0, num_slots) skipped."""
    gen = torch.Generator(device=device).manual_seed(desc["seed"])
    kv, H, D, bs, N = desc["kv"], desc["heads"], desc["head_dim"], desc["block_size"], desc["num_blocks"]
    is_legacy = desc["layout"] == "legacy"
    g = {}
    g["key/value"], key, value = write_inputs(desc, gen, device)
    cache_dtype = torch.uint8 if kv != "auto" else DTYPES[desc["dtype"]]
    x = 16 // cache_dtype.itemsize
    if is_legacy:
        shapes = {"key_cache": (N, H, D // x, bs, x), "value_cache": (N, H, D, bs)}
        views = {name: (lambda buf, gd, s=s: gd.view(s, buf)) for name, s in shapes.items()}
    else:
        shape = (N, bs, H, D) if desc["layout"] == "NHD" else (N, H, bs, D)
        perm = (0, 1, 2, 3) if desc["layout"] == "NHD" else (0, 2, 1, 3)
        views = {name: (lambda buf, gd: gd.view(shape, buf).permute(*perm)) for name in ("key_cache", "value_cache")}
    caches = {}
    for name in ("key_cache", "value_cache"):
        g[name] = Guarded(name, N * bs * H * D, cache_dtype, device, max(2 * bs * H * D, 4096))
        _random_bytes(g[name], gen)
        caches[name] = views[name](None, g[name])
    slots = write_slots(desc, N * bs)
    slot_dtype = torch.int64 if desc["slot_dtype"] == "int64" else torch.int32
    g["slot_mapping"], slot_t = guarded_tensor("slot_mapping", slots, slot_dtype, device)
    scales = [None, None]
    if kv != "auto":
        n = H if desc["scale"] == "head" else 1
        for i, name in enumerate(("k_scale", "v_scale")):
            vals = (torch.rand(n, generator=gen, device=device) * 0.05 + 0.01).cpu()
            g[name], scales[i] = guarded_tensor(name, vals, torch.float32, device)
    args = [key, value, caches["key_cache"], caches["value_cache"], slot_t, kv, *scales]
    case = Case(desc, g, None, outputs=("key_cache", "value_cache"))
    if desc["malformed"]:
        _malform_write(desc["malformed"], args, g, device)
    else:
        want = {name: g[name].buf.clone() for name in caches}
        keep = (slot_t >= 0) & (slot_t < N * bs)
        valid = torch.where(keep, slot_t.long(), torch.full_like(slot_t.long(), -1))
        wk, wv = (views[name](want[name], g[name]) for name in ("key_cache", "value_cache"))
        if is_legacy:
            legacy_reference.reshape_and_cache(key, value, wk, wv, valid, kv, *scales)
        else:
            reference.reshape_and_cache_flash(key, value, wk, wv, valid, kv, *scales)
        case.expected["caches"] = want
    fn = ops.legacy_write if is_legacy else ops.write
    case.call = lambda: fn(*args)
    return case


def _malform_write(kind: str, args: list, g: dict, device) -> None:
    key, slots = args[0], args[4]
    if kind == "slots_too_many":
        extra = torch.cat([slots.cpu(), torch.zeros(key.shape[0] + 1 - slots.numel(), dtype=slots.dtype)])
        g["slot_mapping_bad"], args[4] = guarded_tensor("slot_mapping_bad", extra, slots.dtype, device)
    elif kind == "slot_float":
        g["slot_mapping_bad"], args[4] = guarded_tensor("slot_mapping_bad", slots.cpu().float(), torch.float32, device)
    elif kind == "slot_2d":
        args[4] = slots.view(-1, 1)
    elif kind == "kv_tokens_differ":
        args[1] = args[1][:-1]
    elif kind == "no_scale":
        args[6] = None
    elif kind == "scale_shape":
        n = key.shape[1] + 1
        for i, name in ((6, "k_scale_bad"), (7, "v_scale_bad")):
            g[name], args[i] = guarded_tensor(name, torch.full((n,), 0.02), torch.float32, device)
    else:
        raise ValueError(f"unknown malformation {kind}")


def verify_write(case: Case, value) -> list[str]:
    return [p for name, want in case.expected["caches"].items() for p in [case.guards[name].diff(want)] if p]


# ============================================================================ legacy attention: build, expect
def legacy_version(desc: dict) -> str:
    """v1 or v2: what the call runs ('auto' by vLLM's rule)."""
    if desc["kind"] != "auto":
        return desc["kind"]
    S, Hq = len(desc["lens"]), desc["heads"][0]
    return "v1" if legacy.use_v1(S, Hq, desc["max_seq_len"]) else "v2"


def legacy_capacity(desc: dict) -> int:
    """Tokens a sequence can reach: the table (max_seq_len is a hint, also for v2)."""
    return desc["width"] * desc["block_size"]


def build_legacy(desc: dict, device, ops: Ops) -> Case:
    gen = torch.Generator(device=device).manual_seed(desc["seed"])
    dtype, kv, D, (Hq, Hkv) = DTYPES[desc["dtype"]], desc["kv"], desc["head_dim"], desc["heads"]
    bs, N, W, S = desc["block_size"], desc["num_blocks"], desc["width"], len(desc["lens"])
    cache_dtype = torch.uint8 if kv != "auto" else dtype
    x = 16 // cache_dtype.itemsize
    g, t = {}, {}
    for name, shape in (("key_cache", (N, Hkv, D // x, bs, x)), ("value_cache", (N, Hkv, D, bs))):
        g[name] = Guarded(name, N * Hkv * D * bs, cache_dtype, device, max(2 * Hkv * D * bs, 4096))
        t[name] = g[name].view(shape)
        fill_random(t[name], gen, kv)
    for name in ("query", "out"):
        g[name] = Guarded(name, S * Hq * D, dtype, device)
        t[name] = g[name].view((S, Hq, D))
    fill_random(t["query"], gen)
    rows = block_table_rows(desc["seed"], desc["lens"], bs, N, W, desc["table_edits"])
    g["block_tables"], t["block_tables"] = guarded_tensor("block_tables", rows, torch.int32, device)
    g["seq_lens"], t["seq_lens"] = guarded_tensor("seq_lens", desc["seq_lens"], torch.int32, device)
    t["k_scale"] = t["v_scale"] = None
    if kv != "auto":
        for name in ("k_scale", "v_scale"):
            g[name], t[name] = guarded_tensor(name, [desc[name]], torch.float32, device)
    outputs = ["out"]
    if desc["kind"] == "v2":
        P = desc["partitions"]
        for name, shape, dt in (("exp_sums", (S, Hq, P), torch.float32), ("max_logits", (S, Hq, P), torch.float32),
                                ("tmp_out", (S, Hq, P, D), dtype)):
            g[name] = Guarded(name, math.prod(shape), dt, device)
            t[name] = g[name].view(shape)
            outputs.append(name)
    a = dict(num_kv_heads=Hkv, scale=D ** -0.5, block_size=bs, max_seq_len=desc["max_seq_len"])
    case = Case(desc, g, None, outputs=tuple(outputs))
    if desc["malformed"]:
        _malform_legacy(desc["malformed"], t, a, g, device)
    else:
        case.expected["out"] = legacy_reference.paged_attention(
            t["query"], t["key_cache"], t["value_cache"], Hkv, a["scale"], t["block_tables"], t["seq_lens"], None,
            kv, t["k_scale"], t["v_scale"], max_tokens=legacy_capacity(desc))
    case.expected["out_tensor"] = t["out"]

    def call():
        common = (t["query"], t["key_cache"], t["value_cache"], a["num_kv_heads"], a["scale"], t["block_tables"],
                  t["seq_lens"], a["block_size"], a["max_seq_len"], None, kv, t["k_scale"], t["v_scale"])
        if desc["kind"] == "v1":
            return ops.legacy_v1(t["out"], *common)
        if desc["kind"] == "v2":
            return ops.legacy_v2(t["out"], t["exp_sums"], t["max_logits"], t["tmp_out"], *common)
        return ops.legacy_auto(t["out"], *common)
    case.call = call
    return case


def _malform_legacy(kind: str, t: dict, a: dict, g: dict, device) -> None:
    if kind == "table_int64":
        g["block_tables_bad"], t["block_tables"] = guarded_tensor("block_tables_bad", t["block_tables"].cpu().long(),
                                                                  torch.int64, device)
    elif kind == "seq_lens_len":
        longer = torch.cat([t["seq_lens"].cpu(), torch.ones(1, dtype=torch.int32)])
        g["seq_lens_bad"], t["seq_lens"] = guarded_tensor("seq_lens_bad", longer, torch.int32, device)
    elif kind == "out_shape":
        S, Hq, D = t["out"].shape
        g["out"] = Guarded("out", (S + 1) * Hq * D, t["out"].dtype, device)
        t["out"] = g["out"].view((S + 1, Hq, D))
    elif kind == "max_seq_len_past_table":
        a["max_seq_len"] = t["block_tables"].shape[1] * a["block_size"] + 1
    elif kind == "partials_small":
        S, Hq, P = t["exp_sums"].shape
        for name in ("exp_sums", "max_logits"):
            g[name] = Guarded(name, S * Hq * (P - 1), torch.float32, device)
            t[name] = g[name].view((S, Hq, P - 1))
    elif kind == "no_scale":
        t["k_scale"] = None
    elif kind == "block_size_arg":
        a["block_size"] *= 2
    elif kind == "num_kv_heads_arg":
        a["num_kv_heads"] += 1
    else:
        raise ValueError(f"unknown malformation {kind}")


def compare_legacy(out: torch.Tensor, want: torch.Tensor, tol: float) -> list[str]:
    """Per sequence: relative L2 error <= tol; exactly zero where the reference is (nothing visible)."""
    if not bool(torch.isfinite(out.float()).all()):
        s = int((~torch.isfinite(out.float())).flatten(1).any(1).nonzero()[0, 0])
        return [f"non-finite output for sequence {s}"]
    for s in range(out.shape[0]):
        if float(want[s].norm()) == 0.0:
            if bool(out[s].any()):
                return [f"sequence {s} sees no token but its output is not zero"]
        elif rel_l2(out[s], want[s]) > tol:
            return [f"sequence {s}: relative L2 error {rel_l2(out[s], want[s]):.3g} > {tol}"]
    return []


def verify_legacy(case: Case, value) -> list[str]:
    desc = case.desc
    problems = []
    if desc["kind"] == "auto" and value != legacy_version(desc):
        problems.append(f"paged_attention ran {value!r}, vLLM's rule says {legacy_version(desc)!r}")
    tol = LEGACY_TOL[DTYPES[desc["dtype"]]]
    return problems + compare_legacy(case.expected["out_tensor"], case.expected["out"], tol)


BUILDERS = {("attn", False): build_attn, ("write", False): build_write, ("legacy", False): build_legacy,
            ("legacy", True): build_write}
VERIFIERS = {("attn", False): verify_attn, ("write", False): verify_write, ("legacy", False): verify_legacy,
             ("legacy", True): verify_write}


# ============================================================================ references in place of the kernels
def reference_ops() -> Ops:
    """Torch implementations of the contract, behind the real Python validation: the harness's own
    self-test (CPU), and what the tests sabotage to see the harness catch each kind of defect."""
    from pagedattn.ops import attention as attention_ops
    from pagedattn.ops import kv_write, legacy_attention, legacy_cache

    def cpu_ok(check):
        try:
            return check()
        except ContractError as exc:
            if "runs on CUDA tensors" not in str(exc):
                raise
            return None

    def attn(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
             softmax_scale=None, causal=False, block_table=None, return_softmax_lse=False, out=None, num_splits=0,
             k_descale=None, v_descale=None, kv_cache_dtype=None):
        cpu_ok(lambda: attention_ops.validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out,
                                              kv_cache_dtype, k_descale, v_descale))
        kv = kv_cache_dtype if k.dtype == torch.uint8 else "auto"
        res = torch.empty_like(q) if out is None else out
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
        for r in expected_attention(q, k, v, cu_seqlens_q, causal=causal, softmax_scale=softmax_scale, kv=kv,
                                    k_descale=k_descale, v_descale=v_descale, block_table=block_table,
                                    seqused_k=seqused_k, cu_seqlens_k=cu_seqlens_k):
            res[r.start:r.stop] = r.out.to(q.dtype)
            lse[:, r.start:r.stop] = r.lse
        return (res, lse) if return_softmax_lse else res

    def write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None, v_scale=None):
        gran = "head" if isinstance(k_scale, torch.Tensor) and k_scale.numel() > 1 else "tensor"
        spec = CacheSpec.from_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype, scale=gran)
        kv_write.validate_inputs(spec, key, value, key_cache, slot_mapping, k_scale, v_scale)
        s = slot_mapping.long()
        s = torch.where(s < spec.num_slots, s, torch.full_like(s, -1))
        reference.reshape_and_cache_flash(key, value, key_cache, value_cache, s, kv_cache_dtype, k_scale, v_scale)

    def legacy_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None,
                     v_scale=None):
        spec = CacheSpec.from_legacy_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype)
        legacy_cache.validate_inputs(spec, key, value, key_cache, slot_mapping, k_scale, v_scale)
        legacy_reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                           k_scale, v_scale)

    def attend(version, out, partials, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=None, v_scale=None):
        call = legacy_attention.check_call(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                           seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                                           k_scale, v_scale)
        if version == "auto":
            version = "v1" if legacy.use_v1(query.shape[0], query.shape[1], max_seq_len) else "v2"
        if partials is not None:
            legacy_attention.check_partials(call, *partials)
        cap = block_tables.shape[1] * block_size
        out.copy_(legacy_reference.paged_attention(query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                                   seq_lens, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                                                   max_tokens=cap).to(out.dtype))
        return version

    return Ops(attn, write,
               lambda out, *a, **kw: attend("v1", out, None, *a, **kw) and None,
               lambda out, es, ml, tmp, *a, **kw: attend("v2", out, (es, ml, tmp), *a, **kw) and None,
               lambda out, *a, **kw: attend("auto", out, None, *a, **kw),
               legacy_write)


# ============================================================================ running many cases
def op_counts(total: int, ops) -> dict[str, int]:
    """--cases split over the selected ops by OP_WEIGHTS (3:1:1), each at least 1."""
    weight = sum(OP_WEIGHTS[o] for o in ops)
    counts = {o: max(1, total * OP_WEIGHTS[o] // weight) for o in ops}
    counts[ops[0]] += max(0, total - sum(counts.values()))
    return counts


def run_in_process(op: str, seed: int, indices, space: Space, device="cuda", ops: Ops | None = None,
                   emit: Callable | None = None) -> list[dict]:
    """Cases of one op in this process; stops after a fatal one (its CUDA context is gone)."""
    results = []
    for i in indices:
        if emit:
            emit(f"BEGIN {i}")
        r = run_case(generate_case(op, seed, i, space), device, ops)
        results.append(r)
        if emit:
            emit("RESULT " + json.dumps(r))
        if r.get("fatal"):
            break
    return results


def worker_command(op: str, start: int, stop: int, args) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", op, "--start", str(start), "--stop",
           str(stop), "--seed", str(args.seed), "--device", args.device, "--dtypes", ",".join(args.space.dtypes),
           "--head-dims", ",".join(map(str, args.space.head_dims)),
           "--kv-cache-dtypes", ",".join(args.space.kv_cache_dtypes)]
    return cmd + (["--small"] if args.space.small else [])


def _lines(proc, q: queue.Queue) -> None:
    for line in proc.stdout:
        q.put(line.rstrip("\n"))
    q.put(None)


def run_children(op: str, n: int, command: Callable[[int, int], list[str]], case_timeout: float = 300.0,
                 max_crashes: int = 20, log=print) -> list[dict]:
    """Cases 0..n-1 of `op` in child processes (`command(start, stop)` starts one; it prints
    `BEGIN i` before and `RESULT <json>` after each case). A child that dies or prints nothing for
    case_timeout seconds is killed and its case recorded as failed; a new child resumes after it."""
    results, next_i, crashes = [], 0, 0
    while next_i < n:
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(command(next_i, n), stdout=subprocess.PIPE, stderr=err, text=True)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_lines, args=(proc, lines), daemon=True).start()
            inflight, progressed, hung = None, False, False
            while True:
                try:
                    line = lines.get(timeout=case_timeout)
                except queue.Empty:
                    hung = True
                    proc.kill()
                    break
                if line is None:
                    break
                if line.startswith("BEGIN "):
                    inflight = int(line.split()[1])
                elif line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    results.append(r)
                    next_i, inflight, progressed = r["index"] + 1, None, True
                    if r["status"] == "failed":
                        log(f"  FAILED {op}#{r['index']}: {r['message'][:300]}")
            rc = proc.wait()
            err.seek(0)
            tail = err.read()[-1500:]
        if inflight is not None:
            why = f"no progress for {case_timeout:.0f} s (hang?)" if hung else f"worker died (exit status {rc})"
            desc = generate_case_safe(op, inflight, command)
            results.append(dict(op=op, index=inflight, status="failed", fatal=True, message=f"{why}; stderr: {tail}",
                                kinds=desc.get("kinds", []), cls=desc.get("class", ""), desc=desc))
            log(f"  FAILED {op}#{inflight}: {why}")
            next_i, crashes = inflight + 1, crashes + 1
        elif rc != 0 and not progressed:
            results.append(dict(op=op, index=next_i, status="failed", fatal=True, kinds=[], cls="",
                                message=f"worker failed to start (exit status {rc}): {tail}"))
            log(f"  worker for {op} failed to start: {tail[-500:]}")
            break
        elif rc == 0 and next_i < n:
            log(f"  worker for {op} stopped early at case {next_i}")
            break
        else:
            crashes += rc != 0
        if crashes > max_crashes:
            log(f"  {op}: {crashes} crashed workers, giving up at case {next_i}")
            break
    return results


def generate_case_safe(op, index, command) -> dict:
    """The description of a case that killed its worker (regenerated from the worker's arguments)."""
    try:
        cmd = command(index, index + 1)
        seed = int(cmd[cmd.index("--seed") + 1])
        return generate_case(op, seed, index, _space_from_cmd(cmd))
    except Exception:  # noqa: BLE001 - a stand-in worker (tests) may not carry these arguments
        return {}


def _space_from_cmd(cmd: list[str]) -> Space:
    def arg(name, default):
        return cmd[cmd.index(name) + 1] if name in cmd else default
    return Space(tuple(arg("--dtypes", "bf16,fp16").split(",")),
                 tuple(int(x) for x in arg("--head-dims", "64,128,72").split(",")),
                 tuple(arg("--kv-cache-dtypes", "auto,fp8_e4m3").split(",")), "--small" in cmd)


# ============================================================================ results
def machine_info(device) -> dict:
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, pagedattn=pagedattn.__version__,
                commit=git_commit(), date=date.today().isoformat(), device=str(device),
                aot_dir=os.environ.get("PAGEDATTN_AOT_DIR"),
                no_cuda_memory_caching=os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"))
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info.update(gpu="cpu", driver=None)
    return info


def git_commit() -> str | None:
    """$PAGEDATTN_GIT_COMMIT (set where .git does not travel), else the checkout this script is in
    (pagedattn.info.git_commit looks beside the installed package, usually not a checkout)."""
    if os.environ.get("PAGEDATTN_GIT_COMMIT"):
        return os.environ["PAGEDATTN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def first_words(message: str, n: int = 4) -> str:
    """The histogram key of a refusal: exception type and the first words of its message."""
    return " ".join(message.split()[:n])


def summarize(results: list[dict], requested: dict[str, int]) -> dict:
    per_op = {}
    for op, n in requested.items():
        rs = [r for r in results if r["op"] == op]
        refused, kinds = {}, {}
        for r in rs:
            if r["status"] == "refused":
                key = first_words(r["message"])
                refused[key] = refused.get(key, 0) + 1
            for k in r.get("kinds", []):
                entry = kinds.setdefault(k, {"cases": 0, "failed": 0})
                entry["cases"] += 1
                entry["failed"] += r["status"] == "failed"
        failures = [r for r in rs if r["status"] == "failed"]
        per_op[op] = dict(requested=n, cases=len(rs), passed=sum(r["status"] == "passed" for r in rs),
                          refused=sum(r["status"] == "refused" for r in rs), failed=len(failures),
                          not_run=max(0, n - len({r["index"] for r in rs})),
                          refused_by=dict(sorted(refused.items(), key=lambda kv: -kv[1])),
                          by_class={c: sum(r.get("cls") == c for r in rs)
                                    for c in ("clean", "hint", "meta", "malformed")},
                          kinds=kinds, seconds=round(sum(r.get("seconds", 0) for r in rs), 2),
                          failures=[dict(index=r["index"], message=r["message"], case=describe(r["desc"])
                                         if r.get("desc") else "", desc=r.get("desc")) for r in failures])
    return per_op


def print_table(per_op: dict, log=print) -> None:
    log(f"{'op':8s} {'cases':>6s} {'passed':>7s} {'refused':>8s} {'failed':>7s} {'not run':>8s} {'seconds':>8s}")
    for op, s in per_op.items():
        log(f"{op:8s} {s['cases']:6d} {s['passed']:7d} {s['refused']:8d} {s['failed']:7d} {s['not_run']:8d} "
            f"{s['seconds']:8.1f}")
    for op, s in per_op.items():
        for key, n in list(s["refused_by"].items())[:5]:
            log(f"  {op} refused {n:4d}x: {key}")
        for f in s["failures"][:10]:
            log(f"  {op} FAILED {f['case'] or f['index']}: {f['message'][:240]}")


def write_results(out_dir: str, meta: dict, per_op: dict, sanitize: bool) -> Path:
    gpu = (meta.get("gpu") or "cpu").replace(" ", "_").lower()
    commit = (meta.get("commit") or "nocommit")[:12]
    name = f"fuzz_metadata{'_sanitize' if sanitize else ''}_{gpu}_{meta['date'].replace('-', '')}_{commit}.json"
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    path = path / name
    path.write_text(json.dumps(dict(kind="fuzz_metadata", metadata=meta, ops=per_op), indent=1))
    return path


# ============================================================================ variants and command line
def kernel_specs(space: Space = Space()) -> list:
    """The KernelSpecs this space can launch (KERNEL_VARIANTS narrowed to the space)."""
    from pagedattn.ops.attention import MODES, AttnFwdSpec
    from pagedattn.ops.kv_write import KvWriteSpec
    from pagedattn.ops.legacy_attention import LegacyAttentionSpec, LegacyReduceSpec
    from pagedattn.ops.legacy_cache import LegacyCacheWriteSpec

    dims = {KERNEL_HEAD_DIM[d] for d in space.head_dims}
    ldims = set(_legacy_dims(space))
    specs = []

    def add(cls, *fields, serves=lambda spec: True):
        try:
            spec = cls(*fields)
        except UnsupportedError:
            return  # a mode that does not exist for these fields
        if getattr(spec, "dispatched", True) and serves(spec):  # not the forced-only ones (AttnFwdSpec.dispatched)
            specs.append(spec)
    for t, kv, d in KERNEL_VARIANTS["attn_fwd"]:
        if t in space.dtypes and kv in space.kv_cache_dtypes:
            for mode in MODES:  # what plans of the space's head sizes launch (72: d80, its prefills at 128)
                add(AttnFwdSpec, t, kv, d, mode, serves=lambda spec: any(map(spec.serves_head_size, space.head_dims)))
    for t, kv in KERNEL_VARIANTS["kv_write"]:
        if t in space.dtypes and kv in space.kv_cache_dtypes:
            for path in KvWriteSpec.SUPPORTED["path"]:
                add(KvWriteSpec, t, kv, path)
    for t, kv, d, bs in KERNEL_VARIANTS["legacy_attn"]:
        if t in space.dtypes and kv in space.kv_cache_dtypes and d in ldims:
            add(LegacyAttentionSpec, t, kv, d, bs)
    for t, d in KERNEL_VARIANTS["legacy_reduce"]:
        if t in space.dtypes and d in ldims:
            add(LegacyReduceSpec, t, d)
    for t, kv in KERNEL_VARIANTS["legacy_cache_write"]:
        if t in space.dtypes and kv in space.kv_cache_dtypes:
            add(LegacyCacheWriteSpec, t, kv)
    return specs


def precompile_command(space: Space = Space()) -> str:
    heads = sorted({KERNEL_HEAD_DIM[d] for d in space.head_dims} | set(_legacy_dims(space)))
    return ("pagedattn precompile --arch sm_90a --ops attn_fwd,kv_write,legacy_attn,legacy_reduce,"
            f"legacy_cache_write --dtypes {','.join(space.dtypes)} --kv-cache-dtypes "
            f"{','.join(space.kv_cache_dtypes)} --head-sizes {','.join(map(str, heads))} --jobs 16 --out DIR")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="total cases, split 3:1:1 over attn, write, legacy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the results JSON")
    p.add_argument("--ops", default="attn,write,legacy")
    p.add_argument("--sanitize", action="store_true",
                   help="~40 small cases (every kind once) in this process, for compute-sanitizer memcheck")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--kv-cache-dtypes", default=",".join(KV_CACHE_DTYPES))
    p.add_argument("--small", action="store_true", help="small cases (as --sanitize uses)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu: the harness against the torch references")
    p.add_argument("--in-process", action="store_true", help="no child processes (stops at a sticky CUDA error)")
    p.add_argument("--case-timeout", type=float, default=300.0,
                   help="seconds without progress before a child is killed")
    p.add_argument("--replay", metavar="JSON", help="a case description, or a results file (its failures), to rerun")
    p.add_argument("--list-variants", action="store_true", help="print the kernel variants and the precompile command")
    p.add_argument("--worker", metavar="OP", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"--ops: unknown {bad}; choose from {OPS}")
    args.space = Space(tuple(args.dtypes.split(",")), tuple(int(x) for x in args.head_dims.split(",")),
                       tuple(args.kv_cache_dtypes.split(",")), args.small or args.sanitize)
    for value, allowed, flag in ((args.space.dtypes, DTYPES, "--dtypes"),
                                 (args.space.head_dims, HEAD_DIMS, "--head-dims"),
                                 (args.space.kv_cache_dtypes, KV_CACHE_DTYPES, "--kv-cache-dtypes")):
        if not value or any(v not in allowed for v in value):
            p.error(f"{flag}: choose from {', '.join(map(str, allowed))}")
    return args


def replay(path_or_json: str, device, ops: Ops) -> int:
    inline = path_or_json.lstrip()[:1] in ("{", "[")
    text = path_or_json if inline else Path(path_or_json).read_text()
    data = json.loads(text)
    if isinstance(data, dict) and "ops" in data:
        descs = [f["desc"] for s in data["ops"].values() for f in s["failures"] if f.get("desc")]
    else:
        descs = data if isinstance(data, list) else [data]
    failed = 0
    for desc in descs:
        r = run_case(desc, device, ops)
        failed += r["status"] == "failed"
        print(f"{r['status']:8s} {describe(desc)} {r['message'][:400]}")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    debug_was = os.environ.pop("PAGEDATTN_DEBUG", None)   # its host-side checks would hide what the kernels do
    if args.sanitize:   # one cudaMalloc per tensor: memcheck then also sees overruns of the LSE and workspaces
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    device = torch.device(args.device)
    ops = reference_ops() if device.type == "cpu" else kernel_ops()
    if args.list_variants:
        for spec in kernel_specs(args.space):
            print(pagedattn.variant_name(spec))
        print(precompile_command(args.space))
        return 0
    if args.worker:
        emit = lambda line: print(line, flush=True)  # noqa: E731
        results = run_in_process(args.worker, args.seed, range(args.start, args.stop), args.space, device, ops, emit)
        return 3 if results and results[-1].get("fatal") else 0
    if args.replay:
        return replay(args.replay, device, ops)
    if args.sanitize:
        counts = {op: len(KINDS[op]) for op in args.ops}
    else:
        counts = op_counts(args.cases, args.ops)
    print(f"fuzz_metadata: seed {args.seed}, cases {counts}, device {device}", flush=True)
    results, t0 = [], time.perf_counter()
    for op, n in counts.items():
        if args.sanitize or args.in_process:
            rs = run_in_process(op, args.seed, range(n), args.space, device, ops)
        else:
            rs = run_children(op, n, lambda a, b, op=op: worker_command(op, a, b, args), args.case_timeout)
        results += rs
        print(f"{op}: {len(rs)} cases in {time.perf_counter() - t0:.1f} s", flush=True)
        if rs and rs[-1].get("fatal") and (args.sanitize or args.in_process):
            print("stopping: the CUDA context is lost", flush=True)
            break
    meta = machine_info(device)
    meta.update(pagedattn_debug_unset=debug_was, seed=args.seed, requested=counts, ops=args.ops,
                sanitize=args.sanitize, argv=sys.argv[1:] if argv is None else argv,
                space=dict(dtypes=args.space.dtypes, head_dims=args.space.head_dims,
                           kv_cache_dtypes=args.space.kv_cache_dtypes, small=args.space.small),
                wall_seconds=round(time.perf_counter() - t0, 1))
    per_op = summarize(results, counts)
    print_table(per_op)
    if args.out:
        print(f"wrote {write_results(args.out, meta, per_op, args.sanitize)}")
    failed = sum(s["failed"] + s["not_run"] for s in per_op.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
