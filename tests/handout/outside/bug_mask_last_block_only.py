"""Style: "encoder blocks reused as a decoder": each Block takes a `causal` flag (a keyword with a default
of False, the way an encoder/decoder-shared block is written), attention through
F.scaled_dot_product_attention(is_causal=causal), model Transformer(vocab_size, dim, depth, heads,
max_seq_len) with a learned position Parameter.

Bug: only the last block is built with causal=True; the earlier blocks attend in both directions, so
they can copy future tokens into earlier rows before the final (masked) block.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "encoder-style blocks with a causal flag, SDPA"
BUG = "causal mask only in the last block"
EXPECTED_CAUSE = r"every block|only (the )?(last|final) block|only block"
FLAGS: list[str] = []


class Attention(nn.Module):
    def __init__(self, dim, heads, causal=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, heads, causal=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size, dim, depth, heads, max_seq_len):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_seq_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, causal=(i == depth - 1)) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, vocab_size)

    def forward(self, x, targets=None):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.to_logits(self.norm(h))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
