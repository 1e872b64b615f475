"""Multi-head attention on torch.nn.MultiheadAttention, and a pre-norm block with RMSNorm (§9.3).

Test data for tests/handout/test_grade.py.
"""

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, causal=False):
        super().__init__()
        self.causal = causal
        self.mha = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x):
        T = x.size(1)
        hidden = torch.ones(T, T, dtype=torch.bool).triu(1) if self.causal else None  # True: may not attend
        y, _ = self.mha(x, x, x, attn_mask=hidden, need_weights=False)
        return y


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, causal=True)
        self.norm2 = nn.RMSNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))
