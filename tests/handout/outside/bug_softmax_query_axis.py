"""Style: einsum everywhere. A scaled_attention(q, k, v, causal=True) helper on (..., T, d) tensors,
a fused to_qkv projection chunked in three, pre-norm blocks and a `Model` class with a learned position
table.

Bug: the softmax normalises over the query axis (dim=-2, the rows' index) instead of over the keys
(dim=-1), so columns sum to one and rows do not.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "einsum attention helper with a causal flag"
BUG = "softmax over the query axis (dim=-2)"
EXPECTED_CAUSE = r"query axis|softmax\(dim=-1\)"
FLAGS = ["--attention", "scaled_attention"]


def scaled_attention(q, k, v, causal=True):
    scores = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    if causal:
        t_q, t_k = scores.shape[-2:]
        hide = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hide, float("-inf"))
    probs = scores.softmax(dim=-2)
    return torch.einsum("...ij,...jd->...id", probs, v)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        out = scaled_attention(q, k, v, causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ff_norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x):
        x = self.attn(self.attn_norm(x)) + x
        return self.ff(self.ff_norm(x)) + x


class Model(nn.Module):
    def __init__(self, num_tokens, dim, depth, heads, max_seq_len):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList([Layer(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, targets=None):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.token_emb(x) + self.pos_emb(pos)
        for layer in self.layers:
            h = layer(h)
        logits = self.to_logits(self.norm(h))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.transpose(1, 2), targets)
