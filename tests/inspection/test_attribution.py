"""Edge attribution: the graph's forward pass is the model's, exact patching equals a loop that cuts one edge
at a time in a forward written out by hand, EAP equals its definition computed on that forward, and the
certificate's statistics are right on worked numbers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptlab.config import SettingError
from gptlab.inspection.attribution import (
    attribute,
    make_pair,
    metric,
    ranks,
    spearman,
    text_pair,
    top_overlap,
)
from gptlab.inspection.edges import build_graph, edge_masks, run_graph
from gptlab.model import GPT
from gptlab.text.tokenizer import tokenizer_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN, CORRUPT = [1, 5, 2, 7, 3, 4], [1, 5, 9, 7, 3, 4]  # one token changed


# ------------------------------------------------------------------------------- a forward by hand


def written_out(model: GPT, ids: list[int], swap: tuple[str, str, torch.Tensor] | None = None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                                          dict[str, torch.Tensor]]:
    """Logits after the last token (V,), every source's output (T, D) and every destination's stream (T, D)
    of a pre-norm GPT with LayerNorm, learned positions and a tanh-GELU MLP, by hand from its weights. Each
    destination adds up the sources before it itself; `swap` = (source, destination, value) puts `value`
    in place of that source's term in that destination's sum."""
    t = model.transformer
    T, D, H = len(ids), model.config.n_embd, model.config.n_head
    hs = D // H
    wrote = {"embed": t.wte.weight[ids] + t.wpe.weight[:T] if rows is None else rows}
    streams: dict[str, torch.Tensor] = {}
    constant = torch.zeros(D)  # biases of W_O

    def stream(destination: str) -> torch.Tensor:
        terms = {s: (swap[2] if swap and swap[:2] == (s, destination) else v) for s, v in wrote.items()}
        streams[destination] = sum(terms.values()) + constant
        return streams[destination]

    def norm(x: torch.Tensor, ln: Any) -> torch.Tensor:
        return F.layer_norm(x, (D,), ln.weight, ln.bias, ln.eps)

    for n, block in enumerate(t.h):
        w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
        outputs = {}
        for h in range(H):
            part = {}
            for i, name in enumerate("qkv"):
                rows_ = slice(i * D + h * hs, i * D + (h + 1) * hs)
                part[name] = norm(stream(f"a{n}.h{h}.{name}"), block.ln_1) @ w[rows_].T + b[rows_]  # (T, hs)
            scores = part["q"] @ part["k"].T / math.sqrt(hs)
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
            answer = scores.softmax(-1) @ part["v"]  # (T, hs)
            outputs[f"a{n}.h{h}"] = answer @ block.attn.c_proj.weight[:, h * hs:(h + 1) * hs].T  # (T, D)
        wrote |= outputs
        constant = constant + block.attn.c_proj.bias
        x = norm(stream(f"m{n}"), block.ln_2)
        hidden = F.gelu(x @ block.mlp.c_fc.weight.T + block.mlp.c_fc.bias, approximate="tanh")
        wrote[f"m{n}"] = hidden @ block.mlp.c_proj.weight.T + block.mlp.c_proj.bias
    logits = norm(stream("logits"), t.ln_f) @ model.lm_head.weight.T  # (T, V)
    return logits[-1], wrote, streams


def hand_edges(n_layer: int, n_head: int) -> list[tuple[str, str]]:
    """Every (source, destination) edge of a model with MLPs, listed by hand."""
    edges, before = [], ["embed"]
    for n in range(n_layer):
        edges += [(s, f"a{n}.h{h}.{p}") for h in range(n_head) for p in "qkv" for s in before]
        before += [f"a{n}.h{h}" for h in range(n_head)]
        edges += [(s, f"m{n}") for s in before]
        before += [f"m{n}"]
    return edges + [(s, "logits") for s in before]


@pytest.fixture
def model(random_gpt: Callable[..., GPT]) -> GPT:
    """A 2-layer, 2-head GPT with far-from-initial weights (vocabulary 13, width 8)."""
    return random_gpt(3)


# ------------------------------------------------------------------------------- the graph


def test_the_hand_written_forward_is_the_model(model: GPT) -> None:
    assert_close(written_out(model, CLEAN)[0], model(torch.tensor([CLEAN]))[0][0, -1])


GROUPED = dict(positions="rope", n_head=4, n_kv_head=2, n_embd=16, qk_norm=True, norm="rmsnorm", ffn="swiglu",
               bias=False)


@pytest.mark.parametrize("changes", [{}, GROUPED, dict(ffn="none", logit_softcap=3.0, attention="naive"),
                                     dict(positions="sinusoidal")])
def test_graph_forward_gives_the_model_logits(random_gpt: Callable[..., GPT],
                                              changes: dict[str, Any]) -> None:
    model = random_gpt(1, **changes)
    idx = torch.randint(0, 13, (3, 7))
    run = run_graph(model, build_graph(model), model.embed(idx))
    assert_close(run.logits, model(idx)[0][:, -1])


def test_cutting_every_edge_gives_the_corrupted_run(model: GPT) -> None:
    graph = build_graph(model)
    clean, corrupt = (model.embed(torch.tensor([ids])) for ids in (CLEAN, CORRUPT))
    corrupt_sources = torch.cat(run_graph(model, graph, corrupt).sources)  # (S, T, D)
    everything = edge_masks(graph, [range(len(graph.edges))], clean)
    assert_close(run_graph(model, graph, clean, corrupt_sources, everything).logits,
                 model(torch.tensor([CORRUPT]))[0][:, -1])


def test_graph_names_every_edge_and_shares_key_heads_under_gqa(random_gpt: Callable[..., GPT]) -> None:
    model = random_gpt(0)
    assert sorted(build_graph(model).names) == sorted(f"{s}->{d}" for s, d in hand_edges(2, 2))
    grouped = build_graph(random_gpt(0, n_head=4, n_kv_head=2, n_embd=16, ffn="none"))
    assert "a0.h2->a1.kv1.k" in grouped.names and "a0.h2->a1.h3.q" in grouped.names
    assert not any(".h" in name.split("->")[1] and name.endswith((".k", ".v")) for name in grouped.names)
    assert len(grouped.names) == 8 * 1 + 8 * 5 + 9  # 4 q, 2 k, 2 v inputs a layer: from 1, then 5; logits


def test_other_arrangements_are_refused_in_one_line(random_gpt: Callable[..., GPT]) -> None:
    for changes, words in ((dict(arrangement="post"), "pre-norm"), (dict(unet=True, n_layer=2), "unet")):
        with pytest.raises(ValueError, match=words):
            build_graph(random_gpt(0, **changes))
    with pytest.raises(ValueError, match="eval"):
        build_graph(random_gpt(0).train())


# ------------------------------------------------------------------------------- the methods


def test_exact_equals_a_loop_that_cuts_one_edge_at_a_time_by_hand(model: GPT) -> None:
    pair = make_pair(model, CLEAN, CORRUPT, target=3, foil=8)
    with torch.no_grad():
        clean_logits, _, _ = written_out(model, CLEAN)
        corrupted = written_out(model, CORRUPT)[1]
        m_clean = clean_logits[3] - clean_logits[8]
        expected = {}
        for source, destination in hand_edges(2, 2):
            logits = written_out(model, CLEAN, (source, destination, corrupted[source]))[0]
            expected[f"{source}->{destination}"] = float(logits[3] - logits[8] - m_clean)
    result = attribute(model, [pair], "exact")
    got = dict(zip(result.names, result.scores.tolist(), strict=True))
    assert got.keys() == expected.keys()
    assert_close(torch.tensor([got[k] for k in expected]), torch.tensor(list(expected.values())),
                 atol=2e-5, rtol=1e-4)
    assert max(map(abs, expected.values())) > 0.05  # a test with something to measure


def hand_eap(model: GPT, alphas: list[float]) -> dict[str, float]:
    """Each edge's gradient of m (target 3, foil 8) with respect to its destination's stream, averaged over
    runs at input rows clean + alpha (corrupt - clean), dotted with the source's corrupt - clean output."""
    clean_rows, corrupt_rows = (model.embed(torch.tensor([ids]))[0].detach() for ids in (CLEAN, CORRUPT))
    with torch.no_grad():
        clean, corrupted = written_out(model, CLEAN)[1], written_out(model, CORRUPT)[1]
    total: dict[str, torch.Tensor] = {}
    for alpha in alphas:
        rows = (clean_rows + alpha * (corrupt_rows - clean_rows)).requires_grad_(True)
        logits, _, streams = written_out(model, CLEAN, rows=rows)
        for name, gradient in zip(streams, torch.autograd.grad(logits[3] - logits[8], list(streams.values())),
                                  strict=True):
            total[name] = total.get(name, 0) + gradient / len(alphas)
    return {f"{s}->{d}": float((total[d] * (corrupted[s] - clean[s])).sum()) for s, d in hand_edges(2, 2)}


@pytest.mark.parametrize(("method", "steps", "alphas"), [("eap", 0, [0.0]),
                                                         ("eap-ig", 4, [0.125, 0.375, 0.625, 0.875])])
def test_eap_and_eap_ig_equal_their_definitions_by_hand(model: GPT, method: str, steps: int,
                                                        alphas: list[float]) -> None:
    expected = hand_eap(model, alphas)
    result = attribute(model, [make_pair(model, CLEAN, CORRUPT, target=3, foil=8)], method, steps)
    got = dict(zip(result.names, result.scores.tolist(), strict=True))
    assert result.steps == steps
    assert_close(torch.tensor([got[k] for k in expected]), torch.tensor(list(expected.values())),
                 atol=2e-5, rtol=1e-4)


def unit_of(destination: str) -> str:
    """The source that a destination's computation writes: its head, its MLP, or the logits (m itself)."""
    return destination.rsplit(".", 1)[0] if destination.startswith("a") else destination


def test_eap_dest_equals_its_definition_by_hand(model: GPT) -> None:
    """The cut edge's destination recomputed by hand, its change dotted with the gradient of m (clean run)
    with respect to what that destination writes; at the logits, m recomputed."""
    clean_rows = model.embed(torch.tensor([CLEAN]))[0].detach().requires_grad_(True)
    logits, clean, _ = written_out(model, CLEAN, rows=clean_rows)
    m_clean = logits[3] - logits[8]
    units = [n for n in clean if n != "embed"]
    gradients = dict(zip(units, torch.autograd.grad(m_clean, [clean[n] for n in units]), strict=True))
    expected = {}
    with torch.no_grad():
        corrupted = written_out(model, CORRUPT)[1]
        for source, destination in hand_edges(2, 2):
            swap = (source, destination, corrupted[source])
            cut_logits, cut, _ = written_out(model, CLEAN, swap, clean_rows)
            unit = unit_of(destination)
            expected[f"{source}->{destination}"] = float(
                cut_logits[3] - cut_logits[8] - m_clean if unit == "logits"
                else ((cut[unit] - clean[unit]) * gradients[unit]).sum())
    result = attribute(model, [make_pair(model, CLEAN, CORRUPT, target=3, foil=8)], "eap-dest")
    got = dict(zip(result.names, result.scores.tolist(), strict=True))
    assert got.keys() == expected.keys() and result.steps == 0
    assert_close(torch.tensor([got[k] for k in expected]), torch.tensor(list(expected.values())),
                 atol=2e-5, rtol=1e-4)
    exact = attribute(model, [make_pair(model, CLEAN, CORRUPT, target=3, foil=8)], "exact")
    assert_close(result.scores[-7:], exact.scores[-7:], atol=2e-5, rtol=1e-4)  # into the logits: exact


@pytest.mark.parametrize("changes", [GROUPED, dict(ffn="none", n_layer=3)])
def test_eap_dest_on_shared_key_heads_and_without_mlps(random_gpt: Callable[..., GPT],
                                                       changes: dict[str, Any]) -> None:
    """The same definition on the graph's own forward (which equals the model's), the gradient taken as the
    derivative of m along the change, written by the destination's sources into every later stream: under
    grouped-query attention a k or v edge changes every head that shares the key/value head."""
    model = random_gpt(2, **changes)
    graph = build_graph(model)
    rows = model.embed(torch.tensor([CLEAN])).detach()
    with torch.no_grad():
        clean = torch.cat(run_graph(model, graph, rows).sources)  # (S, T, D)
        corrupted = torch.cat(run_graph(model, graph, model.embed(torch.tensor([CORRUPT]))).sources)
        m_clean = float(metric(run_graph(model, graph, rows).logits, make_pair(model, CLEAN, CORRUPT, 3, 8)))
    expected = []
    for e, name in enumerate(graph.names):
        with torch.no_grad():
            cut = torch.cat(run_graph(model, graph, rows, corrupted, edge_masks(graph, [[e]], rows)).sources)
            logits = run_graph(model, graph, rows, corrupted, edge_masks(graph, [[e]], rows)).logits
        destination = name.split("->")[1]
        if destination == "logits":
            expected.append(float(logits[0, 3] - logits[0, 8]) - m_clean)
            continue
        layer = destination.split(".")[0]  # a1 or m1: the computation whose every output the cut may change
        unit = [i for i, s in enumerate(graph.sources) if s.split(".")[0] == layer]
        along = [k for k, (s, _) in enumerate(graph.edges) if s in unit]  # every stream they write into
        eps = torch.zeros((), requires_grad=True)
        values = clean + eps * (cut - clean)  # the destination's computation redone with the edge cut, scaled
        run = run_graph(model, graph, rows, values, edge_masks(graph, [along], rows))
        expected.append(float(torch.autograd.grad(run.logits[0, 3] - run.logits[0, 8], eps)[0]))
    result = attribute(model, [make_pair(model, CLEAN, CORRUPT, target=3, foil=8)], "eap-dest")
    assert_close(result.scores, torch.tensor(expected), atol=2e-5, rtol=1e-4)
    assert max(map(abs, expected)) > 0.02  # a test with something to measure

def test_scores_average_over_pairs_with_their_signs(model: GPT) -> None:
    pairs = [make_pair(model, CLEAN, CORRUPT, 3, 8), make_pair(model, CORRUPT, CLEAN, 3, 8)]
    both, first, second = (attribute(model, p, "eap") for p in (pairs, pairs[:1], pairs[1:]))
    assert_close(both.scores, (first.scores + second.scores) / 2)
    assert both.pairs == 2 and both.clean == pytest.approx((first.clean + second.clean) / 2)


def test_exact_is_refused_above_four_layers_unless_a_subset_is_named(random_gpt: Callable[..., GPT]) -> None:
    deep = random_gpt(0, n_layer=5)
    pair = make_pair(deep, CLEAN, CORRUPT, 3, 8)
    with pytest.raises(SettingError, match="edges"):
        attribute(deep, [pair], "exact")
    subset = attribute(deep, [pair], "exact", chosen=["a3.*->logits"])
    assert subset.names == ["a3.h0->logits", "a3.h1->logits"]
    with pytest.raises(SettingError, match="no edge matches"):
        attribute(deep, [pair], "eap", chosen=["a9.*"])


def test_pairs_are_checked_in_one_line(model: GPT) -> None:
    tokenizer = tokenizer_from_dict({"kind": "char", "chars": "abcdefghijklm"})
    with pytest.raises(SettingError, match="same length"):
        text_pair(model, tokenizer, "abc", "abcd", "a")
    with pytest.raises(SettingError, match="exactly one token"):
        text_pair(model, tokenizer, "abc", "abd", "ab")
    with pytest.raises(SettingError, match="same token"):
        make_pair(model, CLEAN, CORRUPT, 3, 3)
    assert text_pair(model, tokenizer, "abc", "abd", "a").foil != 0  # the corrupted run's likeliest other


# ------------------------------------------------------------------------------- the certificate


def test_spearman_and_overlap_on_worked_numbers() -> None:
    expected = torch.tensor([4.0, 1.0, 2.5, 2.5], dtype=torch.float64)
    assert_close(ranks(torch.tensor([3.0, 1.0, 2.0, 2.0])), expected)
    tied = spearman(torch.tensor([1.0, 2, 2, 3]), torch.tensor([1.0, 2, 3, 4]))
    assert tied == pytest.approx(3 / math.sqrt(10))
    assert spearman(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == pytest.approx(-1.0)
    assert math.isnan(spearman(torch.ones(3), torch.arange(3.0)))
    assert top_overlap(torch.tensor([5.0, -4, 0, 1]), torch.tensor([-9.0, 0, 3, 1]), 2) == 0.5
