"""Position information (handout §6): the schemes `ModelConfig.positions` chooses between, for model.py,
and n-gram embeddings (`ModelConfig.ngram_embeddings`), which give each token its local order as a lookup.

Absolute schemes map token rows (B, T, D) and their positions (B or 1, T) to input rows X = E[w] + p;
RoPE instead turns each head's queries and keys (B, H, T, hs). Every scheme takes explicit positions
(default 0..T-1), so generation can continue a sequence from a KV cache at any offset.

N-gram embeddings read each token's K predecessors (K = the largest order - 1): from a `history` of ids
(B, K + T), which a KV cache carries across generation steps (`KVCache.with_history`).

Shape legend: B batch, T sequence length, D model width (n_embd), H heads, hs head size (D // H), K ids
of history before the first of T tokens.

Deliberate choice: RoPE rotates the feature pairs (i, i + hs/2) of each head (the "rotate half" layout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import ModelConfig


class LearnedPositions(nn.Embedding):
    """A trainable row p_i per position: block_size * D parameters (§6.1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.block_size, config.n_embd)

    # The position scheme's forward(x, positions), not nn.Embedding's forward(input): rows are added to x.
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + super().forward(positions)  # rows p_i, (B or 1, T, D); (B, T, D) -> (B, T, D)


class SinusoidalPositions(nn.Module):
    """Fixed rows: even features sin(i w_k), odd features cos(i w_k), w_k = base^(-2k/D); no parameters.

    Rows are computed for any position, since a sliding-window generation goes past block_size.
    """

    freqs: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = self.n_embd = config.n_embd
        self.block_size = config.block_size
        freqs = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("freqs", freqs, persistent=False)  # (ceil(D/2),), derived, so not saved

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows p_i of positions (..., T) -> (..., T, D)."""
        angles = positions.unsqueeze(-1).float() * self.freqs.float()  # (..., T, ceil(D/2))
        rows = angles.new_zeros(*positions.shape, self.n_embd)
        rows[..., 0::2] = angles.sin()
        rows[..., 1::2] = angles[..., : self.n_embd // 2].cos()  # (..., T, floor(D/2))
        return rows.to(self.freqs.dtype)  # angles in float32, rows in the model's dtype

    @property
    def table(self) -> torch.Tensor:
        """The handout's table: rows of positions 0 .. block_size - 1, (T_max, D)."""
        return self.rows(torch.arange(self.block_size, device=self.freqs.device))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return x + self.rows(positions)


class Rotary(nn.Module):
    """RoPE: rotate each query/key feature pair (i, i + hs/2) by an angle proportional to position."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hs = config.head_size
        inv_freq = config.rope_base ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)  # (hs/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # derived, so not saved

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate queries or keys (B, H, T, hs) at positions (B or 1, T), by default 0 .. T-1."""
        if positions is None:
            positions = torch.arange(x.size(-2), device=x.device).unsqueeze(0)  # (1, T)
        angles = positions.unsqueeze(-1).float() * self.inv_freq.float()  # (B or 1, T, hs/2), in float32
        angles = angles.unsqueeze(1)  # (B or 1, 1, T, hs/2): the same for every head
        dtype = torch.result_type(x, self.inv_freq)  # float32 under autocast, else the model's dtype
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, H, T, hs/2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class NoPositions(nn.Module):
    """No position information: the input rows of `none` and `rope`, and the queries/keys of all but rope."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return x


# Each scheme is chosen once, here: (what is added to the input rows, what turns queries and keys).
POSITIONS: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "learned": (LearnedPositions, NoPositions),
    "sinusoidal": (SinusoidalPositions, NoPositions),
    "rope": (NoPositions, Rotary),
    "none": (NoPositions, NoPositions),
}


# ---------------------------------------------------------------------------------------------
# N-gram embeddings (a departure from §6): local order, learned as a lookup rather than computed

HASH_MULTIPLIER = 1_000_003  # a prime: hashed n-grams spread over any table size that it does not divide


class NgramEmbeddings(nn.Module):
    """For each order n of `ngram_embeddings`, a table whose row for the n-gram ending at a token (the token
    and the n - 1 ids before it) is added to the token's own row E[w].

    Before a sequence's first token stands the start id V, never padding nor another row's tokens. An
    n-gram's row is its ids read as digits, h = h * m + id, modulo the table's rows: exact, one row per
    n-gram, with m = V + 1 and (V + 1)^n rows when that many fit in ngram_table_size; else hashed, with m
    a large prime and ngram_table_size rows that n-grams share. The tables start at zero, so a new model
    computes what it would without them (GPT's init leaves them: they are no nn.Embedding).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        V, size, self.orders = config.vocab_size, config.ngram_table_size, config.ngram_embeddings
        self.start = V  # the id before every sequence's first token
        self.context = max(self.orders) - 1  # K: how many ids before a token its n-grams read
        self.multipliers = [V + 1 if (V + 1) ** n <= size else HASH_MULTIPLIER for n in self.orders]
        rows = [min(size, (V + 1) ** n) for n in self.orders]
        self.tables = nn.ParameterList(nn.Parameter(torch.zeros(r, config.n_embd)) for r in rows)  # (rows, D)

    def preceded(self, idx: torch.Tensor) -> torch.Tensor:
        """Whole sequences' ids (B, T) after K start ids, (B, K + T): the history without a KV cache."""
        return F.pad(idx, (self.context, 0), value=self.start)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        """The n-gram rows (B, T, D) of the last T ids of `history` (B, K + T), summed over the orders."""
        K, T = self.context, history.size(1) - self.context
        found = []
        for n, multiplier, table in zip(self.orders, self.multipliers, self.tables, strict=True):
            index = torch.zeros_like(history[:, K:])  # (B, T)
            for back in range(n - 1, -1, -1):  # the n-gram's oldest id first, the token itself last
                index = (index * multiplier + history[:, K - back:K - back + T]) % table.size(0)
            found.append(F.embedding(index, table))  # (B, T, D)
        return sum(found[1:], found[0])
