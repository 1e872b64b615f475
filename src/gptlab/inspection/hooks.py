"""Named hook points on a GPT's intermediate values, added and always removed by a context manager.

Handout §2.2: to understand a prediction, look at the routing (attention weights) and, better, change
an intermediate value and watch the prediction move. Both need access to values inside the forward
pass. gptlab gets it from PyTorch's forward hooks and forward pre-hooks on the model's existing
modules, so the model stays a plain `nn.Module`, nothing changes in `model.py`, and a model with no
hooks registered runs exactly as before (hooks cost nothing until `hooked` registers them).

Hook points are named after module paths, without the `transformer.` prefix:

| name               | value                                                | shape          | replaceable |
|--------------------|------------------------------------------------------|----------------|-------------|
| `embed`            | input rows X = E[w] + p + n-gram rows (`transformer.drop`'s output) | (B, T, D) | yes |
| `h.N.resid_pre`    | the residual stream entering block N                 | (B, T, D)      | yes |
| `h.N.attn.in`      | attention's input (LN_1 output in pre-norm models)   | (B, T, D)      | yes |
| `h.N.attn.scores`  | raw scores s = q k^T / sqrt(hs), future included     | (B, H', T, T)  | no  |
| `h.N.attn.weights` | normalised, masked weights a                         | (B, H', T, T)  | no  |
| `h.N.attn.heads`   | every head's output before W_O (input of `c_proj`)   | (B, T, H, hs)  | yes |
| `h.N.attn.out`     | attention's output after W_O                         | (B, T, D)      | yes |
| `h.N.mlp.out`      | the feed-forward network's output (not in ffn="none") | (B, T, D)     | yes |
| `h.N.resid_post`   | the residual stream leaving block N                  | (B, T, D)      | yes |

Scores and weights are not values of the forward pass: the fast `sdpa` kernel never materialises
them. They are recomputed beside it, from attention's input, only for the layers whose points are
asked for and only for the heads given (H' of them), so the logits are bit-identical with and without
inspection. Being recomputed, they cannot be replaced: replace `h.N.attn.heads` instead.

A hook is `fn(value, name)`; returning a tensor of the same shape replaces the value (for example to
ablate a head), returning None leaves it. Shape legend: B batch, T positions, D width, H heads,
hs head size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from gptlab.model import GPT, CausalSelfAttention, attention_scores, causal_mask, masked_softmax, shared_keys

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]

# Per-block points, in the order their hooks are registered (and run) within a block.
BLOCK_POINTS = ("resid_pre", "attn.in", "attn.scores", "attn.weights", "attn.heads", "attn.out", "mlp.out",
                "resid_post")
RECOMPUTED = ("attn.scores", "attn.weights")


def block_points(model: GPT) -> tuple[str, ...]:
    """The points of each of `model`'s blocks: an attention-only model (ffn="none") has no `mlp.out`."""
    return tuple(p for p in BLOCK_POINTS if p != "mlp.out") if model.config.ffn == "none" else BLOCK_POINTS


def hook_points(model: GPT) -> list[str]:
    """Every hook point name of `model`, in the order the forward pass reaches them."""
    points = block_points(model)
    return ["embed"] + [f"h.{n}.{point}" for n in range(model.config.n_layer) for point in points]


def parse_point(model: GPT, name: str) -> tuple[int | None, str]:
    """(layer, point) of a hook point name, `embed` giving (None, "embed"); a ValueError names the fix."""
    if name == "embed":
        return None, "embed"
    prefix, _, point = name.partition(".")
    layer, _, point = point.partition(".")
    n = int(layer) if layer.isdigit() else model.config.n_layer
    if prefix == "h" and layer == str(n) and point in block_points(model) and n < model.config.n_layer:
        return n, point  # only the canonical spelling: "h.01" would miss its place in hook_points
    raise ValueError(
        f"unknown hook point {name!r}: use 'embed' or 'h.N.POINT' with N in 0..{model.config.n_layer - 1} "
        f"and POINT one of {', '.join(block_points(model))}"
    )


def recompute_attention(
    attn: CausalSelfAttention, x: torch.Tensor, heads: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and weights (B, H', T, T) of the chosen heads (default all) from attention's input (B, T, D)."""
    q, k, _ = attn.project(x)  # positions 0 .. T-1 as in a forward without a cache
    k = shared_keys(k, attn.n_head)  # (B, H, T, hs): a grouped key head once per query head it serves
    if heads is not None:
        q, k = q[:, list(heads)], k[:, list(heads)]  # (B, H', T, hs)
    scores = attention_scores(q, k)  # (B, H', T, T)
    mask = causal_mask(q.size(-2), k.size(-2), q.device) if attn.causal else None
    return scores, masked_softmax(scores, mask)


def _apply(fn: HookFn, value: torch.Tensor, name: str) -> torch.Tensor | None:
    """Call a hook; check that a replacement keeps the value's shape."""
    new = fn(value, name)
    if new is not None and new.shape != value.shape:
        raise ValueError(f"hook for {name} returned shape {tuple(new.shape)}; "
                         f"it must keep {tuple(value.shape)}")
    return new


def _output_hook(fn: HookFn, name: str) -> Callable:
    """A forward hook passing a module's output to fn (a returned tensor replaces the output)."""
    return lambda module, args, output: _apply(fn, output, name)


def _input_hook(fn: HookFn, name: str) -> Callable:
    """A forward pre-hook passing a module's first input to fn (a returned tensor replaces it)."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        new = _apply(fn, args[0], name)
        return None if new is None else (new, *args[1:])

    return hook


def _heads_hook(fn: HookFn, name: str, n_head: int) -> Callable:
    """A pre-hook on W_O (c_proj): its input, the concatenated heads, seen per head."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        B, T, D = args[0].shape
        new = _apply(fn, args[0].view(B, T, n_head, D // n_head), name)  # (B, T, H, hs)
        return None if new is None else (new.reshape(B, T, D), *args[1:])

    return hook


def _routing_hook(fns: Mapping[str, HookFn], layer: int, heads: Sequence[int] | None) -> Callable:
    """A pre-hook on attention that recomputes its scores and weights for the points asked for."""

    def hook(attn: CausalSelfAttention, args: tuple) -> None:
        if len(args) > 1 and args[1] is not None:
            raise ValueError("attention scores and weights are recomputed for whole sequences only: "
                             "run the model without a KV cache while recording them")
        scores, weights = recompute_attention(attn, args[0], heads)
        for point, value in (("attn.scores", scores), ("attn.weights", weights)):
            name = f"h.{layer}.{point}"
            if name in fns and fns[name](value, name) is not None:
                raise ValueError(f"{name} is recomputed beside the fast kernel and cannot be replaced: "
                                 f"replace h.{layer}.attn.heads instead")

    return hook


def _register(model: GPT, name: str, fn: HookFn) -> torch.utils.hooks.RemovableHandle:
    """Register one hook point other than scores and weights."""
    layer, point = parse_point(model, name)
    if layer is None:
        return model.transformer.drop.register_forward_hook(_output_hook(fn, name))
    block = model.transformer.blocks[layer]
    if point == "resid_pre":
        return block.register_forward_pre_hook(_input_hook(fn, name))
    if point == "attn.in":
        return block.attn.register_forward_pre_hook(_input_hook(fn, name))
    if point == "attn.heads":
        return block.attn.c_proj.register_forward_pre_hook(_heads_hook(fn, name, model.config.n_head))
    module = {"attn.out": block.attn, "mlp.out": block.mlp, "resid_post": block}[point]
    assert module is not None, "parse_point offers mlp.out only where the block has an FFN"
    return module.register_forward_hook(_output_hook(fn, name))


@contextlib.contextmanager
def hooked(model: GPT, fns: Mapping[str, HookFn], heads: Sequence[int] | None = None) -> Iterator[GPT]:
    """Run `fns` at their hook points during every forward pass inside the block; always unhook after.

    `heads` limits the recomputed scores and weights to those heads (default: all).
    """
    order = {name: i for i, name in enumerate(hook_points(model))}
    points = {name: parse_point(model, name) for name in fns}  # unknown names fail before any registers
    routing = {layer for layer, point in points.values() if point in RECOMPUTED}
    handles = []
    try:
        for name in sorted(fns, key=order.__getitem__):  # forward order, so attn.in runs before routing
            layer, point = points[name]
            if point not in RECOMPUTED:
                handles.append(_register(model, name, fns[name]))
            elif layer is not None and layer in routing:  # one recomputation per layer: scores and weights
                routing.discard(layer)
                attn = model.transformer.blocks[layer].attn
                handles.append(attn.register_forward_pre_hook(_routing_hook(fns, layer, heads)))
        yield model
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def record(
    model: GPT, names: Sequence[str], heads: Sequence[int] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Collect the values at `names` (detached) into the yielded dict; a later forward overwrites them."""
    store: dict[str, torch.Tensor] = {}

    def keep(value: torch.Tensor, name: str) -> None:
        store[name] = value.detach()

    with hooked(model, {name: keep for name in names}, heads):
        yield store


def recorded_inputs(modules: Sequence[nn.Module], run: Callable[[], object]) -> list[tuple]:
    """The positional inputs each module received during `run()` (its last call), by pre-hooks always removed.

    For models without GPT's hook point names, such as the encoder-decoder.
    """
    inputs: dict[nn.Module, tuple] = {}
    handles = [m.register_forward_pre_hook(lambda module, args: inputs.__setitem__(module, args))
               for m in modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return [inputs[m] for m in modules]
