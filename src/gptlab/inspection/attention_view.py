"""Attention maps of one prompt: a PNG grid of heatmaps and a self-contained interactive HTML page.

Handout §2-§3.2: row i of a head's weight matrix is how query i spreads its attention over the keys
j <= i. The weights are recomputed beside the fast kernel only for the layers and heads asked for
(see `hooks`), so the logits shown beside them are the model's own. §2.2's warning applies to every
picture drawn here: a large weight is routing, not yet an explanation (`interventions` tests that).

The PNG is a grid, layers down and heads across; in every heatmap rows are queries and columns keys,
labelled with the prompt's tokens. The HTML page carries its data as inline JSON and its script and
style inline, so it opens offline: pick a layer and a head, and hover a token to see where it attends
and which next tokens the model predicts at that position.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import SettingError
from gptlab.files import atomic_write_text, save_png
from gptlab.inspection.hooks import record
from gptlab.inspection.page import PAGE
from gptlab.inspection.tokens import token_label, token_labels
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer

TOP_PREDICTIONS = 5  # next tokens listed per position on the HTML page
INCHES_PER_TOKEN = 0.1  # heatmap size per token, so ~7-point labels never overlap


@dataclass(frozen=True)
class AttentionMaps:
    """The weights of some heads on one prompt, and the model's next-token distribution at each position."""

    prompt: str
    labels: list[str]  # each token's text, made visible (token_label)
    layers: list[int]
    heads: list[int]
    weights: torch.Tensor  # (len(layers), len(heads), T, T): rows are queries, columns keys
    probs: torch.Tensor  # (T, V): the distribution of the token after each position


def check_index(value: int | None, count: int, option: str) -> list[int]:
    """[value] if it is a valid index below `count`, every index if it is None; else a SettingError naming
    `option`."""
    if value is None:
        return list(range(count))
    if not 0 <= value < count:
        raise SettingError(f"{{o}} {value} does not exist: the model has {count}, numbered 0..{count - 1}",
                           o=option)
    return [value]


@torch.no_grad()
def attention_maps(model: GPT, tokenizer: Tokenizer, prompt: str, ids: Sequence[int],
                   layer: int | None = None, head: int | None = None) -> AttentionMaps:
    """Run the prompt once, recomputing the weights of one layer/head or of all (the default)."""
    layers = check_index(layer, model.config.n_layer, "layer")
    heads = check_index(head, model.config.n_head, "head")
    device = next(model.parameters()).device
    names = [f"h.{n}.attn.weights" for n in layers]
    with record(model, names, heads) as values:
        logits, _ = model(torch.tensor([list(ids)], device=device))  # (1, T, V)
    weights = torch.stack([values[name][0] for name in names]).float().cpu()  # (L', H', T, T)
    return AttentionMaps(prompt, token_labels(tokenizer, ids), layers, heads, weights,
                         logits[0].float().softmax(-1).cpu())


def save_attention_png(maps: AttentionMaps, path: str | Path) -> None:
    """Draw a layers x heads grid of heatmaps with token labels on both axes (matplotlib's Agg backend)."""
    draw_grid(maps.weights, maps.labels, maps.labels, maps.layers, maps.heads,
              f"attention weights for {maps.prompt!r}", path)


def draw_grid(weights: torch.Tensor, query_labels: Sequence[str], key_labels: Sequence[str],
              layers: Sequence[int], heads: Sequence[int], title: str, path: str | Path,
              axes_names: tuple[str, str] = ("query (attending)", "key (attended to)")) -> None:
    """A PNG grid of heatmaps of weights (L', H', Tq, Tk): layers down, heads across, tokens on the axes."""
    from matplotlib.figure import Figure

    n_rows, n_cols = len(layers), len(heads)
    width = max(2.4, INCHES_PER_TOKEN * len(key_labels))  # one heatmap's size, in inches
    height = max(2.4, INCHES_PER_TOKEN * len(query_labels))
    fig = Figure(figsize=(n_cols * width + 1.4, n_rows * height + 1.0), dpi=100, layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            image = ax.imshow(weights[r, c].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer}, head {head}", fontsize=9)
            # Queries label every row of the left column, keys every column of the bottom row.
            ax.set_yticks(range(len(query_labels)), query_labels if c == 0 else [], fontsize=7,
                          fontfamily="monospace")
            ax.set_xticks(range(len(key_labels)), key_labels if r == n_rows - 1 else [], fontsize=7,
                          fontfamily="monospace", rotation=90)
            ax.tick_params(length=0)
        axes[r][0].set_ylabel(axes_names[0], fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel(axes_names[1], fontsize=8)
    assert image is not None, "draw_grid needs at least one layer and one head"
    fig.colorbar(image, ax=axes, shrink=min(0.8, 3.0 / n_rows + 0.2), label="attention weight")
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)


def predictions(maps: AttentionMaps, tokenizer: Tokenizer, k: int = TOP_PREDICTIONS) -> list[list[list]]:
    """The k most likely next tokens after each position, as [label, probability] pairs."""
    top = maps.probs.topk(min(k, maps.probs.size(-1)), dim=-1)  # (T, k) values and indices
    return [[[token_label(tokenizer, int(t)), round(float(p), 4)] for p, t in zip(ps, ts, strict=True)]
            for ps, ts in zip(top.values, top.indices, strict=True)]


def attention_page(maps: AttentionMaps, tokenizer: Tokenizer) -> str:
    """One self-contained page (inline data, script and style; nothing fetched)."""
    data = {
        "prompt": maps.prompt,
        "labels": maps.labels,
        "layers": maps.layers,
        "heads": maps.heads,
        "weights": maps.weights.double().round(decimals=4).tolist(),  # (L', H', T, T); short decimals
        "predictions": predictions(maps, tokenizer),  # (T, k, 2)
    }
    # "<" escaped as \u003c keeps "</script>" in a token from ending the data block early.
    inline = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    parts = {"TITLE": html.escape(f"attention: {maps.prompt!r}"), "DATA": inline}
    return re.sub("__(TITLE|DATA)__", lambda m: parts[m.group(1)], PAGE)  # one pass: no part is rescanned


def save_attention_html(maps: AttentionMaps, tokenizer: Tokenizer, path: str | Path) -> None:
    """Write `attention_page` to `path`."""
    atomic_write_text(Path(path), attention_page(maps, tokenizer))


@dataclass(frozen=True)
class AttentionView:
    """Attention maps as a notebook shows them: the offline page inline (in an iframe, so its script and
    style stay its own), and `save` to an .html page or a .png grid."""

    maps: AttentionMaps
    tokenizer: Tokenizer

    def __repr__(self) -> str:
        m = self.maps
        return (f"AttentionView({len(m.layers)} layer(s) x {len(m.heads)} head(s) over {len(m.labels)} "
                f"tokens of {m.prompt!r}; shown inline in Jupyter, .save('page.html') or .save('grid.png'))")

    def _repr_html_(self) -> str:
        height = 620 + 14 * len(self.maps.labels)  # the page's controls, then a grid that grows with T
        page = html.escape(attention_page(self.maps, self.tokenizer), quote=True)
        return (f'<iframe srcdoc="{page}" sandbox="allow-scripts" style="width:100%;height:{height}px;'
                'border:0" title="attention weights"></iframe>')

    def save(self, path: str | Path) -> Path:
        """Write the page (path ending .html) or the heatmap grid (.png); return the path."""
        path = Path(path)
        if path.suffix.lower() == ".png":
            save_attention_png(self.maps, path)
        elif path.suffix.lower() in (".html", ".htm"):
            save_attention_html(self.maps, self.tokenizer, path)
        else:
            raise ValueError(f"{path}: save attention as FILE.html (the page) or FILE.png (the grid)")
        return path
