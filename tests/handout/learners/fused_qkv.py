"""A fused-QKV module configured by a dataclass, a post-norm block, and attention with a hiding mask.

Test data for tests/handout/test_grade.py. The mask convention here is the other way round from the
handout's: True marks a key that is hidden.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Config:
    d_model: int = 32
    n_heads: int = 4
    context_length: int = 64


def attention(q, k, v, hide=None):
    """Returns (y, weights); `hide` is True where a query may not see a key."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])
    if hide is not None:
        scores = scores.masked_fill(hide, float("-inf"))
    weights = scores.softmax(-1)
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        H = self.n_heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, H, D // H).permute(0, 2, 1, 3) for t in (q, k, v))  # (B, H, T, hs)
        hide = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        y, _ = attention(q, k, v, hide)
        return self.out(y.permute(0, 2, 1, 3).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = MultiHeadAttention(config)
        self.norm1 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 2 * config.d_model), nn.GELU(),
                                 nn.Linear(2 * config.d_model, config.d_model))
        self.norm2 = nn.LayerNorm(config.d_model)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))
