"""Style: "transformer from the paper, decoder half": a ScaledDotProductAttention module taking
(q, k, v, attn_mask) with an additive float mask (0 = keep, -1e9 = hide), a MultiHeadAttention(d_model,
n_head) holding it, position-wise FFN, pre-norm DecoderLayer, and Decoder(n_vocab, d_model, n_head,
n_layers, n_position) with sinusoidal positions.

Bug: the mask is built with torch.triu(ones, diagonal=0), so the diagonal is hidden too: a token
cannot see itself, and the first row (every key at -1e9) falls back to a uniform average over ALL
positions, future ones included.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "paper-style ScaledDotProductAttention module, additive -1e9 mask"
BUG = "causal mask hides the diagonal (triu(diagonal=0)), row 0 then averages every position"
EXPECTED_CAUSE = r"diagonal|its own (key|position|token)|itself"
FLAGS = ["--model", "Decoder(n_vocab=11, d_model=16, n_head=2, n_layers=2, n_position=16)"]


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, attn_mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = F.softmax(attn, dim=-1)
        return torch.matmul(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_model // n_head
        self.w_qs = nn.Linear(d_model, d_model, bias=False)
        self.w_ks = nn.Linear(d_model, d_model, bias=False)
        self.w_vs = nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=math.sqrt(self.d_k))

    def forward(self, x):
        sz_b, len_q, d_model = x.shape
        q = self.w_qs(x).view(sz_b, len_q, self.n_head, self.d_k).transpose(1, 2)
        k = self.w_ks(x).view(sz_b, len_q, self.n_head, self.d_k).transpose(1, 2)
        v = self.w_vs(x).view(sz_b, len_q, self.n_head, self.d_k).transpose(1, 2)
        hide = torch.triu(torch.ones(len_q, len_q, device=x.device), diagonal=0)
        attn_mask = hide * -1e9
        out, _ = self.attention(q, k, v, attn_mask=attn_mask)
        out = out.transpose(1, 2).contiguous().view(sz_b, len_q, d_model)
        return self.fc(out)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid):
        super().__init__()
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)

    def forward(self, x):
        return self.w_2(F.relu(self.w_1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.slf_attn_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.slf_attn = MultiHeadAttention(d_model, n_head)
        self.pos_ffn_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.pos_ffn = PositionwiseFeedForward(d_model, 4 * d_model)

    def forward(self, dec_input):
        dec_output = dec_input + self.slf_attn(self.slf_attn_norm(dec_input))
        return dec_output + self.pos_ffn(self.pos_ffn_norm(dec_output))


def sinusoid_table(n_position, d_hid):
    position = torch.arange(n_position, dtype=torch.float32).unsqueeze(1)
    div = torch.pow(10000.0, torch.arange(0, d_hid, 2, dtype=torch.float32) / d_hid)
    table = torch.zeros(n_position, d_hid)
    table[:, 0::2] = torch.sin(position / div)
    table[:, 1::2] = torch.cos(position / div)
    return table


class Decoder(nn.Module):
    def __init__(self, n_vocab, d_model=512, n_head=8, n_layers=6, n_position=200):
        super().__init__()
        self.trg_word_emb = nn.Embedding(n_vocab, d_model)
        self.register_buffer("pos_table", sinusoid_table(n_position, d_model))
        self.layer_stack = nn.ModuleList([DecoderLayer(d_model, n_head) for _ in range(n_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.trg_word_prj = nn.Linear(d_model, n_vocab, bias=False)

    def forward(self, trg_seq):
        dec_output = self.trg_word_emb(trg_seq) + self.pos_table[: trg_seq.size(1)]
        for dec_layer in self.layer_stack:
            dec_output = dec_layer(dec_output)
        return self.trg_word_prj(self.layer_norm(dec_output))
