"""prefill_ws's pair schedule (kWsPair) transcribed into Python and checked over random batches: ws_slot,
schedule_tile / tile_keys / split_steps (tile_scheduler.cuh), ws_pair_item (ws_pipeline.cuh), and the
mask's test for a sub-tile every row sees whole (mask.cuh, AttnMask::mask_keys).

For every pair of CTAs (items 2 P and 2 P + 1 of a grid whose row tiles the host made even) and every
split, it checks that:
- both CTAs walk the same steps, and a CTA with no tile of its own walks its partner's;
- the two items are row tiles of one (request, KV head) column and split, the partner's row tile being
  row_tile ^ 1;
- a tile's splits are disjoint and cover every step its own rows see;
- every step a tile walks outside its own keys is wholly invisible to each of its rows, and the mask
  does not take it for an interior sub-tile (which it would leave unmasked).

Run: python pair_schedule_emulation.py [cases]. tests/test_attention.py runs it on the CPU."""
import random
import sys


def visible_keys(q_len, k_len, i, causal, window):
    pos = k_len - q_len + i
    end, begin = k_len, 0
    left, right = window if window else (-1, -1)
    if causal:
        end = pos + 1
    elif window and right >= 0:
        end = pos + 1 + right
    if window and left >= 0:
        begin = pos - left
    end = min(end, k_len)
    begin = max(begin, 0)
    return begin, max(end, begin)


def tile_keys(p, q_len, k_len, tile):
    """tile_keys: (row0, mask_from, mask_below, step_begin, step_end) or None (no such tile)."""
    rows = q_len * p["group"]
    row0 = tile * p["block_m"]
    if row0 >= rows:
        return None
    i_min = row0 // p["group"]
    i_max = (min(rows, row0 + p["block_m"]) - 1) // p["group"]
    first = visible_keys(q_len, k_len, i_min, p["causal"], p["window"])
    last = visible_keys(q_len, k_len, i_max, p["causal"], p["window"])
    lo = first[0] // p["stage"]
    hi = -(-last[1] // p["stage"]) if last[1] > first[0] else lo
    return dict(row0=row0, mask_from=first[1], mask_below=last[0], lo=lo, hi=hi)


def ws_slot(p, item):
    per_split = p["seqs"] * p["heads"] * p["tiles"]
    split, rem = divmod(item, per_split)
    column, t = divmod(rem, p["tiles"])
    return dict(column=column, row_tile=p["tiles"] - 1 - t, split=split)


def split_steps(p, split, lo, hi):
    steps = hi - lo
    per = -(-steps // p["splits"])
    return lo + min(steps, split * per), lo + min(steps, split * per + per)


def pair_item(p, pair, rank):
    """ws_pair_item for the CTA of cluster rank `rank`: (own tile or None, column, split, steps) or None."""
    total = p["seqs"] * p["heads"] * p["tiles"] * p["splits"]
    mine = 2 * pair + rank
    exists = mine < total
    slot = ws_slot(p, mine if exists else mine ^ 1)
    b = slot["column"] // p["heads"]
    q_len, k_len = p["q_lens"][b], p["k_lens"][b]
    own = tile_keys(p, q_len, k_len, slot["row_tile"])
    has_mine = exists and own is not None
    if exists and (mine ^ 1) < total:
        other = tile_keys(p, q_len, k_len, slot["row_tile"] ^ 1)
        if other is not None:
            lo = min(own["lo"], other["lo"]) if has_mine else other["lo"]
            hi = max(own["hi"], other["hi"]) if has_mine else other["hi"]
        elif not has_mine:
            return None
        else:
            lo, hi = own["lo"], own["hi"]
    elif own is None:
        return None
    else:
        lo, hi = own["lo"], own["hi"]
    steps = split_steps(p, slot["split"], lo, hi)
    return (own if has_mine else None), slot, steps


def check(p):
    total = p["seqs"] * p["heads"] * p["tiles"] * p["splits"]
    walked = {}  # (column, row_tile) -> [steps of each split]
    for pair in range(-(-total // 2)):
        got = [pair_item(p, pair, r) for r in (0, 1)]
        live = [g for g in got if g is not None]
        if not live:
            continue
        assert len(live) == 2, f"pair {pair}: one CTA walks, the other not: {got}"
        (own0, s0, st0), (own1, s1, st1) = live
        assert st0 == st1, f"pair {pair}: the CTAs walk different steps {st0} / {st1}"
        assert s0["column"] == s1["column"] and s0["split"] == s1["split"], (pair, s0, s1)
        for own, slot, steps in live:
            if own is None:
                continue
            walked.setdefault((slot["column"], slot["row_tile"]), []).append(steps)
            b = slot["column"] // p["heads"]
            q_len, k_len = p["q_lens"][b], p["k_lens"][b]
            rows = range(own["row0"], min(q_len * p["group"], own["row0"] + p["block_m"]))
            for step in range(*steps):
                if own["lo"] <= step < own["hi"]:
                    continue
                key0 = step * p["stage"]
                for r in rows:
                    begin, end = visible_keys(q_len, k_len, r // p["group"], p["causal"], p["window"])
                    assert end <= key0 or begin >= key0 + p["stage"] or begin == end, \
                        f"row {r} sees keys of step {step}, outside its tile's steps {own['lo']}..{own['hi']}"
                interior = (not p["window"] or key0 >= own["mask_below"]) and key0 + p["stage"] <= own["mask_from"]
                assert not interior, f"step {step} would go unmasked"
    for b in range(p["seqs"]):
        for h in range(p["heads"]):
            for rt in range(p["tiles"]):
                own = tile_keys(p, p["q_lens"][b], p["k_lens"][b], rt)
                got = walked.get((b * p["heads"] + h, rt), [])
                if own is None:
                    assert not got
                    continue
                assert len(got) == p["splits"], (b, h, rt, got)
                covered = sorted(s for lo, hi in got for s in range(lo, hi))
                assert len(covered) == len(set(covered)), f"splits overlap: {got}"
                assert set(range(own["lo"], own["hi"])) <= set(covered), (own, got)


def random_batch(rng):
    group = rng.choice([1, 2, 4, 7, 8, 16])
    seqs = rng.randint(1, 4)
    q_lens = [rng.choice([0, 1, 17, 31, 64, 100, 200, 333, 1000]) for _ in range(seqs)]
    k_lens = [q + rng.choice([0, 0, 0, 5, 130, 1500]) for q in q_lens]
    block_m = 128
    max_q = max(q_lens)
    tiles = max(1, -(-max_q * group // block_m))
    tiles += tiles % 2  # the host pads to even
    window = rng.choice([None, None, (rng.randint(0, 400), rng.choice([-1, 0, 50]))])
    return dict(group=group, seqs=seqs, heads=rng.randint(1, 3), q_lens=q_lens, k_lens=k_lens, block_m=block_m,
                tiles=tiles, splits=rng.choice([1, 1, 2, 3]), causal=rng.random() < 0.6, window=window,
                stage=rng.choice([64, 128]))


def main(cases=3000, seed=0):
    rng = random.Random(seed)
    for _ in range(cases):
        check(random_batch(rng))
    print(f"{cases} batches: pairs walk the same steps; every tile's own steps covered once; "
          f"the steps added for a partner are invisible to the tile's rows and masked")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
