"""The server's prefix cache: the keys and values of finished rows, kept across requests in a byte budget, so
that a later prompt that starts with the same tokens skips their prefill (chat clients resend the system
prompt and the whole conversation every turn).

- An entry is the token ids a row held in the KV cache when it left (its prompt, and the tokens it
  generated but the last) with their keys and values (L, Hkv, n, hs), copied out of the batch's cache.
  Only rows whose tokens sit at positions 0 .. n-1 are kept: not a learned-positions window that moved,
  not a ring that wrapped.
- Keyed by exact token ids: a request reuses an entry's first m tokens only when its own first m tokens
  are the same (the longest shared prefix over all entries, token by token: no block-size floor), and at
  most all but its last token, which runs in the batched step to give the row its first logits. So no
  request reads another's keys except by sending the same tokens.
- Filled only as entries arrive (nothing is reserved up front), within `budget` bytes: the least recently
  used entries go first; an entry that is a prefix of another is dropped (the longer one serves both);
  an entry larger than the whole budget keeps its first tokens that fit.

A reused prefix gives the logits of a fresh prefill up to float rounding: its keys and values were
computed from the same tokens at the same positions (tests/serve/test_prefix_cache.py compares them for
every position scheme and grouped-query attention).

Shape legend: L layers, Hkv key/value heads, n tokens, hs head size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptlab.kv_cache import KVCache

# 256 MiB: about 5,600 tokens of SmolLM2-135M's shape in float32 (46 KB each), 65,000 of the demo model's
DEFAULT_BUDGET = 256 * 2**20


@dataclass(frozen=True)
class Entry:
    """The keys and values of a row's first tokens, and those tokens."""

    ids: torch.Tensor  # (n,) on the CPU
    keys: torch.Tensor  # (L, Hkv, n, hs)
    values: torch.Tensor  # (L, Hkv, n, hs)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two id vectors (n,) and (m,) have in common."""
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).long().cumprod(dim=0).sum())


class PrefixCache:
    """Entries of token ids and their keys and values, least recently used first, in `budget` bytes (0: off).

    `queried` and `hits` count prompt tokens looked up and tokens reused (vLLM counts its prefix cache in
    tokens too)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"prefix cache budget {budget} bytes must be at least 0 (0 turns it off)")
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.bytes = 0  # held by the entries now
        self.queried = 0
        self.hits = 0

    def reuse(self, ids: Sequence[int], cache: KVCache, row: int) -> int:
        """Load into an empty `row` of `cache` the longest kept prefix of `ids`, short of its last token;
        how many tokens it holds now (0 for none)."""
        self.queried += len(ids)
        query = torch.tensor(list(ids), dtype=torch.long)  # (m,)
        best, length = None, 0
        for key, entry in self.entries.items():
            if key[0] != ids[0]:  # most entries differ at once: skip them without tensor work
                continue
            shared = shared_prefix(entry.ids, query)
            if shared > length:
                best, length = key, shared
        length = min(length, len(ids) - 1)  # the last token runs in the batched step, for the logits
        if best is None or length < 1:
            return 0
        entry = self.entries[best]
        self.entries.move_to_end(best)
        cache.load(row, entry.ids[:length], entry.keys[:, :, :length], entry.values[:, :, :length])
        self.hits += length
        return length

    def keep(self, ids: Sequence[int], cache: KVCache, row: int) -> None:
        """Keep the keys and values of the first len(ids) tokens of `row` of `cache` (its tokens at positions
        0 .. len(ids) - 1), evicting the least recently used entries to stay within the budget."""
        per_token = cache.keys[:, row, :, :1].nbytes + cache.values[:, row, :, :1].nbytes
        count = min(len(ids), self.budget // per_token)  # the first tokens that fit
        if count < 1:
            return
        kept = torch.tensor(list(ids[:count]), dtype=torch.long)  # (n,)
        for key, entry in list(self.entries.items()):
            if key[0] != ids[0]:
                continue
            shared = shared_prefix(entry.ids, kept)
            if shared == count:  # already kept, within a longer entry (or the same)
                self.entries.move_to_end(key)
                return
            if shared == len(entry.ids):  # a prefix of the new entry, which serves it too
                self._drop(key)
        while self.entries and self.bytes + count * per_token > self.budget:
            self._drop(next(iter(self.entries)))
        keys = cache.keys[:, row, :, :count].clone()  # (L, Hkv, n, hs)
        values = cache.values[:, row, :, :count].clone()
        self.entries[tuple(kept.tolist())] = Entry(kept, keys, values)
        self.bytes += keys.nbytes + values.nbytes

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self.entries.pop(key).nbytes
