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

from collections.abc import Iterator

import torch

from gptlab import tasks
from gptlab.encoder_decoder import EncoderDecoder
from gptlab.generate import greedy_answers
from gptlab.inspection.cross_attention import cross_inputs
from gptlab.inspection.hooks import recorded_inputs
from gptlab.inspection.verify import Property, check_tied, gap_of, measured
from gptlab.model import KVCache

FIRST_SYMBOL = len(tasks.SPECIALS)  # random ids start here: never <pad>, <bos> or <eos>


def _row_gaps(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor) -> Iterator[tuple[float, float]]:
    """|row sum - 1| of every head's weights: encoder, decoder self-attention and cross-attention."""
    selfs = [block.attn for block in (*model.encoder.h, *model.decoder.h)]
    crosses = [block.cross for block in model.decoder.h]
    inputs = recorded_inputs(selfs + crosses, lambda: model(src, tgt))
    for module, args in zip(selfs + crosses, inputs, strict=True):
        if module in crosses:  # args: decoder rows, the source's keys and values, its padding mask
            weights = module.attention_weights(*args)
        else:  # args: rows, no cache, and an encoder's padding mask
            x, _, *mask = args
            weights = module.attention_weights(x, *mask)
        yield float((weights.sum(-1) - 1).abs().max()), 1.0


def check_padding(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor, eps: float) -> list[Property]:
    """Padding gets exactly zero cross-attention weight; a padded row's logits are its logits alone."""
    source = model.encode(src)
    padded = src == tasks.PAD  # (B, S): the positions padded here, whatever the model's mask says
    weight_on_padding = 0.0
    for block, cross_in, kv in zip(model.decoder.h, cross_inputs(model, tgt, source), source.keys_values,
                                   strict=True):
        weights = block.cross.attention_weights(cross_in, kv, source.mask)  # (B, H, T, S)
        weight_on_padding = max(weight_on_padding, float(weights.transpose(1, 3)[padded].abs().max()))
    real = int((~padded[-1]).sum())  # the last source row is the padded one
    alone = model(src[-1:, :real], tgt[-1:])[0]
    gap = gap_of(model(src, tgt)[0][-1:], alone)
    return [
        Property("pad", "cross-attention gives padding zero weight", weight_on_padding, 0.0,
                 weight_on_padding == 0.0, f"{int(padded.sum())} padded source positions, exact"),
        measured("pad", "a padded source gives its logits alone", [gap], eps,
                  f"{src.size(1) - real} padding tokens"),
    ]


def check_dependence(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor,
                     generator: torch.Generator) -> list[Property]:
    """§7.3 for the decoder (exact), and that every target position reads every source position."""
    clean = model(src[:1], tgt[:1])[0]  # (1, T, V)
    V, T = model.config.vocab_size, tgt.size(1)
    worst = 0.0
    for cut in range(T - 1):
        changed = tgt[:1].clone()
        shift = torch.randint(1, V - FIRST_SYMBOL, (T - cut - 1,), generator=generator).to(tgt.device)
        later = changed[0, cut + 1:] - FIRST_SYMBOL
        changed[0, cut + 1:] = FIRST_SYMBOL + (later + shift) % (V - FIRST_SYMBOL)  # a new symbol each
        after = model(src[:1], changed)[0]
        worst = max(worst, float((after[:, : cut + 1] - clean[:, : cut + 1]).abs().max()))
    least = float("inf")  # the smallest change, over source positions j and target positions i
    for j in range(src.size(1)):
        changed = src[:1].clone()
        changed[0, j] = FIRST_SYMBOL + (changed[0, j] - FIRST_SYMBOL + 1) % (V - FIRST_SYMBOL)
        least = min(least, float((model(changed, tgt[:1])[0] - clean).abs().amax(-1).min()))
    return [
        Property("§7.3", "decoder logits at i ignore every target after i", worst, 0.0, worst == 0.0,
                 f"{T - 1} cuts, exact comparison"),
        Property("x-attn", "every target position reads every source token", least, 0.0, least > 0.0,
                 f"smallest logit change over {src.size(1)} source x {T} target positions (must be > 0)"),
    ]


def check_decoding(model: EncoderDecoder, src: torch.Tensor, eps: float) -> list[Property]:
    """§7.1: cached greedy decoding gives the answers and, step by step, the logits of recomputing."""
    cached = greedy_answers(model, src, tasks.BOS, tasks.EOS, use_cache=True)
    recomputed = greedy_answers(model, src, tasks.BOS, tasks.EOS, use_cache=False)
    differ = sum(a != b for a, b in zip(cached, recomputed, strict=True))
    source = model.encode(src[:1])
    tgt = torch.tensor([[tasks.BOS] + cached[0]], device=src.device)[:, : model.config.block_size]  # (1, T)
    cache = KVCache(model.config, 1, device=src.device, dtype=source.memory.dtype)
    steps = torch.cat([model.decode(tgt[:, t : t + 1], source, cache) for t in range(tgt.size(1))], dim=1)
    return [
        Property("§7.1", "cached greedy answers = recomputed", float(differ), 0.0, differ == 0,
                 f"{src.size(0)} sources; deviation = answers that differ"),
        measured("§7.1", "cached step logits = teacher forcing", [gap_of(steps, model.decode(tgt, source))],
                  eps, f"{tgt.size(1)} steps of the first answer"),
    ]


@torch.no_grad()
def verify_seq2seq(model: EncoderDecoder, seed: int = 0, sources: int = 4) -> list[Property]:
    """Measure every property on `model` with random sources (the last one padded) and targets."""
    training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        S = T = model.config.block_size
        V = model.config.vocab_size
        src = torch.randint(FIRST_SYMBOL, V, (sources, S), generator=generator)  # (B, S)
        src[-1, S // 2 :] = tasks.PAD  # the last source is half padding
        tgt = torch.randint(FIRST_SYMBOL, V, (sources, T), generator=generator)  # (B, T)
        tgt[:, 0] = tasks.BOS
        src, tgt = src.to(device), tgt.to(device)
        eps = torch.finfo(next(model.parameters()).dtype).eps
        return [
            measured("§3.2", "attention rows sum to one", _row_gaps(model, src, tgt), eps,
                      f"encoder, decoder and cross-attention, {model.config.n_head} heads each"),
            *check_padding(model, src, tgt, eps),
            *check_dependence(model, src, tgt, generator),
            *check_decoding(model, src, eps),
            check_tied(model.config.tied, model.lm_head.weight, model.wte.weight),
        ]
    finally:
        model.train(training)
