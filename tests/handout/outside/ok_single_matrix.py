"""Style: "one sequence at a time" homework. attention(Q, K, V, mask=None) is written for a single
(T, d) matrix, with Q @ K.T on 2-D tensors (correct there); the module loops over batch items and heads
and calls it on each (T, d_h) slice, then concatenates the heads.

Correct: .T is the matrix transpose on 2-D inputs, and the function is only ever given 2-D inputs.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "attention for one (T, d) matrix at a time, .T on 2-D"
BUG = None
FLAGS: list[str] = []


def attention(Q, K, V, mask=None):
    """Q: (T_q, d_k), K: (T_k, d_k), V: (T_k, d_v). mask: (T_q, T_k) of 0/1, 1 = keep."""
    d_k = Q.shape[1]
    S = Q @ K.T / np.sqrt(d_k)
    if mask is not None:
        S = S.masked_fill(mask == 0, float("-inf"))
    A = F.softmax(S, dim=1)
    return A @ V, A


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.W_Q = nn.Linear(d_model, d_model, bias=False)
        self.W_K = nn.Linear(d_model, d_model, bias=False)
        self.W_V = nn.Linear(d_model, d_model, bias=False)
        self.W_O = nn.Linear(d_model, d_model, bias=False)

    def forward(self, X):
        B, T, _ = X.shape
        Q, K, V = self.W_Q(X), self.W_K(X), self.W_V(X)
        mask = torch.tril(torch.ones(T, T, device=X.device))
        outputs = []
        for b in range(B):
            head_outputs = []
            for h in range(self.num_heads):
                cols = slice(h * self.d_head, (h + 1) * self.d_head)
                out, _ = attention(Q[b, :, cols], K[b, :, cols], V[b, :, cols], mask)
                head_outputs.append(out)
            outputs.append(torch.cat(head_outputs, dim=1))
        return self.W_O(torch.stack(outputs))


class Block(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.mha = MultiHeadAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, X):
        X = X + self.mha(self.ln1(X))
        return X + self.ffn(self.ln2(X))


class GPT(nn.Module):
    def __init__(self, vocab_size, d_model, num_heads, num_layers, context_length):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleList([Block(d_model, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        X = self.token_embedding(idx) + self.position_embedding(torch.arange(T, device=idx.device))
        for block in self.blocks:
            X = block(X)
        logits = self.lm_head(self.ln_f(X))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
