"""Style: fused QKV laid out per head. One Linear(d_model, 3 * d_model) whose output is read as
(B, T, heads, 3, head_dim): each head's q, k and v columns sit next to each other (the layout some
Megatron/GPT-NeoX-style code uses), instead of [all Q | all K | all V].

Correct: the layout is a different (equally learnable) parameterisation of the same attention.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

STYLE = "fused QKV interleaved per head, view(B, T, H, 3, hs)"
BUG = None
FLAGS: list[str] = []


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.dh = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, self.h, 3, self.dh)
        q, k, v = qkv.unbind(dim=3)  # each (B, T, h, dh)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dh)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v  # (B, h, T, dh)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.n2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.ffn(self.n2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, n_layers, max_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.unembed = nn.Linear(d_model, vocab_size)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))[None]
        for b in self.blocks:
            x = b(x)
        logits = self.unembed(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
