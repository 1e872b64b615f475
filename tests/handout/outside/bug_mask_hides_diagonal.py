"""Style: lab-assignment file with a `causal_mask(T)` helper returning a 0/1 keep-matrix, an
attention(q, k, v, mask=None) function (mask: 1 = keep) and a MultiHeadSelfAttention(embed_dim,
num_heads) with one fused qkv Linear; pre-norm Block; GPT(vocab_size, embed_dim, num_heads,
num_layers, block_size).

Bug: the causal mask hides the diagonal too (tril(..., diagonal=-1)): a query may not look at its own
key, and the first row has nothing left to attend to (all -inf, NaN after the softmax).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "causal_mask helper + attention function (mask 1 = keep)"
BUG = "causal mask hides the diagonal (tril(-1)): a token cannot see itself"
EXPECTED_CAUSE = r"diagonal|its own (key|position|token)|itself"
FLAGS: list[str] = []


def causal_mask(T, device=None):
    """1 where query i may attend to key j (strictly earlier keys)."""
    return torch.tril(torch.ones(T, T, device=device), diagonal=-1)


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = self.qkv(x).split(E, dim=-1)
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = attention(q, k, v, causal_mask(T, x.device))
        return self.out(y.transpose(1, 2).reshape(B, T, E))


class Block(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadSelfAttention(embed_dim, num_heads)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(),
                                 nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, block_size):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, embed_dim)
        self.pos_emb = nn.Embedding(block_size, embed_dim)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
