"""Handout #11 written out: attention, multi-head attention, a pre-norm block and a small GPT.

Plain PyTorch, one definition per handout section. Shapes: B batch, T positions, D model width,
H heads, V vocabulary. `gptlab check` grades this file against the handout.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def attention(q, k, v, mask=None):
    """§2 and §3.2: score every key, normalise over the keys, mix the values; returns (y, weights).

    q, k: (..., T, d_k), v: (..., T, d_v); mask: (T, T) bool, True where query i may see key j.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., T, T): rows are queries
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: a hidden key gets no weight
    weights = scores.softmax(dim=-1)  # each row sums to one over the keys
    return weights @ v, weights  # (..., T, d_v), (..., T, T)


class MultiHeadAttention(nn.Module):
    """§4 and §4.2: H heads of width D/H from one fused Q/K/V projection, concatenated, mixed by W_O."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        assert n_embd % n_head == 0, f"n_embd={n_embd} must be divisible by n_head={n_head}"
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # W_QKV = [W_Q W_K W_V]
        self.proj = nn.Linear(n_embd, n_embd)  # W_O

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)  # 3 x (B, T, D)
        # Each head takes its own D/H features: (B, T, D) -> (B, T, H, D/H) -> (B, H, T, D/H)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        y, _ = attention(q, k, v, mask)  # (B, H, T, D/H)
        y = y.transpose(1, 2).reshape(B, T, D)  # concatenate the heads: (B, T, D)
        return self.proj(y)


class Block(nn.Module):
    """§5, pre-norm: mix positions with attention, then transform each position with an MLP."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)  # normalises each token's features
        self.attn = MultiHeadAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
        return x


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 64  # the longest context, and the number of learned positions
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class GPT(nn.Module):
    """§6 and §7: token and position embeddings, a stack of blocks, a vocabulary head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)  # E
        self.pos = nn.Embedding(config.block_size, config.n_embd)  # learned p_i
        self.blocks = nn.ModuleList([Block(config.n_embd, config.n_head) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        """idx: (B, T) token ids; targets: (B, T), targets[b, i] the token after idx[b, i]."""
        B, T = idx.shape
        x = self.tok(idx)  # (B, T, D)
        x = x + self.pos(torch.arange(T, device=idx.device))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=idx.device))  # (T, T): key j <= query i
        for block in self.blocks:
            x = block(x, mask)  # every block is masked
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
