"""Style: lean on the library. Each block holds torch.nn.MultiheadAttention(batch_first=True) and
passes a boolean attn_mask (True above the diagonal = not allowed); a sinusoidal position table is
registered as a buffer. Constructor TransformerLM(vocab_size, embed_dim, num_heads, num_layers,
context_length).

Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "nn.MultiheadAttention inside the Block"
BUG = None
FLAGS: list[str] = []


def sinusoids(length, dim):
    pos = torch.arange(length).unsqueeze(1).float()
    freq = torch.exp(torch.arange(0, dim, 2).float() * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Block(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.ln_a = nn.LayerNorm(embed_dim)
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)
        self.ln_b = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim),
            nn.GELU(),
            nn.Linear(4 * embed_dim, embed_dim),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        T = x.size(1)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln_a(x)
        attended, _ = self.mha(h, h, h, attn_mask=future, need_weights=False)
        x = x + attended
        x = x + self.mlp(self.ln_b(x))
        return x


class TransformerLM(nn.Module):
    def __init__(self, vocab_size, embed_dim=128, num_heads=4, num_layers=3, context_length=128,
                 dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.register_buffer("pe", sinusoids(context_length, embed_dim), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, dropout) for _ in range(num_layers)])
        self.ln = nn.LayerNorm(embed_dim)
        self.out = nn.Linear(embed_dim, vocab_size)

    def forward(self, x, y=None):
        T = x.size(1)
        h = self.drop(self.embed(x) * math.sqrt(self.embed.embedding_dim) + self.pe[:T])
        for blk in self.blocks:
            h = blk(h)
        logits = self.out(self.ln(h))
        if y is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
