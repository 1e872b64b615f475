"""Circuits (issue 41): the fewest edges, taken in order of attribution, that keep a share of the metric.

Edges are ranked by |score| (`attribution.attribute`); the circuit is the shortest prefix of that ranking
whose faithfulness reaches `keep`, each prefix checked for real: every edge outside it is cut to the
corrupted run's value (`edges.run_graph`), the edges inside keep whatever the run computes. With m the
mean of logit(target) - logit(foil) over the pairs, normalised as `gptlab patch` does:

    faithfulness = (m(circuit only) - m(corrupt)) / (m(clean) - m(corrupt))
    completeness = (m(clean) - m(circuit cut)) / (m(clean) - m(corrupt))

Faithfulness 1 means the circuit alone carries the whole difference; completeness 1 means cutting the
circuit alone removes all of it (nothing outside it does the same job). Pairs whose m barely differs
(`attribution.unseparated`) are refused: both shares would divide by rounding noise. `recovery` compares a
circuit with edges known in advance (`ground_truth`).

Shape legend: K prefixes tried, E edges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gptlab.config import SettingError
from gptlab.inspection.attribution import (
    METRIC,
    Attribution,
    Pair,
    PairRuns,
    batch_rows,
    cut_metric,
    pair_runs,
    unseparated,
)
from gptlab.inspection.edges import Graph, build_graph
from gptlab.model import GPT


@dataclass(frozen=True)
class Circuit:
    """The edges found, most important first, and how much of the metric they keep and carry."""

    method: str  # the attribution that ranked the edges
    names: list[str]
    scores: list[float]  # their attribution scores
    keep: float
    faithfulness: float
    completeness: float
    clean: float  # mean m of the clean runs
    corrupt: float
    kept: float  # mean m with every edge outside the circuit cut
    removed: float  # mean m with only the circuit's edges cut
    total_edges: int
    curve: list[float]  # faithfulness of the first k ranked edges, k = 0, 1, ... len(names)

    def to_json(self) -> dict[str, Any]:
        """The --json object of `gptlab circuit`."""
        metric = {"name": METRIC, "clean": self.clean, "corrupt": self.corrupt, "circuit": self.kept,
                  "circuit_cut": self.removed}
        return {"method": self.method, "metric": metric,
                "keep": self.keep, "faithfulness": self.faithfulness, "completeness": self.completeness,
                "total_edges": self.total_edges,
                "edges": [{"name": n, "score": s} for n, s in zip(self.names, self.scores, strict=True)]}


def mean_cut(model: GPT, graph: Graph, pairs: Sequence[Pair], runs: Sequence[PairRuns],
             edge_sets: Sequence[Sequence[int]]) -> torch.Tensor:
    """The mean over the pairs of m (len(edge_sets),) with each set of edges cut."""
    each = [cut_metric(model, graph, p, r, edge_sets) for p, r in zip(pairs, runs, strict=True)]
    return torch.stack(each).mean(dim=0)


def find_circuit(model: GPT, pairs: Sequence[Pair], attribution: Attribution, keep: float = 0.8) -> Circuit:
    """The shortest prefix of the edges ranked by |score| whose faithfulness reaches `keep`."""
    if not 0.0 < keep <= 1.0:
        raise SettingError(f"{{k}}={keep} must be a share of the metric in (0, 1]", k="keep")
    graph = build_graph(model)
    if attribution.names != graph.names:
        raise ValueError("a circuit is searched among every edge: score all of them (no edge subset)")
    runs = [pair_runs(model, graph, pair) for pair in pairs]
    clean, corrupt = (sum(getattr(r, side) for r in runs) / len(runs) for side in ("clean", "corrupt"))
    problem = unseparated(clean, corrupt)
    if problem is not None:  # faithfulness would divide by rounding noise
        raise ValueError(f"{problem}: a circuit has nothing to keep a share of; corrupt the prompts where "
                         "the prediction depends on them")
    order = attribution.scores.abs().argsort(descending=True, stable=True).tolist()
    step, curve, found = batch_rows(runs[0]), [], None
    for start in range(0, len(order) + 1, step):
        prefixes = range(start, min(start + step, len(order) + 1))  # the circuit is order[:k]
        kept = mean_cut(model, graph, pairs, runs, [order[k:] for k in prefixes])  # (K,)
        for k, m in zip(prefixes, kept.tolist(), strict=True):
            curve.append((m - corrupt) / (clean - corrupt))
            if curve[-1] >= keep:
                found = (k, m)
                break
        if found:
            break
    assert found is not None, "with every edge kept the run is the clean one, faithfulness 1"
    k, m_kept = found
    removed = float(mean_cut(model, graph, pairs, runs, [order[:k]])[0])
    return Circuit(attribution.method, [graph.names[e] for e in order[:k]],
                   [float(attribution.scores[e]) for e in order[:k]], keep, curve[-1],
                   (clean - removed) / (clean - corrupt), clean, corrupt, m_kept, removed, len(order), curve)


def recovery(found: Sequence[str], known: Sequence[str]) -> tuple[float, float]:
    """(precision, recall) of the edge names `found` against the `known` ones."""
    hits = len(set(found) & set(known))
    return hits / len(found) if found else 0.0, hits / len(set(known)) if known else 0.0
