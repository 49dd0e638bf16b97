"""Tokens/s of transformers' continuous batching (`generate_batch`, greedy) on pagedattn ("paged|pagedattn")
against transformers' own "paged|sdpa", same tiny random-weight model (pagedattn/integrations/hf_tiny.py, no
download), same batch (`hf_tiny.throughput`: each once untimed, then --reps timed runs, alternating); the
median is recorded in perf/results/hf_continuous_batching_<gpu>_<date>_<commit>.json. paged|sdpa ignores
Gemma-2's attention softcap, so its gemma2 tokens differ from ours (the shapes are the same).

    python perf/hf_continuous_batching.py [--kinds llama,mistral,gemma2] [--prompts 32] [--max-prompt 256]
        [--max-new-tokens 128] [--reps 3] [--out perf/results]
"""
from __future__ import annotations

import argparse

import torch

from pagedattn.bench.meta import write_quick
from pagedattn.info import git_commit
from pagedattn.integrations import hf_tiny


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(hf_tiny.KINDS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="perf/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    n, longest = args.prompts, args.max_prompt
    low = max(2, longest // 8)  # n prompt lengths spread evenly over [longest / 8, longest]
    prompts = hf_tiny.tiny_prompts(n, lengths=tuple(low + (longest - low) * i // max(1, n - 1) for i in range(n)))
    results = []
    for kind in args.kinds.split(","):
        r = hf_tiny.throughput(kind, prompts, args.max_new_tokens, args.reps)
        results.append(r)
        print(f"{kind:8s} pagedattn {r['pagedattn_tokens_per_s']:9.1f} tok/s   paged|sdpa {r['sdpa_tokens_per_s']:9.1f}"
              f" tok/s   x{r['speedup']:.2f}   identical sequences {r['identical_sequences']}/{r['prompts']}")
    import transformers

    path = write_quick(args.out, "hf_continuous_batching", results, suffix="_" + (git_commit() or "nocommit")[:7],
                       transformers=transformers.__version__,
                       note="tiny random-weight models (hf_tiny); tokens/s = generated tokens / generate_batch "
                            "wall time, median of the timed runs; paged|sdpa ignores Gemma-2's softcap")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
