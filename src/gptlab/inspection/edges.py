"""A GPT as a graph of edges, and a forward pass in which any edge can carry another run's value (issue 41).

Sources write into the residual stream: the input rows (`embed`, token + position), each head's output
(its hs columns of W_O applied to its answer, `a{L}.h{H}`) and each feed-forward network (`m{L}`).
Destinations read from it: each head's query, key and value input (`a{L}.h{H}.q`, `.k`, `.v`), each
feed-forward input (`m{L}`) and the `logits`. In a pre-norm model the stream a destination reads is the
sum of what the sources before it wrote (plus the biases of W_O, the same in every run), so each
destination here gets its own copy of that sum, normalised by the model's own norm afterwards, and an
edge s -> d is cut by swapping s's term in d's copy for the value s had in another (corrupted) run.
With nothing swapped, the logits are the model's own (`tests/inspection/test_attribution.py`).

Under grouped-query attention (n_kv_head < n_head) the key and value inputs belong to the shared key/value
heads, so their destinations are `a{L}.kv{G}.k` and `.v`: one per shared head, not per query head.
Only pre-norm models without U-net skips are taken, and their projections must be plain linear layers.

Shape legend: B batch (runs side by side), S sources, N destinations, T positions, D width, H query heads,
Hkv key/value heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gptlab.config import SettingError
from gptlab.model import GPT, CausalSelfAttention

EXACT_LAYERS = 4  # exact patching of every edge is offered up to this depth


@dataclass(frozen=True)
class Graph:
    """The sources, destinations and edges of one model, each list in the order the forward reaches it."""

    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    edges: tuple[tuple[int, int], ...]  # (source index, destination index)
    n_layer: int
    n_head: int
    n_kv_head: int
    has_mlp: bool

    @property
    def names(self) -> list[str]:
        """Every edge's name, `source->destination`, e.g. `a0.h1->a1.h3.k`."""
        return [f"{self.sources[s]}->{self.destinations[d]}" for s, d in self.edges]

    def layer_sources(self, layer: int) -> int:
        """How many sources come before layer `layer`'s heads (all of them when layer = n_layer)."""
        return 1 + layer * (self.n_head + int(self.has_mlp))

    def layer_destinations(self, layer: int) -> int:
        """How many destinations come before layer `layer`'s query inputs (the logits' index at n_layer)."""
        return layer * (self.n_head + 2 * self.n_kv_head + int(self.has_mlp))

    def select(self, patterns: Sequence[str]) -> list[int]:
        """The indices of the edges whose names match any of the shell-style `patterns` (`a0.*->a1.h2.k`)."""
        chosen = [i for i, name in enumerate(self.names)
                  if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        if not chosen:
            raise SettingError(f"no edge matches {', '.join(map(repr, patterns))}: {{e}} takes names such as "
                               f"{self.names[0]!r} or {self.names[-1]!r}, and * wildcards", e="edges")
        return chosen


def check_graph_model(model: GPT) -> None:
    """A ValueError in one line if `model` cannot be split into edges here."""
    config = model.config
    if config.arrangement != "pre":
        raise ValueError(f"arrangement={config.arrangement!r}: edge attribution needs a pre-norm model, "
                         "where each sublayer reads the norm of the sum of what came before it")
    if config.unet:
        raise ValueError("unet=True: edge attribution does not follow U-net skips; use a model without them")
    for block in model.transformer.blocks:
        linears = [block.attn.c_attn, block.attn.c_proj]
        if any(type(layer) is not nn.Linear for layer in linears):
            raise ValueError("edge attribution reads W_QKV and W_O as plain weights: merge the adapters "
                             "(gptlab.lora.merge_lora) or load the model unquantised")
    if model.training:
        raise ValueError("the model is in training mode: call model.eval() first (dropout would differ "
                         "between runs)")


def build_graph(model: GPT) -> Graph:
    """Every edge of `model`'s graph: from each source to each destination after it."""
    check_graph_model(model)
    config = model.config
    n_layer, n_head, n_kv = config.n_layer, config.n_head, config.kv_heads
    has_mlp = config.ffn != "none"
    sources: list[str] = ["embed"]
    destinations: list[str] = []
    edges: list[tuple[int, int]] = []
    kv = "h" if n_kv == n_head else "kv"  # shared key/value heads are named by their own index

    def connect(names: list[str], n_sources: int) -> None:
        for name in names:
            edges.extend((s, len(destinations)) for s in range(n_sources))
            destinations.append(name)

    for layer in range(n_layer):
        reads = [f"a{layer}.h{h}.q" for h in range(n_head)]
        reads += [f"a{layer}.{kv}{g}.{part}" for part in "kv" for g in range(n_kv)]
        connect(reads, len(sources))
        sources.extend(f"a{layer}.h{h}" for h in range(n_head))
        if has_mlp:
            connect([f"m{layer}"], len(sources))
            sources.append(f"m{layer}")
    connect(["logits"], len(sources))
    return Graph(tuple(sources), tuple(destinations), tuple(edges), n_layer, n_head, n_kv, has_mlp)


@dataclass(frozen=True)
class GraphRun:
    """One forward pass through the graph."""

    logits: torch.Tensor  # (B, V) after the last position
    sources: list[torch.Tensor]  # S of them, (B, T, D): what each source wrote into the stream
    inputs: list[torch.Tensor]  # per group of destinations, (B, n, T, D): the stream each read, unnormed


def stream_inputs(written: list[torch.Tensor], total: torch.Tensor, n: int, corrupt: torch.Tensor | None,
                  cut: torch.Tensor | None) -> torch.Tensor:
    """The stream each of n destinations reads, (B, n, T, D): `total` (B, T, D), the sum of the sources
    `written` so far (and biases), with source s's term swapped for corrupt[s] (S, T, D) in the proportion
    cut (B, s, n) says."""
    x = total.unsqueeze(1).expand(-1, n, -1, -1)  # (B, n, T, D)
    if cut is None or corrupt is None or not bool(cut.any()):
        return x
    x = x.clone()
    for s in cut.any(dim=2).any(dim=0).nonzero().flatten().tolist():  # only the sources cut somewhere ...
        runs = cut[:, s].any(dim=1).nonzero().flatten()  # ... and only in the runs that cut them
        change = corrupt[s] - written[s][runs]  # (b, T, D)
        x.index_add_(0, runs, cut[runs, s, :, None, None] * change.unsqueeze(1))
    return x


def per_head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each of n heads' projection of its own input: x (B, n, T, D), weight (n * hs, D) -> (B, n, T, hs)."""
    n, D = x.size(1), x.size(-1)
    out = torch.einsum("bntd,ned->bnte", x, weight.view(n, -1, D))
    return out if bias is None else out + bias.view(n, 1, -1)


def head_outputs(attn: CausalSelfAttention, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every head's contribution to the stream, (B, H, T, D), from the streams its q, k, v read,
    x (B, H + 2 Hkv, T, D): the block's norm, the model's own position scheme, qk-norm and kernel."""
    H, Hkv = attn.n_head, attn.n_kv_head
    weights = attn.c_attn.weight.split(attn.widths)  # W_Q (H hs, D), W_K and W_V (Hkv hs, D)
    biases = (None,) * 3 if attn.c_attn.bias is None else attn.c_attn.bias.split(attn.widths)
    inputs = norm(x).split([H, Hkv, Hkv], dim=1)
    # queries (B, H, T, hs), keys and values (B, Hkv, T, hs)
    q, k, v = (per_head(i, w, b) for i, w, b in zip(inputs, weights, biases, strict=True))
    q, k = attn.rotate(attn.q_norm(q)), attn.rotate(attn.k_norm(k))  # as CausalSelfAttention.project
    answers = attn.kernel(q, k, v, None, attn.causal)  # (B, H, T, hs)
    w_o = attn.c_proj.weight.view(x.size(-1), H, -1)  # (D, H, hs): head h's columns of W_O
    return torch.einsum("bhti,dhi->bhtd", answers, w_o)


def run_graph(model: GPT, graph: Graph, embed: torch.Tensor, corrupt: torch.Tensor | None = None,
              patched: torch.Tensor | None = None) -> GraphRun:
    """The forward pass from input rows embed (B, T, D), each destination summing its sources itself.

    `patched` (B, S, N) in [0, 1] swaps, in run b, the term of source s in destination d's stream for
    `corrupt[s]` (S, T, D) (0: this run's value, 1: the corrupted one); only edges of `graph` may be set.
    """
    written, inputs = [embed], []
    total = embed  # (B, T, D): every source so far, with W_O's biases (the same in every run, so no source's)

    def read(first: int, n: int, total: torch.Tensor) -> torch.Tensor:  # the next n destinations' streams
        cut = None if patched is None else patched[:, : len(written), first:first + n]  # (B, s, n)
        inputs.append(stream_inputs(written, total, n, corrupt, cut))
        return inputs[-1]

    for layer, block in enumerate(model.transformer.blocks):
        first = graph.layer_destinations(layer)
        x = read(first, graph.n_head + 2 * graph.n_kv_head, total)  # (B, H + 2 Hkv, T, D)
        heads = head_outputs(block.attn, block.ln_1, x)  # (B, H, T, D)
        written.extend(heads.unbind(dim=1))
        total = total + heads.sum(dim=1)
        if block.attn.c_proj.bias is not None:
            total = total + block.attn.c_proj.bias
        if block.mlp is not None and block.ln_2 is not None:
            x = read(first + graph.n_head + 2 * graph.n_kv_head, 1, total)  # (B, 1, T, D)
            written.append(block.mlp(block.ln_2(x[:, 0])))
            total = total + written[-1]
    x = read(graph.layer_destinations(graph.n_layer), 1, total)  # (B, 1, T, D)
    return GraphRun(model.head(x[:, 0, -1]), written, inputs)


def edge_masks(graph: Graph, edge_sets: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    """A `patched` tensor (B, S, N), dtype and device of `like`: run b cuts the edges edge_sets[b]
    (indices into graph.edges)."""
    mask = torch.zeros(len(edge_sets), len(graph.sources), len(graph.destinations))
    pairs = torch.tensor(graph.edges, dtype=torch.long)  # (E, 2)
    for run, edges in enumerate(edge_sets):
        chosen = pairs[torch.as_tensor(list(edges), dtype=torch.long)]  # (e, 2)
        mask[run, chosen[:, 0], chosen[:, 1]] = 1.0
    return mask.to(like)
