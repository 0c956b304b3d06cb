"""HostPool bookkeeping against a plain one-(b, h)-at-a-time reference."""

import random

import pytest
import torch

from infinigen.storage.pool import EVICTIONS, HostPool, PooledTier, capacity_slots


class RefRow:
    """One (batch row, KV head) of the pool, written as plainly as possible."""

    def __init__(self, capacity, policy):
        self.capacity, self.policy = capacity, policy
        self.slot_of = {}  # resident position -> slot
        self.count = {}  # resident position -> fetches since admission
        self.last_use = {}  # resident position -> (step, 0) for a fetch, (latest step seen, 1) for admission
        self.latest_step = -1
        self.length = 0
        self.evictions = 0

    def key(self, p):
        if self.policy == "counter":
            return (self.count[p], p)
        if self.policy == "lru":
            return (self.last_use[p], p)
        return p

    def admit(self, valid_row):
        evicted = []
        new_positions = []
        for ok in valid_row:
            q = self.length
            self.length += 1
            new_positions.append(q)
            if not ok:
                evicted.append(-1)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.capacity) if s not in used]
            victim = -1
            if q < self.capacity:
                assert q in free
                slot = q
            elif free:
                slot = min(free)
            else:
                candidates = [p for p in self.slot_of if p < q]
                victim = min(candidates, key=self.key)
                slot = self.slot_of.pop(victim)
                del self.count[victim], self.last_use[victim]
                self.evictions += 1
            evicted.append(victim)
            self.slot_of[q] = slot
            self.count[q] = 0
            self.last_use[q] = (self.latest_step, 1)
        slots = [self.slot_of.get(q, -1) for q in new_positions]
        return slots, evicted

    def fetch(self, positions, step):
        for p in positions:
            self.count[p] += 1
            self.last_use[p] = max(self.last_use[p], (step, 0))
        self.latest_step = max(self.latest_step, step)


class Ref:
    def __init__(self, batch, kv_heads, capacity, policy):
        self.rows = [[RefRow(capacity, policy) for _ in range(kv_heads)] for _ in range(batch)]

    def admit(self, valid):
        slots, evicted = [], []
        for b, heads in enumerate(self.rows):
            pairs = [row.admit(valid[b].tolist()) for row in heads]
            slots.append([s for s, _ in pairs])
            evicted.append([e for _, e in pairs])
        return torch.tensor(slots, dtype=torch.long), torch.tensor(evicted, dtype=torch.long)

    def fetch(self, selected, step):
        for b, heads in enumerate(self.rows):
            for h, row in enumerate(heads):
                row.fetch(selected[b][h], step)


def as_selection(selected, batch, kv_heads):
    """Per-(b, h) position lists -> (indices, valid) [B, Hkv, n], padding slots holding 0."""
    n = max((len(p) for row in selected for p in row), default=0)
    indices = torch.zeros(batch, kv_heads, n, dtype=torch.long)
    valid = torch.zeros(batch, kv_heads, n, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            ps = sorted(selected[b][h])
            indices[b, h, : len(ps)] = torch.tensor(ps, dtype=torch.long)
            valid[b, h, : len(ps)] = True
    return indices, valid


def check_state(pool, ref):
    batch, kv_heads, cap = pool.batch, pool.kv_heads, pool.capacity
    resident = pool.resident()
    counts = pool.fetch_counts()
    assert pool.length == ref.rows[0][0].length
    assert pool.evictions == sum(row.evictions for heads in ref.rows for row in heads)
    indices = torch.arange(pool.length).expand(batch, kv_heads, -1).contiguous()
    slots = pool.slots_of(indices, resident)
    assert bool((slots[~resident] == 0).all())
    for b in range(batch):
        for h in range(kv_heads):
            row = ref.rows[b][h]
            expect = sorted(row.slot_of)
            assert resident[b, h].nonzero().flatten().tolist() == expect
            assert [counts[b, h, p].item() for p in expect] == [row.count[p] for p in expect]
            assert int(counts[b, h].sum()) == sum(row.count.values())
            # slots: distinct, within capacity, and where the reference put them
            held = {p: int(slots[b, h, p]) for p in expect}
            assert held == row.slot_of
            assert len(set(held.values())) == len(held) <= cap
            assert all(0 <= slot < cap for slot in held.values())


def random_selection(pool, rng):
    resident = pool.resident()
    selected = []
    for b in range(pool.batch):
        per_head = []
        for h in range(pool.kv_heads):
            present = resident[b, h].nonzero().flatten().tolist()
            per_head.append(rng.sample(present, rng.randint(0, len(present))) if present else [])
        selected.append(per_head)
    return selected


def random_valid(rng, batch, n, pad_prob):
    return torch.tensor([[rng.random() >= pad_prob for _ in range(n)] for _ in range(batch)], dtype=torch.bool)


def run_sequence(seed, policy, force_stepwise=False, batch=2, kv_heads=3):
    rng = random.Random(seed)
    cap = rng.randint(1, 8)
    pool = HostPool(batch, kv_heads, cap, policy=policy)
    if force_stepwise:  # exercise the per-admission path where the closed form would apply
        pool._order_is_positional = lambda: False
    ref = Ref(batch, kv_heads, cap, policy)

    def admit(n, pad_prob):
        valid = random_valid(rng, batch, n, pad_prob)
        use_none = pad_prob == 0 and rng.random() < 0.5
        slots, evicted = pool.admit(n, None if use_none else valid)
        exp_slots, exp_evicted = ref.admit(valid)
        assert slots.dtype == torch.long and evicted.dtype == torch.long
        assert torch.equal(slots, exp_slots)
        assert torch.equal(evicted, exp_evicted)
        # this call's new positions are resident exactly where they kept a slot
        assert torch.equal(pool.resident()[:, :, pool.length - n :], slots >= 0)
        check_state(pool, ref)

    admit(rng.randint(0, 3 * cap + 2), 0.3)  # prefill with padding
    step = 0
    for _ in range(rng.randint(10, 25)):
        if rng.random() < 0.7:
            selected = random_selection(pool, rng)
            indices, valid = as_selection(selected, batch, kv_heads)
            pool.record_fetch(indices, valid, step)
            ref.fetch(selected, step)
            check_state(pool, ref)
        if rng.random() < 0.8:
            admit(1, 0.0)
        else:
            admit(rng.randint(0, 2 * cap + 2), 0.2)  # a chunk after fetches
        step += rng.randint(0, 2)  # steps may repeat (admission after a fetch at the same step)
    return pool


@pytest.mark.parametrize("policy", EVICTIONS)
@pytest.mark.parametrize("seed", range(8))
def test_matches_reference(policy, seed):
    run_sequence(seed, policy)


@pytest.mark.parametrize("policy", EVICTIONS)
@pytest.mark.parametrize("seed", range(3))
def test_stepwise_eviction_matches_reference(policy, seed):
    """The per-admission path also handles the cases the closed form covers."""
    run_sequence(100 + seed, policy, force_stepwise=True)


@pytest.mark.parametrize("policy", EVICTIONS)
def test_long_prefill_keeps_most_recent(policy):
    pool = HostPool(2, 2, 5, policy=policy)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    valid[1, 7] = False
    slots, evicted = pool.admit(12, valid)
    resident = pool.resident()
    assert resident[0, 0].nonzero().flatten().tolist() == [7, 8, 9, 10, 11]
    assert resident[1, 1].nonzero().flatten().tolist() == [6, 8, 9, 10, 11]
    assert (slots[0, 0, :7] == -1).all() and (slots[0, 0, 7:] >= 0).all()
    assert evicted[0, 0].tolist() == [-1] * 5 + [0, 1, 2, 3, 4, 5, 6]
    # row 1: positions 4..6, 8 fill slots 4, 0, 1, 2 (padded home slots), 9 takes slot 3, 10 evicts 4, 11 evicts 5
    assert evicted[1, 0].tolist() == [-1] * 10 + [4, 5]
    assert slots[1, 0].tolist() == [-1] * 6 + [1, -1, 2, 3, 4, 0]
    assert pool.evictions == 2 * 7 + 2 * 2


@pytest.mark.parametrize("policy", EVICTIONS)
def test_full_capacity_is_identity(policy):
    rng = random.Random(7)
    batch, kv_heads, total = 3, 2, 60
    pool = HostPool(batch, kv_heads, capacity_slots(1.0, total), policy=policy)
    prefill = random_valid(rng, batch, 20, 0.3)
    valid_all = [prefill]
    slots, evicted = pool.admit(20, prefill)
    for step in range(40):
        selected = random_selection(pool, rng)
        indices, valid = as_selection(selected, batch, kv_heads)
        pool.record_fetch(indices, valid, step)
        assert torch.equal(pool.slots_of(indices, valid)[valid], indices[valid])
        new_valid = random_valid(rng, batch, 1, 0.1)
        s, e = pool.admit(1, new_valid)
        slots, evicted = torch.cat([slots, s], -1), torch.cat([evicted, e], -1)
        valid_all.append(new_valid)
    valid_all = torch.cat(valid_all, -1)[:, None, :].expand(batch, kv_heads, total)
    positions = torch.arange(total).expand(batch, kv_heads, total)
    assert pool.evictions == 0 and (evicted == -1).all()
    assert torch.equal(slots, torch.where(valid_all, positions, -1))
    assert torch.equal(pool.resident(), valid_all)


def test_padding_takes_no_slot():
    pool = HostPool(1, 2, 4)
    valid = torch.tensor([[False, False, True, True, False, True]])
    slots, evicted = pool.admit(6, valid)
    assert slots[0, 0].tolist() == [-1, -1, 2, 3, -1, 0]
    assert (evicted == -1).all() and pool.evictions == 0
    assert pool.resident()[0, 0].tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="not resident"):
        pool.slots_of(torch.tensor([[[1]], [[1]]]).view(1, 2, 1), torch.ones(1, 2, 1, dtype=torch.bool))
    slots, _ = pool.admit(2)  # 6 takes the last free slot (1), 7 must evict
    assert slots[0, 0].tolist() == [1, 2]
    assert pool.evictions == 2


def test_counter_evicts_least_fetched():
    pool = HostPool(1, 1, 3, policy="counter")
    pool.admit(3)
    sel = torch.tensor([[[0, 2]]])
    ok = torch.ones(1, 1, 2, dtype=torch.bool)
    pool.record_fetch(sel, ok, 0)
    pool.record_fetch(torch.tensor([[[0]]]), torch.ones(1, 1, 1, dtype=torch.bool), 1)
    _, evicted = pool.admit(1)  # counts 0:2, 1:0, 2:1
    assert evicted.item() == 1
    _, evicted = pool.admit(1)  # 3 is new with count 0: without protection it goes next
    assert evicted.item() == 3
    assert pool.fetch_counts()[0, 0].tolist() == [2, 0, 1, 0, 0]


def test_lru_and_fifo_order():
    for policy, victims in (("lru", [1, 2, 0]), ("fifo", [0, 1, 2])):
        pool = HostPool(1, 1, 3, policy=policy)
        pool.admit(3)
        pool.record_fetch(torch.tensor([[[0]]]), torch.ones(1, 1, 1, dtype=torch.bool), 0)
        pool.record_fetch(torch.tensor([[[2]]]), torch.ones(1, 1, 1, dtype=torch.bool), 1)
        pool.record_fetch(torch.tensor([[[0]]]), torch.ones(1, 1, 1, dtype=torch.bool), 2)
        got = [pool.admit(1)[1].item() for _ in range(3)]
        assert got == victims, policy


def test_lru_admission_is_newer_than_fetch_of_same_step():
    pool = HostPool(1, 1, 2, policy="lru")
    pool.admit(2)
    pool.record_fetch(torch.tensor([[[0, 1]]]), torch.ones(1, 1, 2, dtype=torch.bool), 0)
    _, evicted = pool.admit(1)  # both fetched at step 0: the older position goes
    assert evicted.item() == 0
    pool.record_fetch(torch.tensor([[[1]]]), torch.ones(1, 1, 1, dtype=torch.bool), 0)
    _, evicted = pool.admit(1)  # 2 was admitted after the step-0 fetch of 1
    assert evicted.item() == 1


def test_slots_of_and_record_fetch_reject_evicted():
    pool = HostPool(1, 1, 2, policy="fifo")
    pool.admit(3)
    ok = torch.ones(1, 1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="not resident"):
        pool.slots_of(torch.tensor([[[0]]]), ok)
    with pytest.raises(ValueError, match="not resident"):
        pool.record_fetch(torch.tensor([[[0]]]), ok, 0)
    with pytest.raises(ValueError, match="never admitted"):
        pool.slots_of(torch.tensor([[[3]]]), ok)
    # a non-valid entry is ignored, whatever it holds
    assert pool.slots_of(torch.tensor([[[0]]]), ~ok).tolist() == [[[0]]]
    assert pool.slots_of(torch.tensor([[[2]]]), ok).tolist() == [[[0]]]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="counter, lru, fifo"):
        HostPool(1, 1, 4, policy="random")
    for cap in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            HostPool(1, 1, cap)
    pool = HostPool(2, 1, 4)
    with pytest.raises(ValueError, match="valid"):
        pool.admit(3, torch.ones(1, 3, dtype=torch.bool))
    pool.admit(2)
    with pytest.raises(ValueError, match="step"):
        pool.record_fetch(torch.zeros(2, 1, 1, dtype=torch.long), torch.ones(2, 1, 1, dtype=torch.bool), -1)
    with pytest.raises(ValueError, match="upto"):
        pool.resident(5)
    with pytest.raises(ValueError):
        capacity_slots(0.0, 10)
    assert capacity_slots(0.25, 10) == 3 and capacity_slots(1.0, 0) == 1


def test_empty_admit():
    pool = HostPool(2, 3, 4)
    slots, evicted = pool.admit(0)
    assert slots.shape == evicted.shape == (2, 3, 0)
    assert pool.length == 0 and pool.resident().shape == (2, 3, 0)


def test_large_prefill_is_vectorized():
    pool = HostPool(2, 4, 1000, policy="counter")
    slots, evicted = pool.admit(5000)
    assert pool.evictions == 2 * 4 * 4000
    assert pool.resident()[0, 0].nonzero().flatten().tolist() == list(range(4000, 5000))
    assert torch.equal(slots[:, :, 4000:], (torch.arange(4000, 5000) % 1000).expand(2, 4, 1000))
    assert torch.equal(evicted[:, :, 1000:], torch.arange(4000).expand(2, 4, 4000))


def test_pooled_tier_stores_what_the_pool_places_and_refuses_what_it_evicted():
    """The tier over the pool: rows come back from their slots, evicted positions are absent
    from `present`, and asking for one is an error (a selection never may)."""
    from infinigen.storage import TransferStats

    gen = torch.Generator().manual_seed(0)
    tier = PooledTier(1, 2, 4, torch.float32, TransferStats(), capacity=3, eviction="fifo")
    k, v = torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen)
    tier.append(k, v)  # 5 positions into 3 slots: fifo keeps 2, 3, 4
    assert tier.evictions == 2 * 2 and tier.length == 5
    assert tier.present(5)[0, 0].tolist() == [False, False, True, True, True]
    idx = torch.tensor([[[2, 4], [3, 4]]])
    got_k, got_v = tier.gather(idx, torch.ones_like(idx, dtype=torch.bool), torch.device("cpu"), torch.float32)
    assert torch.equal(got_k[0, 0], k[0, 0, [2, 4]]) and torch.equal(got_v[0, 1], v[0, 1, [3, 4]])
    with pytest.raises(ValueError, match="not resident"):
        tier.gather(
            torch.tensor([[[0], [2]]]), torch.ones(1, 2, 1, dtype=torch.bool), torch.device("cpu"), torch.float32
        )
    with pytest.raises(RuntimeError, match="evicted"):
        tier.read_all(5, torch.device("cpu"), torch.float32)


def test_the_slot_map_grows_by_the_one_growth_rule():
    """The map from positions to slots makes room a quarter more at a time (`grown_size`), not
    double, so the pool's metadata stays close to the positions admitted."""
    from infinigen.growing import grown_size

    pool = HostPool(1, 2, 16)
    room = 64  # the map's first room
    fixed = pool.nbytes - 2 * room * 8  # the slot arrays, sized by the capacity
    for n in (10, 90, 1, 40, 200):
        if pool.length + n > room:
            room = grown_size(room, pool.length + n)
        pool.admit(n)
        assert pool.nbytes == fixed + 2 * room * 8
