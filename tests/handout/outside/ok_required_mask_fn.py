"""Style: a course notebook whose attention function takes the mask as a REQUIRED fourth argument
(no default): attention(q, k, v, mask) with mask a bool tensor, True where a query may look. The
module builds the causal mask and always passes it.

Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "attention function with a required mask argument"
BUG = None
FLAGS: list[str] = []


def attention(q, k, v, mask):
    """q, k: (..., T, d_k); v: (..., T, d_v); mask: (T, T) bool, True = allowed. Returns (out, weights)."""
    d_k = q.shape[-1]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    scores = scores.masked_fill(torch.logical_not(mask), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v), weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, max_len=128):
        super().__init__()
        self.n_heads = n_heads
        self.Wq = nn.Linear(d_model, d_model, bias=False)
        self.Wk = nn.Linear(d_model, d_model, bias=False)
        self.Wv = nn.Linear(d_model, d_model, bias=False)
        self.Wo = nn.Linear(d_model, d_model, bias=False)
        self.register_buffer("allowed", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, x):
        B, T, D = x.shape
        H = self.n_heads

        def split(t):
            return t.view(B, T, H, D // H).transpose(1, 2)

        out, _ = attention(split(self.Wq(x)), split(self.Wk(x)), split(self.Wv(x)), self.allowed[:T, :T])
        return self.Wo(out.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_len=128):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.mha = MultiHeadAttention(d_model, n_heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.mha(self.ln1(x))
        return x + self.ff(self.ln2(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, n_layers, max_len):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads, max_len) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x, targets=None):
        positions = torch.arange(x.size(1), device=x.device)
        logits = self.head(self.ln(self.blocks(self.emb(x) + self.pos(positions))))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.transpose(1, 2), targets)
