"""transformers' continuous batching on pagedattn: the attention implementation "paged|pagedattn".

    import pagedattn.integrations.transformers as pa_hf
    pa_hf.register()                                   # once per process
    model.set_attn_implementation("paged|pagedattn")   # a fp16/bf16 model on a CUDA device
    outputs = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)

What transformers (5.x) hands an attention implementation during continuous batching, and what
this module does with it (`attention_forward`):

- `cache`, a `PagedAttentionCache`: per layer of a layer group one key and one value tensor
  `[(num_blocks + 2) * block_size, Hkv, D]`, contiguous; viewed as `[num_blocks + 2, block_size,
  Hkv, D]` that is pagedattn's NHD layout (`CacheSpec.from_tensors` checks it). The two extra blocks
  are transformers' read and write trash. One block id means the same block in every layer's tensor.
- `write_index[group]`: int64 page (= slot) of every new token; padding tokens point at the write
  trash. It is the `slot_mapping` of `reshape_and_cache_flash`, as is.
- `read_index[group]`: int64 page of every key each request sees, requests packed like
  `cu_seq_lens_k`; empty when no request of the step has anything cached.
  - full-attention layers: pages `table[j] * block_size + offset` of logical positions
    0 .. past + q - 1, so the block table is read off every `block_size`-th entry
    (`block_table_from_read_index`: index arithmetic on B x max_blocks ints, no K/V is copied);
  - sliding-window layers: transformers keeps the last W keys of a request in a ring (position p at
    ring slot p % W, W = `config.sliding_window`), `read_index` lists the min(past, W - 1) cached
    pages oldest first, then a sentinel per new token. The kernels read them through a one-token-page
    view of the same cache (block_size 1) and a per-key page table whose new-token entries are the
    tokens' write slots (`sliding_page_table`), written before the read.
- `cu_seq_lens_q` / `cu_seq_lens_k` (int32) and `max_seqlen_q` / `max_seqlen_k` (Python ints), the
  `_k` ones per layer type ("full_attention" / "sliding_attention") when a model mixes both.
- `block_table` (the flash decode fast path): transformers enables it only for flash-attention
  implementations, never for this one (it is refused if it comes).

A step that reads no cache (every request a fresh prefill) attends over the step's own K/V in
contiguous varlen mode. Window (`sliding_window - 1`, 0), softcap (`softcap=`, Gemma-2) and sinks
(`s_aux=`, gpt-oss) go to the kernel as features. transformers' own "paged|sdpa" and "paged|eager"
ignore `softcap`.

Refused, with the reason (`UnsupportedError` unless said otherwise): a call without the cache (a
plain forward); dropout (`NotImplementedError`); float32 models; a value head size other than the
query's (MLA); and on a sliding-window layer, a step that reads the cache while one of its requests
sees more than W keys (`SLIDING_WINDOW_LIMIT` says why no page table can describe that step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..contract import ContractError
from ..registry import UnsupportedError

NAME = "paged|pagedattn"
MIN_VERSION = "5.0"

SLIDING_WINDOW_LIMIT = (
    "transformers keeps a sliding-window layer's keys in a ring of W = sliding_window slots (position p "
    "at slot p % W): a multi-token chunk of a request overwrites keys its own earlier queries still "
    "see, and a chunk longer than W sends its first tokens to a trash slot, so once the chunk is "
    "written the cache no longer holds every key of the step. paged|sdpa reads the old keys before "
    "the write and concatenates the new ones (a gather); pagedattn reads K/V only through the cache's "
    "pages, so it refuses such a step. It happens when a prompt longer than the window, or a chunk of "
    "one, is prefilled in the same step as requests that read the cache; a step of fresh prefills "
    "alone, and decode steps, are exact.")


@dataclass(frozen=True)
class Kernels:
    """The two ops the translation calls: `write` has reshape_and_cache_flash's signature and
    `attend` flash_attn_varlen_func's. The default is pagedattn's CUDA kernels;
    `reference_kernels()` runs the same translation on the CPU."""
    write: Callable
    attend: Callable


def cuda_kernels() -> Kernels:
    from .. import flash_attn_varlen_func, reshape_and_cache_flash

    return Kernels(reshape_and_cache_flash, flash_attn_varlen_func)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("pagedattn.integrations.transformers needs transformers >= 5 "
                          "(pip install 'transformers>=5')") from e
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_VERSION):
        raise ImportError(f"pagedattn.integrations.transformers needs transformers >= {MIN_VERSION} "
                          f"(continuous batching's PagedAttentionCache), found {transformers.__version__}")
    return transformers


def register(name: str = NAME, kernels: Kernels | None = None) -> str:
    """Register the attention implementation `name` (it must start with "paged|": transformers'
    continuous batching keeps such names as they are) in transformers' AttentionInterface.
    Returns the name, for `model.set_attn_implementation(...)`."""
    transformers = _transformers()
    if not isinstance(name, str) or not name.startswith("paged|") or name == "paged|":
        raise ContractError(f"name must be 'paged|<something>' (continuous batching only keeps paged "
                            f"implementations), got {name!r}")
    if "flash" in name:  # transformers would take it for a flash-attention kernel to load
        raise ContractError(f"name {name!r} must not contain 'flash': transformers would try to load "
                            "a flash-attention package for it")
    kernels = kernels or cuda_kernels()

    def forward(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(kernels, module, query, key, value, attention_mask, **kwargs)

    forward.__name__ = forward.__qualname__ = "pagedattn_paged_attention_forward"
    transformers.AttentionInterface.register(name, forward)
    return name


# -- pure translation pieces ---------------------------------------------------------------------

@dataclass(frozen=True)
class LayerView:
    """Where layer `layer_idx` lives in the cache: its group, its tensor within the group, and the
    sliding window of its type (0: full attention)."""
    group: int
    index: int
    window: int

    @property
    def layer_type(self) -> str:
        return "sliding_attention" if self.window else "full_attention"


def layer_view(cache, layer_idx: int) -> LayerView:
    try:
        group, index = cache.layer_index_to_group_indices[layer_idx]
    except (KeyError, TypeError):
        raise ContractError(f"layer_idx {layer_idx!r} is not a layer of the PagedAttentionCache "
                            f"(layers {sorted(cache.layer_index_to_group_indices)})") from None
    window = cache.sliding_windows.get(layer_idx, 1)
    return LayerView(group, index, 0 if window in (None, 1) else int(window))


def per_layer_type(value, layer_type: str, name: str):
    """`cu_seq_lens_k` / `max_seqlen_k` come as one value, or a dict by layer type in hybrid models."""
    if not isinstance(value, dict):
        return value
    if layer_type not in value:
        raise ContractError(f"{name} has entries {sorted(value)}, none for this layer's type {layer_type!r}")
    return value[layer_type]


def tokens_major(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' [1, H, T, D] -> pagedattn's [T, H, D], with (H, D) dense (a copy only if not)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1:
        raise ContractError(f"{name} must be [1, heads, tokens, head_dim] (packed continuous batching), "
                            f"got {tuple(getattr(x, 'shape', ()))}")
    t = x[0].transpose(0, 1)
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
        t = t.contiguous()
    return t


def block_table_from_read_index(read_index: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int,
                                max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table int32 [B, ceil(max_seqlen_k / block_size)], seqused_k int32 [B]) of a
    full-attention group: request b's logical block j is the page at read_index[cu_k[b] + j *
    block_size], divided by block_size. Entries past a request's keys are 0 (never read)."""
    seqused = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    width = max(1, -(-int(max_seqlen_k) // block_size))
    first = torch.arange(width, device=read_index.device) * block_size      # [W] first key of block j
    pos = cu_seqlens_k[:-1].long()[:, None] + first                          # [B, W]
    pages = read_index[pos.clamp_(max=max(read_index.numel() - 1, 0))]
    table = torch.where(first < seqused[:, None], pages // block_size, 0).to(torch.int32)
    return table, seqused.to(torch.int32).contiguous()


def sliding_page_table(read_index: torch.Tensor, write_index: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page table int32 [B, max_seqlen_k], seqused_k int32 [B]) of a sliding-window group, for the
    cache viewed with one-token pages: key j of request b is read_index[cu_k[b] + j] for the cached
    keys and, for the request's last q_b keys (transformers' sentinels), the write slot of its new
    token j - (len_k - q_b)."""
    seqused = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    new_from = seqused - (cu_seqlens_q[1:] - cu_seqlens_q[:-1])              # [B] first new key
    j = torch.arange(max(1, int(max_seqlen_k)), device=read_index.device)    # [K]
    pages = read_index[(cu_seqlens_k[:-1].long()[:, None] + j).clamp_(max=max(read_index.numel() - 1, 0))]
    new = j - new_from[:, None]                                              # [B, K] new token index
    fresh = write_index[(cu_seqlens_q[:-1].long()[:, None] + new).clamp_(0, max(write_index.numel() - 1, 0))]
    pages = torch.where(new >= 0, fresh, pages)
    table = torch.where(j < seqused[:, None], pages, 0).to(torch.int32)
    return table, seqused.to(torch.int32).contiguous()


class _Tables:
    """The tables of one step are the same for every layer of a group: built for the first layer,
    reused while the step's index tensors are the same objects, unmodified."""

    def __init__(self):
        self._hit: dict = {}

    def get(self, key: tuple, tensors: tuple, build: Callable):
        stamp = tuple((t, t._version) for t in tensors)
        hit = self._hit.get(key)
        if hit is not None and len(hit[0]) == len(stamp) and all(
                a is b and va == vb for (a, va), (b, vb) in zip(hit[0], stamp)):
            return hit[1]
        value = build()
        self._hit[key] = (stamp, value)
        return value


_TABLES = _Tables()


def _sinks(kwargs) -> torch.Tensor | None:
    s_aux = kwargs.get("s_aux")
    if s_aux is None:
        return None
    return s_aux.detach().float().contiguous()


def attention_forward(kernels: Kernels, module, query, key, value, attention_mask, scaling=None,
                      dropout=0.0, softcap=None, **kwargs):
    """One layer of one continuous-batching step: write the step's K/V into the paged cache, then
    attend through the cache's pages. Returns (out [1, T, Hq, D], None) like transformers' paged
    implementations."""
    cache = kwargs.get("cache")
    if cache is None:
        raise UnsupportedError(
            f"{NAME} runs inside transformers' continuous batching (generate_batch / "
            "init_continuous_batching), which passes the PagedAttentionCache; this call has none "
            "(a plain forward or generate). Use 'sdpa' there")
    if dropout:
        raise NotImplementedError(f"{NAME} has no attention dropout (got dropout={dropout}); call "
                                  "model.eval()")
    if kwargs.get("block_table") is not None:
        raise UnsupportedError(f"{NAME} reads block tables derived from read_index; transformers' "
                               "flash decode fast path (block_table) is for flash_attn_with_kvcache")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedError(f"{NAME} runs fp16/bf16 models; this one computes in {query.dtype} "
                               "(load it with dtype=torch.bfloat16)")
    q = tokens_major(query, "query")
    k = tokens_major(key, "key")
    v = tokens_major(value, "value")
    if v.shape[-1] != q.shape[-1]:
        raise UnsupportedError(f"{NAME} needs one head size for queries and values, got "
                               f"{q.shape[-1]} and {v.shape[-1]} (MLA-style models are not supported)")
    view = layer_view(cache, module.layer_idx)
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = per_layer_type(kwargs["cu_seq_lens_k"], view.layer_type, "cu_seq_lens_k")
    max_q = int(kwargs["max_seqlen_q"])
    max_k = int(per_layer_type(kwargs["max_seqlen_k"], view.layer_type, "max_seqlen_k"))
    read = kwargs["read_index"][view.group]
    write = kwargs["write_index"][view.group]
    if view.window and read.numel() and max_k > view.window:
        raise UnsupportedError(
            f"{NAME}: layer {module.layer_idx} (sliding window {view.window}) gets a step that reads the "
            f"cache while a request sees {max_k} keys, more than the window. {SLIDING_WINDOW_LIMIT}")
    bs, heads, dim = cache.block_size, cache.num_key_value_heads, cache.head_dim
    k_pages, v_pages = cache.key_cache[view.index], cache.value_cache[view.index]   # [pages, Hkv, D]
    key_cache = k_pages.view(-1, bs, heads, dim)
    value_cache = v_pages.view(-1, bs, heads, dim)
    kernels.write(k, v, key_cache, value_cache, write)
    features = dict(softmax_scale=scaling, causal=True,
                    window_size=(view.window - 1, 0) if view.window else (-1, -1),
                    softcap=float(softcap) if softcap else 0.0, s_aux=_sinks(kwargs))
    if read.numel() == 0:    # nothing cached yet: the step's own K/V are all the keys
        out = kernels.attend(q, k, v, max_q, cu_q, max_k, cu_seqlens_k=cu_k, **features)
    elif view.window:
        table, seqused = _TABLES.get((view.group, "sliding"), (read, write, cu_q, cu_k),
                                     lambda: sliding_page_table(read, write, cu_q, cu_k, max_k))
        out = kernels.attend(q, k_pages.view(-1, 1, heads, dim), v_pages.view(-1, 1, heads, dim), max_q, cu_q,
                             max_k, seqused_k=seqused, block_table=table, **features)
    else:
        table, seqused = _TABLES.get((view.group, "full"), (read, cu_k),
                                     lambda: block_table_from_read_index(read, cu_k, bs, max_k))
        out = kernels.attend(q, key_cache, value_cache, max_q, cu_q, max_k, seqused_k=seqused,
                             block_table=table, **features)
    if isinstance(out, tuple):
        out = out[0]
    return out.unsqueeze(0), None


# -- the same translation on the CPU -------------------------------------------------------------

def reference_kernels() -> Kernels:
    """pagedattn's metadata checks (the ones the CUDA ops run first) followed by the torch
    references: the translation checked end to end without a GPU, and the value checks
    (`check_values`, `check_slots`) on every call."""
    from .. import reference
    from ..contract import CacheSpec
    from ..ops import attention as attn
    from ..ops import kv_write

    def write(key, value, key_cache, value_cache, slot_mapping):
        spec = CacheSpec.from_tensors(key_cache, value_cache)
        kv_write.validate_inputs(spec, key, value, key_cache, slot_mapping, None, None)
        kv_write.check_slots(slot_mapping, spec.num_slots)
        reference.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping)

    def attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
               block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               s_aux=None):
        call = attn.validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, None, None,
                             None, None)
        attn.check_values(call, q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                          max_seqlen_k, None, None)
        attn.features_of(call, q.device, causal, window_size, softcap, None, s_aux)
        feats = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                     sinks=s_aux)
        if block_table is None:
            out = reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **feats)
        else:
            out = reference.paged_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, **feats)
        return out.to(q.dtype)

    return Kernels(write, attend)
