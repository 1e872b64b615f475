"""The handout, checked by the library itself: every worked example and stated property of handout #11.

Each check function rebuilds one section's numbers with gptlab's own parts (`attention_scores`,
`masked_softmax`, `attention`, `causal_mask`, `KERNELS`, `CausalSelfAttention`, `MLP`, `NORMS`,
`Block`, `GPT`, `parameter_count`), not with a toy copy of them, and returns `Check`s that state the
handout's expectation, the computed value and whether they agree within an explicit tolerance. This
is the handout's §8 lab, run against the real model. The worked numbers of §2.1-§4.1 and §5's
LayerNorm are functions of any attention function or module (`gptlab.handout.worked`), which `gptlab check`
points at a learner's code. Its general properties (rows sum to one, fused = separate, tying,
permutation equivariance, causality) are the functions of `gptlab.handout.properties`, which `gptlab verify`
runs on trained models too.

The model module is always reached through its name (`M.attention_scores`, ...) so that a test
which monkeypatches `gptlab.model` breaks the lab too: that is how the tests prove the checks bite.

Every check is deterministic on its own: it seeds the global generator inside `torch.random.fork_rng`
(so the caller's random state is untouched and the order of checks does not matter) and computes in
float32 on the CPU.

Shape legend: B batch, T positions, D model width, H heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from gptlab import model as M
from gptlab.config import ModelConfig, parameter_count
from gptlab.handout.properties import (
    Check,
    close,
    differs,
    exceeds,
    fused_and_separate,
    ignores_later_inputs,
    permutation_equivariant,
    tied_head,
)
from gptlab.handout.worked import (
    batch_items_apart,
    head_parameters,
    layer_norm,
    retrieval,
    retrieval_inputs,
    rows_and_columns,
    saturation,
    saturation_inputs,
    score_variance,
    two_head_input,
    two_head_weights,
    two_heads,
)

Section = Callable[[], "list[Check]"]  # one section's checks, seeded on their own


def _seeded(seed: int) -> Callable[[Section], Section]:
    """Run a section with the global generator seeded (module initialisers draw from it) and float32
    as the default dtype, restoring the caller's generator and dtype afterwards."""

    def wrap(check: Section) -> Section:
        @functools.wraps(check)
        def run() -> list[Check]:
            dtype = torch.get_default_dtype()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                torch.set_default_dtype(torch.float32)
                try:
                    return check()
                finally:
                    torch.set_default_dtype(dtype)

        return run

    return wrap


def _small(**changes: object) -> ModelConfig:
    """The lab's tiny model: V=16, D=16, H=2, L=2, T_max=8, no dropout."""
    return ModelConfig.from_dict({"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2,
                                  "n_embd": 16, **changes})


def _random_gpt(seed: int, **changes: object) -> M.GPT:
    """A small GPT whose matrices are redrawn with std 0.25 so that attention is far from uniform.

    At GPT-2's init (std 0.02) every head averages almost uniformly, so a kernel bug such as a missing
    1/sqrt(hs) moves the logits by only ~3e-4, close to a 1e-5 tolerance; with these weights the
    same bug moves them by ~2. Norm gains stay at one.
    """
    torch.manual_seed(seed)
    model = M.GPT(_small(**changes))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.25)
    return model


# ---------------------------------------------------------------------------------------------
# §2-§3: one query, scaling, and the batched matrix operation


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """gptlab's attention as `gptlab.handout.worked` takes it: the outputs only."""
    return M.attention(queries, keys, values)[0]


@_seeded(21)
def check_retrieval() -> list[Check]:
    """§2.1: q = [1, 0] against three keys retrieves y = [2, 1.5], a convex combination of the values."""
    s = "§2.1"
    query, keys, values = retrieval_inputs()  # (1, Tq=1, d_k=2), (1, Tk=3, d_k), (1, Tk, d_v=2)
    fused = M.KERNELS["sdpa"](query[None], keys[None], values[None], None, False)  # (1, 1, 1, d_v)
    return [
        close(s, "scaled scores s", M.attention_scores(query, keys)[0, 0], [math.log(2), 0, 0], 1e-6,
              "[log 2, 0, 0]"),
        *retrieval(_attend),
        close(s, "sdpa kernel output y", fused[0, 0, 0], [2, 1.5], 1e-6, "[2, 1.5]"),
    ]


@_seeded(31)
def check_scaling() -> list[Check]:
    """§3.1: dividing by sqrt(d_k) keeps scores at variance sigma^4 and softmax away from saturation."""
    s = "§3.1"
    raw = torch.tensor([0.0, 8.0])
    query, keys = saturation_inputs()  # (1, 1, d_k=64) and (1, 2, 64): q.k = 0, 8
    return [
        close(s, "softmax of unscaled [0, 8]", M.masked_softmax(raw), [0.000335, 0.999665], 1e-6),
        close(s, "raw q.k at d_k=64", (query @ keys.transpose(-2, -1))[0, 0], [0, 8], 1e-6),
        close(s, "scaled scores at d_k=64", M.attention_scores(query, keys)[0, 0], [0, 1], 1e-6),
        saturation(_attend),
    ] + score_variance(M.attention_scores, sigma=1.5, samples=20000)


@_seeded(32)
def check_batching() -> list[Check]:
    """§3.2: rows of every attention matrix sum to one, columns need not; batch items never mix."""
    x = 3 * torch.randn(2, 6, 8)  # (B, T, D); large enough that routing is far from uniform
    changed = x.clone()
    changed[1] = 3 * torch.randn(6, 8)  # a different batch item 1
    results = []
    for kernel in ("naive", "sdpa"):
        torch.manual_seed(320)  # same weights for both kernels
        attn = M.CausalSelfAttention(ModelConfig(n_embd=8, n_head=2, block_size=8, attention=kernel))
        for causal in (True, False):
            attn.causal = causal
            tag = f"{kernel}, {'masked' if causal else 'unmasked'}"
            if kernel == "naive":  # attention_weights is recomputed explicitly whatever the kernel
                results += rows_and_columns(attn.attention_weights(x), tag)  # weights (B, H, T, T)
            results.append(batch_items_apart(attn, x, changed, tag))
    return results


# ---------------------------------------------------------------------------------------------
# §4: multiple heads


@_seeded(4)
def check_head_parameters() -> list[Check]:
    """§4: at D=8 without biases, attention has 3D^2 + D^2 = 192 + 64 = 256 parameters for any H."""
    results, arithmetic = [], {}
    for n_head in (1, 2, 4, 8):
        config = ModelConfig(vocab_size=16, block_size=8, n_layer=2, n_head=n_head, n_embd=8, bias=False)
        results.append(head_parameters(M.CausalSelfAttention(config), config.n_embd, n_head))
        arithmetic[n_head] = parameter_count(config)["attention"] / config.n_layer
    results.append(Check("§4", "parameter_count / L, D=8", set(arithmetic.values()) == {256},
                         "256 for H = 1, 2, 4, 8", ", ".join(f"H={h}: {n:g}" for h, n in arithmetic.items())))
    return results


def _two_head_module(kernel: str) -> M.CausalSelfAttention:
    """§4.1's heads: D=4, H=2, hs=2, no biases, with gptlab.handout.worked's W_Q, W_K, W_V and W_O = I."""
    config = ModelConfig(vocab_size=4, block_size=3, n_layer=1, n_head=2, n_embd=4, bias=False,
                         attention=kernel)
    attn = M.CausalSelfAttention(config)
    w_q, w_k, w_v, w_o = two_head_weights()  # each (out, in) = (4, 4), as nn.Linear stores them
    with torch.no_grad():
        attn.c_attn.weight.copy_(torch.cat([w_q, w_k, w_v]))  # (3D, D) = [W_Q; W_K; W_V]
        attn.c_proj.weight.copy_(w_o)
    return attn


@_seeded(41)
def check_two_heads() -> list[Check]:
    """§4.1: two heads route the same query differently; concatenation keeps both answers."""
    s = "§4.1"
    x = two_head_input()  # (B=1, T=3, D=4): rows e_0, e_1, e_2
    attn = _two_head_module("naive")
    weights = attn.attention_weights(x)[0, :, 2]  # (H, Tk) at query position 2
    return [
        close(s, "weights of the two heads at position 2", weights,
              [[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]], 1e-6),
        *two_heads(attn(x)[0, 2], " (naive)"),  # (D,) = [head 1 | head 2]
        two_heads(_two_head_module("sdpa")(x)[0, 2], " (sdpa)")[0],  # its output only: names stay unique
        exceeds(s, "both heads weight position 2", weights[:, 2].min().item(), 0.0, "min weight"),
    ]


@_seeded(42)
def check_fused_projection() -> list[Check]:
    """§4.2: one fused projection is three projections; fused heads equal separate heads concatenated.

    Also with grouped key/value heads (n_kv_head < H, a departure from §4), where query head h reads
    key/value head h // (H / n_kv_head).
    """
    s = "§4.2"
    B, T, D, H = 2, 5, 8, 2
    x = torch.randn(B, T, D)
    results = []
    for kernel in ("sdpa", "naive"):
        torch.manual_seed(420)
        attn = M.CausalSelfAttention(ModelConfig(n_embd=D, n_head=H, block_size=8, attention=kernel))
        *projections, (module, heads) = fused_and_separate(attn, x)
        if kernel == "sdpa":  # the projections do not depend on the kernel
            for name, (got, separate) in zip("QKV", projections, strict=True):
                results.append(close(s, f"fused {name} equals its own projection", got, separate, 1e-6,
                                     f"F.linear(x, W_{name}, b_{name}) split into heads"))
            shape = tuple(attn.attention_weights(x).shape)
            results.append(Check(s, "attention weights shape", shape == (B, H, T, T),
                                 "(B, H, T, T) = (2, 2, 5, 5)", str(shape)))
        results.append(close(s, f"separate heads concatenated equal the module ({kernel})", module, heads,
                             1e-6, "c_proj(cat([h(x) for h in heads]))"))
        for n_kv_head in (2, 1):  # four query heads in pairs, then all on one key/value head
            torch.manual_seed(420)
            config = ModelConfig(n_embd=D, n_head=4, n_kv_head=n_kv_head, block_size=8, attention=kernel)
            *_, (module, heads) = fused_and_separate(M.CausalSelfAttention(config), x)
            results.append(close(s, f"grouped heads, H=4, n_kv_head={n_kv_head} ({kernel})", module, heads,
                                 1e-6, "query head h on key/value head h // (H / n_kv_head)"))
    return results


# ---------------------------------------------------------------------------------------------
# §5: LayerNorm works within a token; the FFN's nonlinearity matters


def _affine_residual(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative residual of the best affine map x -> y: ||y - fit|| / ||y - mean(y)||."""
    design = torch.cat([x, torch.ones(len(x), 1)], dim=1).detach().double()  # (N, D + 1): 1 carries bias
    target = y.detach().double()
    fit = design @ torch.linalg.lstsq(design, target).solution
    return ((target - fit).norm() / (target - target.mean(0)).norm()).item()


def _collapse_checks() -> list[Check]:
    """Without its activation the FFN is one affine map; with ReLU or GELU no affine map fits it."""
    s = "§5"
    results = []
    for ffn in ("relu", "gelu"):
        torch.manual_seed(50)
        mlp = M.MLP(ModelConfig(n_embd=8, n_head=2, block_size=8, ffn=ffn))  # PyTorch init: nonzero biases
        w1, b1, w2, b2 = mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias
        x = 3 * torch.randn(4096, 8)  # (N, D); large enough that the activation's bend matters
        linear_only = mlp.c_proj(mlp.c_fc(x))
        results.append(close(s, f"without {ffn}, two linear maps are one", linear_only,
                             x @ (w2 @ w1).T + (w2 @ b1 + b2), 1e-5, "x (W2 W1)^T + (W2 b1 + b2)"))
        results.append(exceeds(s, f"with {ffn}, no affine map fits", _affine_residual(x, mlp(x)), 0.1,
                               "relative residual of the best affine fit"))
        residual = _affine_residual(x, linear_only)
        results.append(Check(s, f"without {ffn}, an affine map fits", residual <= 1e-5,
                             "relative residual <= 1e-5", f"{residual:.1e}"))
    return results


@_seeded(5)
def check_block_parts() -> list[Check]:
    """§5: LayerNorm normalises within a token; without its nonlinearity the FFN collapses to one map."""
    norm = M.NORMS["layernorm"](ModelConfig(n_embd=8, n_head=2, block_size=8))
    return layer_norm(norm) + _collapse_checks()


# ---------------------------------------------------------------------------------------------
# §6: order, positions and the vocabulary head


@_seeded(61)
def check_permutation() -> list[Check]:
    """§6.1: without positions and mask, permuting input rows permutes output rows, nothing more."""
    s = "§6.1"
    idx = torch.randperm(16)[:8].unsqueeze(0)  # (1, T=8) distinct tokens, so every swap moves something
    rows = torch.randn(2, 8, 16)  # (B, T, D)
    unordered = _random_gpt(610, positions="none", causal=False)
    ordered = _random_gpt(611, positions="learned", causal=False)
    torch.manual_seed(612)
    block = M.Block(_small(positions="none", causal=False))
    results = []
    for label, perm in (("swap rows 0 and 2", torch.tensor([2, 1, 0, 3, 4, 5, 6, 7])),
                        ("random permutation", torch.randperm(8))):
        results += [
            permutation_equivariant(f"GPT without positions is equivariant ({label})",
                                    lambda t: unordered(t)[0], idx, perm, 1e-5, "logits(idx)[:, perm]"),
            differs(s, f"... but not invariant ({label})", unordered(idx[:, perm])[0], unordered(idx)[0],
                    1e-3),
            permutation_equivariant(f"one Block is equivariant ({label})", block, rows, perm, 1e-5,
                                    "block(rows)[:, perm]"),
            differs(s, f"learned positions break equivariance ({label})", ordered(idx[:, perm])[0],
                    ordered(idx)[0][:, perm], 1e-3),
        ]
    return results


@_seeded(6)
def check_parameter_sharing() -> list[Check]:
    """§6: learned positions add T_max D parameters, sinusoidal none; a tied head is the embedding."""
    s = "§6"
    T, D, V = 8, 16, 16
    variants: dict[str, dict[str, object]] = {
        "none": {"positions": "none"}, "learned": {}, "sinusoidal": {"positions": "sinusoidal"},
        "untied": {"tied": False}}
    models = {name: M.GPT(_small(**changes)) for name, changes in variants.items()}
    counts = {name: model.num_parameters() for name, model in models.items()}
    arithmetic = {name: parameter_count(model.config)["total"] for name, model in models.items()}
    tied = models["learned"]
    return [
        Check(s, "learned positions add T_max * D", counts["learned"] - counts["none"] == T * D, f"{T * D}",
              f"{counts['learned'] - counts['none']}"),
        Check(s, "sinusoidal positions add nothing", counts["sinusoidal"] == counts["none"], "0",
              f"{counts['sinusoidal'] - counts['none']}"),
        tied_head(tied.config.tied, tied.lm_head.weight, tied.transformer.wte.weight),
        Check(s, "untied head adds V * D", counts["untied"] - counts["learned"] == V * D, f"{V * D}",
              f"{counts['untied'] - counts['learned']}"),
        Check(s, "num_parameters agrees with parameter_count", counts == arithmetic, str(arithmetic),
              str(counts)),
    ]


# ---------------------------------------------------------------------------------------------
# §7: causality and the full numerical trace


def _dependence(model: M.GPT, idx: torch.Tensor) -> torch.Tensor:
    """(T, T) matrix: entry (i, j) is max |d sum(logits_i) / d x_j| over the features of input row j."""
    with torch.enable_grad():
        x = model.embed(idx).detach().requires_grad_()  # (1, T, D) input rows
        logits = model.forward_embeddings(x)  # (1, T, V)
        rows = [torch.autograd.grad(logits[0, i].sum(), x, retain_graph=True)[0][0]  # (T, D)
                for i in range(idx.size(1))]
    return torch.stack(rows).abs().amax(-1)


def _causality_checks(kernel: str) -> list[Check]:
    """§7.1 and §7.3 on a random GPT with one kernel, then with the mask off in all or all but one block."""
    model = _random_gpt(70, attention=kernel)
    idx = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(71))  # (1, T=8)
    before, after = model(idx[:, :7])[0], model(idx)[0][:, :7]  # the prompt, then with a token appended
    dependence = _dependence(model, idx)
    past = dependence.tril().amax(-1).min().item()
    results = [
        close("§7.1", f"appending a token leaves earlier logits unchanged ({kernel})", after, before, 1e-5,
              "logits before appending"),
        ignores_later_inputs(dependence, f"output i ignores inputs after i ({kernel})", "grad"),
        exceeds("§7.3", f"output i uses inputs up to i ({kernel})", past, 0.0,
                "min over i of max |grad| over j <= i"),
    ]
    for block in model.transformer.blocks:
        block.attn.causal = False
    leaks = ("without the mask output 0 sees later inputs", "masking only the final block is not enough")
    for label in leaks:
        leak = _dependence(model, idx)[0, 1:].max().item()
        results.append(exceeds("§7.3", f"{label} ({kernel})", leak, 0.0, "max |grad of output 0| over j > 0"))
        # Then mask only the last block: the first can already copy the future into row 0.
        model.transformer.blocks[-1].attn.causal = True
    return results


@_seeded(7)
def check_causality() -> list[Check]:
    """§7.1, §7.3: earlier logits ignore appended tokens; output i has zero gradient for inputs after i."""
    return _causality_checks("sdpa") + _causality_checks("naive")


def _toy_trace_model() -> M.GPT:
    """§7.4's fixed toy parameters in a real GPT (D=2, one head, no norm, ReLU FFN, untied head)."""
    config = ModelConfig(vocab_size=3, block_size=3, n_layer=1, n_head=1, n_embd=2, norm="none",
                         arrangement="pre", ffn="relu", ffn_mult=1, positions="learned", tied=False,
                         bias=False, attention="naive")
    model = M.GPT(config)
    eye = torch.eye(2)
    # The handout's head has d_k = 1 and scale 1; the library's single head has width hs = D = 2 and
    # scale 1/sqrt(2). So the handout's query/key feature is the first of two (the second is fixed
    # at 0), and W_Q carries a factor sqrt(2) that cancels the library's scale: s_ij = Q_i K_j.
    w_q = torch.tensor([[math.sqrt(2), 0.0], [0.0, 0.0]])  # (out, in): q = [sqrt 2 * x_0, 0]
    w_k = torch.tensor([[math.log(2), 0.0], [0.0, 0.0]])  # k = [log 2 * x_0, 0]
    values = {
        "transformer.wte.weight": [[1.0, 0.0], [0.0, 0.5], [0.5, 0.5]],  # E[A], E[B], E[C]
        "transformer.wpe.weight": [[0.0, 0.0], [0.0, 0.5], [0.5, 0.5]],  # p_0, p_1, p_2
        "transformer.h.0.attn.c_attn.weight": torch.cat([w_q, w_k, eye]),  # [W_Q; W_K; W_V = I]
        "transformer.h.0.attn.c_proj.weight": eye,  # W_O = I
        "transformer.h.0.mlp.c_fc.weight": eye,  # U >= 0, so ReLU(U) = U
        "transformer.h.0.mlp.c_proj.weight": 0.5 * eye,  # H = U + 0.5 U = 1.5 U
        "lm_head.weight": [[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]],  # W_vocab^T, stored (V, D)
    }
    # GPT's init is random (and rescales c_proj), so every parameter must be overwritten.
    names = {name for name, _ in model.named_parameters()}
    assert names == set(values), f"toy trace must set exactly the model's parameters: {names ^ set(values)}"
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.as_tensor(values[name], dtype=param.dtype))
    return model


@_seeded(74)
def check_trace() -> list[Check]:
    """§7.4: the stream A B C (targets B C A) from embeddings to the loss 3.02041."""
    s = "§7.4"
    model = _toy_trace_model()
    block = model.transformer.blocks[0]
    idx, targets = torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, 0]])  # A B C -> B C A
    x = model.embed(idx)  # (1, T=3, D=2)
    q, k, v = block.attn.project(x)  # each (1, H=1, T, hs=2)
    retrieved = block.attn(block.ln_1(x))[0]  # (T, D); W_O = I, so this is the retrieval itself
    u_ref = torch.tensor([[2.0, 0.0], [0.5, 1.5], [1.8, 1.6]], dtype=torch.float64)
    h_ref = 1.5 * u_ref
    logits, loss = model(idx, targets)
    l2 = math.log(2)
    return [
        close(s, "input rows X = E[w] + p", x[0], [[1, 0], [0, 1], [1, 1]], 1e-6),
        close(s, "queries Q (first feature / sqrt 2)", q[0, 0, :, 0] / math.sqrt(2), [1, 0, 1], 1e-6),
        close(s, "keys K (first feature)", k[0, 0, :, 0], [l2, 0, l2], 1e-6, "[log 2, 0, log 2]"),
        close(s, "unused second query/key feature", torch.cat([q[..., 1], k[..., 1]]), torch.zeros(2, 1, 3),
              0.0, "all 0"),
        close(s, "values V = X", v[0, 0], [[1, 0], [0, 1], [1, 1]], 1e-6),
        close(s, "raw scores S (future entries exist)", M.attention_scores(q, k)[0, 0],
              [[l2, 0, l2], [0, 0, 0], [l2, 0, l2]], 1e-6, "Q K^T = [[log 2, 0, log 2], [0, 0, 0], ...]"),
        close(s, "masked weights", block.attn.attention_weights(x)[0, 0],
              [[1, 0, 0], [0.5, 0.5, 0], [0.4, 0.2, 0.4]], 1e-6,
              "[[1, 0, 0], [1/2, 1/2, 0], [2/5, 1/5, 2/5]]"),
        close(s, "row 2 retrieves", retrieved[2], [0.8, 0.6], 1e-6),
        close(s, "U = X + attention", x[0] + retrieved, u_ref, 1e-6),
        close(s, "H = block output = 1.5 U", block(x)[0], h_ref, 1e-6),
        close(s, "logits [h0, h1, -h0 - h1]", logits[0], torch.stack([h_ref[:, 0], h_ref[:, 1],
                                                                      -h_ref.sum(-1)], dim=-1), 1e-6),
        close(s, "mean next-token loss (nats)", loss, torch.tensor(3.0204103, dtype=torch.float64), 1e-5,
              "3.02041 (exactly 3.0204103)"),
    ]


# ---------------------------------------------------------------------------------------------
# §8: the same function written other ways


@_seeded(81)
def check_einsum() -> list[Check]:
    """§8.1: the einsum formulation with named axes equals the library's matmul attention."""
    s = "§8.1"
    results = []
    for axes, shape in (("b", (2,)), ("bh", (2, 3))):  # 3-D batches and 4-D head tensors
        q, k = torch.randn(*shape, 5, 4), torch.randn(*shape, 6, 4)  # (..., Tq, d), (..., Tk, d)
        v = torch.randn(*shape, 6, 3)  # (..., Tk, e)
        scores = torch.einsum(f"{axes}id,{axes}jd->{axes}ij", q, k) / math.sqrt(q.size(-1))
        weights = scores.softmax(dim=-1)
        y = torch.einsum(f"{axes}ij,{axes}je->{axes}ie", weights, v)
        got_y, got_weights = M.attention(q, k, v)
        results.append(close(s, f"einsum weights equal attention's ({len(shape) + 2}-D)", got_weights,
                             weights, 1e-6, f"einsum '{axes}id,{axes}jd->{axes}ij' then softmax"))
        results.append(close(s, f"einsum output equals attention's ({len(shape) + 2}-D)", got_y, y, 1e-6,
                             f"einsum '{axes}ij,{axes}je->{axes}ie'"))
    return results


@_seeded(8)
def check_kernels() -> list[Check]:
    """§8: the fused sdpa kernel computes the same function as the written-out naive kernel."""
    idx = torch.randint(0, 16, (2, 8))  # (B, T)
    results = []
    for causal in (True, False):
        naive = _random_gpt(80, attention="naive", causal=causal)(idx)[0]
        fused = _random_gpt(80, attention="sdpa", causal=causal)(idx)[0]
        results.append(close("§8", f"naive and sdpa kernels agree ({'causal' if causal else 'unmasked'})",
                             fused, naive, 1e-5, "the naive kernel's logits"))
    return results


CHECKS: list[Section] = [  # in handout order
    check_retrieval, check_scaling, check_batching, check_head_parameters, check_two_heads,
    check_fused_projection, check_block_parts, check_permutation, check_parameter_sharing, check_causality,
    check_trace, check_einsum, check_kernels,
]


def run_lab() -> list[Check]:
    """Run every check, in handout order; each is seeded on its own, so the order does not matter."""
    return [result for check in CHECKS for result in check()]
