"""The decoder-only Transformer of handout #11, in one file, read top to bottom.

Small parts first (attention maths §2-§3, positions §6, norms and feed-forward §5), then multi-head
attention with a fused QKV projection (§4), the block (§5.1), and the language model with its
vocabulary head and teacher-forcing loss (§6-§7). Module names follow GPT-2's checkpoint
(`transformer.h.0.attn.c_attn`, ...) so that weight conversion is mostly the identity.

Shape legend: B batch, T sequence length, D model width (n_embd), H heads, hs head size (D // H),
F feed-forward width, V vocabulary size.

Deliberate choices:
- Dropout acts on the embeddings and on each residual update, never on attention weights, so the
  `naive` and `sdpa` kernels compute the same function.
- GELU is the tanh approximation, as in GPT-2, so GPT-2 weights give GPT-2's logits.
- RoPE rotates the feature pairs (i, i + hs/2) of each head (the "rotate half" layout).
- Post-norm models end with the last block's norm, so they have no extra final norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import ModelConfig

# ---------------------------------------------------------------------------------------------
# §2-§3: scaled dot-product attention, written out (the reference every fast path is checked against)


def attention_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Raw scores s = q k^T / sqrt(d_k) for every query against every key (§2, §3.1)."""
    # (..., Tq, hs) @ (..., hs, Tk) -> (..., Tq, Tk); transpose(-2, -1) works for any batch rank
    return queries @ keys.transpose(-2, -1) / math.sqrt(queries.size(-1))


def causal_mask(n_queries: int, n_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query i may see key j, i.e. j <= i (§7.3).

    When there are fewer queries than keys, the queries are taken to be the last positions.
    """
    full = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return full.tril(diagonal=n_keys - n_queries)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised weights a = softmax(s) over keys; masked keys get exactly zero weight (§3.2)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The handout's attention(q, k, v): returns the outputs (..., Tq, dv) and weights (..., Tq, Tk)."""
    weights = masked_softmax(attention_scores(queries, keys), mask)
    return weights @ values, weights


def naive_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Explicit scores, mask, softmax, weights @ values; stores all B*H*T*T weights."""
    mask = causal_mask(q.size(-2), k.size(-2), q.device) if causal else None
    return attention(q, k, v, mask)[0]


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """PyTorch's fused kernel: the same function, without materialising the weights."""
    if causal and q.size(-2) != k.size(-2):
        # is_causal aligns the mask to the first positions; queries here are the last ones
        mask = causal_mask(q.size(-2), k.size(-2), q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]] = {
    "naive": naive_kernel,
    "sdpa": sdpa_kernel,
}

# ---------------------------------------------------------------------------------------------
# §6: position information. Each scheme maps token rows (B, T, D) to input rows X = E[w] + p.


class LearnedPositions(nn.Embedding):
    """A trainable row p_i per position: block_size * D parameters (§6.1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.block_size, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return x + self.weight[: x.size(1)]


class SinusoidalPositions(nn.Module):
    """Fixed rows: even features sin(i w_k), odd features cos(i w_k), w_k = base^(-2k/D); no parameters."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.n_embd
        position = torch.arange(config.block_size, dtype=torch.float32).unsqueeze(1)  # (T_max, 1)
        freqs = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
        table = torch.zeros(config.block_size, d)
        table[:, 0::2] = torch.sin(position * freqs)  # (T_max, ceil(D/2))
        table[:, 1::2] = torch.cos(position * freqs[: d // 2])  # (T_max, floor(D/2))
        self.register_buffer("table", table, persistent=False)  # derived, so not saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return x + self.table[: x.size(1)]


class NoPositions(nn.Module):
    """No absolute position rows: used by `none` and by `rope`, which acts inside attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


POSITIONS: dict[str, type[nn.Module]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "rope": NoPositions,
    "none": NoPositions,
}


class Rotary(nn.Module):
    """RoPE: rotate each query/key feature pair (i, i + hs/2) by an angle proportional to position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hs = config.head_size
        inv_freq = config.rope_base ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)  # (hs/2,)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (T_max, hs/2)
        self.register_buffer("sin", angles.sin(), persistent=False)  # (T_max, hs/2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, hs) -> (B, H, T, hs)
        cos, sin = self.cos[: x.size(-2)], self.sin[: x.size(-2)]
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, H, T, hs/2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# ---------------------------------------------------------------------------------------------
# §5: token-wise normalisation and the position-wise feed-forward network

NORMS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "layernorm": lambda c: nn.LayerNorm(c.n_embd, eps=c.norm_eps, bias=c.bias),
    "rmsnorm": lambda c: nn.RMSNorm(c.n_embd, eps=c.norm_eps),
    "none": lambda c: nn.Identity(),
}


class MLP(nn.Module):
    """Expand D -> F, apply a nonlinearity, contract F -> D, at every position separately."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.act = nn.GELU(approximate="tanh") if config.ffn == "gelu" else nn.ReLU()
        self.c_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return self.c_proj(self.act(self.c_fc(x)))  # hidden (B, T, F)


class GatedMLP(nn.Module):
    """SwiGLU (§9.3): two D -> F maps give features and gates, multiplied before F -> D."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.c_gate = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))  # hidden (B, T, F)


FFNS: dict[str, type[nn.Module]] = {"gelu": MLP, "relu": MLP, "swiglu": GatedMLP}

# ---------------------------------------------------------------------------------------------
# §4: multi-head self-attention with one fused projection W_QKV (D -> 3D) and W_O (D -> D)


class CausalSelfAttention(nn.Module):
    """H heads of width hs = D / H, each with its own routing; outputs concatenated, then W_O."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # [W_Q W_K W_V]
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.rotate = Rotary(config) if config.positions == "rope" else nn.Identity()
        self.kernel = KERNELS[config.attention]
        # Only the lab's demonstrations and encoders switch this off (§7.3).
        self.causal = config.causal

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of every head, each (B, H, T, hs), as in §4.2."""
        B, T, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)  # 3 x (B, T, D): one matmul, three feature groups
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        return self.rotate(q), self.rotate(k), v  # (B, H, T, hs) each

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        B, T, D = x.shape
        q, k, v = self.project(x)
        y = self.kernel(q, k, v, self.causal)  # (B, H, T, hs)
        y = y.transpose(1, 2).reshape(B, T, D)  # concatenate the heads' answers: (B, T, D)
        return self.c_proj(y)

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The weights a of every head, (B, H, T, T), recomputed explicitly whatever the kernel."""
        q, k, _ = self.project(x)
        mask = causal_mask(q.size(-2), k.size(-2), q.device) if self.causal else None
        return masked_softmax(attention_scores(q, k), mask)


# ---------------------------------------------------------------------------------------------
# §5.1: a block mixes positions (attention), then transforms features (FFN), each with a residual


class Block(nn.Module):
    """One Transformer block in the pre-norm or post-norm arrangement."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = NORMS[config.norm](config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = NORMS[config.norm](config)
        self.mlp = FFNS[config.ffn](config)
        self.drop = nn.Dropout(config.dropout)
        self.prenorm = config.arrangement == "pre"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        if self.prenorm:  # x + g(LN(x)): an explicit identity path through every update
            x = x + self.drop(self.attn(self.ln_1(x)))
            return x + self.drop(self.mlp(self.ln_2(x)))
        x = self.ln_1(x + self.drop(self.attn(x)))  # post-norm: LN(x + g(x))
        return self.ln_2(x + self.drop(self.mlp(x)))


# ---------------------------------------------------------------------------------------------
# §6-§7: the language model


class GPT(nn.Module):
    """Token embedding + positions, L blocks, final norm, vocabulary head; causal in every block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # E, (V, D)
                wpe=POSITIONS[config.positions](config),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=NORMS[config.norm](config) if config.arrangement == "pre" else nn.Identity(),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tied:  # logits = h E^T: the head *is* the embedding tensor (§6)
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(_init_weights)
        # GPT-2 scales the projections that write into the residual stream by depth, so the
        # stream's variance does not grow with the number of blocks.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Input rows X = E[w] + p for token ids (B, T) -> (B, T, D)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}: "
                f"crop the input to its last {self.config.block_size} tokens"
            )
        x = self.transformer.wpe(self.transformer.wte(idx))  # (B, T, D)
        return self.transformer.drop(x)

    def forward_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Run the blocks, final norm and vocabulary head on input rows: (B, T, D) -> (B, T, V)."""
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids (B, T), and with targets the mean next-token loss.

        `targets[:, i]` is the token that follows `idx[:, i]` (teacher forcing, §7.2); positions
        whose target is -1 are not scored.
        """
        logits = self.forward_embeddings(self.embed(idx))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def num_parameters(self) -> int:
        """Trainable parameters, counting a tied embedding/head tensor once."""
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases (PyTorch's defaults hit CPU denormals)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def parameter_count(config: ModelConfig) -> dict[str, int]:
    """Parameters per component, by the handout's arithmetic (§4: 3D^2 + D^2 per attention; §6)."""
    D, F_, V, L = config.n_embd, config.ffn_hidden, config.vocab_size, config.n_layer
    bias = int(config.bias)
    norm = {"layernorm": D + bias * D, "rmsnorm": D, "none": 0}[config.norm]
    attention = 3 * D * D + D * D + bias * (3 * D + D)  # W_QKV and W_O
    if config.ffn == "swiglu":
        ffn = 3 * D * F_ + bias * (2 * F_ + D)
    else:
        ffn = 2 * D * F_ + bias * (F_ + D)
    counts = {
        "token embedding": V * D,
        "positions": config.block_size * D if config.positions == "learned" else 0,
        "attention": L * attention,
        "feed-forward": L * ffn,
        "norms": L * 2 * norm + (norm if config.arrangement == "pre" else 0),
        "vocabulary head": 0 if config.tied else V * D,
    }
    counts["total"] = sum(counts.values())
    return counts
