"""Style: PyTorch-2 fast path: one fused qkv Linear, F.scaled_dot_product_attention(is_causal=True),
pre-norm blocks, GPT(GPTConfig) with wte / wpe tables.

Bug: the position table is indexed by the token ids (self.wpe(idx)) instead of the positions
(self.wpe(torch.arange(T))), so it is a second token embedding and the same token at two positions
still starts with the same row.
"""

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

STYLE = "F.scaled_dot_product_attention(is_causal=True), fused qkv"
BUG = "position table indexed by the token ids instead of the positions"
EXPECTED_CAUSE = r"token id|by the ids|indexed by (the )?tokens?"
FLAGS: list[str] = []


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
