"""Look inside a trained model (handout §2.2): hook points, attention maps, ablations, interventions, checks.

- `hooks`: named hook points on intermediate values, registered by a context manager that always
  removes them; attention weights recomputed beside the fast kernel, for the layers and heads asked for.
- `attention_view`: attention weights of a prompt as a PNG grid or an interactive, offline HTML page.
- `cross_attention`: an encoder-decoder's cross-attention: where each answer token read the source.
- `interventions`: remove heads or edit the prompt, and measure the prediction (the causal test).
- `verify`, `verify_seq2seq`: the handout's properties (`gptlab.checks`) measured on a trained model.
"""

from gptlab.inspection.attention_view import (
    AttentionMaps,
    attention_maps,
    save_attention_html,
    save_attention_png,
)
from gptlab.inspection.cross_attention import (
    CrossAttentionMaps,
    cross_attention_maps,
    save_cross_attention_png,
)
from gptlab.inspection.hooks import hook_points, hooked, recompute_attention, record
from gptlab.inspection.interventions import (
    Ablation,
    HeadEffect,
    Intervention,
    ablate_heads,
    edit_tokens,
    intervene,
    save_ablation_png,
)
from gptlab.inspection.verify import verify_model

__all__ = [
    "Ablation",
    "AttentionMaps",
    "CrossAttentionMaps",
    "HeadEffect",
    "Intervention",
    "ablate_heads",
    "attention_maps",
    "cross_attention_maps",
    "edit_tokens",
    "hook_points",
    "hooked",
    "intervene",
    "recompute_attention",
    "record",
    "save_ablation_png",
    "save_attention_html",
    "save_attention_png",
    "save_cross_attention_png",
    "verify_model",
]
