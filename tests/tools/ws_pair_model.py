"""A model of prefill_ws's K/V ring in clusters of two CTAs (tile field kWsPair: ws_produce's multicast,
ws_hand_back, ws_pass_steps, the cluster barriers of attn_fwd_ws), run under random interleavings.

Agents, per CTA (rank 0 and 1): its producer (four warps acting together here) and its two consumer
warpgroups. Each is a generator that yields the condition it waits on; a scheduler advances a random
ready agent until all are done, and none ready then is a deadlock.

What the kernel does, as modelled:
- Both CTAs walk the same steps, pair after pair. A pair's CTA either has a tile (its consumers read
  every step's K and V) or passes the steps (ws_pass_steps: waits for each slot to land, reads nothing).
- A producer waits on its own empty barrier (every consumer warpgroup of both CTAs), announces the
  whole step's bytes on its own full barrier (one arrival with expect_tx) and copies its half of the
  boxes into the slot of both CTAs (multicast), each half's bytes completing on the full barrier of
  each CTA. A copy lands at once: the earliest it could, the worst case for overwrites.
- mbarriers follow PTX: a phase completes when its arrivals are in and its transaction count is back
  at zero, whichever comes last; bytes may arrive before they are announced. A wait on parity P
  returns once the phase of parity P has completed (a fresh barrier's phase 1 counts as completed).
- A consumer warpgroup with a tile takes step g's K before step g - 1's V (ws_consume's overlap of
  S(g) with P V(g - 1)), across items too when they are chained (kWsQFeed 2); one passing steps takes
  K(g) then V(g). It hands each slot back on both CTAs' empty barriers.
- A CTA leaves after the cluster barrier at its end (both CTAs' agents done); an arrival or a copy
  reaching a CTA that left is an error, and so is one that lands in a slot a consumer still reads, or
  bytes of a slot's next use counted in the phase of its current one.

Switches (`faults`) break one rule each, to show that the model catches it: "own_empty" (hand slots back
to one's own CTA only), "pass_early" (pass a step without waiting for it to land), "no_exit_sync" (leave
without the cluster barrier)."""
import random


class Deadlock(Exception):
    pass


class Violation(AssertionError):
    pass


class TxBarrier:
    """An mbarrier with arrivals and a transaction count; `use` numbers the phase now open."""

    def __init__(self, name, count):
        self.name, self.count, self.pending, self.tx, self.phase = name, count, count, 0, 0

    def _settle(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx=0):
        self.pending -= 1
        if self.pending < 0:
            raise Violation(f"{self.name}: more arrivals than expected")
        self.tx += expect_tx
        self._settle()

    def complete_tx(self, nbytes, use):
        if use != self.phase:
            raise Violation(f"{self.name}: bytes of use {use} counted in phase {self.phase}")
        self.tx -= nbytes
        self._settle()

    def done(self, parity):
        return (self.phase & 1) != parity


def simulate(pairs, stages, seed, faults=(), chain=False):
    """pairs: per pair (steps, tiles) with tiles a pair of bools, the CTAs (rank 0, 1) that have a tile
    of their own; chain: items chained (kWsQFeed 2). Raises Violation or Deadlock."""
    rng = random.Random(seed)
    half = 1  # the bytes of one CTA's half of a step (a unit)
    ctas = []
    for r in range(2):
        ctas.append(dict(
            full_k=[TxBarrier(f"cta{r}.full_k[{s}]", 1) for s in range(stages)],
            full_v=[TxBarrier(f"cta{r}.full_v[{s}]", 1) for s in range(stages)],
            empty_k=[TxBarrier(f"cta{r}.empty_k[{s}]", 4) for s in range(stages)],  # 2 warpgroups x 2 CTAs
            empty_v=[TxBarrier(f"cta{r}.empty_v[{s}]", 4) for s in range(stages)],
            # slot contents: {half: step} per slot, and who reads it now
            k=[dict() for _ in range(stages)], v=[dict() for _ in range(stages)],
            k_readers=[set() for _ in range(stages)], v_readers=[set() for _ in range(stages)],
            done=set(), left=False))

    def wait(cond):
        while not cond():
            yield cond

    def reach(cta, what):
        if cta["left"]:
            raise Violation(f"{what} reaches a CTA that left")

    def producer(r):
        me = ctas[r]
        g = 0  # the CTA's step
        for steps, _ in pairs:
            for _ in range(steps):
                s, use = g % stages, g // stages
                for kind in ("k", "v"):
                    yield from wait(lambda: me[f"empty_{kind}"][s].done((use & 1) ^ 1))
                    me[f"full_{kind}"][s].arrive(expect_tx=2 * half)
                    for dst in ctas:  # this CTA's half into both CTAs' slots (multicast)
                        reach(dst, f"cta{r}'s copy")
                        if dst[f"{kind}_readers"][s]:
                            raise Violation(f"cta{r}'s copy of step {g} lands in a {kind} slot that "
                                            f"{dst[f'{kind}_readers'][s]} still read")
                        dst[kind][s][r] = g
                        dst[f"full_{kind}"][s].complete_tx(half, use)
                g += 1

    def consumer(r, wg):
        me, who = ctas[r], f"cta{r}.wg{wg}"

        def take(kind, g, read):  # wait for step g's K or V slot, read it (or pass it), hand it back
            s, use = g % stages, g // stages
            if read or "pass_early" not in faults:
                yield from wait(lambda: me[f"full_{kind}"][s].done(use & 1))
            if read:  # both halves must be this step's
                if me[kind][s] != {0: g, 1: g}:
                    raise Violation(f"{who} reads {kind} slot {s} for step {g}: it holds {me[kind][s]}")
                me[f"{kind}_readers"][s].add(who)
                yield None  # others may run while it reads
                me[f"{kind}_readers"][s].discard(who)
            for dst in ctas if "own_empty" not in faults else (me,):
                reach(dst, f"{who}'s hand-back")
                dst[f"empty_{kind}"][s].arrive()

        # The order of a CTA's waits: ws_consume takes K(g) before V(g - 1) inside an item, and with the
        # chain (kWsQFeed 2) across items too, where the next item has a tile of its own; ws_pass_steps
        # takes K(g), V(g).
        g, v_due = 0, None  # v_due: the step whose V is still to take (read or not)
        for n, (steps, tiles) in enumerate(pairs):
            read = tiles[r]
            for _ in range(steps):
                yield from take("k", g, read)
                if v_due is not None:
                    yield from take("v", *v_due)
                    v_due = None
                if read:
                    v_due = (g, True)
                else:
                    yield from take("v", g, False)
                g += 1
            nxt = pairs[n + 1] if n + 1 < len(pairs) else None
            chained = chain and read and nxt is not None and nxt[0] > 0 and nxt[1][r]
            if v_due is not None and not chained:
                yield from take("v", *v_due)
                v_due = None
        if v_due is not None:
            yield from take("v", *v_due)

    def leave(r):  # the cluster barrier at the end of every agent of the CTA
        ctas[r]["done"].add("all")
        if "no_exit_sync" not in faults:
            yield from wait(lambda: all(c["done"] for c in ctas))
        ctas[r]["left"] = True

    def cta_agents(r):
        agents = [producer(r), consumer(r, 0), consumer(r, 1)]
        return agents

    def run_cta(r):  # the CTA's three agents interleaved, then its exit
        subs = cta_agents(r)
        waits = [None] * len(subs)
        while subs:
            ready = [i for i in range(len(subs)) if waits[i] is None or waits[i]()]
            if not ready:
                yield lambda: any(waits[i] is None or waits[i]() for i in range(len(subs)))
                continue
            i = rng.choice(ready)
            try:
                waits[i] = next(subs[i])
            except StopIteration:
                del subs[i], waits[i]
            yield None
        yield from leave(r)

    agents = {r: run_cta(r) for r in range(2)}
    waiting = {r: None for r in agents}
    while agents:
        ready = [r for r in agents if waiting[r] is None or waiting[r]()]
        if not ready:
            raise Deadlock("no agent can move")
        r = rng.choice(ready)
        try:
            waiting[r] = next(agents[r])
        except StopIteration:
            del agents[r]


def random_pairs(rng):
    kinds = [(True, True)] * 4 + [(True, False), (False, True)]
    return [(rng.choice([0, 1, 1, 2, 3, 5]), rng.choice(kinds)) for _ in range(rng.randint(0, 8))]


def main(cases=2000, seed=0):
    rng = random.Random(seed)
    for _ in range(cases):
        pairs = random_pairs(rng)
        for stages in (2, 3):
            for chain in (False, True):
                simulate(pairs, stages, seed=rng.randrange(2**31), chain=chain)
    print(f"{cases} pair lists x 2-3 ring slots x items chained or not: no deadlock, no copy into a slot being read, "
          f"no bytes counted in the wrong phase, nothing reaching a CTA that left")


def caught(fault, cases=300, seed=0):
    """Whether some random case fails with `fault` switched on."""
    rng = random.Random(seed)
    for _ in range(cases):
        pairs = random_pairs(rng)
        try:
            simulate(pairs, 2, seed=rng.randrange(2**31), faults=(fault,))
        except (Violation, Deadlock):
            return True
    return False


if __name__ == "__main__":
    main()
    for fault in ("own_empty", "pass_early", "no_exit_sync"):
        print(fault, "caught" if caught(fault) else "NOT caught")
