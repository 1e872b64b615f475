"""Edge attribution (issue 41): how much of m = logit(target) - logit(foil) each edge of the graph carries.

An edge's score is the change in m after the last position when that edge alone carries the corrupted
run's value and every other edge the clean run's: m(clean, edge cut) - m(clean). It is signed: an edge
that carries the clean answer scores below zero. Three ways to get it (`edges` has the graph):
- `exact`: one forward pass per edge (run side by side in batches), the edge cut for real.
- `eap`, edge attribution patching: the first-order estimate, the gradient of m with respect to the
  destination's stream in the clean run dotted with the source's (corrupted - clean) output, summed over
  positions and features; one forward and one backward pass score every edge.
- `eap-ig`: the same with the gradient averaged over `steps` runs whose input rows lie between the clean
  and corrupted ones, at the midpoints of `steps` equal intervals (integrated gradients along the input).
- `eap-dest`: EAP with each edge's destination computed for real: the cut edge's change in what its
  destination writes (the head with its softmax, the MLP; at the logits, m itself) dotted with the
  clean run's gradient of m there. The softmax that saturates, or flips between two positions, is where
  the plain gradient errs most; only the way on from the destination to m is taken as linear.
Over several pairs the scores are averaged, signs kept. Where exact patching is affordable, `certify`
measures an estimate against it: Spearman's rank correlation over every edge, of |score| (the order in
which a circuit search takes edges) and of the signed scores, and the overlap of the top k by |score|.

Identical clean and corrupted prompts are refused (every edge would carry the same value in both runs),
and a certificate or a circuit (`circuit`) is refused for pairs whose m barely differs between the runs
(`unseparated`): what they would divide or rank is rounding noise.

Shape legend: B runs side by side, S sources, N destinations, E edges, T positions, D width, V vocabulary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlab.config import SettingError
from gptlab.data.corpora import read_utf8
from gptlab.inspection.edges import EXACT_LAYERS, Graph, build_graph, edge_masks, head_outputs, run_graph
from gptlab.inspection.patching import check_same_length
from gptlab.inspection.tokens import encode_prompt, encode_token
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer

METHODS = ("exact", "eap", "eap-ig", "eap-dest")
METRIC = "logit(target) - logit(foil) after the last token"
Unit = Callable[[torch.Tensor], torch.Tensor]  # what a destination computes from its streams (eap-dest)
BATCH_ELEMENTS = 1 << 22  # runs side by side hold at most about this many stream values (16 MB in float32)
# m must differ between the clean and corrupted runs by this share of its scale, max(1, |m|): float32 logits
# round at about 1e-6 of theirs, so a smaller difference is mostly rounding, and a share of it or a ranking
# of the edges that carry it is noise.
SEPARATION = 1e-3


@dataclass(frozen=True)
class Pair:
    """A clean and a corrupted prompt of the same length, and the two tokens m compares after them."""

    clean: tuple[int, ...]
    corrupt: tuple[int, ...]
    target: int
    foil: int


def make_pair(model: GPT, clean: Sequence[int], corrupt: Sequence[int], target: int,
              foil: int | None = None) -> Pair:
    """A Pair, checked; `foil` defaults to the corrupted run's likeliest token other than the target."""
    check_same_length(clean, corrupt)
    if tuple(clean) == tuple(corrupt):
        raise SettingError("{c} and {x} are the same prompt: no edge carries a difference between them; "
                           "corrupt the prompt where the prediction depends on it", c="clean", x="corrupt")
    if foil is None:
        with torch.no_grad():
            logits = model(torch.tensor([list(corrupt)], device=next(model.parameters()).device))[0]
        top2 = logits[0, -1].topk(2).indices.tolist()
        foil = top2[1] if top2[0] == target else top2[0]
    if foil == target:
        raise SettingError("{f} is the same token as {t}: m would be zero; choose another foil", f="foil",
                           t="target")
    return Pair(tuple(clean), tuple(corrupt), target, foil)


def text_pair(model: GPT, tokenizer: Tokenizer, clean: str, corrupt: str, target: str,
              foil: str | None = None) -> Pair:
    """A Pair from text: two prompts within the context window, a target and foil of one token each."""
    block = model.config.block_size
    ids = [encode_prompt(tokenizer, text, block, option)
           for text, option in ((clean, "clean"), (corrupt, "corrupt"))]
    foil_id = None if foil is None else encode_token(tokenizer, foil, "foil")
    return make_pair(model, ids[0], ids[1], encode_token(tokenizer, target, "target"), foil_id)


def read_pairs(model: GPT, tokenizer: Tokenizer, path: str | Path) -> list[Pair]:
    """The pairs of a JSONL file, one {"clean", "corrupt", "target", "foil"} object a line (foil optional)."""
    pairs = []
    for number, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)  # a JSONDecodeError is a ValueError
            if not isinstance(row, dict) or not {"clean", "corrupt", "target"} <= row.keys():
                raise ValueError('each line must be an object with "clean", "corrupt", "target" (and "foil")')
            texts = (row["clean"], row["corrupt"], row["target"], row.get("foil"))
            pairs.append(text_pair(model, tokenizer, *texts))
        except ValueError as err:
            raise ValueError(f"{path} line {number}: {err}") from None
    if not pairs:
        raise ValueError(f"{path} holds no pairs: write one JSON object a line")
    return pairs


def unseparated(clean: float, corrupt: float) -> str | None:
    """Why m's clean and corrupted values (means over the pairs) are too close to divide or rank by, as a
    sentence; None when they differ by at least SEPARATION of their scale."""
    if abs(clean - corrupt) >= SEPARATION * max(1.0, abs(clean), abs(corrupt)):
        return None
    return (f"the pairs (or the model) do not separate clean from corrupted: m is {clean:+.6f} clean and "
            f"{corrupt:+.6f} corrupted, a difference under {SEPARATION:g} of its scale")


def metric(logits: torch.Tensor, pair: Pair) -> torch.Tensor:
    """m for each run, (B,), from the logits after the last position (B, V)."""
    logits = logits.float()
    return logits[:, pair.target] - logits[:, pair.foil]


@dataclass(frozen=True)
class PairRuns:
    """The clean and corrupted runs of one pair through the graph."""

    clean_rows: torch.Tensor  # (1, T, D) input rows
    corrupt_rows: torch.Tensor  # (1, T, D)
    clean_sources: torch.Tensor  # (S, T, D) what each source wrote
    corrupt_sources: torch.Tensor  # (S, T, D)
    clean: float  # m
    corrupt: float


@torch.no_grad()
def pair_runs(model: GPT, graph: Graph, pair: Pair) -> PairRuns:
    """Run both prompts of a pair through the graph, nothing cut."""
    device = next(model.parameters()).device
    rows = [model.embed(torch.tensor([list(ids)], device=device)) for ids in (pair.clean, pair.corrupt)]
    clean, corrupt = (run_graph(model, graph, r) for r in rows)
    sources = [torch.cat(run.sources) for run in (clean, corrupt)]  # (S, T, D) each
    return PairRuns(rows[0], rows[1], sources[0], sources[1], float(metric(clean.logits, pair)),
                    float(metric(corrupt.logits, pair)))


def batch_rows(runs: PairRuns) -> int:
    """How many runs of this pair fit side by side under BATCH_ELEMENTS."""
    return max(1, BATCH_ELEMENTS // runs.clean_sources.numel())


@torch.no_grad()
def cut_metric(model: GPT, graph: Graph, pair: Pair, runs: PairRuns,
               edge_sets: Sequence[Sequence[int]]) -> torch.Tensor:
    """m (len(edge_sets),) of the clean prompt with each set of edges cut to the corrupted run's values."""
    out = []
    step = batch_rows(runs)
    for start in range(0, len(edge_sets), step):
        chunk = edge_sets[start:start + step]
        patched = edge_masks(graph, chunk, runs.clean_rows)  # (B, S, N)
        rows = runs.clean_rows.expand(len(chunk), -1, -1)  # (B, T, D)
        out.append(metric(run_graph(model, graph, rows, runs.corrupt_sources, patched).logits, pair))
    return torch.cat(out).cpu()


def exact_scores(model: GPT, graph: Graph, pair: Pair, runs: PairRuns, edges: Sequence[int]) -> torch.Tensor:
    """Each edge's score (E,) by cutting it alone: m(clean, edge cut) - m(clean)."""
    return cut_metric(model, graph, pair, runs, [[e] for e in edges]) - runs.clean


def gradient_scores(model: GPT, graph: Graph, pair: Pair, runs: PairRuns, edges: Sequence[int],
                    steps: int) -> torch.Tensor:
    """Each edge's first-order score (E,): EAP with steps=0, else EAP-IG over `steps` points of the input."""
    alphas = torch.tensor([0.0]) if steps == 0 else (torch.arange(steps) + 0.5) / steps  # (B,)
    alphas = alphas.to(runs.clean_rows).view(-1, 1, 1)
    rows = runs.clean_rows + alphas * (runs.corrupt_rows - runs.clean_rows)  # (B, T, D)
    with torch.enable_grad():
        rows.requires_grad_(True)
        run = run_graph(model, graph, rows)
        gradients = torch.autograd.grad(metric(run.logits, pair).sum(), run.inputs)  # each (B, n, T, D)
    gradient = torch.cat(gradients, dim=1).mean(dim=0)  # (N, T, D): the mean over the points of the path
    change = runs.corrupt_sources - runs.clean_sources  # (S, T, D)
    table = torch.einsum("ntd,std->sn", gradient.float(), change.float())  # (S, N): every pair of nodes
    pairs = torch.tensor(graph.edges, device=table.device)[torch.as_tensor(list(edges), device=table.device)]
    return table[pairs[:, 0], pairs[:, 1]].cpu()


def source_gradients(graph: Graph, gradient: torch.Tensor) -> torch.Tensor:
    """The gradient of m with respect to what each source writes, (S, T, D): the sum of the gradients at
    the destinations after it (every source reaches every later destination), from gradient (N, T, D)."""
    after = gradient.flip(0).cumsum(0).flip(0)  # (N, T, D): the sum over destinations d.. onwards
    first = torch.full((len(graph.sources),), len(graph.destinations), dtype=torch.long)
    pairs = torch.tensor(graph.edges, dtype=torch.long)  # (E, 2)
    first = first.scatter_reduce(0, pairs[:, 0], pairs[:, 1], reduce="amin")
    return torch.cat([after, after.new_zeros(1, *after.shape[1:])])[first.to(after.device)]


def unit_scores(unit: Unit, reads: torch.Tensor, cuts: list[tuple[int, int]], change: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """For each cut (slot j, source s), the change in what `unit` writes when its input slot j, of the
    streams reads (n, T, D), gets change[s] added, dotted with weight (k, T, D); `unit` maps (B, n, T, D)
    streams to (B, k, T, D) outputs."""
    base = unit(reads.unsqueeze(0))  # (1, k, T, D)
    out = []
    step = max(1, BATCH_ELEMENTS // reads.numel())
    for start in range(0, len(cuts), step):
        chunk = cuts[start:start + step]
        x = reads.unsqueeze(0).repeat(len(chunk), 1, 1, 1)  # (B, n, T, D)
        slots = torch.tensor([j for j, _ in chunk], device=x.device)
        x[torch.arange(len(chunk), device=x.device), slots] += change[[s for _, s in chunk]]
        out.append(torch.einsum("bktd,ktd->b", (unit(x) - base).float(), weight))
    return torch.cat(out) if out else reads.new_zeros(0)


def destination_scores(model: GPT, graph: Graph, pair: Pair, runs: PairRuns,
                       edges: Sequence[int]) -> torch.Tensor:
    """Each edge's score (E,) by eap-dest: its destination's output recomputed with the edge cut, the
    change dotted with the clean gradient of m at that output (at the logits: m recomputed)."""
    rows = runs.clean_rows.clone().requires_grad_(True)
    with torch.enable_grad():
        run = run_graph(model, graph, rows)
        gradients = torch.autograd.grad(metric(run.logits, pair).sum(), run.inputs)  # each (1, n, T, D)
    reads = torch.cat(run.inputs, dim=1)[0].detach()  # (N, T, D): the stream each destination read
    weight = source_gradients(graph, torch.cat(gradients, dim=1)[0].float())  # (S, T, D)
    change = runs.corrupt_sources - runs.clean_sources  # (S, T, D)
    units: list[tuple[int, int, Unit, torch.Tensor]] = []  # (first destination, n, unit, weight)
    H = graph.n_head
    for layer, block in enumerate(model.transformer.blocks):
        first, heads = graph.layer_destinations(layer), graph.layer_sources(layer)
        units.append((first, H + 2 * graph.n_kv_head, partial(head_outputs, block.attn, block.ln_1),
                      weight[heads:heads + H]))
        if block.mlp is not None and block.ln_2 is not None:
            units.append((first + H + 2 * graph.n_kv_head, 1, nn.Sequential(block.ln_2, block.mlp),
                          weight[heads + H:heads + H + 1]))

    def logits_unit(x: torch.Tensor) -> torch.Tensor:  # m itself, (B, 1, 1, 1), from the final streams
        return metric(model.head(x[:, 0, -1]), pair).view(-1, 1, 1, 1)

    units.append((graph.layer_destinations(graph.n_layer), 1, logits_unit, weight.new_ones(1, 1, 1)))
    scores = torch.zeros(len(edges))
    chosen = [(i, *graph.edges[e]) for i, e in enumerate(edges)]  # (place in edges, source, destination)
    with torch.no_grad():
        for first, n, unit, unit_weight in units:
            mine = [(i, s, d) for i, s, d in chosen if first <= d < first + n]
            if mine:
                cuts = [(d - first, s) for _, s, d in mine]
                scores[[i for i, _, _ in mine]] = unit_scores(unit, reads[first:first + n], cuts, change,
                                                              unit_weight).float().cpu()
    return scores


@dataclass(frozen=True)
class Attribution:
    """Every scored edge's score, averaged over the pairs, and the metric on the clean and corrupted runs."""

    method: str
    steps: int  # points of the integral (eap-ig), else 0
    names: list[str]  # the scored edges, in the graph's order
    scores: torch.Tensor  # (E,)
    clean: float  # mean m over the pairs
    corrupt: float
    pairs: int

    def ranked(self) -> list[tuple[str, float]]:
        """(name, score) of every edge, the largest |score| first."""
        order = self.scores.abs().argsort(descending=True, stable=True).tolist()
        return [(self.names[i], float(self.scores[i])) for i in order]

    def to_json(self) -> dict[str, Any]:
        """The --json object: method, metric, pairs and every edge with its score."""
        metric = {"name": METRIC, "clean": self.clean, "corrupt": self.corrupt}
        edges = [{"name": n, "score": float(s)} for n, s in zip(self.names, self.scores, strict=True)]
        return {"method": self.method, "metric": metric, "pairs": self.pairs, "edges": edges}


def check_method(graph: Graph, method: str, steps: int, chosen: Sequence[str] | None) -> None:
    """One-line errors for a method that does not exist, a bad step count, or exact patching too deep."""
    if method not in METHODS:
        raise SettingError(f"{{m}} {method!r} is not one of {', '.join(METHODS)}", m="method")
    if method == "eap-ig" and steps < 1:
        raise SettingError(f"{{s}}={steps}: the integral needs at least one point", s="steps")
    if method == "exact" and graph.n_layer > EXACT_LAYERS and not chosen:
        raise SettingError(f"exact patching of all {len(graph.edges)} edges of a {graph.n_layer}-layer model "
                           f"is refused above {EXACT_LAYERS} layers: name a subset with {{e}}, or use "
                           "eap, eap-ig or eap-dest", e="edges")


def attribute(model: GPT, pairs: Sequence[Pair], method: str = "eap-ig", steps: int = 16,
              chosen: Sequence[str] | None = None) -> Attribution:
    """Score the edges (all, or those matching the `chosen` patterns, shell-style) averaged over `pairs`."""
    graph = build_graph(model)
    check_method(graph, method, steps, chosen)
    if not pairs:
        raise SettingError("no pairs to score: give {c}, {x} and {t}, or pairs", c="clean", x="corrupt",
                           t="target")
    edges = graph.select(chosen) if chosen else list(range(len(graph.edges)))
    total, clean, corrupt = torch.zeros(len(edges)), 0.0, 0.0
    for pair in pairs:
        runs = pair_runs(model, graph, pair)
        if method == "exact":
            total += exact_scores(model, graph, pair, runs, edges)
        elif method == "eap-dest":
            total += destination_scores(model, graph, pair, runs, edges)
        else:
            total += gradient_scores(model, graph, pair, runs, edges, steps if method == "eap-ig" else 0)
        clean, corrupt = clean + runs.clean, corrupt + runs.corrupt
    names = [graph.names[e] for e in edges]
    n = len(pairs)
    steps = steps if method == "eap-ig" else 0
    return Attribution(method, steps, names, total / n, clean / n, corrupt / n, n)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of x (n,), tied values sharing their mean rank."""
    ordered, order = x.sort()
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    mean_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2  # (groups,)
    out = torch.empty(len(x), dtype=torch.float64)
    out[order] = mean_rank[inverse]
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two score vectors (n,); nan when either is constant."""
    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    scale = float(ra.norm() * rb.norm())
    return float(ra @ rb) / scale if scale > 0 else math.nan


def top_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """The share of b's top k edges by |score| that are among a's top k."""
    k = min(k, len(a))
    top_a, top_b = (set(x.abs().topk(k).indices.tolist()) for x in (a, b))
    return len(top_a & top_b) / k if k else math.nan


@dataclass(frozen=True)
class Certificate:
    """How well an estimate agrees with exact patching on the same edges."""

    spearman: float  # rank correlation of |score| over every edge (the order a circuit search uses)
    signed_spearman: float  # rank correlation of the signed scores
    top_k: int
    overlap: float  # share of the exact top k (by |score|) in the estimate's top k

    def to_json(self) -> dict[str, Any]:
        """The --json form (nan as null)."""
        return {"spearman": nan_free(self.spearman), "signed_spearman": nan_free(self.signed_spearman),
                "top_k": self.top_k, "overlap": self.overlap}


def nan_free(x: float) -> float | None:
    """x, or None for nan (JSON has no nan)."""
    return None if math.isnan(x) else x


def certify(estimate: Attribution, exact: Attribution, top_k: int = 10) -> Certificate:
    """Compare an estimate's scores with exact patching's, edge by edge; a ValueError for pairs whose m
    barely differs (`unseparated`), whose exact scores are rounding noise to rank."""
    assert estimate.names == exact.names, "a certificate compares the same edges"
    if top_k < 1:
        raise SettingError(f"{{k}}={top_k}: compare at least the top 1 edge", k="top_k")
    problem = unseparated(exact.clean, exact.corrupt)
    if problem is not None:
        raise ValueError(f"{problem}: exact patching's scores are rounding noise, with no order to certify")
    k = min(top_k, len(exact.names))
    a, b = estimate.scores, exact.scores
    return Certificate(spearman(a.abs(), b.abs()), spearman(a, b), k, top_overlap(a, b, k))
