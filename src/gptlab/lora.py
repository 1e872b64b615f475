"""LoRA (low-rank adaptation): train a small update B A beside each frozen projection, merge it, export it.

A LoRA layer computes y = W x + b + (alpha / r) * B A dropout(x), with A (r, in) and B (out, r). A starts
Kaiming-uniform (as PEFT and nn.Linear do) and B at zero, so a fresh adapter leaves the logits unchanged;
only A and B train. Reference: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models".

Deliberate choices:
- `LoraLinear` *is* an nn.Linear holding the base layer's own weight and bias Parameters, so the base
  tensors keep their names (`...attn.c_attn.weight`) and a run's base weights load unchanged; the
  adapter adds `...c_attn.lora_A.weight` and `...c_attn.lora_B.weight`.
- Targets are module-name patterns (fnmatch), matched against the full dotted name or its tail after a
  dot: `c_proj` is both projections, `attn.c_proj` only attention's, `h.0.*` every linear of block 0.
  The default names the attention and FFN projections; those a model lacks (c_gate in a GELU FFN) are
  skipped, while a pattern the user chose must match something.

New tokens (chat markers a tokenizer gained, `gptlab.adapt.chat`) get rows in the embedding and an untied
head (`grow_embeddings`). Under LoRA those rows, and only those, train (`add_trainable_tokens`, PEFT's
"trainable tokens"): `TokenRowsEmbedding` and `TokenRowsHead` keep the base's whole weight frozen and
hold the new rows as the Parameter `token_rows`, saved with the adapters (`...wte.token_rows`, and
`lm_head.token_rows` when the head is untied; a tied head reads the embedding's).

The PEFT export of an adapter is `gptlab.interop.peft`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import Config, SettingError, check_positive, option
from gptlab.model import GPT

# The attention projections (fused QKV, W_O) and the FFN's (up, gate, down) of every block.
DEFAULT_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_gate", "mlp.c_proj")


@dataclass
class LoraConfig(Config):
    """Rank, scale, dropout and target layers of the adapters (Hu et al. 2021, §4)."""

    r: int = option(8, "rank r of each adapter: A is (r, in), B is (out, r)")
    alpha: float = option(16.0, "scale numerator: the update B A is multiplied by alpha / r")
    dropout: float = option(0.0, "dropout on the adapter's input only, in [0, 1)")
    targets: tuple[str, ...] = option(DEFAULT_TARGETS, "module-name patterns of the linear layers to adapt "
                                      "(fnmatch, matched on the name or its tail, e.g. c_proj or h.0.*)")

    def validate(self) -> None:
        owner = "LoraConfig"
        check_positive(owner, r=self.r, alpha=self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{owner}.dropout={self.dropout} must be in [0, 1)")
        if not self.targets or not all(t.strip() for t in self.targets):
            raise ValueError(f"{owner}.targets={list(self.targets)!r} must name at least one layer, "
                             f"with no empty pattern (default: {', '.join(DEFAULT_TARGETS)})")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoraLinear(nn.Linear):
    """A frozen nn.Linear plus the low-rank update (alpha / r) B A; `enabled=False` is the base layer."""

    def __init__(self, base: nn.Linear, config: LoraConfig) -> None:
        # Built on the meta device, then handed the base layer's own Parameters: nothing is copied, and a
        # weight shared elsewhere stays shared.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        kind = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, config.r, bias=False, **kind)  # A, (r, in)
        self.lora_B = nn.Linear(config.r, base.out_features, bias=False, **kind)  # B, (out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default, nn.Linear's too
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the update starts at exactly zero
        self.dropout = nn.Dropout(config.dropout)
        self.r, self.scaling = config.r, config.scaling
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        y = F.linear(x, self.weight, self.bias)  # the base layer's computation, bit for bit
        if not self.enabled:
            return y
        # y + scaling * B A x in one op (no scaled temporary as wide as y), through (..., r)
        return torch.add(y, self.lora_B(self.lora_A(self.dropout(x))), alpha=self.scaling)

    def delta(self) -> torch.Tensor:
        """The update (alpha / r) B A as a weight (out, in), computed in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Every LoRA layer of the model by module name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def add_lora(model: GPT, config: LoraConfig) -> GPT:
    """Wrap the target linear layers in LoRA layers and freeze every other weight; returns the model."""
    if lora_layers(model):
        raise ValueError("this model already has LoRA adapters: merge them (merge_lora) or start from "
                         "the base model")
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    chosen = [name for name in linears if any(_matches(name, t) for t in config.targets)]
    required = [] if config.targets == DEFAULT_TARGETS else config.targets
    unmatched = [t for t in required if not any(_matches(name, t) for name in linears)]
    if unmatched or not chosen:
        tails = sorted({name.split(".", 3)[-1] for name in linears})
        raise ValueError(f"LoRA target(s) {', '.join(unmatched or config.targets)} match no linear layer of "
                         f"this model; its linear layers are: {', '.join(tails)}")
    if model.config.tied and "lm_head" in chosen:
        raise ValueError("lm_head shares its weight with the token embedding (tied): an adapter on it would "
                         "change the embedding when merged; leave lm_head out of the targets")
    narrowest = min(chosen, key=lambda name: min(linears[name].in_features, linears[name].out_features))
    rank = min(linears[narrowest].in_features, linears[narrowest].out_features)
    if config.r > rank:  # B A has rank at most min(in, out): more adds parameters, not capacity
        raise SettingError(f"{{r}} {config.r} is larger than the adapted layer {narrowest} allows "
                           f"({linears[narrowest].in_features} -> {linears[narrowest].out_features}): "
                           f"choose a rank of at most {rank}", r="LoraConfig.r")
    model.requires_grad_(False)
    for name in chosen:
        _replace(model, name, LoraLinear(linears[name], config))  # only A and B require grad
    return model


def trainable_parameters(model: nn.Module) -> int:
    """How many numbers an optimiser would update (parameters with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_lora_tensor(name: str) -> bool:
    """True for an adapter tensor's name (`...lora_A.weight`, `...lora_B.weight`, new tokens'
    `...token_rows`), False for a base one."""
    return name.endswith((".lora_A.weight", ".lora_B.weight", ".token_rows"))


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (A and B of every LoRA layer, new tokens' rows), detached copies: a small
    adapter file."""
    return {name: t.detach().clone() for name, t in model.state_dict().items() if is_lora_tensor(name)}


def load_lora_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into the model's LoRA layers; every one must be given, with its shape."""
    ours = {name: t for name, t in model.state_dict().items() if is_lora_tensor(name)}
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    wrong = [f"{n} {tuple(state[n].shape)} (the model has {tuple(t.shape)})"
             for n, t in ours.items() if n in state and state[n].shape != t.shape]
    if missing or unexpected or wrong:
        raise ValueError(f"these adapter weights do not fit the model's LoRA layers (same targets and rank "
                         f"needed): missing {missing}, unexpected {unexpected}, wrong shape {wrong}")
    with torch.no_grad():
        for name, tensor in ours.items():
            tensor.copy_(state[name])


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the model as its base inside the block (every LoRA layer computes W x + b only, and new tokens
    read their base rows)."""
    layers = [*lora_layers(model).values(), *token_row_layers(model).values()]
    before = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer, enabled in zip(layers, before, strict=True):
            layer.enabled = enabled


def merge_lora(model: GPT) -> GPT:
    """Fold (alpha / r) B A into each W and new tokens' rows into their weights, and put plain layers back;
    every weight trains again.

    The sum is formed in float32 and rounded once to W's dtype, so the merged logits differ from the
    adapted ones only by float rounding (W x + s B A x is summed in a different order).
    """
    for name, layer in lora_layers(model).items():
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        with torch.no_grad():
            layer.weight.copy_((layer.weight.float() + layer.delta()).to(layer.weight.dtype))
        plain.weight, plain.bias = layer.weight, layer.bias  # the same Parameters, now updated
        _replace(model, name, plain)
    for name, rows in token_row_layers(model).items():
        if rows.token_rows is not None:  # a tied head's rows are the embedding's, copied in with them
            with torch.no_grad():
                rows.weight.index_copy_(0, rows.ids, rows.token_rows.to(rows.weight.dtype))
        _replace(model, name, rows.plain())
    return model.requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# New tokens: their rows in the embedding and the head, and training only those under LoRA


def grow_embeddings(model: GPT, new_ids: Sequence[int], mean_of: int) -> GPT:
    """A model whose embedding (and untied head) has a row for each of `new_ids`, set to the mean of the
    first `mean_of` rows (the old tokenizer's ids); every other row is unchanged, so are old ids' logits."""
    config = model.config.replace(vocab_size=max(model.config.vocab_size, max(new_ids) + 1))
    state = model.state_dict()
    for name in ("transformer.wte.weight", "lm_head.weight"):  # the same tensor twice when tied
        old = state[name]  # (V_old, D)
        rows = torch.cat([old, old.new_zeros(config.vocab_size - old.size(0), old.size(1))])  # (V, D)
        rows[list(new_ids)] = old[:mean_of].mean(dim=0)
        state[name] = rows
    grown = GPT(config).to(device=old.device, dtype=old.dtype)
    grown.load_state_dict(state)
    return grown.train(model.training)


def _token_ids(ids: Sequence[int], weight: torch.Tensor) -> torch.Tensor:
    """The new tokens' ids as a tensor beside `weight`, checked to be distinct rows of it."""
    assert len(set(ids)) == len(ids) and all(0 <= i < weight.size(0) for i in ids), \
        f"new token ids {list(ids)} must be distinct rows of the {weight.size(0)}-row weight"
    return torch.tensor(list(ids), dtype=torch.long, device=weight.device)


class TokenRowsEmbedding(nn.Embedding):
    """A frozen embedding whose rows for the new tokens' `ids` are the trainable Parameter `token_rows`."""

    ids: torch.Tensor  # (N,) the new tokens' ids
    slots: torch.Tensor  # (V,) each id's row of token_rows, -1 for an old id

    def __init__(self, base: nn.Embedding, ids: Sequence[int]) -> None:
        # Given the base's weight to wrap, nn.Embedding draws no initial one (a normal_ on the meta device
        # costs seconds the first time); the assignment keeps the very Parameter, so a tied head shares it.
        super().__init__(base.num_embeddings, base.embedding_dim, _weight=base.weight)
        self.weight = base.weight  # frozen; its rows for `ids` are not read while the layer is enabled
        self.weight.requires_grad_(False)
        self.register_buffer("ids", _token_ids(ids, self.weight), persistent=False)
        self.token_rows = nn.Parameter(self.weight.detach()[self.ids].clone())  # (N, D), from the base's
        slots = torch.full((self.num_embeddings,), -1, dtype=torch.long, device=self.weight.device)
        slots[self.ids] = torch.arange(len(ids), device=self.weight.device)
        self.register_buffer("slots", slots, persistent=False)
        self.enabled = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, D)
        rows = F.embedding(idx, self.weight)  # the base's rows, bit for bit
        if not self.enabled:
            return rows
        slot = self.slots[idx]  # (B, T)
        new = F.embedding(slot.clamp(min=0), self.token_rows)  # (B, T, D)
        return torch.where((slot >= 0).unsqueeze(-1), new, rows)  # gradient reaches token_rows only

    def plain(self) -> nn.Embedding:
        """A plain nn.Embedding holding this layer's weight Parameter."""
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=self.weight)
        plain.weight = self.weight  # the very Parameter (the constructor wraps a new one around its data)
        return plain


class TokenRowsHead(nn.Linear):
    """A frozen vocabulary head whose rows for the new tokens' `ids` train: its own `token_rows` when
    untied; when tied, the embedding's, held outside the module tree so that they are saved once."""

    ids: torch.Tensor  # (N,) the new tokens' ids

    def __init__(self, base: nn.Linear, ids: Sequence[int], tied_to: TokenRowsEmbedding | None) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        self.register_buffer("ids", _token_ids(ids, self.weight), persistent=False)
        self._tied = [tied_to] if tied_to is not None else []  # a list: not a submodule
        self.token_rows = (None if tied_to is not None
                           else nn.Parameter(self.weight.detach()[self.ids].clone()))  # (N, D)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., V)
        logits = F.linear(x, self.weight, self.bias)  # the base's logits, bit for bit
        if not self.enabled:
            return logits
        rows = self._tied[0].token_rows if self._tied else self.token_rows
        assert rows is not None, "an untied head holds its own rows"
        bias = None if self.bias is None else self.bias[self.ids]
        return logits.index_copy(-1, self.ids, F.linear(x, rows, bias))  # the new ids' logits (..., N)

    def plain(self) -> nn.Linear:
        """A plain nn.Linear holding this layer's weight and bias Parameters."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        return plain


def token_row_layers(model: nn.Module) -> dict[str, TokenRowsEmbedding | TokenRowsHead]:
    """The new tokens' layers of the model by module name (the embedding, then the head), or none."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TokenRowsEmbedding | TokenRowsHead)}


def add_trainable_tokens(model: GPT, ids: Sequence[int]) -> GPT:
    """Let the embedding and head rows of the new tokens' `ids` train, every other row of them frozen
    (PEFT's trainable tokens); a fresh one leaves the logits unchanged. Returns the model."""
    if token_row_layers(model):
        raise ValueError("this model's new tokens already train: merge them (merge_lora) first")
    if isinstance(model.lm_head, LoraLinear):
        raise ValueError("lm_head has a LoRA adapter, and the new tokens' rows of it would train beside it: "
                         "leave lm_head out of the LoRA targets")
    embedding = TokenRowsEmbedding(model.transformer.wte, ids)
    model.transformer.wte = embedding
    model.lm_head = TokenRowsHead(model.lm_head, ids, embedding if model.config.tied else None)
    return model
