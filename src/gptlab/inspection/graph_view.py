"""A picture of the graph's strongest edges (issue 41): `gptlab attribute --out` and `gptlab circuit --out`.

Sources are boxes in forward order from the bottom (embed, each layer's heads side by side, its MLP) to
the logits at the top; an edge runs from its source to the q, k or v input of a head (three points below
the head's box, left to right; a shared key/value head's k and v a row lower, between the heads it
serves), an MLP's input or the logits. Its width grows with |score|; it is blue
where the score is negative (the edge carries the clean answer: cutting it lowers m), red where positive.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from gptlab.config import ModelConfig
from gptlab.files import save_png
from gptlab.model import GPT

HEAD = re.compile(r"a(\d+)\.(h|kv)(\d+)(?:\.([qkv]))?")
PART_OFFSET = {"q": -0.22, "k": 0.0, "v": 0.22}


def rows(config: ModelConfig) -> dict[str, float]:
    """The height of each layer's parts: embed 0, then heads and MLP of each layer, the logits on top."""
    step = 2 if config.ffn != "none" else 1
    heights = {"embed": 0.0, "logits": float(1 + step * config.n_layer)}
    for layer in range(config.n_layer):
        heights[f"a{layer}"] = float(1 + step * layer)
        heights[f"m{layer}"] = float(2 + step * layer)
    return heights


def place(config: ModelConfig, node: str) -> tuple[float, float]:
    """(x, y) of a source box or a destination point, from its name."""
    heights = rows(config)
    match = HEAD.fullmatch(node)
    if match is None:
        return 0.0, heights[node] - (0.22 if node.startswith("m") else 0.0)  # an MLP's input: below its box
    layer, kind, index, part = match.groups()
    group = 1 if kind == "h" else config.n_head // config.kv_heads  # query heads that share a key head
    x = (int(index) + 0.5) * group - 0.5 - (config.n_head - 1) / 2  # the middle of the heads it serves
    if part is None:
        return x, heights[f"a{layer}"]
    return x + PART_OFFSET[part], heights[f"a{layer}"] - (0.22 if kind == "h" else 0.36)  # shared: lower


def save_graph_png(model: GPT, edges: Sequence[tuple[str, float]], path: str | Path, title: str) -> None:
    """Draw `edges` (name, score) over every source of `model`'s graph, the scores listed beside it."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    config = model.config
    heights = rows(config)
    fig = Figure(figsize=(1.5 * config.n_head + 4.2, 1.4 + 0.9 * heights["logits"]), dpi=110,
                 layout="constrained")
    ax, listing = fig.subplots(1, 2, width_ratios=[max(3.0, 1.5 * config.n_head), 2.6])
    heads = [f"a{n}.h{h}" for n in range(config.n_layer) for h in range(config.n_head)]
    mlps = [f"m{n}" for n in range(config.n_layer)] if config.ffn != "none" else []
    for box in ["embed", "logits", *heads, *mlps]:
        x, y = place(config, box)
        ax.text(x, y + (0.1 if box in heads else 0.0), box, ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", facecolor="0.93", edgecolor="0.6"))
    for layer in range(config.n_layer):  # the q, k, v input points under each head (or shared key head)
        for part in "qkv":
            for index in range(config.n_head if part == "q" else config.kv_heads):
                kind = "h" if part == "q" or config.kv_heads == config.n_head else "kv"
                x, y = place(config, f"a{layer}.{kind}{index}.{part}")
                ax.text(x, y - 0.04, part, ha="center", va="top", fontsize=6, color="0.45")
    largest = max((abs(score) for _, score in edges), default=1.0) or 1.0
    for name, score in edges:
        source, destination = name.split("->")
        (x0, y0), end = place(config, source), place(config, destination)
        width = 0.6 + 3.5 * abs(score) / largest
        colour = "tab:blue" if score < 0 else "tab:red"
        ax.add_patch(FancyArrowPatch((x0, y0 + (0.25 if source in heads else 0.15)), end, arrowstyle="-|>",
                                     mutation_scale=6 + 2 * width, connectionstyle="arc3,rad=0.12",
                                     linewidth=width, alpha=0.7, color=colour))
    half = (config.n_head - 1) / 2 + 0.6
    ax.set_xlim(-half, half)
    ax.set_ylim(-0.5, heights["logits"] + 0.4)
    ax.axis("off")
    listing.axis("off")
    scores = "\n".join(f"{name}  {score:+.3f}" for name, score in edges)
    listing.text(0.0, 0.5, scores, ha="left", va="center", fontsize=7, family="monospace",
                 transform=listing.transAxes)
    fig.suptitle(f"{title}\nblue: carries the clean answer (score < 0); red: score > 0; width: |score|",
                 fontsize=9)
    save_png(fig, path)
