"""Style: course-notes file with q/k/v as one ModuleDict of projections and a SelfAttention(d_model,
n_heads) that precomputes its scale in __init__; post-norm-free pre-norm block, GELU MLP.

Bug: the scale is 1 / d_model -- divided by D, the model width, with no square root at all.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "ModuleDict of projections, scale precomputed in __init__"
BUG = "scores divided by D (the model width), not sqrt(head size)"
EXPECTED_CAUSE = r"model width|\bby D\b|/ ?D\b"
FLAGS: list[str] = []


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.d_model = d_model
        self.proj = nn.ModuleDict({name: nn.Linear(d_model, d_model, bias=False) for name in "qkvo"})
        self.scale = 1.0 / d_model

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = (self.proj[n](x).view(b, t, h, d // h).permute(0, 2, 1, 3) for n in "qkv")
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(causal, float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", logits.softmax(-1), v)
        return self.proj["o"](out.permute(0, 2, 1, 3).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.norm_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, n_layers, max_seq_len):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(max_seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens, targets=None):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
