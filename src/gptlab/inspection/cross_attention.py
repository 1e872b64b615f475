"""Cross-attention maps of an encoder-decoder: where in the source each answer token was read from.

The model answers the source greedily; then one teacher-forced pass over its own answer records every
decoder layer's input to cross-attention, and the weights are recomputed from it for the heads asked
for (the forward pass keeps its fast kernel). Row t is the decoder position that predicts answer
token t (the last row predicts <eos>), column j is source token j. For `reverse` a model that has
learned the task reads the anti-diagonal: answer token t comes from source position n - 1 - t.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import TaskConfig
from gptlab.inspection.attention_view import check_index, draw_grid
from gptlab.inspection.hooks import recorded_inputs
from gptlab.seq2seq import tasks
from gptlab.seq2seq.model import EncodedSource, EncoderDecoder, decode_answers
from gptlab.text.tokenizer import SymbolTokenizer


def cross_inputs(model: EncoderDecoder, tgt: torch.Tensor, source: EncodedSource) -> list[torch.Tensor]:
    """Each decoder layer's input to cross-attention (B, T, D), recorded during one decode."""
    crosses = [block.cross for block in model.decoder_blocks]
    return [args[0] for args in recorded_inputs(crosses, lambda: model.decode(tgt, source))]


@dataclass(frozen=True)
class CrossAttentionMaps:
    """Cross-attention weights of some decoder layers and heads for one source and the model's answer."""

    source: str
    answer: str
    source_labels: list[str]  # the keys: each source token, then <eos>
    answer_labels: list[str]  # the queries, by the token each one predicts: the answer, then <eos>
    layers: list[int]
    heads: list[int]
    weights: torch.Tensor  # (len(layers), len(heads), T, S)


@torch.no_grad()
def cross_attention_maps(model: EncoderDecoder, vocab: SymbolTokenizer, task: TaskConfig, source: str,
                         layer: int | None = None, head: int | None = None) -> CrossAttentionMaps:
    """Answer `source` greedily and recompute the cross-attention weights behind every answer token."""
    tasks.check_source(task, source, model.config.block_size)
    layers = check_index(layer, model.config.n_layer, "layer")
    heads = check_index(head, model.config.n_head, "head")
    device = next(model.parameters()).device
    src = tasks.encode_sources(vocab, [source]).to(device)  # (1, S)
    answer = decode_answers(model, src, tasks.BOS, tasks.EOS)[0]
    fed = ([tasks.BOS] + answer)[:model.config.block_size]  # an answer that never ends fills the window
    encoded = model.encode(src)
    inputs = cross_inputs(model, torch.tensor([fed], device=device), encoded)
    blocks = model.decoder_blocks
    weights = torch.stack([
        blocks[n].cross.attention_weights(inputs[n], encoded.keys_values[n], encoded.mask)[0, heads]
        for n in layers
    ])  # (L', H', T, S)
    source_labels = list(source) + ["<eos>"]
    # Row i predicts the answer's token i, or <eos> after the last one (rows: the tokens fed).
    answer_labels = ([vocab.decode([token]) for token in answer] + ["<eos>"])[:len(fed)]
    return CrossAttentionMaps(source, vocab.decode(answer), source_labels, answer_labels, layers, heads,
                              weights.float().cpu())


def save_cross_attention_png(maps: CrossAttentionMaps, path: str | Path) -> None:
    """A layers x heads grid: rows are answer tokens, columns source tokens."""
    draw_grid(maps.weights, maps.answer_labels, maps.source_labels, maps.layers, maps.heads,
              f"cross-attention: {maps.source!r} -> {maps.answer!r}", path,
              ("answer token (predicted)", "source token (attended to)"))
