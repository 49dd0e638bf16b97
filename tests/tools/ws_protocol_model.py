"""A model of prefill_ws's hand-over protocol with the producer feed (ws_producer.cuh: ws_produce's K/V
ring, ws_feed_q, ws_consume_fed and ws_consume's chain), run under random interleavings.

One agent per role: the producer (its four warps act together here) and the two consumer warpgroups.
Each is a generator that yields the condition it waits on. A scheduler advances a random ready agent
until all are done; none ready then is a deadlock.

mbarriers follow PTX: a wait on parity P returns once the phase of parity P has completed, and a fresh
barrier's phase 1 counts as completed. Named barriers (the ping-pong turns, the consumers' tile_sync)
are modelled as arrivals that one side must not make twice before the other syncs.

Every shared-memory resource records what was last written to it: a K or V ring slot, a Q tile per
warpgroup, a work slot. Reads check that the slot holds the right item and step. Writes check that no
reader still holds the slot.

Covered: one or two Q tiles (kWsQFeed 1 / 2); chained items (2); items with no steps, which break the
chain; idle items (kWsPair: the other CTA's alone, no Q rows, steps passed), which break it too; last
steps that clear V's tail (a tile_sync over both warpgroups); two or three ring slots; any number of
items, none included."""
import random
from dataclasses import dataclass, field


class Deadlock(Exception):
    pass


class Mbarrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):  # the phase of this parity has completed
        return (self.phase & 1) != parity


@dataclass
class Resource:
    """What a shared-memory buffer holds and who reads it now."""
    name: str
    content: object = None
    readers: set = field(default_factory=set)

    def write(self, content):
        assert not self.readers, f"{self.name} overwritten with {content} while {self.readers} read {self.content}"
        self.content = content

    def hold(self, who, expect):
        assert self.content == expect, f"{who} expected {expect} in {self.name}, found {self.content}"
        self.readers.add(who)

    def drop(self, who):
        self.readers.discard(who)


def simulate(items, tiles, stages, seed):
    """items: per CTA item, (steps, partial last step[, idle]); idle (kWsPair): the item is the other CTA's
    alone, so it has no Q rows and its steps pass through (ws_pass_steps). tiles: 1 or 2 (2: chained).
    Raises on a violation."""
    items = [(*item, False)[:3] for item in items]
    rng = random.Random(seed)
    chain = tiles == 2
    slots = 4 if chain else 2
    full_k = [Mbarrier(1) for _ in range(stages)]
    full_v = [Mbarrier(1) for _ in range(stages)]
    empty_k = [Mbarrier(2) for _ in range(stages)]  # a consumer warpgroup each (their warps act together)
    empty_v = [Mbarrier(2) for _ in range(stages)]
    q_full = [[Mbarrier(1) for _ in range(tiles)] for _ in range(2)]
    q_empty = [[Mbarrier(1) for _ in range(tiles)] for _ in range(2)]
    k_slot = [Resource(f"K[{s}]") for s in range(stages)]
    v_slot = [Resource(f"V[{s}]") for s in range(stages)]
    q_tile = [[Resource(f"Q[wg{g}][{t}]") for t in range(tiles)] for g in range(2)]
    work = [[Resource(f"work[wg{g}][{k}]") for k in range(slots)] for g in range(2)]
    turn = {2: 0, 3: 0}  # named barriers 2 and 3: arrivals not yet synced (bar.arrive before bar.sync)
    tile_sync = {"gen": 0, "here": set()}

    def wait(cond):
        while not cond():
            yield cond

    def producer():
        ring = 0
        for n, (steps, _, _) in enumerate(items):
            for it in range(steps):
                g = ring + it
                s, ph = g % stages, (g // stages) & 1
                yield from wait(lambda: empty_k[s].done(ph ^ 1))
                k_slot[s].write((n, it))
                full_k[s].arrive()
                if it == 0:
                    yield from feed(n, items[n])
                yield from wait(lambda: empty_v[s].done(ph ^ 1))
                v_slot[s].write((n, it))
                full_v[s].arrive()
            if steps == 0:
                yield from feed(n, items[n])
            ring += steps
        yield from feed(len(items), None)  # the end: a work item with b = -1

    def feed(n, item):
        t, use = n % tiles, n // tiles
        for wg in range(2):
            yield from wait(lambda: q_empty[wg][t].done((use & 1) ^ 1))
            work[wg][n % slots].write(("end",) if item is None else (n, item[0], item[2]))
            if item is not None and not item[2]:  # an idle item has no Q rows
                q_tile[wg][t].write(n)
            q_full[wg][t].arrive()

    def my_turn(wg):
        bar = 2 + wg
        yield from wait(lambda: turn[bar] > 0)
        turn[bar] -= 1

    def your_turn(wg):
        bar = 3 - wg
        assert turn[bar] == 0, f"bar {bar} arrived on twice"
        turn[bar] += 1

    def sync_tiles(wg):  # tile_sync: bar.sync 1 over both warpgroups
        gen = tile_sync["gen"]
        tile_sync["here"].add(wg)
        if len(tile_sync["here"]) == 2:
            tile_sync["gen"] += 1
            tile_sync["here"] = set()
        yield from wait(lambda: tile_sync["gen"] > gen)

    def consumer(wg):
        me = f"wg{wg}"
        if wg == 1:
            your_turn(1)  # pp.start()
        ring, n, s0_ready = 0, 0, False
        while True:
            t = n % tiles
            yield from wait(lambda: q_full[wg][t].done((n // tiles) & 1))
            w = work[wg][n % slots]
            if w.content == ("end",):
                break
            w.hold(me, (n, items[n][0], items[n][2]))
            steps, partial, idle = items[n]
            if idle:  # ws_consume_fed: the steps read, the tile and slot handed back, the steps passed
                w.drop(me)
                q_empty[wg][t].arrive()
                for it in range(steps):
                    g = ring + it
                    s, ph = g % stages, (g // stages) & 1
                    yield from wait(lambda: full_k[s].done(ph))
                    yield from wait(lambda: full_v[s].done(ph))
                    empty_k[s].arrive()
                    empty_v[s].arrive()
                ring += steps
                n += 1
                s0_ready = False
                continue
            q_tile[wg][t].hold(me, n)

            def take(kind, it, hold_s=True):
                g = ring + it
                s, ph = g % stages, (g // stages) & 1
                bar, slot = (full_k, k_slot) if kind == "k" else (full_v, v_slot)
                yield from wait(lambda: bar[s].done(ph))
                slot[s].hold(me, (n + (it >= steps), it - steps if it >= steps else it))

            def release(kind, it):
                s = (ring + it) % stages
                (k_slot if kind == "k" else v_slot)[s].drop(me)
                (empty_k if kind == "k" else empty_v)[s].arrive()

            if steps == 0:
                q_tile[wg][t].drop(me)
                q_empty[wg][t].arrive()
                s0_ready = False
            else:
                if not s0_ready:
                    yield from take("k", 0)
                    yield from my_turn(wg)
                    your_turn(wg)
                    release("k", 0)
                for it in range(1, steps):
                    yield from take("k", it)
                    yield from take("v", it - 1)
                    yield from my_turn(wg)
                    your_turn(wg)
                    release("k", it)
                    release("v", it - 1)
                q_tile[wg][t].drop(me)  # next_q(): the last S is done
                q_empty[wg][t].arrive()
                chained = False
                if chain:  # WsChain::next(): item n + 1 handed over, with steps?
                    m = n + 1
                    yield from wait(lambda: q_full[wg][m % 2].done((m // 2) & 1))
                    nxt = work[wg][m % slots].content
                    chained = nxt != ("end",) and nxt[1] > 0 and not nxt[2]  # WsChain::next
                    if chained:
                        q_tile[wg][m % 2].hold(me + "-next", m)
                        yield from take("k", steps)
                yield from take("v", steps - 1)
                if partial:
                    yield from sync_tiles(wg)
                yield from my_turn(wg)
                your_turn(wg)
                release("v", steps - 1)
                if chained:
                    release("k", steps)
                    q_tile[wg][(n + 1) % 2].drop(me + "-next")
                s0_ready = chained
            w.hold(me, (n, items[n][0], False))  # the epilogue reads the item's fields
            w.drop(me)
            ring += steps
            n += 1
        if wg == 0:
            yield from my_turn(0)  # pp.finish()

    agents = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {name: None for name in agents}
    while agents:
        ready = [name for name in agents if waiting[name] is None or waiting[name]()]
        if not ready:
            raise Deadlock(f"no agent can move: {sorted(agents)}")
        name = rng.choice(ready)
        try:
            waiting[name] = next(agents[name])
        except StopIteration:
            del agents[name]
    assert turn == {2: 0, 3: 0}, f"ping-pong turns left over: {turn}"


def random_items(rng):
    return [(rng.choice([0, 1, 1, 2, 3, 5]), rng.random() < 0.3, rng.random() < 0.15) for _ in range(rng.randint(0, 9))]


def main(cases=3000, seed=0):
    rng = random.Random(seed)
    for i in range(cases):
        items = random_items(rng)
        for tiles in (1, 2):
            for stages in (2, 3):
                simulate(items, tiles, stages, seed=rng.randrange(2**31))
    print(f"{cases} item lists x 1-2 Q tiles x 2-3 ring slots: no deadlock, no buffer read while overwritten")


if __name__ == "__main__":
    main()
