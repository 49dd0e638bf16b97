"""Engines that run models on pagedattn's kernels.

- `pagedattn.integrations.transformers`: Hugging Face transformers' continuous batching
  (`generate_batch` / `init_continuous_batching`) as the attention implementation "paged|pagedattn".
"""
