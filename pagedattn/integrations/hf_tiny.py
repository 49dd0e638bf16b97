"""Tiny random-weight models for transformers' continuous batching: what the tests and `make demo` run, and
`throughput` measures (built from configs here: nothing is downloaded).

Kinds: "llama" (GQA, 8 query heads over 2 KV heads), "mistral" (the same with a sliding window of
16 on every layer), "gemma2" (one sliding-window layer and one full layer, attention softcap 2).
The q/k projections are scaled by `QK_SCALE` so that scores reach the softcap and softmax is not
near-uniform, and the lm_head by `LM_HEAD_SCALE` so that logits are spread wide (see
`tiny_model`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

KINDS = ("llama", "mistral", "gemma2")
WINDOW = 16
SOFTCAP = 2.0
QK_SCALE = 3.0
LM_HEAD_SCALE = 16.0
PROMPT_LENGTHS = (3, 9, 17, 24, 31, 40, 52, 64)   # distinct: a step's segments name their prompts


def tiny_config(kind: str):
    import transformers

    common = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if kind == "gemma2":
        return transformers.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP,
                                         final_logit_softcapping=None, query_pre_attn_scalar=64,
                                         layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def tiny_model(kind: str, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """A random-weight model of `kind`, eval mode. q_proj and k_proj are multiplied by QK_SCALE
    (scores of order 1, so softcap and window change the result), lm_head by LM_HEAD_SCALE (logits
    spread wide: the greedy choice is not decided by the bf16 rounding of the logits)."""
    import transformers

    config = tiny_config(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model.to(device=device, dtype=dtype).eval()


def tiny_prompts(n: int = len(PROMPT_LENGTHS), seed: int = 0, vocab: int = 128,
                 lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [lengths[i % len(lengths)] + i // len(lengths) for i in range(n)]
    return [torch.randint(2, vocab, (L,), generator=g).tolist() for L in lengths]


@dataclass
class Run:
    tokens: list[list[int]]                 # generated tokens, in prompt order
    logits: list[list[torch.Tensor]] | None  # float32 [vocab] per prompt per step (None: unmapped)
    seconds: float                          # wall time of generate_batch

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds

    @property
    def first_logits(self) -> torch.Tensor:
        return torch.stack([steps[0] for steps in self.logits])


def cb_config(prompts, max_new_tokens: int, block_size: int = 16):
    """A continuous-batching config sized for `prompts`: every prompt fits one prefill step."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(map(len, prompts)) + max_new_tokens
    blocks = len(prompts) * (-(-longest // block_size) + 1) + 8
    return ContinuousBatchingConfig(block_size=block_size, num_blocks=blocks,
                                    max_batch_tokens=max(256, sum(map(len, prompts))),
                                    max_requests_per_batch=len(prompts), allow_block_sharing=False)


def generate(model, implementation: str, prompts, max_new_tokens: int = 8, config=None,
             record_logits: bool = True) -> Run:
    """Greedy `generate_batch` with `implementation`. record_logits: keep every step's logits by
    prompt (hooks that sync once per step: leave it off to time)."""
    from transformers import GenerationConfig

    model.set_attn_implementation(implementation)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=-1)
    steps: list = []   # per forward: (position of each logits row, logits rows)

    def on_forward(_module, _args, kwargs):
        steps.append([kwargs["position_ids"][0, kwargs["logits_indices"]].tolist(), None])

    def on_logits(_module, _args, out):
        if steps and steps[-1][1] is None:
            steps[-1][1] = out[0].float()

    hooks = [model.register_forward_pre_hook(on_forward, with_kwargs=True),
             model.lm_head.register_forward_hook(on_logits)] if record_logits else []
    try:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=gen,
                                       continuous_batching_config=config or cb_config(prompts, max_new_tokens))
        seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    failed = [o.error for o in outputs.values() if o.error]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch with {implementation}: {len(failed)} of {len(prompts)} requests "
                           f"failed, {len(prompts) - len(outputs)} missing; first error: "
                           f"{failed[0] if failed else None}")
    by_prompt = {tuple(o.prompt_ids): o for o in outputs.values()}
    tokens = [list(by_prompt[tuple(p)].generated_tokens) for p in prompts]
    return Run(tokens, _logits_by_prompt(steps, prompts) if record_logits else None, seconds)


def throughput(kind: str, prompts, max_new_tokens: int, reps: int = 1) -> dict:
    """generate_batch tokens/s (greedy, no logits kept) of the tiny `kind` model on the GPU on pagedattn and
    on transformers' own "paged|sdpa", same prompts (`make demo`; any kind in one call): each once
    untimed (compiles, allocator), then `reps` timed runs alternating; the medians, every run's figure and
    how many sequences came out identical."""
    from . import transformers as pa_hf

    impls = {"pagedattn": pa_hf.register(), "sdpa": "paged|sdpa"}
    model, config = tiny_model(kind, torch.bfloat16, "cuda"), cb_config(prompts, max_new_tokens)
    run = lambda impl: generate(model, impl, prompts, max_new_tokens, config=config,  # noqa: E731
                                record_logits=False)
    tokens = {key: run(impl).tokens for key, impl in impls.items()}
    runs = {key: [] for key in impls}
    for _ in range(reps):
        for key, impl in impls.items():
            runs[key].append(run(impl).tokens_per_s)
    tps = {key: statistics.median(v) for key, v in runs.items()}
    return {"kind": kind, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "max_new_tokens": max_new_tokens, "block_size": config.block_size,
            "pagedattn_tokens_per_s": tps["pagedattn"], "sdpa_tokens_per_s": tps["sdpa"],
            "speedup": tps["pagedattn"] / tps["sdpa"], "runs_tokens_per_s": runs,
            "identical_sequences": sum(a == b for a, b in zip(tokens["pagedattn"], tokens["sdpa"]))}


def _logits_by_prompt(steps, prompts):
    """Row r of step s belongs to the prompt whose length is position + 1 - s (every prompt is
    prefilled in step 0 and decodes one token per step after it; lengths are distinct)."""
    lengths = [len(p) for p in prompts]
    if len(set(lengths)) != len(lengths):
        return None
    out = [[] for _ in prompts]
    for s, (positions, rows) in enumerate(steps):
        for r, pos in enumerate(positions):
            n = pos + 1 - s
            if n not in lengths or len(out[lengths.index(n)]) != s:
                return None
            out[lengths.index(n)].append(rows[r])
    return out


def eager_reference(model, prompts, max_new_tokens: int = 8) -> Run:
    """transformers' plain greedy `generate` of each prompt alone with the "eager" attention (no
    continuous batching): the reference for features its paged implementations drop (softcap)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("eager")
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    tokens, logits = [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=model.device), generation_config=gen)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append([x[0].float() for x in out.logits])
    return Run(tokens, logits, time.perf_counter() - t0)


def compare(ref: Run, run: Run, rtol: float = 0.04) -> dict:
    """Step by step, per prompt: logits within rtol * max|ref logits| of the reference (skipped when
    `run` kept none), and the same greedy token unless the reference's top-2 margin at that step is
    below twice that tolerance (a near-tie bf16 may break either way: the prompt is compared no
    further). Returns a summary; the caller asserts on it."""
    worst, ties, mismatches = 0.0, [], []
    for i, ref_steps in enumerate(ref.logits):
        steps = run.logits[i] if run.logits is not None else [None] * len(ref_steps)
        for s, (a, b) in enumerate(zip(ref_steps, steps)):
            tol = rtol * float(a.abs().max())
            err = float((a - b.to(a.device)).abs().max()) if b is not None else 0.0
            worst = max(worst, err / max(tol, 1e-6))
            if err > tol:
                mismatches.append(f"prompt {i} step {s}: logits differ by {err:.4g} > {tol:.4g}")
                break
            if ref.tokens[i][s] != run.tokens[i][s]:
                top = a.topk(2).values
                margin = float(top[0] - top[1])
                if margin > 2 * tol:
                    mismatches.append(f"prompt {i} step {s}: token {run.tokens[i][s]} != {ref.tokens[i][s]} "
                                      f"with a top-2 margin of {margin:.4g} (> {2 * tol:.4g})")
                else:
                    ties.append((i, s, margin))
                break
    identical = sum(a == b for a, b in zip(ref.tokens, run.tokens))
    return dict(worst=worst, ties=ties, mismatches=mismatches, identical=identical)
