"""Attention on F.scaled_dot_product_attention with a causal flag, and separate q/k/v/o projections.

Test data for tests/handout/test_grade.py.
"""

import torch.nn.functional as F
from torch import nn


def attention(q, k, v, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape

        def heads(t):
            return t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, T, hs)

        y = attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))
