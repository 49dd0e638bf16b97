"""`make demo`: the main job on an embedded default.

GPU: allocate a paged cache, write K/V through slot_mapping, read it back with attention, check
against the torch reference, print timings; then, with transformers installed, generate with a tiny
random-weight Llama through transformers' continuous batching on pagedattn ("paged|pagedattn") and
on transformers' own paged|sdpa, and print both tokens/s. No GPU: compile the kernels for sm_90a and
run the torch reference, saying plainly that no GPU was found.
"""
from __future__ import annotations

import os
import time

import torch

import pagedattn
from pagedattn import CacheSpec, reference
from pagedattn.registry import get_kernel

DEFAULT = dict(num_seqs=8, context=1000, num_kv_heads=8, num_q_heads=32, head_size=128, block_size=16,
               dtype=torch.bfloat16)


def _build(device):
    d = DEFAULT
    blocks_per_seq = -(-d["context"] // d["block_size"])
    spec = CacheSpec(d["num_seqs"] * blocks_per_seq + 4, d["block_size"], d["num_kv_heads"],
                     d["head_size"], d["dtype"])
    T = d["num_seqs"] * d["context"]
    key = torch.randn(T, d["num_kv_heads"], d["head_size"], dtype=d["dtype"], device=device)
    value = torch.randn_like(key)
    # each sequence owns a shuffled set of physical blocks
    block_table = torch.randperm(spec.num_blocks, device=device)[: d["num_seqs"] * blocks_per_seq]
    block_table = block_table.view(d["num_seqs"], blocks_per_seq).int()
    pos = torch.arange(d["context"], device=device)
    slots = (block_table[:, pos // d["block_size"]].long() * d["block_size"] + pos % d["block_size"]).reshape(-1)
    return spec, key, value, block_table, slots


def _time(fn, reps=50):
    from .bench.timing import median_us  # the one timer module

    return median_us(fn, reps=reps, warmup=3)


def run_gpu() -> int:
    spec, key, value, block_table, slots = _build("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}  cache: {spec}")
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    t0 = time.perf_counter()
    pagedattn.reshape_and_cache_flash(key, value, kc, vc, slots)
    torch.cuda.synchronize()
    print(f"first write call (incl. JIT/cache load): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    rk, rv = spec.allocate("cuda", fill=float("nan"))
    reference.reshape_and_cache_flash(key, value, rk, rv, slots)
    ok = torch.equal(kc.view(torch.int16), rk.view(torch.int16)) and \
        torch.equal(vc.view(torch.int16), rv.view(torch.int16))
    us = _time(lambda: pagedattn.reshape_and_cache_flash(key, value, kc, vc, slots))
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * 8
    print(f"write  {key.shape[0]} tokens: {us:8.1f} us  {nbytes / us / 1e3:7.1f} GB/s  "
          f"matches reference bit for bit: {ok}")
    if hasattr(pagedattn, "flash_attn_varlen_func"):
        ok = _attention(spec, kc, vc, block_table) and ok
    else:
        print("attention: not built yet in this version")
    ok = _transformers() and ok
    return 0 if ok else 1


def _transformers(num_prompts: int = 32, max_new_tokens: int = 64) -> bool:
    """The tiny Llama (GQA 8/2, head dim 64) through generate_batch on both implementations."""
    try:
        from .integrations import hf_tiny
        from .integrations import transformers as pa_hf

        pa_hf._transformers()
    except ImportError as e:
        print(f"transformers continuous batching: skipped ({e})")
        return True
    prompts = hf_tiny.tiny_prompts(num_prompts, lengths=tuple(range(32, 512, 15)))
    r = hf_tiny.throughput("llama", prompts, max_new_tokens)
    print(f"transformers {_hf_version()} generate_batch, tiny Llama, {num_prompts} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {max_new_tokens} new tokens each (greedy):")
    for impl in ("pagedattn", "sdpa"):
        print(f"  paged|{impl:10s} {r[impl + '_tokens_per_s']:9.1f} tokens/s")
    print(f"  identical sequences: {r['identical_sequences']}/{num_prompts} (bf16 near-ties of a random model may "
          "break either way; tests/test_hf_transformers.py checks every step's logits)")
    return True


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def _attention(spec, kc, vc, block_table) -> bool:
    d = DEFAULT
    B = d["num_seqs"]
    q = torch.randn(B, d["num_q_heads"], d["head_size"], dtype=d["dtype"], device="cuda")
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    seqused = torch.full((B,), d["context"], dtype=torch.int32, device="cuda")
    def call():
        return pagedattn.flash_attn_varlen_func(q, kc, vc, 1, cu_q, d["context"], seqused_k=seqused,
                                                causal=True, block_table=block_table)
    out = call()
    ref = reference.paged_attention(q, kc, vc, cu_q, seqused, block_table, causal=True)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    us = _time(call)
    kv_bytes = 2 * B * d["context"] * d["num_kv_heads"] * d["head_size"] * 2
    print(f"decode B={B} ctx={d['context']}: {us:8.1f} us  {kv_bytes / us / 1e3:7.1f} GB/s  rel L2 err {err:.2e}")
    return err < 2e-2


def demo_specs():
    """The variants the GPU demo runs."""
    from .ops.kv_write import KvWriteSpec

    from .ops.attention import AttnFwdSpec, kernel_head_dim

    d = DEFAULT
    return [KvWriteSpec("bf16", "auto", "span"),
            AttnFwdSpec("bf16", "auto", kernel_head_dim(d["head_size"]), "decode_tma")]


def run_cpu() -> int:
    print("No CUDA GPU found: compiling the kernels for sm_90a (NVRTC needs no GPU) and running the "
          "torch reference instead.")
    os.environ.setdefault("PAGEDATTN_ARCH", "sm_90a")
    for spec in demo_specs():
        t0 = time.perf_counter()
        art = get_kernel(spec).artifact("sm_90a")
        print(f"  {get_kernel(spec).name:40s} sm_90a  {len(art.cubin) / 1024:7.1f} KiB  "
              f"{art.origin:13s} {time.perf_counter() - t0:5.2f} s")
    spec, key, value, block_table, slots = _build("cpu")
    kc, vc = spec.allocate("cpu", fill=float("nan"))
    t0 = time.perf_counter()
    reference.reshape_and_cache_flash(key, value, kc, vc, slots)
    print(f"reference write of {key.shape[0]} tokens on the CPU: {(time.perf_counter() - t0) * 1e3:.1f} ms; "
          f"unwritten slots still NaN: {int(kc.isnan().any(-1).any(-1).sum())} of {spec.num_slots}")
    if hasattr(reference, "paged_attention"):
        d = DEFAULT
        q = torch.randn(d["num_seqs"], d["num_q_heads"], d["head_size"], dtype=d["dtype"])
        cu_q = torch.arange(d["num_seqs"] + 1, dtype=torch.int32)
        seqused = torch.full((d["num_seqs"],), d["context"], dtype=torch.int32)
        out = reference.paged_attention(q, kc, vc, cu_q, seqused, block_table, causal=True)
        print(f"reference paged attention (decode): out {tuple(out.shape)}, finite: {bool(out.isfinite().all())}")
    return 0


def main() -> int:
    from . import ops  # noqa: F401

    return run_gpu() if torch.cuda.is_available() else run_cpu()


if __name__ == "__main__":
    raise SystemExit(main())
