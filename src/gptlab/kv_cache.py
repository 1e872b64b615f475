"""The KV cache (§7.1, handout #12): every layer's keys and values, kept across generation steps.

In a causal model appending a token leaves earlier positions unchanged, so generation can keep each
layer's keys and values and compute only the new positions. `GPT.forward(idx, cache=...)` takes only
the tokens the cache has not seen; the cache gives them positions and a mask, and each attention
layer stores its new keys and values here and attends over all the held ones.

One class serves both users: `generate` (a padded batch whose rows start together, allocated once
per run) and the server's scheduler (rows with their own counts and positions that join and leave
at any step, in a cache that grows and shrinks with what they need: `resize`, `clear`, `move`,
and `load` for a prefix kept from an earlier request).

Shape legend: L layers, B batch (rows), Hkv key/value heads (H unless grouped), S slots per row,
T new tokens, hs head size.
"""

from __future__ import annotations

import torch

from gptlab.config import ModelConfig

EMPTY = torch.iinfo(torch.long).max  # the position of an unused slot: after every query, so never seen


def kv_cache_bytes(config: ModelConfig, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of `rows` rows x `tokens` tokens: what a cache of that size holds."""
    per_token = 2 * config.n_layer * config.kv_heads * config.head_size  # a key and a value per layer
    return rows * tokens * per_token * dtype.itemsize


class KVCache:
    """Every layer's keys and values of the tokens fed so far, row by row.

    A forward pass with a cache takes only the new tokens of the rows in `batch` (all rows unless
    `select` narrowed it). `advance` gives them their slots and positions (continuing each row's own
    count) and builds their queries' mask; each layer then stores its new keys and values with
    `update` and attends over all the held ones.
    - Each row's slots fill in order and wrap around (a ring of `capacity` slots) once it has been fed
      that many tokens; rows fed several tokens at once must all hold the same count, and the chunk
      must not cross the ring's end. A chunk of n tokens after the ring has wrapped needs
      capacity >= window + n - 1, or it would overwrite keys its own queries need.
    - Each slot remembers its token's position and whether it is real or left padding. A query at
      position p sees the real keys at positions p - window < j <= p (window = block_size): the causal
      mask of §7.3 limited to the context window (a band). With capacity >= window a wrapped ring only
      ever overwrites a key that just left every later query's window; a smaller capacity must hold
      every token a row will be fed (generate and the scheduler size it so).
    - Row b's next tokens after `reset(pad, first)` are pad[b] padding tokens, then real tokens at
      positions first[b], first[b] + 1, ...; padding takes the position of the first real token and
      may see anything (its outputs are never used), so no query row is empty.
    - The mask is None when every query sees every held key (one new token per row, equal counts, no
      padding, nothing wrapped or out of the window: most batch-1 steps), sparing the kernel a masked path.
    - For n-gram embeddings each slot also keeps its token's id, and each row the K ids before its first
      real token (`before`, start ids unless `reset` is given them): `with_history` hands a forward pass
      its new tokens' K predecessors, so a row's n-grams never read padding nor another row's tokens.
    """

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.window = config.block_size
        self.capacity = capacity or config.block_size
        shape = (config.n_layer, batch_size, config.kv_heads, self.capacity, config.head_size)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.slot_positions = torch.full((batch_size, self.capacity), EMPTY, device=device)  # (B, S)
        self.slot_real = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=device)  # (B, S)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.first = torch.zeros_like(self.pad)  # (B,)
        self.slot_tokens = torch.zeros(batch_size, self.capacity, dtype=torch.long, device=device)  # (B, S)
        self.start = config.vocab_size  # n-gram embeddings' id before a sequence's first token
        context = max(config.ngram_embeddings, default=1) - 1  # K, the ids n-grams read before a token
        self.before = torch.full((batch_size, context), self.start, device=device)  # (B, K)
        self.fed = [0] * batch_size  # tokens fed to each row since its reset, padding included
        self.batch = slice(0, batch_size)  # the rows the next forward pass runs
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # the new ones', (B, T)
        self.mask: torch.Tensor | None = None  # (B, 1, T, S), or None when every query sees every key
        self._start: int | None = 0  # the slot the new tokens start at when every row shares it
        self._write = self.pad  # otherwise each row's slot for its one new token, (B,)
        self._used = 0  # slots of the fullest row in the batch
        self._padded: bool | None = False  # whether `pad` holds padding (None: not known yet)

    @property
    def size(self) -> int:
        """How many rows the cache holds."""
        return len(self.fed)

    @property
    def padded(self) -> bool:
        """Whether any row was reset with left padding (the scheduler's rows never are)."""
        if self._padded is None:
            self._padded = bool((self.pad > 0).any())
        return self._padded

    def reset(self, pad: torch.Tensor, first: torch.Tensor | None = None,
              before: torch.Tensor | None = None) -> None:
        """Forget every token, keeping the memory; see the class docstring for `pad`, `first` (B,) and
        `before` (B, K)."""
        self.pad, self._padded = pad, None
        self.first = torch.zeros_like(pad) if first is None else first
        assert before is None or before.shape == self.before.shape, "before holds K ids per row"
        self.before = torch.full_like(self.before, self.start) if before is None else before
        self.fed = [0] * self.size
        self.batch = slice(0, self.size)
        self.slot_positions.fill_(EMPTY)
        self.slot_real.fill_(False)

    def select(self, start: int, stop: int) -> None:
        """Run the next forward passes on rows start .. stop - 1 only (a contiguous range: views, no copy)."""
        self.batch = slice(start, stop)

    def advance(self, n_new: int) -> torch.Tensor:
        """Take the selected rows' next n_new tokens: positions (B, T), their queries' mask in `self.mask`."""
        fed, device = self.fed[self.batch], self.slot_positions.device
        uniform = min(fed) == max(fed)
        assert n_new == 1 or (uniform and fed[0] % self.capacity + n_new <= self.capacity), \
            "a chunk of tokens may not cross the ring's end, and rows fed a chunk must hold the same count"
        assert n_new == 1 or fed[0] + n_new <= self.capacity or self.capacity >= self.window + n_new - 1, \
            "a chunk after the ring has wrapped needs capacity >= window + n_new - 1"
        pad, first = self.pad[self.batch, None], self.first[self.batch, None]  # (B, 1)
        if n_new == 1 and uniform and not self.padded:
            return self._advance_one(fed[0], first)
        column = torch.tensor(fed, device=device)[:, None] + torch.arange(n_new, device=device)  # (B, T)
        real = column >= pad  # (B, T)
        self.positions = first + (column - pad).clamp(min=0)  # (B, T)
        slots = column % self.capacity  # (B, T)
        self._start = fed[0] % self.capacity if uniform else None
        self._write = slots[:, 0]
        self.slot_positions[self.batch].scatter_(1, slots, self.positions)
        self.slot_real[self.batch].scatter_(1, slots, real)
        self.fed[self.batch] = [f + n_new for f in fed]
        longest = max(fed) + n_new
        self._used = min(longest, self.capacity)
        return self._mask(real)

    def _advance_one(self, fed: int, first: torch.Tensor) -> torch.Tensor:
        """`advance` by one token for rows that share their count and hold no padding (most decoding
        steps): the same slots, positions and mask with a few operations instead of a dozen."""
        slot = fed % self.capacity
        self.positions = first + fed  # (B, 1)
        self._start, self._used = slot, min(fed + 1, self.capacity)
        self.slot_positions[self.batch, slot] = self.positions[:, 0]
        self.slot_real[self.batch, slot] = True
        self.fed[self.batch] = [fed + 1] * len(self.fed[self.batch])
        if fed + 1 <= min(self.window, self.capacity):
            self.mask = None  # one query per row, no padding, nothing wrapped or out of the window
            return self.positions
        return self._mask(torch.ones_like(self.positions, dtype=torch.bool))

    def _mask(self, real: torch.Tensor) -> torch.Tensor:
        """The new queries' mask (real: which are real tokens, (B, T)) into `self.mask`; their positions."""
        keys_at = self.slot_positions[self.batch, None, :self._used]  # (B, 1, S)
        queries_at = self.positions[:, :, None]  # (B, T, 1)
        visible = (keys_at <= queries_at) & (keys_at > queries_at - self.window)  # (B, T, S)
        # real queries skip padding
        visible &= self.slot_real[self.batch, None, :self._used] | ~real[:, :, None]
        self.mask = visible.unsqueeze(1)  # (B, 1, T, S): the same for every head
        return self.positions

    def with_history(self, idx: torch.Tensor) -> torch.Tensor:
        """The selected rows' new ids (B, T) after the K ids before each row's first, (B, K + T), for n-gram
        embeddings; padding reads as the start id. Called before `advance`: it keeps the new ids in their
        slots, where later steps (and a rewind) find them."""
        K, capacity = self.before.size(1), self.capacity
        assert K < capacity or max(self.fed[self.batch]) + idx.size(1) <= capacity, \
            "a ring that wraps must hold a row's last K ids"
        fed = torch.tensor(self.fed[self.batch], device=idx.device)[:, None]  # (B, 1)
        column = fed - K + torch.arange(K + idx.size(1), device=idx.device)  # (B, K + T): fed before each
        held = self.slot_tokens[self.batch].gather(1, column[:, :K].clamp(min=0) % capacity)  # (B, K)
        self.slot_tokens[self.batch].scatter_(1, column[:, K:] % capacity, idx)
        ahead = column - self.pad[self.batch, None] + K  # (B, K + T): index into `before` until >= K
        earlier = self.before[self.batch].gather(1, ahead.clamp(0, K - 1))  # (B, K + T)
        ids = torch.where(ahead >= K, torch.cat([held, idx], dim=1), earlier)
        return ids.masked_fill(ahead < 0, self.start)  # before `before`: the start id

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values (B, Hkv, T, hs); return all it holds (B, Hkv, S, hs)."""
        held_keys = self.keys[layer, self.batch]  # (B, Hkv, S, hs)
        held_values = self.values[layer, self.batch]
        if self._start is not None:  # every row writes the same slots: a plain copy
            held_keys.narrow(2, self._start, keys.size(2)).copy_(keys)
            held_values.narrow(2, self._start, values.size(2)).copy_(values)
        else:  # one token per row, each into its own slot
            rows = torch.arange(keys.size(0), device=keys.device)
            held_keys[rows, :, self._write] = keys[:, :, 0]  # (B, Hkv, hs)
            held_values[rows, :, self._write] = values[:, :, 0]
        return held_keys[:, :, :self._used], held_values[:, :, :self._used]  # unused slots take no part

    # ----------------------------------------------------------------- rows that join, leave and grow

    def resize(self, batch_size: int, capacity: int) -> None:
        """Reallocate for `batch_size` rows of `capacity` slots, keeping what the first rows hold.

        Dropped rows must be unused; a new capacity must hold every kept row's tokens unwrapped
        (a wrapped row's slots are numbered modulo the old capacity).
        """
        kept = min(batch_size, self.size)
        if capacity != self.capacity:
            assert all(f <= min(capacity, self.capacity) for f in self.fed[:kept]), \
                "a resize would lose or renumber a row's tokens"
        assert not any(self.fed[kept:]), "a resize would drop a row that holds tokens"
        shape = (self.config.n_layer, batch_size, self.config.kv_heads, capacity, self.config.head_size)
        slots = min(capacity, self.capacity)
        old = (self.keys, self.values, self.slot_positions, self.slot_real, self.pad, self.first,
               self.slot_tokens, self.before)
        self.keys = self.keys.new_zeros(shape)  # (L, B, Hkv, S, hs)
        self.values = self.values.new_zeros(shape)
        self.keys[:, :kept, :, :slots] = old[0][:, :kept, :, :slots]
        self.values[:, :kept, :, :slots] = old[1][:, :kept, :, :slots]
        self.slot_positions = old[2].new_full((batch_size, capacity), EMPTY)  # (B, S)
        self.slot_positions[:kept, :slots] = old[2][:kept, :slots]
        self.slot_real = old[3].new_zeros(batch_size, capacity)  # (B, S)
        self.slot_real[:kept, :slots] = old[3][:kept, :slots]
        self.pad, self.first = old[4].new_zeros(batch_size), old[5].new_zeros(batch_size)  # (B,)
        self.pad[:kept], self.first[:kept] = old[4][:kept], old[5][:kept]
        self.slot_tokens = old[6].new_zeros(batch_size, capacity)  # (B, S)
        self.slot_tokens[:kept, :slots] = old[6][:kept, :slots]
        self.before = old[7].new_full((batch_size, old[7].size(1)), self.start)  # (B, K)
        self.before[:kept] = old[7][:kept]
        self.fed = self.fed[:kept] + [0] * (batch_size - kept)
        self.capacity, self.batch = capacity, slice(0, batch_size)

    def clear(self, row: int) -> None:
        """Forget one row's tokens: its next token is real, at position 0."""
        self.fed[row] = 0
        self.pad[row] = self.first[row] = 0
        self.before[row] = self.start
        self.slot_positions[row].fill_(EMPTY)
        self.slot_real[row].fill_(False)

    def rewind(self, row: int, count: int = 1) -> None:
        """Forget the newest `count` tokens of `row`: a scheduler's stand-in, or rejected drafted tokens.

        Their keys stay in memory but out of sight, and the row's next tokens take their slots. In a
        wrapped ring the keys these slots held before are lost; the rule `advance` holds for chunks
        (capacity >= window + n - 1) ensures they were out of every later query's window.
        """
        assert 0 <= count <= self.fed[row], f"cannot rewind {count} of the row's {self.fed[row]} tokens"
        self.fed[row] -= count
        slots = [(self.fed[row] + i) % self.capacity for i in range(count)]
        self.slot_positions[row, slots] = EMPTY
        self.slot_real[row, slots] = False

    def load(self, row: int, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill an empty row with its first n tokens (n,) and their keys and values (L, Hkv, n, hs), at
        positions 0 .. n-1: a prefix computed before (the server's prefix cache). Its next token is at
        position n."""
        n = keys.size(2)
        assert self.fed[row] == 0 and n <= self.capacity, "load fills an empty row with what it can hold"
        self.keys[:, row, :, :n] = keys
        self.values[:, row, :, :n] = values
        self.slot_tokens[row, :n] = ids.to(self.slot_tokens.device)
        self.slot_positions[row, :n] = torch.arange(n, device=self.slot_positions.device)
        self.slot_real[row, :n] = True
        self.fed[row] = n

    def move(self, source: int, target: int) -> None:
        """Copy row `source` into row `target` (so the rows in use stay the first ones)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]
        rows = (self.slot_positions, self.slot_real, self.slot_tokens, self.pad, self.first, self.before)
        for state in rows:
            state[target] = state[source]
        self.fed[target] = self.fed[source]
