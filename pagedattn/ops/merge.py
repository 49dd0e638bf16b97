"""merge_attn_states: one attention result from results over disjoint parts of the keys.

Context-parallel decode splits each request's keys by tokens across ranks; each rank runs
flash_attn_varlen_func with return_softmax_lse=True over its part and the parts are merged here with
the same stable rule as split-KV inside the kernel (split_combine.cuh):

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

computed from the largest lse_i, in float32. A part whose row saw no key (lse_i = -inf) adds nothing,
even where its out_i is NaN; a row no part saw gives out 0 and lse -inf, as the kernel does.
Learnable sinks (s_aux) are one logit of the whole softmax: pass them to ONE part's call only, or the
merge counts them once per part.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..contract import ContractError, describe


def merge_attn_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *,
                      out: torch.Tensor | None = None, return_lse: bool = False):
    """Merge attention results over disjoint key sets of the same queries.

    outs: each [total_q, Hq, D] (fp16, bf16 or fp32; all alike); lses: each [Hq, total_q] float32, the
    natural-log LSE flash_attn_varlen_func returns. Returns out [total_q, Hq, D] in the parts' dtype
    (written into `out` when given) and, with return_lse, the merged lse [Hq, total_q]."""
    outs, lses = list(outs), list(lses)
    _check(outs, lses, out)
    lse = torch.stack([x.float() for x in lses])                    # [P, Hq, T]
    top = lse.amax(dim=0)
    top_safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top_safe)                                   # exp(-inf) = 0 for empty parts
    total = w.sum(dim=0)
    merged_lse = torch.where(total > 0, top_safe + torch.log(total), torch.full_like(top, float("-inf")))
    w = w / total.clamp_min(1.0)  # total >= 1 where any part saw a key (its top term is exp(0)); else w = 0
    acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for wi, oi in zip(w, outs):
        wt = wi.transpose(0, 1).unsqueeze(-1)                       # [T, Hq, 1]
        acc += torch.where(wt > 0, wt * oi.float(), torch.zeros((), device=acc.device))
    result = acc.to(outs[0].dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, merged_lse) if return_lse else result


def _check(outs: list, lses: list, out) -> None:
    if not outs or len(outs) != len(lses):
        raise ContractError(f"merge_attn_states needs one lse per output and at least one part, got "
                            f"{len(outs)} outputs and {len(lses)} lses")
    first = outs[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 3 or \
            first.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ContractError(f"outs[0] must be a [total_q, Hq, D] fp16/bf16/fp32 tensor, got {describe(first)}")
    T, H, _ = first.shape
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or o.shape != first.shape or o.dtype != first.dtype or \
                o.device != first.device:
            raise ContractError(f"outs[{i}] must match outs[0] ({tuple(first.shape)}, {first.dtype}, "
                                f"{first.device}), got {describe(o)}")
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (H, T) or lse.dtype != torch.float32 or \
                lse.device != first.device:
            raise ContractError(f"lses[{i}] must be a float32 [Hq, total_q] = [{H}, {T}] tensor on "
                                f"{first.device}, got {describe(lse)}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != first.shape or
                            out.dtype != first.dtype or out.device != first.device):
        raise ContractError(f"out must match the parts ({tuple(first.shape)}, {first.dtype}), got {describe(out)}")
