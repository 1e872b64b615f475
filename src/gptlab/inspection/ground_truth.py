"""Circuits known in advance, to test circuit finding against (issue 41).

Two kinds of model whose answer is known:
- a trained one whose heads the detectors name (`induction_edges`): the edges from layer-0
  previous-token heads into the key inputs of later induction heads, read off `detectors.score_heads`;
- `wired_induction`, a 2-layer attention-only model whose weights are set by hand to run induction, so
  that its whole circuit is known by construction (`WIRED_CIRCUIT`).

Both are probed with `repeat_pairs`: a span of distinct tokens, then its start again up to a query token;
the corrupted prompt swaps the query's earlier copy with another token of the first span, so the token
after the query's earlier copy, which induction predicts, changes from the target to the foil, while
every position keeps its token count and the query stays the same.

Shape legend: T positions, D width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptlab.config import ModelConfig
from gptlab.inspection.attribution import Pair
from gptlab.inspection.detectors import score_heads
from gptlab.model import GPT

WIRED_VOCAB, WIRED_BLOCK = 8, 12
# The wired model's stream: the token (one-hot), the position (one-hot), the previous token (written by
# layer 0 head 0), the answer (written by layer 1 head 0, read by the vocabulary head).
TOKEN, POS, PREV, ANSWER = 0, WIRED_VOCAB, WIRED_VOCAB + WIRED_BLOCK, 2 * WIRED_VOCAB + WIRED_BLOCK
WIRED_WIDTH = 3 * WIRED_VOCAB + WIRED_BLOCK  # 36: two heads of 18
SHARP = 100.0  # query scale: a score of 100 / sqrt(18) = 24 on the right key, 0 elsewhere
WIRED_CIRCUIT = ("embed->a0.h0.v", "a0.h0->a1.h0.k", "a1.h0->logits")


def wired_induction() -> GPT:
    """A 2-layer, 2-head attention-only model (no norms, one-hot positions) wired by hand for induction.

    Layer 0 head 0 queries with the position moved back one step, keys with the position, so it attends
    to i - 1, and copies that token into PREV. Layer 1 head 0 queries with the current token against keys
    PREV, so it attends to the position after an earlier copy of the current token, and copies that
    position's token into ANSWER, which alone the vocabulary head reads. Layer 0 head 1 attends to its
    own position and writes nothing; layer 1 head 1 is all zeros.
    """
    V, T, D = WIRED_VOCAB, WIRED_BLOCK, WIRED_WIDTH
    config = ModelConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=D, norm="none", ffn="none",
                         tied=False, bias=False)
    model = GPT(config).eval()
    hs = config.head_size
    q, k, v = 0, D, 2 * D  # row offsets of W_Q, W_K, W_V in the fused (3D, D) weight; head h adds h * hs
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight[:, TOKEN:TOKEN + V] = torch.eye(V)
        positions = model.transformer.wpe
        assert isinstance(positions, torch.nn.Embedding), "learned positions: one row per position"
        positions.weight[:, POS:POS + T] = torch.eye(T)
        (w0, o0), (w1, o1) = ((b.attn.c_attn.weight, b.attn.c_proj.weight) for b in model.transformer.blocks)
        w0[q:q + T - 1, POS + 1:POS + T] = SHARP * torch.eye(T - 1)  # q_i = e_{i-1} (zero at i = 0)
        w0[k:k + T, POS:POS + T] = torch.eye(T)  # k_j = e_j
        w0[v:v + V, TOKEN:TOKEN + V] = torch.eye(V)  # v_j = the token at j ...
        o0[PREV:PREV + V, 0:V] = torch.eye(V)  # ... written into PREV
        w0[q + hs:q + hs + T, POS:POS + T] = SHARP * torch.eye(T)  # head 1: its own position, nothing out
        w0[k + hs:k + hs + T, POS:POS + T] = torch.eye(T)
        w1[q:q + V, TOKEN:TOKEN + V] = SHARP * torch.eye(V)  # q_i = the token at i
        w1[k:k + V, PREV:PREV + V] = torch.eye(V)  # k_j = the token before j
        w1[v:v + V, TOKEN:TOKEN + V] = torch.eye(V)  # v_j = the token at j ...
        o1[ANSWER:ANSWER + V, 0:V] = torch.eye(V)  # ... written into ANSWER
        model.lm_head.weight[:, ANSWER:ANSWER + V] = 10.0 * torch.eye(V)
    return model


def repeat_pairs(alphabet: Sequence[int], count: int, span: int, seed: int = 0) -> list[Pair]:
    """`count` pairs of prompts: `span` distinct tokens of `alphabet`, then the span's first j + 1 again.

    The clean prompt continues with span[j + 1]; the corrupted one swaps span[j] with span[i] in the first
    copy (1 <= i, j <= span - 2, |i - j| >= 2), so it continues with span[i + 1]: target and foil.
    Neither prompt ends with its first token, nor repeats a token in the first span.
    """
    if span < 5 or len(set(alphabet)) < span:
        raise ValueError(f"span={span} needs 5 or more distinct tokens, and the alphabet has "
                         f"{len(set(alphabet))}: use a span of 5 to {len(set(alphabet))}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(sorted(set(alphabet)))
    pairs: list[Pair] = []
    while len(pairs) < count:
        first = tokens[torch.randperm(len(tokens), generator=generator)[:span]].tolist()
        i, j = (int(x) for x in torch.randint(1, span - 1, (2,), generator=generator))
        if abs(i - j) < 2:
            continue
        swapped = list(first)
        swapped[i], swapped[j] = first[j], first[i]
        pairs.append(Pair(tuple(first + first[:j + 1]), tuple(swapped + first[:j + 1]), first[j + 1],
                          first[i + 1]))
    return pairs


def induction_edges(model: GPT, threshold: float = 0.5, seed: int = 0) -> list[str]:
    """The edges from every previous-token head into the key input of every induction head of a later
    layer, the heads being those whose detector score reaches `threshold` (`gptlab heads`)."""
    scores = score_heads(model, seed=seed).scores  # detector -> (L, H)
    groups = model.config.n_head // model.config.kv_heads
    kv = "h" if groups == 1 else "kv"
    previous = (scores["previous_token"] >= threshold).nonzero().tolist()
    induction = (scores["induction"] >= threshold).nonzero().tolist()
    edges = (f"a{pl}.h{ph}->a{il}.{kv}{ih // groups}.k"
             for pl, ph in previous for il, ih in induction if il > pl)
    return list(dict.fromkeys(edges))  # heads sharing a key head share its edge
