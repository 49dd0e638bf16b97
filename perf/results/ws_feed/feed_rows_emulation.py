# Session 32, CPU: a Python transcription of WsQFeedRows (ws_producer.cuh) against load_q_rows (mainloop_sm80.cuh),
# SmemLayoutQ as CuTe builds it (Swizzle<3,3,3> over 8 x 64 atoms, 64-column panels). Run: python3 feed_rows_emulation.py
# Emulates load_q_rows (the consumer's) and WsQFeedRows (the producer's walk) for one warpgroup's 64 rows:
# the sets of (smem element offset, q element offset or None) must be equal.
import random
def smem_q(r, c, kBlockM):
    off = r % 8 * 64 + c % 64
    off ^= (off & (0b111 << 6)) >> 3
    return off + (r // 8) * 512 + (c // 64) * kBlockM * 64
def load_q_rows(D, kBlockM, p, w, row_begin, rows, threads):
    kChunks = D // 8; out = set()
    for tid in range(threads):
        for i in range(tid, rows * kChunks, threads):
            r = row_begin + i // kChunks; col = (i % kChunks) * 8
            R = w['row0'] + r; t = R // p['group']; g = R - t * p['group']
            ok = t < w['q_len'] and col < p['head_size']
            src = (w['q_start'] + t) * p['rs'] + (w['kv_head'] * p['group'] + g) * p['hs'] + col
            out.add((smem_q(r, col, kBlockM), src if ok else None))
    return out
def feed_rows(D, kBlockM, p, w, wg, threads=128):
    kChunks = D // 8; assert threads % kChunks == 0; kStep = threads // kChunks; assert 64 % kStep == 0
    out = set()
    for tid in range(threads):
        R = w['row0'] + 64 * wg + tid // kChunks
        t = R // p['group']; g = R - t * p['group']
        dt = kStep // p['group']; dg = kStep - dt * p['group']
        step = dt * p['rs'] + dg * p['hs']; carry = p['rs'] - p['group'] * p['hs']
        src = (w['q_start'] + t) * p['rs'] + (w['kv_head'] * p['group'] + g) * p['hs'] + tid % kChunks * 8
        col = tid % kChunks * 8; row = 64 * wg + tid // kChunks
        first = smem_q(row, col, kBlockM)
        for k in range(64 // kStep):
            ok = col < p['head_size'] and t < w['q_len']
            dst = first + kStep * k * 64 if kStep % 8 == 0 else smem_q(row + kStep * k, col, kBlockM)
            out.add((dst, src if ok else None))
            t += dt; g += dg; src += step
            if g >= p['group']:
                g -= p['group']; t += 1; src += carry
    return out
rng = random.Random(0)
n = 0
for _ in range(3000):
    D = rng.choice([64, 128, 256]); kBlockM = 128
    group = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32])
    Hkv = rng.randint(1, 4); hs = rng.choice([D, D + 8, 2 * D]); rs = hs * group * Hkv + rng.choice([0, 8, 64])
    head_size = rng.choice([D, D - 8, D - 16]) if D > 64 else rng.choice([64, 56])
    p = dict(group=group, hs=hs, rs=rs, head_size=head_size)
    q_len = rng.randint(1, 300); row0 = rng.randrange(0, q_len * group, 128) if q_len * group > 0 else 0
    w = dict(row0=row0, q_len=q_len, q_start=rng.randint(0, 50), kv_head=rng.randrange(Hkv))
    for wg in (0, 1):
        a = load_q_rows(D, kBlockM, p, w, 64 * wg, 64, 128)
        b = feed_rows(D, kBlockM, p, w, wg)
        assert a == b, (D, p, w, wg, len(a ^ b))
        n += 1
print(n, "warpgroup tiles: the walk copies what load_q_rows copies")
