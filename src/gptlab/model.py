"""The decoder-only Transformer of handout #11, in one file, read top to bottom.

Small parts first (attention maths §2-§3, norms and feed-forward §5; the position schemes of §6 are in
`gptlab.positions`), then multi-head attention with a fused QKV projection (§4), the block (§5.1), and
the language model with its vocabulary head and teacher-forcing loss (§6-§7). Module names follow
GPT-2's checkpoint (`transformer.h.0.attn.c_attn`, ...) so that weight conversion is mostly the identity.

Shape legend: B batch, T sequence length, D model width (n_embd), H heads, hs head size (D // H),
F feed-forward width, V vocabulary size.

Deliberate choices:
- Dropout acts on the embeddings and on each residual update, never on attention weights, so the
  `naive` and `sdpa` kernels compute the same function.
- GELU is the tanh approximation, as in GPT-2, so GPT-2 weights give GPT-2's logits.
- Post-norm models end with the last block's norm, so they have no extra final norm.
- Position schemes take explicit positions (default 0..T-1), so generation can continue a sequence
  from a KV cache (§7.1, handout #12, `gptlab.kv_cache`) at any offset; the cache supplies the mask.

Four options borrowed from the GPU speedrun (Keller Jordan's modded-nanogpt), each off by default:
- `qk_norm`: each head's queries and keys are RMS-normalised over their hs features (gains shared by
  the heads) and only then rotated by RoPE, so the scores are bounded by the gains, not the weights.
- `logit_softcap`: logits cap * tanh(logits / cap) (also Gemma 2's), for the loss and for sampling.
- `zero_init`: attention's and the FFN's W_O start at zero, so a pre-norm block starts as the identity.
- `unet`: U-net skips across the stack; the weights start at 1, as in the speedrun (`GPT.run_blocks`).
And one from the speedruns' newer records: `ngram_embeddings` adds to each token's row E[w] a row looked
up by the token and the ids before it (`gptlab.positions.NgramEmbeddings`), so every input row, the
`embed` hook point's included, carries its n-grams; a KV cache keeps each row's last ids for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import ModelConfig
from gptlab.positions import POSITIONS, NgramEmbeddings

if TYPE_CHECKING:
    from gptlab.kv_cache import KVCache

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


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool) -> torch.Tensor | None:
    """The keys each query may see: `mask` (True = visible), and-ed with §7.3's causal mask if `causal`."""
    if not causal:
        return mask
    future_hidden = causal_mask(queries.size(-2), keys.size(-2), queries.device)  # (Tq, Tk)
    return future_hidden if mask is None else mask & future_hidden


# Every kernel maps queries (B, H, Tq, hs), keys and values (B, Hkv, Tk, hs) with Hkv dividing H, a
# boolean mask (None or broadcastable to (B, H, Tq, Tk)) and `causal` to the outputs (B, H, Tq, hs).
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


def shared_keys(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Grouped-query attention: key/value heads (B, Hkv, T, hs) repeated for their H / Hkv query heads.

    Query head h reads key/value head h // (H / Hkv), so consecutive query heads share one.
    """
    groups = n_head // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # (B, H, T, hs)


def naive_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool) -> torch.Tensor:
    """Explicit scores, mask, softmax, weights @ values; stores all B*H*Tq*Tk weights."""
    k, v = shared_keys(k, q.size(1)), shared_keys(v, q.size(1))
    return attention(q, k, v, visible_keys(q, k, mask, causal))[0]


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
    """PyTorch's fused kernel: the same function, without materialising the weights."""
    gqa = k.size(1) != q.size(1)  # grouped heads: the kernel pairs them as shared_keys does
    if mask is None and q.size(-2) == k.size(-2):  # is_causal aligns its mask to the first positions
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_keys(q, k, mask, causal), enable_gqa=gqa)


KERNELS: dict[str, Kernel] = {"naive": naive_kernel, "sdpa": sdpa_kernel}


# ---------------------------------------------------------------------------------------------
# §5: token-wise normalisation and the position-wise feed-forward network

NORMS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "layernorm": lambda c: nn.LayerNorm(c.n_embd, eps=c.norm_eps, bias=c.bias),
    "rmsnorm": lambda c: nn.RMSNorm(c.n_embd, eps=c.norm_eps),
    "none": lambda c: nn.Identity(),
}


class ReLUSquared(nn.Module):
    """relu(x)^2: as cheap as ReLU, and it trained small models faster than GELU (see presets.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": lambda: nn.GELU(approximate="tanh"),
    "gelu_exact": nn.GELU,
    "relu": nn.ReLU,
    "relu2": ReLUSquared,
}


class MLP(nn.Module):
    """Expand D -> F, apply a nonlinearity, contract F -> D, at every position separately."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.act = ACTIVATIONS[config.ffn]()
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


# "none" departs from §5: the block keeps only its attention sublayer (attention-only transformers,
# where every computation is a path through heads; see gptlab.inspection.detectors).
FFNS: dict[str, type[nn.Module] | None] = {name: MLP for name in ACTIVATIONS} | {"swiglu": GatedMLP,
                                                                                  "none": None}

# ---------------------------------------------------------------------------------------------
# §4: multi-head self-attention with one fused projection W_QKV (D -> 3D) and W_O (D -> D)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, hs): §4.2's view and transpose, giving each head its own hs features."""
    B, T, D = x.shape
    return x.view(B, T, n_head, D // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, hs) -> (B, T, D): concatenate the heads' answers, ready for W_O."""
    B, H, T, hs = y.shape
    return y.transpose(1, 2).reshape(B, T, H * hs)


class CausalSelfAttention(nn.Module):
    """H heads of width hs = D / H, each with its own routing; outputs concatenated, then W_O.

    With n_kv_head = Hkv < H (grouped-query attention) W_K and W_V make only Hkv heads, each shared
    by H / Hkv query heads; the KV cache then holds Hkv heads.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, hs = config.n_head, config.kv_heads, config.head_size
        self.widths = [self.n_head * hs, self.n_kv_head * hs, self.n_kv_head * hs]  # of Q, K and V
        self.c_attn = nn.Linear(config.n_embd, sum(self.widths), bias=config.attn_bias)  # [W_Q W_K W_V]
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.rotate = POSITIONS[config.positions][1](config)  # RoPE turns queries and keys; others pass
        # qk_norm: RMSNorm over each head's hs features, one gain (hs,) for all heads, initialised to 1.
        self.q_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hs, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.kernel = KERNELS[config.attention]
        # Only the lab's demonstrations and encoders switch this off (§7.3).
        self.causal = config.causal
        self.layer = layer  # which layer of a KVCache is this one's

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, hs), keys and values (B, Hkv, T, hs) of every head, as in §4.2."""
        q, k, v = self.c_attn(x).split(self.widths, dim=2)  # one matmul, three groups
        q = split_heads(q, self.n_head)  # (B, H, T, hs)
        k, v = split_heads(k, self.n_kv_head), split_heads(v, self.n_kv_head)  # (B, Hkv, T, hs) each
        q, k = self.q_norm(q), self.k_norm(k)  # qk_norm: normalise, then rotate; the cache holds these keys
        return self.rotate(q, positions), self.rotate(k, positions), v

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, D) -> same
        """`mask` (B, 1, 1, T), True for real tokens, hides an encoder's padded keys. With a `cache`,
        x holds only the new tokens, whose queries see every held key under the cache's own mask."""
        q, k, v = self.project(x, None if cache is None else cache.positions)
        if cache is not None:  # the cache's mask already holds causality, padding and the window
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, S, hs) each
            mask = cache.mask  # (B, 1, T, S), or None when every query sees every held key
        y = self.kernel(q, k, v, mask, self.causal and cache is None)  # (B, H, T, hs)
        return self.c_proj(merge_heads(y))

    def attention_weights(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The weights a of every head, (B, H, T, T), recomputed explicitly whatever the kernel."""
        q, k, _ = self.project(x)
        k = shared_keys(k, self.n_head)  # (B, H, T, hs)
        return masked_softmax(attention_scores(q, k), visible_keys(q, k, mask, self.causal))


# ---------------------------------------------------------------------------------------------
# §5.1: a block mixes positions (attention), then transforms features (FFN), each with a residual


class Block(nn.Module):
    """One Transformer block in the pre-norm or post-norm arrangement.

    With ffn="none" the second sublayer is absent, together with its norm (`ln_2` and `mlp` are None):
    a pre-norm block is x + attn(LN(x)), a post-norm one LN(x + attn(x)).
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = NORMS[config.norm](config)
        self.attn = CausalSelfAttention(config, layer)
        ffn = FFNS[config.ffn]
        self.ln_2 = NORMS[config.norm](config) if ffn else None
        self.mlp = ffn(config) if ffn else None
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()  # a call fewer
        self.prenorm = config.arrangement == "pre"

    def residual(self, x: torch.Tensor, norm: nn.Module,
                 update: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # (B, T, D) -> same
        """Add one sublayer g: pre-norm x + g(LN(x)), an explicit identity path; post-norm LN(x + g(x))."""
        if self.prenorm:
            return x + self.drop(update(norm(x)))
        return norm(x + self.drop(update(x)))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, D) -> same
        x = self.residual(x, self.ln_1, lambda h: self.attn(h, cache, mask))  # mix positions
        if self.mlp is None or self.ln_2 is None:  # attention-only (the two are None together)
            return x
        return self.residual(x, self.ln_2, self.mlp)  # transform each position's features


# ---------------------------------------------------------------------------------------------
# §6-§7: the language model


class ResidualStack(nn.ModuleDict):
    """A stack's parts under GPT-2's checkpoint names, with their types (a plain ModuleDict has none)."""

    wte: nn.Embedding  # E, (V, D): GPT's only; the encoder-decoder keeps its shared one outside its stacks
    wpe: nn.Module  # adds positions to the token rows (§6)
    drop: nn.Module
    h: nn.ModuleList  # the blocks
    ln_f: nn.Module  # the final norm; the identity in a post-norm stack

    @property
    def blocks(self) -> list[Block]:
        """The entries of `h` as Blocks, for reaching their `attn`, `mlp` and norms."""
        blocks = [block for block in self.h if isinstance(block, Block)]
        assert len(blocks) == len(self.h), "every entry of a stack's h is a Block"
        return blocks


def residual_stack(config: ModelConfig, blocks: list[nn.Module], **first: nn.Module) -> ResidualStack:
    """One stack of blocks: `first` (GPT's token embedding `wte`), positions, dropout, blocks, final norm."""
    return ResidualStack(dict(
        **first,
        wpe=POSITIONS[config.positions][0](config),
        drop=nn.Dropout(config.dropout),
        h=nn.ModuleList(blocks),
        ln_f=NORMS[config.norm](config) if config.arrangement == "pre" else nn.Identity(),  # post: in blocks
    ))


class SoftCap(nn.Module):
    """cap * tanh(logits / cap): close to the identity for small logits, smoothly bounded by +-cap."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> same
        return self.cap * torch.tanh(logits / self.cap)


class LanguageModel(nn.Module):
    """What the GPT and the encoder-decoder share: input rows, the vocabulary head, GPT-2's init."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def add_head_and_init(self, wte: nn.Embedding, depth: int) -> None:
        """Add the vocabulary head W_vocab (D -> V), tied to `wte` or not, then initialise every weight."""
        self.lm_head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
        if self.config.tied:  # logits = h E^T: the head *is* the embedding tensor (§6)
            self.lm_head.weight = wte.weight
        self.apply(init_weights)
        # GPT-2 scales the projections that write into the residual stream by depth, so the
        # stream's variance does not grow with the number of blocks.
        # zero_init starts them at zero instead (the speedrun's choice): blocks first add nothing.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight") and self.config.zero_init:
                nn.init.zeros_(param)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    def input_rows(self, stack: ResidualStack, rows: torch.Tensor,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """Input rows X = E[w] + p of token rows E[w] (B, T, D) -> same, at positions (B, T) or 0 .. T-1."""
        T, window = rows.size(1), self.config.block_size
        if positions is None:  # 0 .. T-1, which must fit the window
            if T > window:
                raise ValueError(f"sequence length {T} exceeds block_size={window}: crop the input to its "
                                 f"last {window} tokens, or use a model with a larger block_size")
            positions = torch.arange(T, device=rows.device).unsqueeze(0)  # (1, T)
        return stack.drop(stack.wpe(rows, positions))  # (B, T, D)

    def num_parameters(self) -> int:
        """Trainable parameters, counting a tied embedding/head tensor once."""
        return sum(p.numel() for p in self.parameters())


class GPT(LanguageModel):
    """Token embedding + positions, L blocks, final norm, vocabulary head; causal in every block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        wte = nn.Embedding(config.vocab_size, config.n_embd)  # E, (V, D)
        self.transformer = residual_stack(config, [Block(config, n) for n in range(config.n_layer)], wte=wte)
        # unet: one weight per skip, for the last n_layer // 2 blocks (an odd middle block has none).
        self.n_skips = config.n_layer // 2 if config.unet else 0
        if config.unet:
            self.skip_weights = nn.Parameter(torch.ones(self.n_skips))  # (n_skips,), the speedrun's init
        self.softcap = SoftCap(config.logit_softcap) if config.logit_softcap > 0 else nn.Identity()
        self.ngrams = NgramEmbeddings(config) if config.ngram_embeddings else None
        self.add_head_and_init(wte, depth=config.n_layer)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
              history: torch.Tensor | None = None) -> torch.Tensor:
        """Input rows X = E[w] + p for token ids (B, T) -> (B, T, D), at positions (B, T) or 0 .. T-1.

        With ngram_embeddings E[w] gains the n-gram rows, read from `history` (B, K + T): idx after the K
        ids before it (by default K start ids: idx starts a sequence)."""
        rows = self.transformer.wte(idx)  # (B, T, D)
        if self.ngrams is not None:
            rows = rows + self.ngrams(self.ngrams.preceded(idx) if history is None else history)
        return self.input_rows(self.transformer, rows, positions)

    def run_blocks(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The residual stream through every block, (B, T, D) -> same.

        With unet, the stream after each of the first n_skips blocks is kept, and before each of the last
        n_skips blocks the latest kept one is taken back (last in, first out) and added, times its weight:
        block L-1-i receives block i's output. Every step is per position, so under a KV cache the
        new positions carry their own skips.
        """
        kept: list[torch.Tensor] = []  # outputs of the first n_skips blocks, each (B, T, D)
        second_half = len(self.transformer.h) - self.n_skips
        for n, block in enumerate(self.transformer.h):
            if n >= second_half:
                x = x + self.skip_weights[n - second_half] * kept.pop()
            x = block(x, cache)
            if n < self.n_skips:
                kept.append(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, vocabulary head and (with logit_softcap) the cap: the stream (..., D) -> (..., V)."""
        return self.softcap(self.lm_head(self.transformer.ln_f(x)))

    def forward_embeddings(self, x: torch.Tensor, cache: KVCache | None = None,
                           last_only: bool = False) -> torch.Tensor:
        """Run the blocks, final norm and vocabulary head on input rows: (B, T, D) -> (B, T or 1, V)."""
        x = self.run_blocks(x, cache)
        if last_only:  # generation needs only the prediction after the last token
            x = x[:, -1:]  # (B, 1, D)
        return self.head(x)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids (B, T), and with targets the mean next-token loss.

        `targets[:, i]` is the token that follows `idx[:, i]` (teacher forcing, §7.2); positions
        whose target is -1 are not scored. With a `cache`, idx holds only the tokens it has not seen
        yet, and their positions (and n-grams) continue the cache's. `last_only` keeps the last position's
        logits.
        """
        history = None if cache is None or self.ngrams is None else cache.with_history(idx)  # (B, K + T)
        positions = None if cache is None else cache.advance(idx.size(1))  # (B, T)
        logits = self.forward_embeddings(self.embed(idx, positions, history), cache, last_only)  # (B, T, V)
        return logits, None if targets is None else next_token_loss(logits, targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), skipping targets of -1 (§7.2)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases (PyTorch's defaults hit CPU denormals)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)

