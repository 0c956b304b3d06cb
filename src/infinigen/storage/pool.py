"""Bookkeeping for a host pool of limited capacity: which cached position sits in which slot.

InfiniGen (OSDI 2024) can cap the slow tier at `capacity` slots per (batch row, KV head) and evict
positions when it is full. This module only decides *where* each position lives and *which* one is
dropped; it moves no data. A tier holding `capacity` rows per (b, h) writes the KV of each admitted
position at the slot `admit` returns and reads selected positions at the slots `slots_of` returns.

Rules, per (b, h):

* Positions arrive in order (0, 1, 2, ...). Padding positions (``valid`` False at admission) take no
  slot: they are never resident and map to slot -1.
* A valid position ``p`` takes slot ``p`` while ``p < capacity`` (that slot is always free then), else
  the lowest free slot (slots left free by padding), else the slot of a victim evicted by the policy.
  Hence with ``capacity >= `` the number of positions ever admitted nothing is evicted and every
  valid position ``p`` sits in slot ``p``: a pool sized to the whole context changes nothing.
* Victims are chosen among the resident positions older than the one being admitted.
* Policies (ties always go to the smallest, i.e. oldest, position):

  - ``counter``: fewest fetches since admission;
  - ``lru``: oldest last use, where a use is a fetch at decode step ``s`` or the admission. An admission
    counts as later than every fetch recorded before it and earlier than any fetch at a later step;
  - ``fifo``: oldest admission, i.e. smallest position.

* A call admitting several positions behaves exactly as admitting them one at a time with no fetch in
  between; a position may then be evicted by a later one of the same call (its returned slot is -1).
  While no resident position has been fetched (always, under ``fifo``) every policy evicts in position
  order, which is computed in closed form; a prefill longer than the pool keeps its most recent
  ``capacity`` valid positions. Otherwise the evicting admissions of one call are processed one per
  iteration, each vectorized over (b, h).
"""

from __future__ import annotations

import math

import torch

from infinigen.growing import grown_size
from infinigen.storage.base import TransferStats
from infinigen.storage.ram import RamTier

EVICTIONS = ("counter", "lru", "fifo")

_POS_BITS = 40  # victim keys pack (primary key, position) into one int64


def capacity_slots(fraction: float, context: int) -> int:
    """Slots per (b, h) for a pool holding `fraction` of `context` positions (at least one slot).

    `context` is the number of positions the pool will ever be offered (prompt plus generated tokens);
    `fraction` 1.0 keeps them all."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"pool fraction must be in (0, 1], got {fraction}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return max(1, math.ceil(fraction * context))


class HostPool:
    """Slot bookkeeping for a capped slow tier holding [B, Hkv, capacity] rows."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, policy: str = "counter") -> None:
        for name, value in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if policy not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {policy!r}; available: {', '.join(EVICTIONS)}")
        self.batch, self.kv_heads, self.capacity = batch, kv_heads, capacity
        self.policy = policy
        shape = (batch, kv_heads, capacity)
        self._slot_pos = torch.full(shape, -1, dtype=torch.long)  # position held by each slot, -1 free
        self._count = torch.zeros(shape, dtype=torch.long)  # fetches of that position since admission
        self._stamp = torch.zeros(shape, dtype=torch.long)  # its last use (see _admission_stamp)
        self._slot_of = torch.full((batch, kv_heads, 64), -1, dtype=torch.long)  # slot of each position
        self._num_free = torch.full((batch, kv_heads), capacity, dtype=torch.long)
        self._fetched = False  # False only when no resident position has been fetched
        self._length = 0
        self._evictions = 0
        self._last_step = -1  # latest decode step seen by record_fetch

    # ------------------------------------------------------------------ state

    @property
    def length(self) -> int:
        """Positions admitted so far (padding included)."""
        return self._length

    @property
    def evictions(self) -> int:
        """Positions evicted so far, summed over (b, h); each one is lost for good."""
        return self._evictions

    @property
    def nbytes(self) -> int:
        """Bytes of its slot maps and counters."""
        maps = (self._slot_pos, self._count, self._stamp, self._slot_of, self._num_free)
        return sum(t.nbytes for t in maps)

    def resident(self, upto: int | None = None) -> torch.Tensor:
        """[B, Hkv, T] bool, T = `upto` (default: length): True where the position is in the pool."""
        upto = self._check_upto(upto)
        return self._slot_of[:, :, :upto] >= 0

    def fetch_counts(self, upto: int | None = None) -> torch.Tensor:
        """[B, Hkv, T] long: fetches of each resident position since its admission (0 elsewhere)."""
        upto = self._check_upto(upto)
        out = torch.zeros(self.batch, self.kv_heads, upto, dtype=torch.long)
        b, h, s = ((self._slot_pos >= 0) & (self._slot_pos < upto)).nonzero(as_tuple=True)
        out[b, h, self._slot_pos[b, h, s]] = self._count[b, h, s]
        return out

    def _check_upto(self, upto: int | None) -> int:
        if upto is None:
            return self._length
        if not 0 <= upto <= self._length:
            raise ValueError(f"upto must be in [0, {self._length}], got {upto}")
        return upto

    # ------------------------------------------------------------------ lookups and fetches

    def slots_of(self, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Slots [B, Hkv, n] of the positions `indices` [B, Hkv, n] where `valid` (0 where not valid).

        Raises ValueError if a valid entry names a position that is not resident (evicted, padding or
        never admitted)."""
        if indices.shape != valid.shape or tuple(indices.shape[:2]) != (self.batch, self.kv_heads):
            raise ValueError(
                f"expected indices and valid of shape [{self.batch}, {self.kv_heads}, n], "
                f"got {tuple(indices.shape)} and {tuple(valid.shape)}"
            )
        indices = indices.to("cpu", torch.long)
        valid = valid.to("cpu", torch.bool)
        if indices.shape[2] == 0:
            return torch.zeros_like(indices)
        out_of_range = valid & ((indices < 0) | (indices >= self._length))
        if bool(out_of_range.any()):
            b, h, i = (int(x) for x in out_of_range.nonzero()[0])
            raise ValueError(
                f"position {int(indices[b, h, i])} (batch {b}, head {h}) was never admitted; length {self._length}"
            )
        safe = torch.where(valid, indices, torch.zeros_like(indices))
        slots = self._slot_of.gather(2, safe)
        missing = valid & (slots < 0)
        if bool(missing.any()):
            b, h, i = (int(x) for x in missing.nonzero()[0])
            raise ValueError(
                f"position {int(indices[b, h, i])} (batch {b}, head {h}) is not resident in the pool "
                "(evicted or padding)"
            )
        return torch.where(valid, slots, torch.zeros_like(slots))

    def record_fetch(self, indices: torch.Tensor, valid: torch.Tensor, step: int) -> None:
        """Count one fetch of each valid position in `indices` [B, Hkv, n] at decode step `step` (>= 0)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        slots = self.slots_of(indices, valid)
        b, h, i = valid.to("cpu", torch.bool).nonzero(as_tuple=True)
        s = slots[b, h, i]
        self._count.index_put_((b, h, s), torch.ones_like(s), accumulate=True)
        self._stamp[b, h, s] = self._stamp[b, h, s].clamp(min=2 * step + 2)
        self._last_step = max(self._last_step, step)
        self._fetched = self._fetched or len(s) > 0

    def _admission_stamp(self) -> int:
        # A fetch at step s is stamped 2s + 2; an admission just after it 2s + 3, before any fetch 1.
        return 2 * self._last_step + 3

    # ------------------------------------------------------------------ admission

    def admit(self, num_new: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Admit positions length .. length + num_new - 1 for every (b, h).

        valid: [B, num_new] bool (False = padding) or None (all valid).
        Returns (slots, evicted), both [B, Hkv, num_new] long: the slot each new position is written to
        (-1 for padding and for a position evicted again within this call) and the position evicted to
        make room for it (-1 if none)."""
        if isinstance(num_new, bool) or not isinstance(num_new, int) or num_new < 0:
            raise ValueError(f"num_new must be an integer >= 0, got {num_new!r}")
        bsz, hkv, cap, n, p0 = self.batch, self.kv_heads, self.capacity, num_new, self._length
        if valid is None:
            valid = torch.ones(bsz, n, dtype=torch.bool)
        elif tuple(valid.shape) != (bsz, n):
            raise ValueError(f"valid must have shape [{bsz}, {n}], got {tuple(valid.shape)}")
        valid = valid.to("cpu", torch.bool)
        self._grow(p0 + n)
        evicted_out = torch.full((bsz, hkv, n), -1, dtype=torch.long)
        if n == 0:
            return torch.full((bsz, hkv, 0), -1, dtype=torch.long), evicted_out
        stamp = self._admission_stamp()
        positions = torch.arange(p0, p0 + n)
        v = valid[:, None, :].expand(bsz, hkv, n)

        # Positions below capacity go to their own slot; the next ones fill the free slots, lowest first.
        home = v & (positions < cap)
        late = v & (positions >= cap)
        rank = late.long().cumsum(-1) - 1  # among this call's valid positions >= capacity
        n_free = (self._num_free - home.sum(-1))[:, :, None]  # free slots left once home slots are taken
        fill = late & (rank < n_free)
        slot_new = positions.expand(bsz, hkv, n)
        if bool(fill.any()):
            free = self._slot_pos < 0
            if bool(home.any()):
                claimed = torch.zeros(bsz, hkv, cap + 1, dtype=torch.bool)
                claimed.scatter_(2, torch.where(home, positions, cap), True)
                free &= ~claimed[:, :, :cap]
            free_sorted = torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices
            slot_new = torch.where(home, slot_new, free_sorted.gather(2, rank.clamp(0, cap - 1)))
        placed = home | fill
        b, h, i = placed.nonzero(as_tuple=True)
        self._place(b, h, p0 + i, slot_new[b, h, i], stamp)
        self._num_free -= placed.sum(-1)

        # The rest evict: k-th such position of row (b, h) is phase3_pos[b, h, k].
        num_evict = (late.sum(-1) - n_free.squeeze(-1)).clamp(min=0)  # [B, Hkv]
        max_evict = int(num_evict.max())
        if max_evict > 0:
            evicting = late & ~fill
            k = torch.where(evicting, rank - n_free, max_evict)
            phase3_pos = torch.full((bsz, hkv, max_evict + 1), -1, dtype=torch.long)
            phase3_pos.scatter_(2, k, positions.expand(bsz, hkv, n))
            phase3_pos = phase3_pos[:, :, :max_evict]
            if self._order_is_positional():
                self._evict_in_position_order(num_evict, phase3_pos, evicted_out, stamp)
            else:
                self._evict_by_policy(num_evict, phase3_pos, evicted_out, stamp)
            self._evictions += int(num_evict.sum())

        self._length = p0 + n
        return self._slot_of[:, :, p0 : p0 + n].clone(), evicted_out

    def _grow(self, need: int) -> None:
        have = self._slot_of.shape[2]
        if need <= have:
            return
        grown = torch.full((self.batch, self.kv_heads, grown_size(have, need)), -1, dtype=torch.long)
        grown[:, :, :have] = self._slot_of
        self._slot_of = grown

    def _place(self, b: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, stamp: int) -> None:
        self._slot_pos[b, h, slot] = pos
        self._count[b, h, slot] = 0
        self._stamp[b, h, slot] = stamp
        self._slot_of[b, h, pos] = slot

    def _order_is_positional(self) -> bool:
        """True when every policy would evict the resident positions oldest first: always under fifo,
        and under counter and lru while no resident position has been fetched (all counts zero; lru
        stamps are then admission stamps, which grow with the position)."""
        if self.policy == "fifo" or not self._fetched:
            return True
        self._fetched = bool((self._count > 0).any())
        return not self._fetched

    def _evict_in_position_order(
        self, num_evict: torch.Tensor, phase3_pos: torch.Tensor, evicted_out: torch.Tensor, stamp: int
    ) -> None:
        """All evicting admissions at once when victims go in position order.

        The pool is full (in rows that evict). Let Q be its positions in ascending order and S their
        slots. The k-th evicting position (k from 0) evicts Q[k] if k < capacity, else the
        (k - capacity)-th evicting position, and takes slot S[k mod capacity]; of the E evicting
        positions the last `capacity` survive, and Q[j] survives iff j >= E."""
        cap, p0 = self.capacity, self._length
        max_evict = phase3_pos.shape[2]
        q_pos, q_slot = torch.topk(self._slot_pos, min(max_evict, cap), dim=-1, largest=False, sorted=True)
        k = torch.arange(max_evict).expand_as(phase3_pos)
        e = num_evict[:, :, None]
        active = k < e
        slot_k = q_slot.gather(2, k % cap)
        victim_k = torch.where(
            k < cap, q_pos.gather(2, k.clamp(max=cap - 1)), phase3_pos.gather(2, (k - cap).clamp(min=0))
        )
        # Residents that go: Q[j] for j < min(E, capacity), i.e. positions <= Q[min(E, capacity) - 1].
        last_gone = q_pos.gather(2, (e.clamp(max=cap) - 1).clamp(min=0))
        gone = (e > 0) & (self._slot_pos <= last_gone)
        b, h, s = gone.nonzero(as_tuple=True)
        self._slot_of[b, h, self._slot_pos[b, h, s]] = -1
        b, h, i = (active & (k >= e - cap)).nonzero(as_tuple=True)
        self._place(b, h, phase3_pos[b, h, i], slot_k[b, h, i], stamp)
        b, h, i = active.nonzero(as_tuple=True)
        evicted_out[b, h, phase3_pos[b, h, i] - p0] = victim_k[b, h, i]

    def _evict_by_policy(
        self, num_evict: torch.Tensor, phase3_pos: torch.Tensor, evicted_out: torch.Tensor, stamp: int
    ) -> None:
        """Evicting admissions one per iteration, each an argmin over [B, Hkv, capacity] victim keys."""
        p0 = self._length
        never = torch.iinfo(torch.long).max
        for k in range(phase3_pos.shape[2]):
            act = k < num_evict
            q = phase3_pos[:, :, k]
            if self.policy == "counter":
                key = (self._count << _POS_BITS) + self._slot_pos
            elif self.policy == "lru":
                key = (self._stamp << _POS_BITS) + self._slot_pos
            else:
                key = self._slot_pos.clone()
            eligible = (self._slot_pos >= 0) & (self._slot_pos < q[:, :, None])
            victim = torch.where(eligible, key, never).argmin(-1)
            b, h = act.nonzero(as_tuple=True)
            slot = victim[b, h]
            old = self._slot_pos[b, h, slot]
            new = q[b, h]
            self._slot_of[b, h, old] = -1
            self._place(b, h, new, slot, stamp)
            evicted_out[b, h, new - p0] = old


class PooledTier(RamTier):
    """A capped host pool: `capacity` slots per (batch row, KV head) in host RAM, filled and
    evicted as `HostPool` decides. Positions keep their numbers; an evicted one is gone for
    good, and `present` says which remain, so that no selection asks for it. Rows are stored
    and read as in `RamTier`, at the slot the pool gives each position."""

    def in_place(self):
        return None  # its slots are not positions

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        stats: TransferStats,
        capacity: int,
        eviction: str = "counter",
    ) -> None:
        super().__init__(batch, kv_heads, head_dim, dtype, stats)
        self.pool = HostPool(batch, kv_heads, capacity, eviction)
        self._k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype)
        self._v = torch.zeros_like(self._k)
        self._clock = 0  # one tick per gather: the decode step the pool stamps its fetches with

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    def _append(self, keys, values, valid) -> None:
        n = keys.shape[2]
        slots, _ = self.pool.admit(n, None if valid is None else valid.to("cpu", torch.bool))
        where = (slots >= 0).nonzero(as_tuple=True)
        self._k[where[0], where[1], slots[where]] = keys[where].detach().to("cpu", self.dtype)
        self._v[where[0], where[1], slots[where]] = values[where].detach().to("cpu", self.dtype)
        self.length += n

    def present(self, upto: int) -> torch.Tensor:
        return self.pool.resident(upto)

    def beside_compute(self) -> dict[str, int]:
        """The pool's slot maps: every selection consults them."""
        return {"metadata": self.pool.nbytes}

    def _gather(self, indices, valid, device, dtype, out=None):
        self._clock += 1
        idx, ok = indices.to("cpu", torch.long), valid.to("cpu", torch.bool)
        self.pool.record_fetch(idx, ok, self._clock)
        return super()._gather(self.pool.slots_of(idx, ok), ok, device, dtype, out)  # raises for an evicted position

    def _read_range(self, start, stop, device, dtype, out=None):
        raise RuntimeError("a capped host pool cannot return every position (some were evicted)")

    def peek_all(self):
        raise RuntimeError("a capped host pool does not hold every position (some were evicted)")
