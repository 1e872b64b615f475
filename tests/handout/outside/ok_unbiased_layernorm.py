"""Style: everything hand-written for a "no torch.nn layers but Linear" exercise: a LayerNorm class
computing mean and variance over the last axis with the UNBIASED variance x.var(-1, unbiased=True),
gain and bias parameters, GELU by formula, heads as a 4-D view.

Correct: unbiased vs biased variance changes the normalised scale by sqrt(D / (D - 1)), a constant the
gain absorbs; the norm is still taken across the features of each token, as §5 asks.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "hand-written LayerNorm with unbiased variance"
BUG = None
FLAGS: list[str] = []


class LayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=True)
        return self.gamma * (x - mu) / torch.sqrt(var + self.eps) + self.beta


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, hd).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / hd ** 0.5
        future = torch.triu(torch.ones(t, t, device=x.device), 1).bool()
        s = s.masked_fill(future, -1e30)
        a = s.softmax(-1)
        y = (a @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, heads)
        self.norm2 = LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.down(gelu(self.up(self.norm2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, dim, heads, depth, max_len):
        super().__init__()
        self.token = nn.Parameter(torch.randn(vocab_size, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = LayerNorm(dim)

    def forward(self, idx, targets=None):
        x = self.token[idx] + self.position[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.token.T  # tied output head
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
