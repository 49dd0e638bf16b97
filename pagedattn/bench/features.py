"""features suite: the attention variants of issue 14 (window, softcap, ALiBi, sinks) against the plain
kernel timed in the same process (a ratio goal each, CASES), and head dim 512 against the copy ceiling.
Checked once against pagedattn.reference; timed under both methods (attention.run_case).
"""
from __future__ import annotations

from .attention import _dims, _params, run_case
from .common import Case, Ctx

SOFTCAP = 30.0
# (id, shape, features of ours, (peer shape, ratio goal) or fraction-of-copy goal)
CASES = (
    ("decode/B16/ctx32768/window4096", dict(B=16, ctx=32768, q_len=1), dict(window_size=(4096, 0)),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.15)),
    ("decode/B16/ctx4096/softcap", dict(B=16, ctx=4096, q_len=1), dict(softcap=SOFTCAP),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("decode/B16/ctx4096/alibi", dict(B=16, ctx=4096, q_len=1), dict(alibi_slopes="head"),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("decode/B16/ctx4096/sinks", dict(B=16, ctx=4096, q_len=1), dict(s_aux="head"),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("prefill/B4/S4096/softcap", dict(B=4, ctx=4096, q_len=4096), dict(softcap=SOFTCAP),
     dict(peer=dict(B=4, ctx=4096, q_len=4096), ratio=1 / 1.15)),
    ("decode/B16/ctx4096/d512", dict(B=16, ctx=4096, q_len=1, d=512), {}, dict(fraction=0.85)),
)
TINY_CASES = (
    ("decode/B2/ctx200/window64", dict(B=2, ctx=200, q_len=1), dict(window_size=(64, 0)),
     dict(peer=dict(B=2, ctx=64, q_len=1), ratio=1 / 1.15)),
    ("decode/B2/ctx80/sinks", dict(B=2, ctx=80, q_len=1), dict(s_aux="head"),
     dict(peer=dict(B=2, ctx=80, q_len=1), ratio=1 / 1.05)),
)
PLAIN = "pagedattn plain"


def cases(ctx: Ctx) -> list[Case]:
    """Each case run by attention.run_case, the plain kernel at the goal's peer shape as peer PLAIN."""
    out = []
    for cid, shape, feats, goal in (TINY_CASES if ctx.tiny else CASES):
        params = _params(ctx, shape["B"], shape["q_len"], shape["ctx"], "auto", layout="NHD",
                         d=shape.get("d", _dims(ctx)["d"]), peers="base" if "peer" in goal else "")
        params["features"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in feats.items()}
        goals = {"fraction": goal.get("fraction")}
        if "peer" in goal:
            params.update(base=goal["peer"], base_name=PLAIN)
            goals["vs"] = (PLAIN, goal["ratio"])
        out.append(Case(cid, "features", params, lambda ctx, rec, p=params, g=goals: run_case(ctx, rec, p, g)))
    return out
