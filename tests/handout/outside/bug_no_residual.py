"""Style: torch.nn.MultiheadAttention inside each DecoderBlock (batch_first=True, bool attn_mask with True =
not allowed, built by nn.Transformer.generate_square_subsequent_mask's boolean twin), learned positions,
model class TransformerLM(vocab_size, d_model, nhead, num_layers, max_len).

Bug: the attention sublayer has no residual connection: x = attn(ln(x)) replaces the stream instead of
x = x + attn(ln(x)) (the FFN's residual is kept).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "nn.MultiheadAttention inside the Block"
BUG = "missing residual connection around the attention sublayer"
EXPECTED_CAUSE = (r"no residual|residual (connection|is missing|missing|add)|missing (the )?residual"
                  r"|without (the |a )?residual|skip connection")
FLAGS: list[str] = []


class DecoderBlock(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, 4 * d_model)
        self.linear2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        T = x.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(diagonal=1)
        h = self.norm1(x)
        x = self.self_attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x


class TransformerLM(nn.Module):
    def __init__(self, vocab_size, d_model, nhead, num_layers, max_len):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_embedding = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList([DecoderBlock(d_model, nhead) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.fc_out = nn.Linear(d_model, vocab_size)

    def forward(self, src, tgt=None):
        pos = torch.arange(src.size(1), device=src.device).unsqueeze(0)
        x = self.embedding(src) + self.pos_embedding(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.fc_out(self.norm(x))
        if tgt is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
