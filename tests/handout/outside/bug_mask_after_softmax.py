"""Style: "attention returns its weights so we can plot them". attention(query, key, value, mask=None)
with mask 1 = visible, 0 = hidden; an AttentionHeads module with separate projections; pre-norm blocks;
a TransformerLM(vocab_size, d_model, n_heads, n_layers, context_length).

Bug: the mask is applied after the softmax (weights of hidden keys zeroed), so hidden keys still take
part in each row's normalisation and rows no longer sum to one.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "attention function returning weights, mask 1 = visible"
BUG = "mask applied after the softmax"
EXPECTED_CAUSE = r"after the softmax"
FLAGS: list[str] = []


def attention(query, key, value, mask=None):
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
    weights = F.softmax(scores, dim=-1)
    if mask is not None:
        weights = weights.masked_fill(mask == 0, 0.0)
    return torch.matmul(weights, value), weights


class AttentionHeads(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.wo = nn.Linear(d_model, d_model)
        self.last_weights = None

    def forward(self, x):
        B, T, D = x.shape
        H = self.n_heads
        q = self.wq(x).view(B, T, H, D // H).transpose(1, 2)
        k = self.wk(x).view(B, T, H, D // H).transpose(1, 2)
        v = self.wv(x).view(B, T, H, D // H).transpose(1, 2)
        mask = torch.tril(torch.ones(T, T, device=x.device))
        y, self.last_weights = attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.heads = AttentionHeads(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.heads(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, n_layers, context_length):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
