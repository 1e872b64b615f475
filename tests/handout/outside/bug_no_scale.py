"""Style: "from the slides" file. An attention(q, k, v, mask=None) function returning (out, weights)
(mask: bool, True = may attend), a MultiHeadAttention with separate projections that calls it, a
pre-norm Block and a GPT built from a GPTConfig.

Bug: the scores are never divided by sqrt(d_k) (q @ k^T straight into the softmax).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "attention function + separate-projection MultiHeadAttention"
BUG = "no sqrt(d_k) scale on the scores"
EXPECTED_CAUSE = r"sqrt\(d_k\)|not (divided|scaled)"
FLAGS: list[str] = []


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)  # (..., T, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(n_embd, n_embd)
        self.k_proj = nn.Linear(n_embd, n_embd)
        self.v_proj = nn.Linear(n_embd, n_embd)
        self.out_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y, _ = attention(q, k, v, mask)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = MultiHeadAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config.n_embd, config.n_head) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
