"""The handout's properties, measured on a trained encoder-decoder (a `gptlab seq2seq` run).

The same statements as `verify` makes of a GPT, on random sources (one of them padded) and targets
from a fixed seed, plus the two that cross-attention adds:
- §3.2: every row of every head's weights sums to one: encoder and decoder self-attention, and
  cross-attention over the source positions;
- padding: source padding gets exactly zero cross-attention weight, and a padded source gives the
  logits it gives alone;
- §7.3: decoder position i's logits do not change at all when every target input after i changes,
  but they change when any one source token changes (every position reads the whole source);
- §7.1: greedy decoding with the KV cache gives the answers and logits of recomputing every step;
- §6: a tied vocabulary head is one tensor with the shared token embedding.
"""

from __future__ import annotations

import torch

from gptlab.handout import properties as checks
from gptlab.handout.verify import evaluating
from gptlab.inspection.cross_attention import cross_inputs
from gptlab.inspection.hooks import recorded_inputs
from gptlab.kv_cache import KVCache
from gptlab.seq2seq import tasks
from gptlab.seq2seq.model import EncoderDecoder, decode_answers

FIRST_SYMBOL = len(tasks.SPECIALS)  # random ids start here: never <pad>, <bos> or <eos>


def attention_weights(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor) -> list[torch.Tensor]:
    """Every head's weights, recomputed from each module's recorded input: encoder, decoder, cross."""
    selfs = [block.attn for block in (*model.encoder.blocks, *model.decoder_blocks)]
    crosses = [block.cross for block in model.decoder_blocks]
    inputs = recorded_inputs([*selfs, *crosses], lambda: model(src, tgt))
    # Self-attention takes (rows, a cache, an encoder's padding mask), and its weights need no cache;
    # cross-attention takes (rows, the source's keys and values, its mask).
    of_selfs, of_crosses = inputs[: len(selfs)], inputs[len(selfs):]
    return ([attn.attention_weights(args[0], *args[2:]) for attn, args in zip(selfs, of_selfs, strict=True)]
            + [cross.attention_weights(*args) for cross, args in zip(crosses, of_crosses, strict=True)])


def check_padding(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor,
                  eps: float) -> list[checks.Check]:
    """Padding gets exactly zero cross-attention weight; a padded row's logits are its logits alone."""
    source = model.encode(src)
    padded = src == tasks.PAD  # (B, S): the positions padded here, whatever the model's mask says
    on_padding = torch.cat([  # every weight a padded source position gets, in every layer, (B, H, T, S) each
        block.cross.attention_weights(cross_in, kv, source.mask).transpose(1, 3)[padded].flatten()
        for block, cross_in, kv in zip(model.decoder_blocks, cross_inputs(model, tgt, source),
                                       source.keys_values, strict=True)])
    real = int((~padded[-1]).sum())  # the last source row is the padded one
    alone = model(src[-1:, :real], tgt[-1:])[0]
    return [
        checks.close("pad", "cross-attention gives padding zero weight", on_padding,
                     torch.zeros_like(on_padding), 0.0, "0 on every padded key",
                     f"{int(padded.sum())} padded source positions, exact"),
        checks.close("pad", "a padded source gives its logits alone", model(src, tgt)[0][-1:], alone,
                     checks.relative(eps), note=f"{src.size(1) - real} padding tokens"),
    ]


def check_dependence(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor,
                     generator: torch.Generator) -> list[checks.Check]:
    """§7.3 for the decoder (exact), and that every target position reads every source position."""
    V, S, T = model.config.vocab_size, src.size(1), tgt.size(1)
    later = checks.replacement_dependence(lambda t: model(src[:1], t)[0], tgt[:1], generator, FIRST_SYMBOL, V)
    clean = model(src[:1], tgt[:1])[0]  # (1, T, V)
    least = float("inf")  # the smallest change, over source positions j and target positions i
    for j in range(S):
        changed = src[:1].clone()
        changed[0, j] = FIRST_SYMBOL + (changed[0, j] - FIRST_SYMBOL + 1) % (V - FIRST_SYMBOL)
        least = min(least, float((model(changed, tgt[:1])[0] - clean).abs().amax(-1).min()))
    return [
        checks.ignores_later_inputs(later, "decoder logits at i ignore every target after i",
                                    note=f"{T - 1} cuts, exact comparison"),
        checks.exceeds("x-attn", "every target position reads every source token", least, 0.0,
                       "smallest logit change",
                       f"smallest logit change over {S} source x {T} target positions (must be > 0)"),
    ]


def check_decoding(model: EncoderDecoder, src: torch.Tensor, eps: float) -> list[checks.Check]:
    """§7.1: cached greedy decoding gives the answers and, step by step, the logits of recomputing."""
    cached = decode_answers(model, src, tasks.BOS, tasks.EOS, use_cache=True)
    recomputed = decode_answers(model, src, tasks.BOS, tasks.EOS, use_cache=False)
    differ = sum(a != b for a, b in zip(cached, recomputed, strict=True))
    source = model.encode(src[:1])
    tgt = torch.tensor([[tasks.BOS] + cached[0]], device=src.device)[:, : model.config.block_size]  # (1, T)
    cache = KVCache(model.config, 1, device=src.device, dtype=source.memory.dtype)
    steps = torch.cat([model.decode(tgt[:, t : t + 1], source, cache) for t in range(tgt.size(1))], dim=1)
    return [
        checks.Check("§7.1", "cached greedy answers = recomputed", differ == 0, "no answer differs",
                     f"{differ} answers differ", float(differ), 0.0,
                     f"{src.size(0)} sources; deviation = answers that differ"),
        checks.close("§7.1", "cached step logits = teacher forcing", steps, model.decode(tgt, source),
                     checks.relative(eps), note=f"{tgt.size(1)} steps of the first answer"),
    ]


def verify_seq2seq(model: EncoderDecoder, seed: int = 0, sources: int = 4) -> list[checks.Check]:
    """Measure every property on `model` with random sources (the last one padded) and targets."""
    with evaluating(model) as eps:
        generator = torch.Generator().manual_seed(seed)
        S = T = model.config.block_size
        V = model.config.vocab_size
        src = torch.randint(FIRST_SYMBOL, V, (sources, S), generator=generator)  # (B, S)
        src[-1, S // 2 :] = tasks.PAD  # the last source is half padding
        tgt = torch.randint(FIRST_SYMBOL, V, (sources, T), generator=generator)  # (B, T)
        tgt[:, 0] = tasks.BOS
        src, tgt = src.to(next(model.parameters()).device), tgt.to(next(model.parameters()).device)
        note = f"encoder, decoder and cross-attention, {model.config.n_head} heads each"
        return [
            checks.rows_sum_to_one(attention_weights(model, src, tgt), checks.EPSILONS * eps, note=note),
            *check_padding(model, src, tgt, eps),
            *check_dependence(model, src, tgt, generator),
            *check_decoding(model, src, eps),
            checks.tied_head(model.config.tied, model.lm_head.weight, model.wte.weight),
        ]
