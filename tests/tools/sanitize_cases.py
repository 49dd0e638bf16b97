"""Small cases run under compute-sanitizer memcheck on the GPU: corrupt slots and tables must not
cause any out-of-bounds access. With the argument `ws`: only the warp-specialised prefill (its TMA
producer, mbarrier rings, ping-pong and tail zeroing), small enough for racecheck and synccheck.
With `part I/N`: the I-th of N shares of the attention runs only (the writer and legacy cases in
share 0), so that N processes compile the kernels at once before memcheck runs the whole script on
the warm JIT cache (h200.sh sanitize)."""
import sys

import torch

import pagedattn
from pagedattn import CacheSpec

PART, PARTS = map(int, sys.argv[2].split("/")) if sys.argv[1:2] == ["part"] else (0, 1)

if sys.argv[1:] == ["ws"]:
    from pagedattn.ops.attention import flash_attn_varlen_func

    from pagedattn.ops.attention.overrides import forced

    # the fp8 case: its producer widens the chunks to fp16 (forced, though the dispatch takes prefill_ws there);
    # head size 96 on the 128 tile (the dispatch's), and 96 and 80 compiled as such (forced narrow: 32- and
    # 16-column panels, three and five boxes per chunk; their decode_tma too)
    cases = (("NHD", 128, "auto", False), ("HND", 64, "auto", False), ("NHD", 256, "auto", False),
             ("NHD", 128, "fp8_e4m3", False), ("NHD", 96, "auto", False), ("HND", 96, "auto", True),
             ("NHD", 80, "auto", True))
    for layout, D, kv, narrow in cases:
        fp8 = kv != "auto"
        spec = CacheSpec(40, 16, 2, D, torch.uint8 if fp8 else torch.bfloat16, kv, layout)
        kc, vc = spec.allocate("cuda", fill=float("nan"))
        for cache in (kc, vc):
            if fp8:
                values = torch.randn(cache[:32].shape, device="cuda").to(torch.float8_e4m3fn)
                cache[:32].copy_(values.view(torch.uint8))
            else:
                cache[:32].normal_()
        scale = {"k_descale": torch.ones(1, device="cuda"), "v_descale": torch.ones(1, device="cuda")} if fp8 else {}
        # request 0: 300 keys over shuffled pages (a tail of 12 keys, NaN past it); request 1: a corrupt page
        table = torch.randperm(32, device="cuda").to(torch.int32).view(2, 16)
        table[1, 3] = 10**6
        seq = torch.tensor([300, 250], dtype=torch.int32, device="cuda")
        q = torch.randn(300 + 70, 8, D, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.tensor([0, 300, 370], dtype=torch.int32, device="cuda")
        # at D = 128 the opt-in tiles too: the producer feeding items and Q rows (two Q tiles, chained
        # items), O's bulk stores, the lagging maxima; clusters of two CTAs with K/V multicast (the corrupt
        # page zero-filled in both CTAs' slots, each by its own producer)
        opt_in = ({}, {"kWsQFeed": 2, "kWsOBulk": True, "kLazyMax": 3},
                  {"kWsPair": True, "kWsQFeed": 2, "kWsOBulk": True, "kLazyMax": 3}) if D == 128 else ({},)
        for splits in (1, 3):
            for tiles in opt_in:
                with forced(prefill="prefill_ws" if fp8 or narrow else None, tiles={"prefill_ws": tiles},
                            narrow=narrow or None):
                    out = flash_attn_varlen_func(q, kc, vc, 300, cu_q, 300, seqused_k=seq, block_table=table,
                                                 causal=True, num_splits=splits, kv_cache_dtype=kv, **scale)
                assert torch.isfinite(out).all()
        if narrow:  # its decode too: decode_tma's rings filled by boxes of 32 / 16 columns
            cu_1 = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
            with forced(narrow=True):
                out = flash_attn_varlen_func(q[:2], kc, vc, 1, cu_1, 300, seqused_k=seq, block_table=table,
                                             causal=True, num_splits=3)
            assert torch.isfinite(out).all()
    torch.cuda.synchronize()
    print("sanitize ws cases done")
    sys.exit(0)

for layout in ("NHD", "HND") if PART == 0 else ():
    for kv, dtype in (("auto", torch.bfloat16), ("fp8_e4m3", torch.uint8)):
        spec = CacheSpec(4, 16, 4, 72, dtype, kv, layout, "head" if layout == "HND" else "tensor")
        kc, vc = spec.allocate("cuda", fill=float("nan"))
        flat = torch.randn(2 * 9 * 4 * 72 + 1, dtype=torch.bfloat16, device="cuda")
        key = flat[1:1 + 9 * 4 * 72].view(9, 4, 72)           # unaligned base
        slots = torch.tensor([0, -1, 63, 64, 2**40, -2**40, 5, 17, 3], device="cuda")
        s = torch.ones(4 if spec.scale == "head" else 1, device="cuda")
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots, kv, s, s)
        # aligned D=128 rows (the flat path where the host picks it) with the same corrupt slots
        spec = CacheSpec(4, 16, 4, 128, dtype, kv, layout, "head" if layout == "HND" else "tensor")
        kc, vc = spec.allocate("cuda", fill=float("nan"))
        key = torch.randn(9, 4, 128, dtype=torch.bfloat16, device="cuda")
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots, kv, s, s)
# many tokens: the streaming fp8 schedule (items of two packs at D=128, of one at D=72), corrupt slots mixed in
for layout in ("NHD", "HND") if PART == 0 else ():
    for D in (128, 72):
        T = 3000
        spec = CacheSpec(T // 16 + 4, 16, 4, D, torch.uint8, "fp8_e5m2", layout, "head")
        kc, vc = spec.allocate("cuda", fill=float("nan"))
        key = torch.randn(T, 4, D, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(spec.num_slots, device="cuda")[:T]
        slots[::97] = 2**40
        slots[1::89] = spec.num_slots
        s = torch.ones(4, device="cuda")
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots, "fp8_e5m2", s, s)
torch.cuda.synchronize()
print("sanitize cases done")

# attention: corrupt block ids, seqused_k beyond the table, fp8 with D % 16 == 8, split-KV, the feature
# variants (window + sinks, softcap + ALiBi) and head dim 512. 4 x group 4 rows: decode variants; 8 x 4:
# multi-token decode (multi_tma on sm_90 for 16-bit); 40 x 4: prefill (wgmma on sm_90 for 16-bit)
from pagedattn.ops.attention import flash_attn_varlen_func  # noqa: E402

table = torch.tensor([[0, 5, 10**6], [-3, 2, 1]], dtype=torch.int32, device="cuda")
seq = torch.tensor([40, 10**5], dtype=torch.int32, device="cuda")
s = torch.ones(1, device="cuda")
features = (dict(window_size=(20, 0), s_aux=torch.randn(8, device="cuda")),
            dict(softcap=30.0, alibi_slopes=torch.rand(8, device="cuda")))
runs = [("HND", kv, D, dict(num_splits=n)) for kv, D in (("auto", 128), ("fp8_e4m3", 72), ("fp8_e4m3", 128))
        for n in (1, 3)]  # fp8 d128: register operands on sm_90
runs += [("NHD", kv, D, dict(num_splits=3, **f)) for kv, D in (("auto", 128), ("fp8_e4m3", 128), ("auto", 512))
         for f in features]
for layout, kv, D, kw in runs[PART::PARTS]:
    kc, vc = CacheSpec(6, 16, 2, D, torch.bfloat16 if kv == "auto" else torch.uint8, kv, layout).allocate(
        "cuda", fill=0.5)
    for q_len in (4, 8, 40):
        q = torch.randn(1 + q_len, 8, D, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.tensor([0, 1, 1 + q_len], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, kc, vc, q_len, cu_q, 10**5, seqused_k=seq, block_table=table, causal=True,
                               kv_cache_dtype=kv, k_descale=s, v_descale=s, return_softmax_lse=True, **kw)
torch.cuda.synchronize()
print("sanitize attention cases done")

# legacy path: corrupt tables, negative and oversized lengths, slots past the cache
from pagedattn import legacy  # noqa: E402

for kv, dt in (("auto", torch.float16), ("fp8_e5m2", torch.uint8)) if PART == 0 else ():
    kc, vc = CacheSpec(6, 16, 2, 80, dt, kv, "legacy").allocate("cuda", fill=0.5)
    t = torch.tensor([[0, 5, 10**6, -1], [-3, 2, 1, 2**31 - 1]], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 80, dtype=torch.float16, device="cuda")
    s = torch.ones(1, device="cuda")
    seq = torch.tensor([10**5, -4], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    legacy.paged_attention_v1(out, q, kc, vc, 2, 0.1, t, seq, 16, 64, None, kv, s, s)
    legacy.paged_attention_v2(out, *legacy.allocate_partials(q, 64), q, kc, vc, 2, 0.1, t, seq, 16, 64,
                              None, kv, s, s)
    k = torch.randn(3, 2, 80, dtype=torch.float16, device="cuda")
    legacy.reshape_and_cache(k, k, kc, vc, torch.tensor([0, 96, 2**40], device="cuda"), kv, s, s)
torch.cuda.synchronize()
print("sanitize legacy cases done")
