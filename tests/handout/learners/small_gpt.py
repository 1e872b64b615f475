"""A whole small GPT in one learner's style: a 0/1 mask buffer, labels shifted inside the model.

Test data for tests/handout/test_grade.py. forward(idx, labels) scores position i against labels[i + 1],
as Hugging Face models do, so the caller passes labels = idx.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    vocab_size: int = 50
    max_seq_len: int = 32
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4


def attention(q, k, v, mask=None):
    """mask: 1 where a query may see a key, 0 where it may not."""
    att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1)))
    if mask is not None:
        att = att.masked_fill(mask == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v, att


class SelfAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(args.max_seq_len, args.max_seq_len)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y, _ = attention(q, k, v, self.mask[:T, :T])
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = SelfAttention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                                          nn.Linear(4 * args.dim, args.dim))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.pos_embeddings = nn.Embedding(params.max_seq_len, params.dim)
        self.layers = nn.ModuleList([TransformerBlock(params) for _ in range(params.n_layers)])
        self.norm = nn.LayerNorm(params.dim)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)

    def forward(self, tokens, labels=None):
        T = tokens.size(1)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(T, device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return logits, loss
