"""Style: explicit Python loops, the way a first-principles assignment spells attention out: for each
batch item, each head and each query position, score the keys 0..t one at a time, softmax, and sum the
values. Slow, but it is the handout's equation line by line.

Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "explicit for-loops over positions and heads"
BUG = None
FLAGS: list[str] = []


class MultiHeadAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.query = nn.Linear(n_embd, n_embd, bias=False)
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        Q, K, V = self.query(x), self.key(x), self.value(x)
        rows = []
        for b in range(B):
            per_pos = []
            for t in range(T):
                per_head = []
                for h in range(self.n_head):
                    lo, hi = h * self.head_size, (h + 1) * self.head_size
                    q = Q[b, t, lo:hi]
                    scores = []
                    for s in range(t + 1):  # only keys at or before the query
                        scores.append(torch.dot(q, K[b, s, lo:hi]) / math.sqrt(self.head_size))
                    weights = F.softmax(torch.stack(scores), dim=0)
                    acc = torch.zeros(self.head_size, dtype=x.dtype, device=x.device)
                    for s in range(t + 1):
                        acc = acc + weights[s] * V[b, s, lo:hi]
                    per_head.append(acc)
                per_pos.append(torch.cat(per_head))
            rows.append(torch.stack(per_pos))
        return self.proj(torch.stack(rows))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = MultiHeadAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc1 = nn.Linear(n_embd, 4 * n_embd)
        self.fc2 = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(F.relu(self.fc1(self.ln2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd, n_head, n_layer):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx)
        for t in range(T):  # add the position vector row by row
            x[:, t] = x[:, t] + self.wpe.weight[t]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss
