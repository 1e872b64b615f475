"""Style: PyTorch 2 fast path. Separate q/k/v projections, heads via rearranged views, and
F.scaled_dot_product_attention(q, k, v, is_causal=True) doing the scaling, masking and softmax.
Keyword constructor GPT(vocab_size, d_model, n_heads, n_layers, max_seq_len).

Correct.
"""

import torch
import torch.nn.functional as F
from torch import nn

STYLE = "F.scaled_dot_product_attention(is_causal=True)"
BUG = None
FLAGS: list[str] = []


class CausalAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        self.n_heads = n_heads
        self.to_q = nn.Linear(d_model, d_model, bias=False)
        self.to_k = nn.Linear(d_model, d_model, bias=False)
        self.to_v = nn.Linear(d_model, d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model)
        self.p = dropout

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.n_heads, -1).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self._heads(self.to_q(x)), self._heads(self.to_k(x)), self._heads(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                             is_causal=True)
        out = out.permute(0, 2, 1, 3).reshape(b, n, d)
        return self.to_out(out)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int = 128, n_heads: int = 4, n_layers: int = 4,
                 max_seq_len: int = 256, dropout: float = 0.1):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, max_seq_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:, :n]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
