"""An SAE as SAELens's plain files, so `sae_lens.SAE.load_from_disk(DIR)` loads it: `cfg.json` and
`sae_weights.safetensors`. gptlab writes these files itself (it never imports sae_lens) and reads its own
SAEs back from them, so the weights exist once.

The layout is SAELens 6's (the one `SAE.load_from_disk` reads since 6.0, checked in the tests against the
version pinned by gptlab's `sae` extra):

- `sae_weights.safetensors`: W_enc (D, F), b_enc (F,), W_dec (F, D), b_dec (D,), float32.
- `cfg.json`: "architecture" "topk" with its "k"; "d_in" D and "d_sae" F; the default behaviour that
  `sae.SparseAutoencoder` computes (b_dec subtracted from the input, no normalisation, no reshaping,
  no rescaling by decoder norms); and "metadata" with SAELens's names: "hook_name" (the hook point, as
  gptlab's hooks name it, e.g. h.1.resid_post), "model_name", "context_size", "prepend_bos" (false: gptlab's
  runs put no BOS token first), "dataset_path" and "sae_lens_version", the layout's version, which tells
  SAELens not to convert the file as one from before 6.0.

Hooks keep gptlab's names: SAELens's own hooked models (TransformerLens) call the same value
`blocks.1.hook_resid_post`, so an SAE from here is used with gptlab's model, or after renaming the site.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab.files import atomic_write, atomic_write_text
from gptlab.sae.model import SparseAutoencoder

WEIGHTS, CONFIG = "sae_weights.safetensors", "cfg.json"
LAYOUT_VERSION = "6.0.0"  # SAELens's version whose cfg.json layout these files follow
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec")
# What SAELens may say for the behaviour gptlab's TopK SAE has; anything else is refused on reading.
DEFAULTS = {"apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
            "rescale_acts_by_decoder_norm": False}


@dataclass(frozen=True)
class Provenance:
    """Where an SAE's activations came from, as SAELens's metadata names it."""

    hook_name: str  # the site, e.g. h.1.resid_post
    model_name: str  # the run folder's name
    context_size: int  # the model's block_size: the windows the activations were read in
    dataset_path: str  # the data the windows were drawn from


def saelens_config(sae: SparseAutoencoder, provenance: Provenance) -> dict[str, Any]:
    """The cfg.json SAELens reads for this SAE."""
    metadata = {"sae_lens_version": LAYOUT_VERSION, "hook_name": provenance.hook_name,
                "hook_head_index": None, "model_name": provenance.model_name,
                "context_size": provenance.context_size, "prepend_bos": False,
                "dataset_path": provenance.dataset_path}
    return {"architecture": "topk", "d_in": sae.d_in, "d_sae": sae.width, "k": sae.k, "dtype": "float32",
            "device": "cpu", **DEFAULTS, "metadata": metadata}


def write_saelens(sae: SparseAutoencoder, folder: Path, provenance: Provenance) -> None:
    """Write the SAE's weights and cfg.json into `folder`, each file atomically."""
    tensors = {name: getattr(sae, name).detach().float().cpu().contiguous() for name in TENSORS}
    atomic_write(folder / WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    atomic_write_text(folder / CONFIG, json.dumps(saelens_config(sae, provenance), indent=2) + "\n")


def read_saelens(folder: Path) -> tuple[SparseAutoencoder, Provenance]:
    """The TopK SAE stored in `folder` as SAELens files, and where its activations came from; a folder
    without them, or one with another architecture or behaviour, is a ValueError naming the file."""
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS))
    except FileNotFoundError as err:
        raise ValueError(f"{folder} holds no SAE ({err.filename} is missing): train one with gptlab sae "
                         "train") from None
    except (ValueError, SafetensorError) as err:  # not JSON, or not a safetensors file
        raise ValueError(f"{folder} holds a damaged SAE ({err}): train it again") from None
    if config.get("architecture") != "topk" or any(config.get(k, v) != v for k, v in DEFAULTS.items()):
        raise ValueError(f"{folder / CONFIG} describes a {config.get('architecture')} SAE with settings "
                         f"gptlab does not compute; gptlab reads TopK SAEs with {DEFAULTS}")
    sae = SparseAutoencoder(int(config["d_in"]), int(config["d_sae"]), int(config["k"]))
    try:
        sae.load_state_dict(tensors)
    except RuntimeError as err:
        raise ValueError(f"{folder / WEIGHTS} does not fit {folder / CONFIG} ({str(err).splitlines()[-1]})"
                         ) from None
    meta = config.get("metadata", {})
    provenance = Provenance(str(meta.get("hook_name")), str(meta.get("model_name")),
                            int(meta.get("context_size") or 0), str(meta.get("dataset_path")))
    return sae.eval(), provenance
