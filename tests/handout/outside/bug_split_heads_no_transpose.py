"""Style: "multi-head as a batched matmul" lecture code: MultiHeadAttention(d_model, num_heads) with
three projections, heads split by a reshape, scores masked with a lower-triangular buffer, heads merged
back with transpose + reshape; post-LN-free pre-norm blocks; model GPT(GPTConfig).

Bug: the heads are split with q.view(B, H, T, hs) straight from (B, T, D) instead of
view(B, T, H, hs).transpose(1, 2), so each "head" row mixes features of different positions.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "separate projections, heads split by reshape"
BUG = "heads split with view(B, H, T, hs) without the transpose"
EXPECTED_CAUSE = r"split|view\(B, ?H, ?T"
FLAGS: list[str] = []


@dataclass
class GPTConfig:
    vocab_size: int = 100
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, block_size=64):
        super().__init__()
        self.h = num_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, D = x.shape
        hs = D // self.h
        q = self.W_q(x).view(B, self.h, T, hs)
        k = self.W_k(x).view(B, self.h, T, hs)
        v = self.W_v(x).view(B, self.h, T, hs)
        att = q @ k.transpose(-2, -1) / math.sqrt(hs)
        att = att.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v  # (B, h, T, hs)
        return self.W_o(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = MultiHeadAttention(config.n_embd, config.n_head, config.block_size)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
