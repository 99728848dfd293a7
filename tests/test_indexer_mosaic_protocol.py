"""The fp4 converter kernel's barrier protocol (`pallas_kernels/indexer/gpu_mosaic.py`: `_convert_blocks` and the
scorer's loop in `_kernel_body`), as a block-level model under random schedules.

The GPU interpreter runs the kernel's scores path (test_indexer_kernels.py, with its race detector), but not the
segment top-k's selection PTX, so seg_hist "converter"'s hand-over (seg_ready / hist_done) has no interpreted test.
This model states the order of each warpgroup's waits, arrivals, reads, writes and copies a block, as the kernel
issues them, and checks under many random interleavings (and random TMA landing times):
- no deadlock;
- every mbarrier wait finds the phase it waits for, never one ahead: Pallas tracks one parity bit a barrier per
  waiter, so a phase overrun (a barrier completing twice before its waiter looked) passes or hangs silently;
- the key ring, the e5m2 slots and the segment buffer hold the block each reader expects when it reads it, and the
  converter's histogram holds every block once when the scorer selects (with select_wgs 2, when both warpgroups
  meet at the selection's pair barrier: every block's scores are stored and counted for either of them).
A warpgroup's 128 threads are one actor here (their arrivals complete a phase together), which is what the
kernel's barriers (commit_smem / Pallas' copy barrier, or 128 mbarrier arrivals) make of them.
"""

from __future__ import annotations

import random

import pytest

from pallas_kernels.indexer.gpu_mosaic import CONV_SYNCS, HIST_LAG


class Barrier:
    """An mbarrier completing one phase per `count` arrivals; each waiter keeps its own count of waits (Pallas' parity
    bit a barrier) and must find exactly the phase it waits for completed or the one before it in progress."""

    def __init__(self, name, count=1):
        self.name, self.count, self.arrived, self.phases = name, count, 0, 0
        self.waits = {}

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.phases = 0, self.phases + 1

    def ready(self, who):
        k = self.waits.get(who, 0)   # this waiter's k-th wait: phase k must have completed, phase k + 1 not
        if self.phases > k + 1:
            raise AssertionError(f"{self.name}: phase overrun ({self.phases} completed at {who}'s wait {k})")
        return self.phases == k + 1

    def passed(self, who):
        self.waits[who] = self.waits.get(who, 0) + 1


def simulate(n_read, stages, cslots, conv_sync, hist, seed, ring=HIST_LAG + 1, pair=False):
    """One schedule of one split CTA's n_read blocks; ring: seg_ready's slots (the kernel's: HIST_LAG + 1); pair
    (select_wgs 2, with hist): after their loops both warpgroups meet at the selection's named barrier; pair
    "before_tail" (a wrong order, for the model's teeth): the converter meets the scorer before counting its last
    HIST_LAG blocks and the scorer does not wait for hist_done."""
    rng = random.Random(seed)
    k_bars = [Barrier(f"k_bars[{i}]") for i in range(stages)]
    conv_full = [Barrier(f"conv_full[{i}]") for i in range(cslots)]
    conv_empty = [Barrier(f"conv_empty[{i}]") for i in range(cslots)]
    seg_ready = [Barrier(f"seg_ready[{i}]") for i in range(ring)]
    hist_done = Barrier("hist_done")
    pair_bar = Barrier("pair barrier", count=2)   # a named barrier: both warpgroups' threads, one phase
    key_ring = [None] * stages        # the block each key slot holds
    e5m2 = [None] * cslots            # ... each converted slot
    seg = {}                          # the scorer's scores in the segment buffer, by block
    counted = []                      # the blocks the histogram counted
    in_flight = []                    # copies issued, not landed: (block, slot)

    def issue(j):   # block j's TMA copy into slot j % stages (the slot's readers must be done with its last block)
        if j < n_read:
            in_flight.append((j, j % stages))

    def refill(j):
        issue(j + stages)

    def wait(bar, who):   # yield (the barrier, the waiter) until the barrier's phase completes
        while not bar.ready(who):
            yield bar, who
        bar.passed(who)

    def count(i):   # seg_hist "converter": the converter counts block i's scores
        yield from wait(seg_ready[i % ring], "converter")
        assert i in seg, f"block {i} counted before the scorer stored it"
        counted.append(i)
        yield

    def select(who):   # select_wgs 2: both warpgroups at the selection's first barrier, then its reads
        pair_bar.arrive()
        yield from wait(pair_bar, who)
        assert sorted(seg) == list(range(n_read)), f"{who} selects before every block's scores are stored"
        assert sorted(counted) == list(range(n_read)), f"{who} selects over a histogram missing blocks: {counted}"
        yield

    def converter():
        for j in range(min(stages, n_read)):
            issue(j)
        for j in range(n_read):
            slot, cslot = j % stages, j % cslots
            yield from wait(k_bars[slot], "converter")
            assert key_ring[slot] == j, f"converter read key slot {slot}: block {key_ring[slot]}, wanted {j}"
            yield
            if conv_sync == "early":   # after the conversion (the values in registers)
                refill(j)
                yield
            if j >= cslots:
                yield from wait(conv_empty[cslot], "converter")
            e5m2[cslot] = j
            yield
            conv_full[cslot].arrive()
            yield
            if conv_sync == "commit":
                refill(j)
                yield
            if hist and j >= HIST_LAG:
                yield from count(j - HIST_LAG)
        if pair == "before_tail":
            yield from select("converter")
        if hist:
            for i in range(max(n_read - HIST_LAG, 0), n_read):
                yield from count(i)
            hist_done.arrive()
            yield
        for j in range(max(n_read - cslots, 0), n_read):   # the drain: every release observed
            yield from wait(conv_empty[j % cslots], "converter")
        if pair is True:
            yield from select("converter")

    def scorer():
        for j in range(n_read):
            cslot = j % cslots
            yield from wait(conv_full[cslot], "scorer")
            if conv_sync == "arrive":   # every converter thread is past block j's key slot
                refill(j)
                yield
            assert e5m2[cslot] == j, f"scorer read e5m2 slot {cslot}: block {e5m2[cslot]}, wanted {j}"
            yield   # the wgmma reads the slot until its accumulator is loaded
            assert e5m2[cslot] == j, f"e5m2 slot {cslot} overwritten while the wgmma read block {j}"
            conv_empty[cslot].arrive()
            yield
            seg[j] = True
            yield
            if hist:
                seg_ready[j % ring].arrive()
            else:
                counted.append(j)
            yield
        if pair == "before_tail":
            yield from select("scorer")
            return
        if hist:
            yield from wait(hist_done, "scorer")
        assert sorted(counted) == list(range(n_read)), counted
        if pair:
            yield from select("scorer")

    actors = {"converter": converter(), "scorer": scorer()}
    parked = {}   # an actor's last step: (barrier, waiter) where it waits, else None
    while actors or in_flight:
        choices = list(actors) + (["copy"] if in_flight else [])
        pick = rng.choice(choices)
        if pick == "copy":   # the oldest or a random copy lands (TMA completion order is not issue order)
            j, slot = in_flight.pop(rng.randrange(len(in_flight)))
            key_ring[slot] = j
            k_bars[slot].arrive()
            continue
        try:
            parked[pick] = next(actors[pick])
        except StopIteration:
            del actors[pick]
            parked.pop(pick, None)
        if actors and not in_flight and all(parked.get(a) and not parked[a][0].ready(parked[a][1]) for a in actors):
            raise AssertionError(f"deadlock: {sorted(actors)} wait")
    return counted


@pytest.mark.parametrize("conv_sync", CONV_SYNCS)
@pytest.mark.parametrize("hist,pair", [(False, False), (True, False), (True, True)])
def test_converter_protocol_under_random_schedules(conv_sync, hist, pair):
    """Every conv_sync, with and without seg_hist "converter" (and with it select_wgs 2), for 1-4 e5m2 slots and
    1-4 key slots, splits of 0-9 blocks (fewer than HIST_LAG too), 30 schedules each."""
    for cslots in range(1, 5):
        for stages in range(1, 5):
            for n_read in (0, 1, 2, 3, 5, 9):
                for seed in range(30):
                    simulate(n_read, stages, cslots, conv_sync, hist, seed, pair=pair)


def test_the_model_catches_a_short_seg_ready_ring():
    """The model's teeth: seg_ready with HIST_LAG slots instead of HIST_LAG + 1 overruns a phase in some schedule
    (the scorer completes a slot's next block before the converter waited for its last one)."""
    errors = set()
    for seed in range(300):
        try:
            simulate(9, 3, 2, "early", True, seed, ring=HIST_LAG)
        except AssertionError as e:
            errors.add(str(e).split(":")[1].split("(")[0].strip())
    assert errors == {"phase overrun"}, errors
    for seed in range(50):   # the kernel's ring size: never
        simulate(9, 3, 2, "early", True, seed, ring=HIST_LAG + 1)


def test_the_model_catches_a_deadlock(monkeypatch):
    """The model's teeth, the other way: a converter that never arrives on hist_done leaves the scorer waiting
    (and with select_wgs 2, the converter at the pair barrier too)."""
    real = Barrier.arrive
    monkeypatch.setattr(Barrier, "arrive", lambda self: None if self.name == "hist_done" else real(self))
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(5, 2, 2, "early", True, seed=1)
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(5, 2, 2, "early", True, seed=1, pair=True)


def test_the_model_catches_a_selection_before_the_last_count():
    """The model's teeth for select_wgs 2: a converter that met the scorer at the pair barrier before counting its
    last HIST_LAG blocks (with the scorer's hist_done wait dropped as redundant) selects over a histogram that
    misses them; the check at the barrier finds it. The kernel's order never does."""
    errors = set()
    for seed in range(40):
        try:
            simulate(9, 3, 2, "early", True, seed, pair="before_tail")
        except AssertionError as e:
            errors.add(str(e).split(" selects ")[1].split(":")[0])
    assert errors == {"over a histogram missing blocks"}, errors
    for seed in range(40):
        simulate(9, 3, 2, "early", True, seed, pair=True)
