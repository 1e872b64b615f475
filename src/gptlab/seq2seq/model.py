"""The encoder-decoder Transformer, assembled from model.py's parts plus one new one: cross-attention.

The encoder is a stack of model.py's `Block`s whose self-attention is not masked (every source
position sees every other), with a padding mask so that sources of different lengths share a batch.
The decoder's blocks are the same `Block` with one more sublayer between self-attention and the
feed-forward network: cross-attention, whose queries come from the decoder and whose keys and
values come from the encoder's output (the "memory"). The decoder stays causal, exactly as the
decoder-only model of handout #11; cross-attention adds the source without breaking §7.3, because
every decoder position may see all of the source.

Shape legend: B batch, S source length, T target length, D width, H heads, hs head size, V vocabulary.

Deliberate choices:
- One token embedding (and, when `tied`, the vocabulary head) serves sources and targets, which
  share a vocabulary, as in the original Transformer.
- Cross-attention does not rotate its queries or keys under RoPE: they come from two different
  sequences, so their relative distance means nothing; the source's positions reach the decoder
  through the encoder's output.
- Targets are padded at the end. The causal mask already hides those pads from every real position,
  so the decoder needs no padding mask of its own; their predictions are left out of the loss.
- `encode` also computes every decoder layer's cross-attention keys and values, once per source, so
  that decoding (with a KV cache for the decoder's self-attention) never recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gptlab.config import SamplingConfig, Seq2SeqConfig
from gptlab.kv_cache import KVCache
from gptlab.model import (
    KERNELS,
    NORMS,
    Block,
    LanguageModel,
    attention_scores,
    masked_softmax,
    merge_heads,
    next_token_loss,
    residual_stack,
    split_heads,
)
from gptlab.sampling import next_token, sampler


class CrossAttention(nn.Module):
    """Multi-head attention from decoder queries (B, T, D) to encoder keys/values (B, S, D), then W_O."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_Q, on the decoder
        self.c_kv = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)  # [W_K W_V], on memory
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.kernel = KERNELS[config.attention]

    def keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the encoder's output (B, S, D): two (B, H, S, hs), computed once."""
        k, v = self.c_kv(memory).split(memory.size(-1), dim=2)  # 2 x (B, S, D): one matmul
        return split_heads(k, self.n_head), split_heads(v, self.n_head)

    def forward(self, x: torch.Tensor, keys_values: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> same
        """Every decoder position attends over the real source positions (`mask` (B, 1, 1, S))."""
        q = split_heads(self.c_q(x), self.n_head)  # (B, H, T, hs)
        y = self.kernel(q, *keys_values, mask, False)  # (B, H, T, hs): no causal mask across sequences
        return self.c_proj(merge_heads(y))

    def attention_weights(self, x: torch.Tensor, keys_values: tuple[torch.Tensor, torch.Tensor],
                          mask: torch.Tensor) -> torch.Tensor:
        """The weights of every head over the source, (B, H, T, S), recomputed explicitly."""
        q = split_heads(self.c_q(x), self.n_head)  # (B, H, T, hs)
        return masked_softmax(attention_scores(q, keys_values[0]), mask)


class DecoderBlock(Block):
    """model.py's Block with cross-attention between its causal self-attention and its FFN."""

    ln_2: nn.Module  # never None here: Seq2SeqConfig refuses ffn="none"
    mlp: nn.Module

    def __init__(self, config: Seq2SeqConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.ln_cross = NORMS[config.norm](config)
        self.cross = CrossAttention(config)

    # A decoder block also takes the encoded source, so its forward's signature is not Block's.
    def forward(self, x: torch.Tensor, source: EncodedSource,  # type: ignore[override]
                cache: KVCache | None = None) -> torch.Tensor:  # (B, T, D) -> same
        x = self.residual(x, self.ln_1, lambda h: self.attn(h, cache))  # earlier target positions
        x = self.residual(x, self.ln_cross, lambda h: self.cross(h, source.keys_values[self.attn.layer],
                                                                 source.mask))  # the whole source
        return self.residual(x, self.ln_2, self.mlp)


@dataclass
class EncodedSource:
    """What the decoder needs of a batch of sources, computed once by `EncoderDecoder.encode`."""

    memory: torch.Tensor  # the encoder's output, (B, S, D)
    mask: torch.Tensor  # True at real source tokens, (B, 1, 1, S): the same for every head and query
    keys_values: list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer, two (B, H, S, hs)


class EncoderDecoder(LanguageModel):
    """Shared embedding; encoder of unmasked Blocks; decoder of DecoderBlocks; vocabulary head."""

    config: Seq2SeqConfig

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        unmasked = config.encoder_config()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # E, (V, D), sources and targets
        self.encoder = residual_stack(config, [Block(unmasked, n) for n in range(config.n_encoder_layer)])
        self.decoder = residual_stack(config, [DecoderBlock(config, n) for n in range(config.n_layer)])
        self.add_head_and_init(self.wte, depth=config.n_encoder_layer + config.n_layer)

    @property
    def decoder_blocks(self) -> list[DecoderBlock]:
        """The decoder's blocks as DecoderBlocks, for reaching their cross-attention."""
        blocks = [block for block in self.decoder.h if isinstance(block, DecoderBlock)]
        assert len(blocks) == len(self.decoder.h), "every entry of the decoder's h is a DecoderBlock"
        return blocks

    def encode(self, src: torch.Tensor) -> EncodedSource:
        """Run the encoder on source ids (B, S), padded with `pad_id`, and prepare cross-attention."""
        mask = (src != self.config.pad_id)[:, None, None, :]  # (B, 1, 1, S)
        x = self.input_rows(self.encoder, self.wte(src))  # (B, S, D)
        for block in self.encoder.h:
            x = block(x, mask=mask)  # every real source position sees every other
        memory = self.encoder.ln_f(x)  # (B, S, D)
        keys_values = [block.cross.keys_values(memory) for block in self.decoder_blocks]
        return EncodedSource(memory, mask, keys_values)

    def decode(self, tgt: torch.Tensor, source: EncodedSource, cache: KVCache | None = None,
               last_only: bool = False) -> torch.Tensor:
        """Logits (B, T or 1, V) after each target id (B, T); with a cache, tgt holds only new ids."""
        positions = None if cache is None else cache.advance(tgt.size(1))  # (B, T)
        x = self.input_rows(self.decoder, self.wte(tgt), positions)  # (B, T, D)
        for block in self.decoder.h:
            x = block(x, source, cache)
        if last_only:
            x = x[:, -1:]  # (B, 1, D)
        return self.lm_head(self.decoder.ln_f(x))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher forcing (§7.2): logits (B, T, V) for every target position, and the mean loss.

        `tgt` is the target shifted right (it starts with the begin token) and `targets[:, i]` the
        token that follows `tgt[:, i]`; targets of -1 (padding) are not scored.
        """
        logits = self.decode(tgt, self.encode(src))  # (B, T, V)
        return logits, None if targets is None else next_token_loss(logits, targets)


@torch.no_grad()
def decode_answers(model: EncoderDecoder, sources: torch.Tensor, bos_id: int, eos_id: int,
                   sampling: SamplingConfig | None = None, *, use_cache: bool = True,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """The encoder-decoder's answer to each padded source (B, S), up to (without) its <eos>.

    Tokens are chosen as `sampling` says (default: greedy). The source is encoded once, with every
    decoder layer's cross-attention keys and values. With `use_cache` the decoder's self-attention
    keeps its keys and values in a KVCache and each step feeds one token per row; without it every
    step recomputes the whole answer so far (the reference). Answers stop at <eos>, after
    max_new_tokens, or when the decoder's window (block_size inputs) is full.
    """
    sampling = sampling or SamplingConfig(temperature=0)
    generator = generator or sampler(sampling, sources.device)
    source = model.encode(sources)
    cache = KVCache(model.config, sources.size(0), device=sources.device,
                    dtype=source.memory.dtype) if use_cache else None
    tokens = torch.full((sources.size(0), 1), bos_id, dtype=torch.long, device=sources.device)  # (B, 1)
    done = torch.zeros(sources.size(0), dtype=torch.bool, device=sources.device)  # (B,)
    longest = min(model.config.block_size, sampling.max_new_tokens)
    while tokens.size(1) <= longest and not done.all():
        fed = tokens[:, -1:] if use_cache else tokens  # the cache holds every earlier position
        logits = model.decode(fed, source, cache, last_only=True)  # (B, 1, V)
        new = next_token(logits[:, -1], sampling, generator)[:, 0].masked_fill(done, eos_id)  # (B,)
        tokens = torch.cat([tokens, new[:, None]], dim=1)  # (B, t + 1); finished rows repeat <eos>
        done |= new == eos_id
    rows = tokens[:, 1:].tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]
