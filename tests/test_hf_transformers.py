"""transformers' continuous batching on pagedattn (pagedattn.integrations.transformers).

CPU: registration, the translation pieces (block tables and sliding page tables from transformers'
read/write indices), the refusals, and whole `generate_batch` runs of the tiny models with the
translation calling pagedattn's metadata checks + torch references instead of the CUDA kernels.
GPU: the same runs on the CUDA kernels against transformers' own paged attention.

The tiny models (pagedattn/integrations/hf_tiny.py) scale the lm_head by 16 so that logits are
spread wide (std ~5), and q/k by 3 so that softcap and window change the scores. Scaling alone does
not make greedy decoding immune to bf16: two correct bf16 attentions differ by about an ulp, and a
random model has near-ties (top-2 margins of one bf16 ulp of the logits, seen on the CPU even
between transformers' own paged|sdpa and eager). So `hf_tiny.compare` checks every step's logits
(the first step's included) within 4 % of the reference's largest logit, and requires the same
greedy token at every step unless the reference's top-2 margin there is within twice that
tolerance, where that prompt is compared no further.
"""
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("5"):
    pytest.skip(f"needs transformers >= 5, found {transformers.__version__}", allow_module_level=True)

import pagedattn  # noqa: E402
from pagedattn.integrations import hf_tiny  # noqa: E402
from pagedattn.integrations import transformers as pa_hf  # noqa: E402

REF_NAME = "paged|pagedattn_cpuref"
MAX_NEW = 8


@pytest.fixture
def cpu_memory(monkeypatch):
    """transformers sizes the cache from free memory, which it can only read on the CPU with psutil."""
    from transformers.generation.continuous_batching import cache

    monkeypatch.setattr(cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)


# -- registration --------------------------------------------------------------------------------

def test_register_adds_the_implementation():
    from transformers import AttentionInterface

    assert pa_hf.register() == "paged|pagedattn"
    assert "paged|pagedattn" in AttentionInterface._global_mapping
    assert pa_hf.register("paged|mine", pa_hf.reference_kernels()) == "paged|mine"


@pytest.mark.parametrize("name", ["pagedattn", "paged|", "paged|flash_pagedattn", 3])
def test_register_refuses_bad_names(name):
    with pytest.raises(pagedattn.ContractError, match="name"):
        pa_hf.register(name)


# -- the translation pieces ----------------------------------------------------------------------

def _shuffled_tables(lengths, block_size, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lengths:
        k = -(-n // block_size)
        tables.append(ids[:k])
        ids = ids[k:]
    return tables


def test_block_table_from_read_index():
    lengths, bs = [5, 16, 33, 0, 47], 16
    tables = _shuffled_tables(lengths, bs, 16)
    # transformers' full-attention read index: the page of every logical position, requests packed
    read = torch.tensor([tables[b][p // bs] * bs + p % bs for b, n in enumerate(lengths) for p in range(n)])
    cu_k = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    table, seqused = pa_hf.block_table_from_read_index(read, cu_k, bs, max(lengths))
    assert table.dtype == seqused.dtype == torch.int32
    assert seqused.tolist() == lengths
    assert table.shape == (5, 3)
    for b, n in enumerate(lengths):
        assert table[b, :len(tables[b])].tolist() == tables[b]
        assert table[b, len(tables[b]):].eq(0).all()


def test_sliding_page_table_points_new_keys_at_their_write_slots():
    W, sentinel = 8, 999
    # request 0 decodes at position 20 (7 cached keys, ring slots 13 % 8 .. 19 % 8), request 1 is a
    # fresh prefill of 5 tokens, request 2 decodes at position 3 (3 cached keys)
    ring = {0: [100 + s for s in range(W)], 1: [200 + s for s in range(W)], 2: [300 + s for s in range(W)]}
    read = ([ring[0][p % W] for p in range(13, 20)] + [sentinel]
            + [sentinel] * 5
            + [ring[2][p] for p in range(3)] + [sentinel])
    write = [ring[0][20 % W]] + [ring[1][p] for p in range(5)] + [ring[2][3]]
    cu_q = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 13, 17], dtype=torch.int32)
    table, seqused = pa_hf.sliding_page_table(torch.tensor(read), torch.tensor(write), cu_q, cu_k, 8)
    assert seqused.tolist() == [8, 5, 4]
    assert table[0].tolist() == [ring[0][p % W] for p in range(13, 21)]
    assert table[1, :5].tolist() == ring[1][:5] and table[1, 5:].eq(0).all()
    assert table[2, :4].tolist() == ring[2][:4] and table[2, 4:].eq(0).all()


def test_tokens_major_keeps_dense_views_and_copies_the_rest():
    x = torch.randn(1, 7, 4, 16).transpose(1, 2)          # [1, H=4, T=7, D] view of [1, T, H, D]
    t = pa_hf.tokens_major(x, "query")
    assert t.shape == (7, 4, 16) and t.data_ptr() == x.data_ptr()
    y = torch.randn(1, 4, 7, 16)                           # RoPE output layout: heads outermost
    t = pa_hf.tokens_major(y, "key")
    assert t.shape == (7, 4, 16) and t.is_contiguous() and torch.equal(t, y[0].transpose(0, 1))
    with pytest.raises(pagedattn.ContractError, match="query"):
        pa_hf.tokens_major(torch.randn(2, 4, 7, 16), "query")


# -- refusals ------------------------------------------------------------------------------------

def _fake_call(window=0, dtype=torch.bfloat16, v_dim=16, read=0, max_k=4, **extra):
    cache = types.SimpleNamespace(layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: window or 1},
                                  block_size=16, num_key_value_heads=2, head_dim=16,
                                  key_cache=[torch.zeros(64, 2, 16, dtype=dtype)],
                                  value_cache=[torch.zeros(64, 2, 16, dtype=dtype)])
    kwargs = dict(cache=cache, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor([0, max_k], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=max_k,
                  read_index=[torch.zeros(read, dtype=torch.int64)], write_index=[torch.arange(4)])
    kwargs.update(extra)
    q = torch.randn(1, 4, 4, 16, dtype=dtype)
    k = torch.randn(1, 2, 4, 16, dtype=dtype)
    v = torch.randn(1, 2, 4, v_dim, dtype=dtype)
    return types.SimpleNamespace(layer_idx=0), q, k, v, kwargs


def _forward(module, q, k, v, kwargs):
    return pa_hf.attention_forward(pa_hf.reference_kernels(), module, q, k, v, None, **kwargs)


def test_fake_call_runs():
    out, weights = _forward(*_fake_call())
    assert out.shape == (1, 4, 4, 16) and weights is None


@pytest.mark.parametrize("change, error, match", [
    (dict(cache=None), pagedattn.UnsupportedError, "continuous batching"),
    (dict(dropout=0.1), NotImplementedError, "dropout"),
    (dict(dtype=torch.float32), pagedattn.UnsupportedError, "fp16/bf16"),
    (dict(v_dim=8), pagedattn.UnsupportedError, "MLA"),
    (dict(block_table=torch.zeros(1, 1, 4, dtype=torch.int32)), pagedattn.UnsupportedError, "fast path"),
    (dict(window=8, read=20, max_k=20), pagedattn.UnsupportedError, "ring of W"),
])
def test_refusals(change, error, match):
    call_keys = {"window", "dtype", "v_dim", "read", "max_k"}
    module, q, k, v, kwargs = _fake_call(**{n: x for n, x in change.items() if n in call_keys})
    kwargs.update({n: x for n, x in change.items() if n not in call_keys})
    with pytest.raises(error, match=match):
        _forward(module, q, k, v, kwargs)


def test_sliding_step_within_the_window_is_served():
    out, _ = _forward(*_fake_call(window=8, read=8, max_k=8))
    assert out.shape == (1, 4, 4, 16) and out.isfinite().all()


# -- whole runs on the CPU (torch references behind pagedattn's checks) ---------------------------

def _reference(kind, model, prompts):
    """transformers' paged|sdpa ignores softcap (integrations/sdpa_paged.py), so Gemma-2's
    reference is its eager attention without continuous batching."""
    if kind == "gemma2":
        return hf_tiny.eager_reference(model, prompts, MAX_NEW)
    return hf_tiny.generate(model, "paged|sdpa", prompts, MAX_NEW)


def _check(summary):
    assert not summary["mismatches"], summary
    assert summary["worst"] <= 1.0


def _run_and_check(kind, device, base):
    counting = _Counting(base)
    name = pa_hf.register("paged|pagedattn_counted", counting.kernels)
    model = hf_tiny.tiny_model(kind, torch.bfloat16, device)
    prompts = hf_tiny.tiny_prompts()
    ours = hf_tiny.generate(model, name, prompts, MAX_NEW)
    assert ours.logits is not None, "the first step did not prefill all 8 prompts"
    assert all(len(t) == MAX_NEW for t in ours.tokens)
    layers = model.config.num_hidden_layers
    assert counting.contiguous == layers               # step 1: fresh prefills, no cache read
    assert counting.paged == layers * (MAX_NEW - 1)    # every decode step reads through the pages
    _check(hf_tiny.compare(_reference(kind, model, prompts), ours))


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
def test_generate_batch_cpu_reference(kind, cpu_memory):
    _run_and_check(kind, "cpu", pa_hf.reference_kernels())


def _chunked(device, kernels):
    name = pa_hf.register("paged|pagedattn_chunked", kernels)
    model = hf_tiny.tiny_model("llama", torch.bfloat16, device)
    prompts = hf_tiny.tiny_prompts()
    config = hf_tiny.cb_config(prompts, MAX_NEW)
    config.max_batch_tokens = 48
    # chunks: a step is not one token per prompt, so tokens are compared (eager's logits judge ties)
    ours = hf_tiny.generate(model, name, prompts, MAX_NEW, config=config, record_logits=False)
    summary = hf_tiny.compare(hf_tiny.eager_reference(model, prompts, MAX_NEW), ours)
    assert not summary["mismatches"], summary


def test_chunked_prefill_reads_the_cache_through_block_tables(cpu_memory):
    """A batch budget of 48 tokens splits the prompts over several steps, so later chunks (q > 1)
    read earlier ones from the cache: the block-table path with long queries."""
    _chunked("cpu", pa_hf.reference_kernels())


def test_init_continuous_batching_manager(cpu_memory):
    """The manager API (init_continuous_batching / add_request / get_result) runs the same path."""
    from transformers import GenerationConfig

    name = pa_hf.register(REF_NAME, pa_hf.reference_kernels())
    model = hf_tiny.tiny_model("llama", torch.bfloat16, "cpu")
    prompts = hf_tiny.tiny_prompts(3)
    model.set_attn_implementation(name)
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=hf_tiny.cb_config(prompts, 4))
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=4) for p in prompts]
        results = [manager.get_result(request_id=i, timeout=120) for i in ids]
    finally:
        manager.stop(block=True, timeout=60)
    assert all(r is not None and r.error is None for r in results), results
    run = hf_tiny.Run([list(r.generated_tokens) for r in results], None, 1.0)
    summary = hf_tiny.compare(hf_tiny.eager_reference(model, prompts, 4), run)
    assert not summary["mismatches"], summary


def test_sliding_window_chunk_past_the_window_is_refused(cpu_memory):
    name = pa_hf.register(REF_NAME, pa_hf.reference_kernels())
    model = hf_tiny.tiny_model("mistral", torch.bfloat16, "cpu")
    prompts = hf_tiny.tiny_prompts()
    config = hf_tiny.cb_config(prompts, MAX_NEW)
    config.max_batch_tokens = 48    # the 64-token prompt is chunked: its second chunk sees > 16 keys
    with pytest.raises(RuntimeError, match="sliding window 16"):
        hf_tiny.generate(model, name, prompts, MAX_NEW, config=config)


# -- GPU: the CUDA kernels against transformers' own paged attention ------------------------------

class _Counting:
    """Kernels that count paged reads (block_table given) and contiguous ones."""

    def __init__(self, base):
        self.paged = self.contiguous = 0

        def attend(*args, block_table=None, **kwargs):
            if block_table is None:
                self.contiguous += 1
            else:
                self.paged += 1
            return base.attend(*args, block_table=block_table, **kwargs)

        self.kernels = pa_hf.Kernels(base.write, attend)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", hf_tiny.KINDS)
def test_generate_batch_gpu(kind):
    _run_and_check(kind, "cuda", pa_hf.cuda_kernels())


@pytest.mark.gpu
def test_chunked_prefill_gpu():
    _chunked("cuda", pa_hf.cuda_kernels())
