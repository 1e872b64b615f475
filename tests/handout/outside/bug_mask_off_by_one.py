"""Style: nanoGPT-flavoured CausalSelfAttention with a boolean "future" buffer built once
(triu of ones, True = hidden), fused c_attn, a Config dataclass with d_model / n_heads / n_layers /
context_length names, and GPT.forward(idx, targets=None) -> (logits, loss).

Bug: off by one -- the buffer is triu(diagonal=2) instead of diagonal=1, so query i also sees key i + 1
(the very token it is meant to predict).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "fused c_attn, boolean future buffer (True = hidden)"
BUG = "off-by-one mask: query i sees key i + 1 (triu(diagonal=2))"
EXPECTED_CAUSE = r"off.by.one|key i ?\+ ?1|one (position|token|key) (ahead|later|too far)|diagonal=1"
FLAGS: list[str] = []


@dataclass
class Config:
    vocab_size: int = 50304
    context_length: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        future = torch.triu(torch.ones(cfg.context_length, cfg.context_length, dtype=torch.bool), diagonal=2)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_heads)
        att = att.masked_fill(self.future[:T, :T], float("-inf"))
        att = att.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
