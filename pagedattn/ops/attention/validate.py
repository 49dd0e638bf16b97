"""What flash_attn_varlen_func checks before anything runs: the FlashAttention keywords it accepts
only at harmless values, the scalars, the tensor metadata (`validate`, once per signature: the plan
cache keeps the result) and, on request, the values (`check_values`, syncs). Every refusal is a
ContractError (or NotImplementedError / TypeError for keywords) naming the argument."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ...contract import CacheSpec, ContractError, check_scale_values, describe, kv_cache_dtype_name
from ...dtypes import short
from .tiles import HEAD_DIMS

# FlashAttention keywords pagedattn accepts only at these (harmless) values
_UNSUPPORTED_OK = {"scheduler_metadata": (None,), "q_descale": (None,), "fa_version": (None, 2, 3),
                   "deterministic": (False, True, None), "return_attn_probs": (False, None),
                   "dropout_p": (0.0, 0, None), "q_v": (None,), "cp_world_size": (1, None),
                   "cp_rank": (0, None), "cp_tot_seqused_k": (None,)}


def _is_default(value, defaults) -> bool:
    """value is one of an unsupported keyword's harmless values. A tensor never is (comparing one with
    a tuple would be elementwise, and its truth value ambiguous)."""
    if isinstance(value, torch.Tensor):
        return False
    try:
        return any(value is ok or value == ok for ok in defaults)
    except (TypeError, ValueError, RuntimeError):  # a type whose == is not a bool (arrays)
        return False


def _given(x) -> str:
    """A scalar argument as given, for error messages (tensors by their metadata)."""
    if isinstance(x, torch.Tensor):
        return describe(x)
    text = repr(x)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(x).__name__})"


def _count_arg(name, x) -> None:
    if type(x) is int and x >= 0:  # the usual case, first: this runs on every call
        return
    if isinstance(x, torch.SymInt):  # traced (fake implementations): a guard, not a value
        if x < 0:
            raise ContractError(f"{name} must be a non-negative int, got {x}")
        return
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ContractError(f"{name} must be a non-negative int, got {_given(x)}")


def check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, num_splits):
    """The scalar arguments, on every call (cheap). Returns softmax_scale as a float, or None for the
    default 1 / sqrt(D). A 0-d tensor scale is read with float() (a sync when it is on the GPU)."""
    if type(max_seqlen_q) is int and type(max_seqlen_k) is int and type(num_splits) is int and \
            max_seqlen_q >= 0 and max_seqlen_k >= 0 and num_splits >= 0:  # the usual call, at once
        if softmax_scale is None:
            return None
        if type(softmax_scale) is float and 0 < softmax_scale < math.inf:
            return softmax_scale
    _count_arg("max_seqlen_q", max_seqlen_q)
    _count_arg("max_seqlen_k", max_seqlen_k)
    _count_arg("num_splits", num_splits)
    if softmax_scale is None:
        return None
    if type(softmax_scale) is not float:
        if isinstance(softmax_scale, torch.Tensor):
            if softmax_scale.dim() != 0 or not softmax_scale.dtype.is_floating_point or \
                    softmax_scale.device.type == "meta":
                raise ContractError(f"softmax_scale must be a float or a 0-d floating tensor, got "
                                    f"{describe(softmax_scale)}")
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise ContractError(f"softmax_scale must be a float, got {_given(softmax_scale)}")
        softmax_scale = float(softmax_scale)
    if not 0 < softmax_scale < math.inf:  # NaN fails too
        raise ContractError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return softmax_scale


def _require_cuda(q) -> None:
    if q.device.type != "cuda":
        raise ContractError(f"flash_attn_varlen_func's kernels need CUDA tensors; q is on {q.device} (for "
                            "CPU tensors use pagedattn.reference.paged_attention / varlen_attention)")


def _on_device(name, t, q) -> None:
    if t.device != q.device:
        hint = "" if q.device.type == "cuda" else "; the kernels need CUDA tensors"
        raise ContractError(f"{name} is on {t.device}, q on {q.device}{hint}")


def _int32_vector(name, t, q, shape) -> None:
    """A contiguous int32 1-D tensor on q's device; `shape` says which, for the message."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        hint = " (convert with .int())" if getattr(t, "dtype", None) == torch.int64 else ""
        raise ContractError(f"{name} must be a contiguous int32 {shape} tensor, got {describe(t)}{hint}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ContractError(f"{name} must be contiguous, got stride {t.stride(0)}")
    _on_device(name, t, q)


_NO_FEATURES = ((False, False, False, False), -1, -1, 0.0, None, 0, None)
_INT32_MAX = 2**31 - 1


def _head_vector(name, t, Hq, B, device, batched=False):
    """alibi_slopes / s_aux: float32 [Hq] (or [B, Hq] when batched) with contiguous heads, on q's
    device; returns the batch stride."""
    shapes = f"[{Hq}]" + (f" or [{B}, {Hq}]" if batched else "")
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} must be a float32 tensor {shapes}, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ContractError(f"{name} must be float32 {shapes}, got {t.dtype}")
    if t.device != device:
        raise ContractError(f"{name} is on {t.device}, q on {device}")
    if t.dim() == 1 and t.shape[0] == Hq and (Hq <= 1 or t.stride(0) == 1):
        return 0
    if batched and t.dim() == 2 and tuple(t.shape) == (B, Hq) and (Hq <= 1 or t.stride(1) == 1):
        return t.stride(0)
    raise ContractError(f"{name} must have shape {shapes} with contiguous heads, got shape "
                        f"{tuple(t.shape)} strides {t.stride()}")


def features_of(call: _Call, device, causal, window_size, softcap, alibi_slopes, sinks):
    """The feature flags of one call (AttnFwdSpec's window/softcap/alibi/sinks) and their launch values
    (window_left, window_right, softcap, alibi_slopes, alibi batch stride, sinks), checked: every bad
    value is a ContractError naming the argument. FlashAttention's semantics: window (-1, -1) and
    softcap 0 are off; causal makes the window's right edge 0."""
    if alibi_slopes is None and sinks is None and (softcap.__class__ is float or softcap.__class__ is int) \
            and softcap == 0 and (window_size is None or window_size.__class__ in (tuple, list) and
                                  len(window_size) == 2 and window_size[0] == -1 == window_size[1]):
        return _NO_FEATURES
    left = right = -1
    if window_size is not None:
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and -1 <= x <= _INT32_MAX for x in window_size):
            raise ContractError(f"window_size must be a pair of ints >= -1 (left, right; -1 = unbounded), "
                                f"got {window_size!r}")
        left, right = window_size  # with causal the kernel ignores right: the causal limit is the edge
    window = left >= 0 or (right >= 0 and not causal)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ContractError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    alibi_stride = 0
    if alibi_slopes is not None:
        alibi_stride = _head_vector("alibi_slopes", alibi_slopes, call.Hq, call.B, device, batched=True)
    if sinks is not None:
        _head_vector("s_aux (sinks)", sinks, call.Hq, call.B, device)
    flags = (window, softcap > 0, alibi_slopes is not None, sinks is not None)
    return flags, left, right, float(softcap), alibi_slopes, alibi_stride, sinks


def _check_aligned(name, t):
    if t.data_ptr() % 16:
        raise ContractError(f"{name} base pointer must be 16-byte aligned (address % 16 = {t.data_ptr() % 16})")


def _check_strides(name, t, what):
    """The kernels load 16-byte rows: a contiguous head dim, row and head strides multiples of 8."""
    if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8:
        raise ContractError(f"{name} needs a contiguous head dim and strides that are multiples of 8 "
                            f"elements{what}, got strides {t.stride()}")


@dataclass
class _Call:
    """Everything validated about one call."""
    B: int
    Hq: int
    Hkv: int
    D: int
    paged: bool
    kv_name: str
    k_strides: tuple
    v_strides: tuple
    num_blocks: int = 0
    block_size: int = 0


def _descale_strides(name, t, B, Hkv, device=None):
    """(batch stride, head stride) of a descale: one scale ([1] or 0-d), [Hkv] or [B, Hkv]. The
    device is checked last (given one), so that a wrong shape is named as such."""
    shapes = f"float32 [1], [{Hkv}] or [{B}, {Hkv}]"
    if t is None:
        raise ContractError(f"an fp8 KV cache needs {name} ({shapes})")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ContractError(f"{name} must be a {shapes} tensor, got {describe(t)}")
    if t.numel() == 1:
        strides = (0, 0)
    elif t.dim() == 1 and t.numel() == Hkv:
        strides = (0, t.stride(0))
    elif t.dim() == 2 and tuple(t.shape) == (B, Hkv):
        strides = (t.stride(0), t.stride(1))
    else:
        raise ContractError(f"{name} must have shape [1], [{Hkv}] or [{B}, {Hkv}] (B, num_kv_heads), "
                            f"got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ContractError(f"{name} is on {t.device}, q on {device}")
    return strides


def _batch(n_cu, *others) -> None:
    """cu_seqlens_q's B against the other per-request tensors: (name, count, unit, expected)."""
    if any(count != want for _, count, _, want in others):
        have = " and ".join(f"{name} has {count} {unit}" for name, count, unit, _ in others)
        raise ContractError(f"cu_seqlens_q has {n_cu} entries (B = {n_cu - 1}) while {have}: they must "
                            "describe the same B requests")


def _paged_kv(q, k, v, n_cu, cu_seqlens_k, seqused_k, block_table, want, k_descale, pointers):
    """validate's paged half: block_table, seqused_k and the caches k, v [num_blocks, block_size, Hkv, D]
    (NHD or HND). Returns (kv cache dtype name, Hkv, D, num_blocks, block_size)."""
    B = n_cu - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        hint = " (int64 tables are not accepted: convert with .int())" \
            if getattr(block_table, "dtype", None) == torch.int64 else ""
        raise ContractError(f"block_table must be an int32 [B, max_blocks_per_seq] tensor, got "
                            f"{describe(block_table)}{hint}")
    if block_table.shape[0] > 0 and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ContractError(f"block_table rows must be contiguous, got shape {tuple(block_table.shape)} "
                            f"strides {block_table.stride()}")
    _on_device("block_table", block_table, q)
    if seqused_k is None:
        raise ContractError("paged attention (a block_table) needs seqused_k: a contiguous int32 [B] tensor")
    _int32_vector("seqused_k", seqused_k, q, "[B]")
    _batch(n_cu, ("block_table", block_table.shape[0], "rows", B), ("seqused_k", seqused_k.numel(), "entries", B))
    if cu_seqlens_k is not None:
        raise ContractError("give either block_table + seqused_k (paged) or cu_seqlens_k (contiguous), not both")
    scale = "tensor"
    if isinstance(k_descale, torch.Tensor) and k_descale.numel() > 1:
        scale = "head"
    try:
        spec = CacheSpec.from_tensors(k, v, kv_cache_dtype=want, scale=scale, pointers=pointers)
    except ContractError as e:  # its messages say key_cache / value_cache: here they are k / v
        raise ContractError(f"k, v (the paged caches): {e}") from None
    if spec.layout not in ("NHD", "HND"):
        raise ContractError(f"cache layout {spec.layout} cannot be read by the flash kernels")
    _on_device("k", k, q)
    return spec.kv_cache_dtype, spec.num_kv_heads, spec.head_size, spec.num_blocks, spec.block_size


def _varlen_kv(q, k, v, n_cu, cu_seqlens_k, seqused_k, want, kv_cache_dtype, pointers):
    """validate's contiguous half: cu_seqlens_k, the optional seqused_k and k, v [total_k, Hkv, D].
    Returns (kv cache dtype name, Hkv, D, 0, 0)."""
    B = n_cu - 1
    if cu_seqlens_k is None:
        raise ContractError("give block_table + seqused_k (paged) or cu_seqlens_k (contiguous varlen)")
    _int32_vector("cu_seqlens_k", cu_seqlens_k, q, "[B + 1]")
    counts = [("cu_seqlens_k", cu_seqlens_k.numel(), "entries", B + 1)]
    if seqused_k is not None:
        _int32_vector("seqused_k", seqused_k, q, "[B]")
        counts.append(("seqused_k", seqused_k.numel(), "entries", B))
    _batch(n_cu, *counts)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ContractError(f"{name} must be a 3-D tensor [total_k, Hkv, D] without a block_table, "
                                f"got {describe(t)}")
        _on_device(name, t, q)
        _check_strides(name, t, "")
        if pointers:
            _check_aligned(name, t)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ContractError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} differ")
    if k.dtype in (torch.float16, torch.bfloat16):
        kv_name = "auto"
    elif k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv_name = short(k.dtype)
    elif k.dtype == torch.uint8 and want != "auto":
        kv_name = want
    else:
        raise ContractError(f"k/v dtype {k.dtype} is not supported (fp16/bf16 like q; float8, or uint8 "
                            "with kv_cache_dtype='fp8_e4m3'/'fp8_e5m2')")
    if want not in ("auto", kv_name):
        raise ContractError(f"kv_cache_dtype={kv_cache_dtype!r} does not match k/v of dtype {k.dtype}")
    _, Hkv, Dk = k.shape
    if Hkv == 0:
        raise ContractError(f"k has no heads: shape {tuple(k.shape)}")
    return kv_name, Hkv, Dk, 0, 0


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, kv_cache_dtype,
             k_descale, v_descale, pointers: bool = True) -> _Call:
    """Every check of a call's tensor metadata; no syncs. q's device is the reference: every tensor
    must be on it. That it is a GPU is checked after this (_require_cuda), so CPU tensors reach every
    check here and the value checks (check_values); q on any other device is refused at once.
    pointers=False (the fake implementations of pagedattn.ops.library: fake and meta tensors have no
    data) skips the base-pointer alignment and the device-type checks; the real op makes them."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ContractError(f"q must be a 3-D tensor [total_q, Hq, D], got {describe(q)}")
    if pointers and q.device.type not in ("cuda", "cpu"):
        _require_cuda(q)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ContractError(f"q dtype {q.dtype} is not supported (fp16, bf16)")
    _, Hq, D = q.shape
    if D % 8 or not 0 < D <= HEAD_DIMS[-1]:  # before the strides: a head size of 132 is the cause, not its stride
        raise ContractError(f"head size {D} (q.shape[2]) is not supported: a multiple of 8, at most {HEAD_DIMS[-1]}")
    if Hq == 0:
        raise ContractError(f"q has no heads: shape {tuple(q.shape)}")
    _check_strides("q", q, "")
    if pointers:
        _check_aligned("q", q)
    want = kv_cache_dtype_name(kv_cache_dtype)
    _int32_vector("cu_seqlens_q", cu_seqlens_q, q, "[B + 1]")
    n_cu = cu_seqlens_q.numel()
    if n_cu == 0:
        raise ContractError("cu_seqlens_q is empty; it holds B + 1 offsets ([0] for an empty batch)")
    B = n_cu - 1
    paged = block_table is not None
    if paged:
        kv_name, Hkv, Dk, num_blocks, block_size = _paged_kv(q, k, v, n_cu, cu_seqlens_k, seqused_k, block_table,
                                                             want, k_descale, pointers)
    else:
        kv_name, Hkv, Dk, num_blocks, block_size = _varlen_kv(q, k, v, n_cu, cu_seqlens_k, seqused_k, want,
                                                              kv_cache_dtype, pointers)
    if Dk != D:
        raise ContractError(f"head size differs: q has {D}, the KV cache {Dk}")
    if Hq % Hkv:
        raise ContractError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads of k/v (GQA shares each "
                            "KV head among Hq // Hkv query heads)")
    if kv_name == "auto" and k.dtype != q.dtype:
        raise ContractError(f"KV dtype {k.dtype} differs from q dtype {q.dtype}; fp8 caches need "
                            "kv_cache_dtype='fp8_e4m3'/'fp8_e5m2' (or float8 tensors)")
    if kv_name != "auto":
        shapes = [(_descale_strides(name, t, B, Hkv), tuple(t.shape))
                  for name, t in (("k_descale", k_descale), ("v_descale", v_descale))]
        if shapes[0][1] != shapes[1][1]:
            raise ContractError(f"k_descale {shapes[0][1]} and v_descale {shapes[1][1]} differ in shape")
        _on_device("k_descale", k_descale, q)
        _on_device("v_descale", v_descale, q)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ContractError(f"out must be None or a tensor like q, got {describe(out)}")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ContractError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got shape "
                                f"{tuple(out.shape)} and {out.dtype}")
        _on_device("out", out, q)
        _check_strides("out", out, " (like q)")
        if pointers:
            _check_aligned("out", out)
    ks = k.stride()
    vs = v.stride()
    if paged:  # logical [num_blocks, block_size, Hkv, D]
        k_strides, v_strides = (ks[0], ks[1], ks[2]), (vs[0], vs[1], vs[2])
    else:      # [total_k, Hkv, D]
        k_strides, v_strides = (0, ks[0], ks[1]), (0, vs[0], vs[1])
    return _Call(B, Hq, Hkv, D, paged, kv_name, k_strides, v_strides, num_blocks, block_size)


def _offsets(name, t, rows, of) -> list[int]:
    """Offsets that start at 0, never decrease and end at `rows` (the rows of `of`); their lengths."""
    cu = t.tolist()
    if cu[0] != 0:
        raise ContractError(f"{name}[0] = {cu[0]}; offsets start at 0")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ContractError(f"{name}[{i}] = {cu[i]} < {name}[{i - 1}] = {cu[i - 1]}; offsets never decrease")
    if cu[-1] != rows:
        raise ContractError(f"{name}[{len(cu) - 1}] = {cu[-1]}, but {of} has {rows} rows ({of}.shape[0])")
    return [b - a for a, b in zip(cu, cu[1:])]


def check_values(call: _Call, q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                 max_seqlen_k, k_descale, v_descale) -> None:
    """validate=True / PAGEDATTN_DEBUG (syncs): the values the kernels trust, on a validated call.
    cu_seqlens_q (cu_seqlens_k) starts at 0, never decreases, ends at total_q (total_k); query lengths
    <= max_seqlen_q, key lengths (seqused_k, else cu_seqlens_k's) in [0, max_seqlen_k]; the table
    (check_tables); descales finite and > 0. Names the first offender."""
    lens_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    for b, n in enumerate(lens_q):
        if n > max_seqlen_q:
            raise ContractError(f"request {b}: q_len {n} (cu_seqlens_q) exceeds max_seqlen_q={max_seqlen_q}")
    used = seqused_k.tolist() if seqused_k is not None else None
    for b, n in enumerate(used or ()):
        if n < 0:
            raise ContractError(f"request {b}: seqused_k[{b}] = {n} is negative")
    lens_k, source = used, "seqused_k"
    if not call.paged:
        keys = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
        for b, n in enumerate(used or ()):
            if n > keys[b]:
                raise ContractError(f"request {b}: seqused_k[{b}] = {n} exceeds its {keys[b]} keys in cu_seqlens_k")
        if used is None:
            lens_k, source = keys, "cu_seqlens_k"
    for b, n in enumerate(lens_k):
        if n > max_seqlen_k:
            raise ContractError(f"request {b}: {n} keys ({source}) exceed max_seqlen_k={max_seqlen_k}")
    if call.paged:
        check_tables(block_table, seqused_k, call.num_blocks, call.block_size)
    if call.kv_name != "auto":
        check_scale_values("k_descale", k_descale)
        check_scale_values("v_descale", v_descale)


def check_tables(block_table, seqused_k, num_blocks, block_size) -> None:
    """PAGEDATTN_DEBUG: seqused_k within its block_table row, every block id it uses in
    [0, num_blocks) (syncs). Names the first offender."""
    width = block_table.shape[1]
    lens = seqused_k.long()
    over = (lens > width * block_size).nonzero()
    if over.numel():
        b = int(over[0, 0])
        raise ContractError(f"request {b}: seqused_k[{b}] = {int(lens[b])} exceeds its block_table capacity "
                            f"({width} blocks x {block_size})")
    used = torch.arange(width, device=lens.device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_table.long()
    bad = (used & ((ids < 0) | (ids >= num_blocks))).nonzero()
    if bad.numel():
        b, i = int(bad[0, 0]), int(bad[0, 1])
        raise ContractError(f"request {b}: block_table[{b}, {i}] = {int(ids[b, i])} is outside "
                            f"[0, {num_blocks}); {bad.shape[0]} bad entr(ies) in use")



def check_unsupported(unsupported: dict, who: str = "flash_attn_varlen_func") -> None:
    """FlashAttention keywords pagedattn accepts only at their harmless values."""
    for name, value in unsupported.items():
        if name not in _UNSUPPORTED_OK:
            raise TypeError(f"{who}() got an unexpected keyword argument {name!r}")
        if not _is_default(value, _UNSUPPORTED_OK[name]):
            raise NotImplementedError(f"pagedattn.{who} does not support {name}={value!r} yet")

