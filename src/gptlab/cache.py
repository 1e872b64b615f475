"""The KV cache (§7.1, handout #12): every layer's keys and values, kept across generation steps.

In a causal model appending a token leaves earlier positions unchanged, so generation can keep each
layer's keys and values and compute only the new positions. `GPT.forward(idx, cache=...)` takes only
the tokens the cache has not seen; the cache gives them positions and a mask, and each attention
layer stores its new keys and values here and attends over all the held ones.

Shape legend: L layers, B batch, Hkv key/value heads (H unless grouped), S cache slots, T new tokens,
hs head size.
"""

from __future__ import annotations

import torch

from gptlab.config import ModelConfig

EMPTY = torch.iinfo(torch.long).max  # the position of an unused slot: after every query, so never seen


class KVCache:
    """Every layer's keys and values of the tokens fed so far, allocated once for a generation run.

    A forward pass with a cache takes only the new tokens. `advance` gives them their slots and
    positions (continuing from the tokens already held) and builds their queries' mask; each layer
    then stores its new keys and values with `update` and attends over all the held ones.
    - Slots fill in order and wrap around (a ring) once `capacity` tokens have been fed; a chunk of
      several tokens must not wrap, or it would overwrite keys its own queries need.
    - Each slot remembers its token's position and whether it is real or left padding. A query at
      position p sees the real keys at positions p - block_size < j <= p: the causal mask of §7.3,
      limited to the context window (a band). With capacity = block_size a wrapped ring only ever
      overwrites a key that just left every later query's window.
    - Row b's next tokens after `reset(pad, first)` are pad[b] padding tokens, then real tokens at
      positions first[b], first[b] + 1, ...; padding takes the position of the first real token and
      may see anything (its outputs are never used), so no query row is empty.
    - The mask is None when every query sees every held key (one new token per row, no padding,
      nothing wrapped or out of the window: most batch-1 steps), sparing the kernel a masked path.
    """

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.capacity = capacity or config.block_size
        self.window = config.block_size
        shape = (config.n_layer, batch_size, config.kv_heads, self.capacity, config.head_size)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.slot_positions = torch.full((batch_size, self.capacity), EMPTY, device=device)  # (B, S)
        self.slot_real = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=device)  # (B, S)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.first = torch.zeros_like(self.pad)  # (B,)
        self.padded = False  # whether any row starts with padding
        self.fed = 0  # tokens fed since the last reset, padding included
        self.start, self.n_new = 0, 0  # the first slot of the tokens being fed, and how many they are
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # theirs, (B, T)
        self.mask: torch.Tensor | None = None  # (B, 1, T, S), or None when every query sees every key

    def reset(self, pad: torch.Tensor, first: torch.Tensor | None = None) -> None:
        """Forget every token, keeping the memory; see the class docstring for `pad` and `first` (B,)."""
        self.pad = pad
        self.padded = bool(pad.any())
        self.first = torch.zeros_like(pad) if first is None else first
        self.fed = 0
        self.slot_positions.fill_(EMPTY)
        self.slot_real.fill_(False)

    def advance(self, n_new: int) -> torch.Tensor:
        """Take the next n_new tokens: their positions (B, T), and their queries' mask in `self.mask`."""
        start = self.fed % self.capacity
        assert n_new == 1 or self.fed + n_new <= self.capacity, "a chunk of tokens may not wrap the ring"
        column = self.fed + torch.arange(n_new, device=self.pad.device)  # tokens since the reset, (T,)
        real = column >= self.pad[:, None]  # (B, T)
        self.positions = self.first[:, None] + (column - self.pad[:, None]).clamp(min=0)  # (B, T)
        self.start, self.n_new = start, n_new
        self.slot_positions[:, start:start + n_new] = self.positions
        self.slot_real[:, start:start + n_new] = real
        self.fed += n_new
        if n_new == 1 and not self.padded and self.fed <= min(self.window, self.capacity):
            self.mask = None  # one query per row, no padding, nothing wrapped or out of the window
            return self.positions
        used = min(self.fed, self.capacity)
        keys_at = self.slot_positions[:, None, :used]  # (B, 1, S)
        queries_at = self.positions[:, :, None]  # (B, T, 1)
        visible = (keys_at <= queries_at) & (keys_at > queries_at - self.window)  # (B, T, S)
        visible &= self.slot_real[:, None, :used] | ~real[:, :, None]  # real queries skip padding
        self.mask = visible.unsqueeze(1)  # (B, 1, T, S): the same for every head
        return self.positions

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values (B, Hkv, T, hs); return all it holds (B, Hkv, S, hs)."""
        held_keys, held_values = self.keys[layer], self.values[layer]  # (B, Hkv, S, hs) each
        held_keys.narrow(2, self.start, self.n_new).copy_(keys)
        held_values.narrow(2, self.start, self.n_new).copy_(values)
        used = min(self.fed, self.capacity)  # unused slots take no part
        return held_keys.narrow(2, 0, used), held_values.narrow(2, 0, used)
