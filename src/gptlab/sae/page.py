"""The features page of an SAE: each feature's top-activating contexts on held-out text, as one offline
HTML file (data, script and style inline, nothing fetched), like the attention page.

For every feature the page shows how often it fires on the held-out tokens, its largest activation, the
tokens its decoder direction raises most when read straight through the unembedding (the direct path
only: it ignores the layers after the site and the final norm), and its CONTEXTS strongest activations,
each with the tokens around it shaded by the feature's activation there. A feature's meaning is a guess
made from such contexts; test it, e.g. by patching or ablating it.

The page is built from static/sae.html, .css and .js; `save` fills __TITLE__ and __DATA__, JSON with every
"<" escaped. Shape legend: B windows, T positions, D width, F features, N = B*T tokens, V vocabulary.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import torch

from gptlab.files import atomic_write_text
from gptlab.inspection.page import static_text
from gptlab.inspection.tokens import token_label
from gptlab.model import GPT
from gptlab.sae.model import SparseAutoencoder
from gptlab.text.tokenizer import Tokenizer

CONTEXTS = 8  # strongest activations shown per feature
BEFORE, AFTER = 15, 4  # tokens shown before and after each one
PROMOTED = 5  # tokens listed that a feature's direction raises most


def page_template() -> str:
    """sae.html with its style and script inlined; __TITLE__ and __DATA__ are left to fill."""
    slots = {"STYLE": static_text("sae.css", "</style"), "SCRIPT": static_text("sae.js", "</script")}
    return re.sub("__(STYLE|SCRIPT)__", lambda m: slots[m.group(1)], static_text("sae.html", None))


@torch.no_grad()
def sparse_codes(sae: SparseAutoencoder, x: torch.Tensor,
                 chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The active features of each token of x (N, D): their activations and ids, both (N, k), on the CPU."""
    values, ids = [], []
    for part in x.split(chunk):
        top = sae.pre_activations(part).topk(sae.k, dim=-1)
        values.append(top.values.relu().cpu())
        ids.append(top.indices.cpu())
    return torch.cat(values), torch.cat(ids)


def strongest(values: torch.Tensor, ids: torch.Tensor, width: int) -> tuple[list[torch.Tensor], list[int]]:
    """For each feature, the tokens (flat indices into N) of its CONTEXTS largest positive activations,
    strongest first; and how many tokens it is active on."""
    tokens = torch.arange(len(ids)).repeat_interleave(ids.size(1))  # (N*k,)
    values, ids = values.flatten(), ids.flatten()
    keep = values > 0
    values, ids, tokens = values[keep], ids[keep], tokens[keep]
    by_value = values.argsort(descending=True)
    order = by_value[ids[by_value].argsort(stable=True)]  # by feature, strongest first within each
    counts = torch.bincount(ids, minlength=width).tolist()
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    return [tokens[order[starts[f] : starts[f] + min(counts[f], CONTEXTS)]] for f in range(width)], counts


def feature_rows(model: GPT, sae: SparseAutoencoder, inputs: torch.Tensor, x: torch.Tensor,
                 tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """One dict per feature: id, frequency, max, promoted tokens and contexts (ids, activations, at)."""
    T = inputs.size(1)
    values, ids = sparse_codes(sae, x)  # (N, k) each
    flat_inputs = inputs.flatten()  # (N,)
    unembedding = model.lm_head.weight.detach()[: tokenizer.vocab_size]  # (V, D), without padding rows
    promoted = (sae.W_dec.detach() @ unembedding.T).cpu().topk(min(PROMOTED, len(unembedding)), dim=-1)
    tops, counts = strongest(values, ids, sae.width)
    rows = []
    for feature, tokens in enumerate(tops):
        contexts = []
        for token in tokens.tolist():
            window_start = token - token % T  # a context stays inside its window
            lo, hi = max(window_start, token - BEFORE), min(window_start + T, token + AFTER + 1)
            activation = ((ids[lo:hi] == feature) * values[lo:hi]).sum(-1)  # (hi - lo,)
            contexts.append({"ids": flat_inputs[lo:hi].tolist(), "at": token - lo,
                             "acts": [round(float(a), 3) for a in activation]})
        pairs = zip(promoted.values[feature].tolist(), promoted.indices[feature].tolist(), strict=True)
        rows.append({"id": feature, "frequency": counts[feature] / len(x),
                     "max": contexts[0]["acts"][contexts[0]["at"]] if contexts else 0.0,
                     "promotes": [[token_label(tokenizer, t), round(v, 3)] for v, t in pairs],
                     "contexts": contexts})
    return rows


def write_feature_page(model: GPT, tokenizer: Tokenizer, sae: SparseAutoencoder, site: str,
                       inputs: torch.Tensor, x: torch.Tensor, path: str | Path, title: str) -> None:
    """Write the features page of `sae` at `site` on the held-out windows `inputs` (B, T), whose
    activations there are x (B*T, D), to `path`."""
    rows = feature_rows(model, sae, inputs, x, tokenizer)
    used = sorted({i for row in rows for context in row["contexts"] for i in context["ids"]})
    data = {"title": title, "site": site, "tokens": len(x), "k": sae.k,
            "labels": {str(i): token_label(tokenizer, i) for i in used}, "features": rows}
    inline = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # no "</script>" in the data
    parts = {"TITLE": html.escape(title), "DATA": inline}
    page = re.sub("__(TITLE|DATA)__", lambda m: parts[m.group(1)], page_template())
    atomic_write_text(Path(path), page)
