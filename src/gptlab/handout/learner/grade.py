"""`grade`: every handout check that applies to what a learner's module defines, each failure with its cause.

What is checked, by kind of definition (names overridable through `Names`):
- `attention(q, k, v[, mask])`, returning y or (y, weights), batched or one matrix at a time: §2.1
  retrieval [2, 1.5]; §3.1 the weights at d_k = 64 and the score variance at d_k = 4, 64, 1024;
  §3.2 rows sum to one and columns do not, batch items do not mix, rank-3 and rank-4 inputs (the
  `.T` trap), returned weights are the ones applied; with a mask argument (bool either way round,
  additive, 0/1, or a causal flag, found by behaviour) §3.2 masked rows and §7.3 output i ignores
  every input after i.
- `MultiHeadAttention` (built as (D, H), (H, hs), (config) ...; fused, per-head, on
  nn.MultiheadAttention or F.scaled_dot_product_attention): §4 3D^2 + D^2 weights at D=8, H=2,
  §3.2 batch items, §4.2 its output equals its own weights written out per head, §4.1 two heads
  give [2, 0.6 | 0.6, 2] with the handout's weights set, §6.1 equivariance when unmasked.
- `Block`: §3.2 batch items, §5 LayerNorm within a token (or RMSNorm), pre- or post-norm
  recognised from behaviour, §6.1 equivariance when unmasked.
- a model: `Names.model`, an expression evaluated in the learner's module, else the first of
  `MODEL_CLASSES` built from its config at V=11, T_max=16, L=2, H=2, D=16: §7.1 appending a token,
  §7.3 output i ignores later tokens (by replacement and by gradients) in every block, the loss is
  next-token, §6.1 whether positions are added.
Without a `MultiHeadAttention` or `Block` class of that name, the attention module and the blocks
found inside the learner's model or block are checked. A kind the file does not define is one
skipped line; a definition that crashes is one failed line naming it (the learner's line number
in the cause), so the other kinds are still graded.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from gptlab.handout.learner.build import BuildError, build, find_class, sizes
from gptlab.handout.learner.calling import (
    CONVENTIONS,
    FLAG,
    AttentionFunction,
    LanguageModel,
    LearnerError,
    describe,
    probe,
    run,
)
from gptlab.handout.learner.inside import Call, record_calls
from gptlab.handout.learner.learning import learning_checks
from gptlab.handout.learner.lm import find_blocks, model_checks
from gptlab.handout.learner.mistakes import (
    EINSUM,
    MASK_SLIPS,
    RANK,
    SLIPS,
    UNKNOWN,
    agrees,
    first_match,
    reference,
)
from gptlab.handout.learner.parts import BATCH, block_checks, heads_checks, input_width
from gptlab.handout.learner.projections import Wiring, find_wiring
from gptlab.handout.properties import Check, changes, close, explain, ignores_later_inputs, skipped
from gptlab.handout.worked import (
    batch_items_apart,
    retrieval,
    rows_and_columns,
    saturation,
    score_variance,
    scores_of,
    weights_of,
)

__all__ = ["LearnerError", "Names", "grade", "subjects"]

MODEL_CLASSES = ("GPT", "GPTLanguageModel", "LanguageModel", "TransformerLM", "Transformer", "Model")
ONE_MATRIX = "the function runs on one (T, d) matrix only"  # marks rank checks until the file's use is known
RETURNED = ("the weights returned are not the ones that mix the values: return the softmax output that "
            "multiplies v")


@dataclass(frozen=True)
class Names:
    """The learner's names for what `grade` checks (the CLI's --attention, --heads, --block, --model)."""

    attention: str = "attention"  # a function attention(q, k, v[, mask]) -> y or (y, weights)
    heads: str = "MultiHeadAttention"  # a multi-head module (fused or per-head)
    block: str = "Block"  # a Transformer block
    model: str | None = None  # a factory expression evaluated in the learner's module namespace, e.g.
    # "GPT(GPTConfig(vocab_size=11, ...))"; None: the first of MODEL_CLASSES, built from its config


def grade(namespace: dict[str, Any], names: Names = Names(), discover: bool = True,
          learning: bool = True) -> list[Check]:
    """Every handout check that applies to what `namespace` (the learner module's globals) defines; with
    `discover`, a model class under a name of its own is found by behaviour (`_discovered_model`); with
    `learning`, the model's learning checks (learner/learning.py: a second or two) run too."""
    for field in fields(Names):
        value = getattr(names, field.name)
        if field.name != "model" and value != field.default and value not in namespace:
            raise LearnerError(f"--{field.name} {value}: the file defines no {value}")
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)  # tiny tensors, one op after another: a second thread only adds hand-over
        try:
            return _grade(namespace, names, discover, learning)
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)


def subjects(namespace: dict[str, Any], names: Names = Names()) -> tuple[Callable[..., Any] | None,
                                                                       nn.Module | None, type | None]:
    """What the checks run on, for pictures: the attention function, the model (built afresh) and the block
    class, each None where the file has none (or its model cannot be built)."""
    fn = namespace.get(names.attention)
    model = _model(namespace, names, discover=True)[0]
    function = fn if callable(fn) and not isinstance(fn, type) else None
    return function, model, find_class(namespace, names.block)


def _grade(namespace: dict[str, Any], names: Names, discover: bool, learning: bool) -> list[Check]:
    """The checks of each kind the file defines, in handout order; a crash fails that kind only."""
    results: list[Check] = []
    fn = namespace.get(names.attention)
    if callable(fn) and not isinstance(fn, type):
        results += _guarded("§2.1", names.attention, namespace, lambda: attention_checks(fn, names.attention))
    else:
        results.append(skipped("§2.1", "attention function", f"the file defines no function {names.attention}"
                               "(q, k, v): name yours with --attention NAME"))
    model, model_label, crash = _model(namespace, names, discover)
    heads_class, block_class = find_class(namespace, names.heads), find_class(namespace, names.block)
    inside = [m for m in (model, _built(block_class, namespace)) if m is not None]
    block_class = block_class or _found_block(inside, namespace)
    heads = _found_heads(inside, namespace, heads_class)
    heads_class = heads_class or (type(heads) if heads is not None else None)
    blocks = find_blocks(model, block_class) if model is not None and block_class is not None else []
    calls: dict[nn.Module, Call] = {}
    results = _one_matrix_only(results, namespace, names.attention,
                               lambda: calls.update(_calls(model, model_label, inside, heads)))
    parts = (("§4", "multi-head module", "heads", heads_class, heads_checks, heads),
             ("§5", "block", "block", block_class, block_checks, blocks[0] if blocks else None))
    for section, kind, flag, cls, checks, instance in parts:
        if cls is None:
            why = (f"the file defines no class {getattr(names, flag)} and none was found inside a model: "
                   f"name yours with --{flag} NAME")
            results.append(skipped(section, kind, why))
        else:
            results += _guarded(section, cls.__name__, namespace,
                                functools.partial(checks, cls, cls.__name__, namespace, instance, calls))
    if crash is not None:
        results.append(crash)
    elif model is None:
        results.append(skipped("§7.3", "language model", "the file defines none of "
                               f"{', '.join(MODEL_CLASSES)}: give a factory expression with "
                               "--model \"GPT(GPTConfig(...))\""))
    else:  # learning first: model_checks sharpens the model's weights in place
        if learning:
            results += _guarded("§7.2", model_label, namespace, lambda: learning_checks(model, model_label))
        results += _guarded("§7.1", model_label, namespace,
                            lambda: model_checks(model, model_label, block_class))
    if all(c.passed is None for c in results):
        raise LearnerError(f"the file defines none of {names.attention}, {names.heads}, {names.block} or a "
                           "model: name yours with --attention, --heads, --block or --model")
    return results


def _where(error: LearnerError, namespace: dict[str, Any]) -> str:
    """Where in the learner's own file the exception behind `error` was raised, if it was."""
    origin, path = error.__cause__, namespace.get("__file__")
    if origin is None or not path:
        return ""
    frames = [f for f in traceback.extract_tb(origin.__traceback__) if f.filename == path]
    return f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""


def _guarded(section: str, label: str, namespace: dict[str, Any],
             checks: Callable[[], list[Check]]) -> list[Check]:
    """`checks()`, or one failed line naming the definition if the learner's code crashes on the way."""
    try:
        return checks()
    except BuildError as error:  # nothing of the learner's ran wrong: the tool could not build the class
        return [skipped(section, f"{label} builds", f"{error}; no instance of it was found inside a model "
                        "either: give the model with --model \"GPT(GPTConfig(...))\" to check the one it "
                        "holds")]
    except LearnerError as error:
        return [Check(section, f"{label} runs", False, "runs on the handout's inputs", "crashed",
                      cause=str(error) + _where(error, namespace))]


def _model(namespace: dict[str, Any], names: Names,
           discover: bool) -> tuple[nn.Module | None, str, Check | None]:
    """The learner's model, its label, and a skipped line if it could not be built."""
    if names.model:
        try:
            made = eval(names.model, namespace)  # noqa: S307 - the user's own expression, in their own module
        except Exception as error:  # the learner's code may raise anything
            raise LearnerError(f"--model {names.model!r} raised {describe(error)}") from error
        if not isinstance(made, nn.Module):
            raise LearnerError(f"--model {names.model!r} gives a {type(made).__name__}, not an nn.Module")
        return made.eval(), names.model, None
    for name in MODEL_CLASSES:
        cls = find_class(namespace, name)
        if cls is not None:
            try:
                return build(cls, name, sizes(16, 2), namespace), name, None
            except BuildError as error:
                return None, name, skipped("§7.1", f"{name} builds", f"{error}: give the model with --model "
                                           f"\"{name}(...)\", sizes V=11, T_max=16, L=2, H=2, D=16")
    found = _discovered_model(namespace) if discover else None
    return (found[1], found[0], None) if found is not None else (None, "", None)


def _discovered_model(namespace: dict[str, Any]) -> tuple[str, nn.Module] | None:
    """The learner's language model under any name: of the file's own module classes that build at the
    check's sizes and map ids (B, T) to logits (B, T, V=11), the largest (it holds the others)."""
    found = []
    for name, cls in namespace.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and _own(cls, namespace)):
            continue
        try:
            made = build(cls, name, sizes(16, 2), namespace)
            vocab = LanguageModel(made, name).vocab
        except LearnerError:
            continue
        if vocab == 11:
            found.append((sum(p.numel() for p in made.parameters()), name, made))
    if not found:
        return None
    _, name, made = max(found, key=lambda f: f[0])
    return name, made


def _calls(model: nn.Module | None, label: str, inside: list[nn.Module],
           heads: nn.Module | None) -> dict[nn.Module, Call]:
    """How the model calls each of its parts (inside.record_calls); without a model, its parts are run on
    rows so that their use of the attention function is seen. None if the learner's code crashes (its own
    checks then say so)."""
    try:
        if model is not None:
            return record_calls(model, label)
        for part in [*inside, *([heads] if heads is not None else [])]:
            rows = torch.randn(2, 6, input_width(part, 16), generator=torch.Generator().manual_seed(9))
            run(type(part).__name__, part, rows)
    except LearnerError:
        pass
    return {}


def _built(cls: type | None, namespace: dict[str, Any]) -> nn.Module | None:
    """An instance of the learner's class to look inside, or None if it cannot be built."""
    try:
        return None if cls is None else build(cls, cls.__name__, sizes(16, 2), namespace)
    except LearnerError:
        return None


def _own(cls: type, namespace: dict[str, Any]) -> bool:
    """Whether a class was written in the learner's file (not torch's)."""
    module = cls.__module__
    return module == namespace.get("__name__", module) and not module.startswith("torch")


def _found_block(inside: list[nn.Module], namespace: dict[str, Any]) -> type | None:
    """The class of the blocks inside the learner's model, if the learner wrote it."""
    for module in inside:
        blocks = find_blocks(module, None)
        if blocks and _own(type(blocks[0]), namespace):
            return type(blocks[0])
    return None


def _found_heads(inside: list[nn.Module], namespace: dict[str, Any], cls: type | None) -> nn.Module | None:
    """The learner's multi-head module inside: an instance of `cls` if given, else the smallest module
    of the learner's with readable W_Q, W_K, W_V of its own (a block holding torch's
    nn.MultiheadAttention is a block, not a multi-head module)."""
    found = []
    for module in inside:
        width = next((e.embedding_dim for e in module.modules() if isinstance(e, nn.Embedding)), None)
        for m in module.modules():
            if cls is not None:
                if isinstance(m, cls):
                    found.append(m)
                continue
            linear = next((x for x in m.modules() if isinstance(x, nn.Linear)), None)
            if linear is not None and _own(type(m), namespace) and not any(
                    isinstance(x, nn.MultiheadAttention) for x in m.modules()) and isinstance(
                    find_wiring(m, width or linear.in_features, 1), Wiring):
                found.append(m)
    return min(found, key=lambda m: sum(p.numel() for p in m.parameters())) if found else None


# ---------------------------------------------------------------------------------------------
# attention(q, k, v[, mask])


def attention_checks(fn: Callable[..., Any], label: str) -> list[Check]:
    """§2.1, §3.1, §3.2 and (with a mask argument) §7.3 for an attention function."""
    att = AttentionFunction(fn, label)
    q, k, v = probe((2,), 3, 4, seed=1)
    slips = [(s, lambda s=s: reference(q, k, v, None, s)) for s in SLIPS if s != "scale by D"]
    slip = first_match(att.attend(q, k, v), slips)
    cause = SLIPS[slip] if slip not in (None, "none") else UNKNOWN
    samples = 4000 if att.batched else 2000  # fewer than the lab: one matrix at a time is one call each
    worked = [*retrieval(att.attend), saturation(att.attend),
              *score_variance(scores_of(att.attend), 1.5, samples)]
    results = [explain(c, cause) for c in worked]
    results += [explain(c, cause) for c in rows_and_columns(weights_of(att.attend, q, k), "unmasked")]
    x = probe((2,), 6, 6, seed=2)[0]  # (B=2, T=6, d)
    changed = x.clone()
    changed[1] = torch.randn(6, x.size(-1), generator=torch.Generator().manual_seed(3))
    if att.batched:
        results.append(explain(batch_items_apart(lambda t: att.attend(t, t, t), x, changed, "self-attention"),
                               BATCH))
    else:
        results.append(skipped("§3.2", "batch items do not mix", f"{label} takes no batches (rank 3)"))
    results += [_rank_check(att, shape, slip) for shape in ((2,), (2, 3))]
    if att.returns_weights and att.batched:
        returned = att.direct(q, k, v)[1]
        assert returned is not None, "returns_weights: the call returned its weights when probed"
        applied = close("§3.2", "returned weights are the ones applied", returned,
                        weights_of(att.attend, q, k), 1e-5, "the weights a with y = a V")
        results.append(explain(applied, RETURNED))
    return results + _mask_checks(att, slip or "none")


def _rank_check(att: AttentionFunction, shape: tuple[int, ...], slip: str | None) -> Check:
    """§3.2: a batch (rank 3) or a head tensor (rank 4) gives each matrix its own answer."""
    name = f"rank-{len(shape) + 2} input {'(B, T, d)' if len(shape) == 1 else '(B, H, T, d)'}"
    q, k, v = probe(shape, 3, 4, seed=3)
    expected = reference(q, k, v, None, slip or "none").float()
    try:
        check = close("§3.2", name, att.direct(q, k, v)[0], expected, 1e-5, "each matrix's own attention")
        error = ""
    except LearnerError as crash:
        error = str(crash)
        check = Check("§3.2", name, False, "each matrix's own attention", f"raises: {error}")
    one_at_a_time = att.works(*(t.reshape(-1, *t.shape[-2:])[0] for t in (q, k, v)))  # a single (T, d)
    if "einsum" in error.lower():
        return explain(check, EINSUM)
    if one_at_a_time and not att.batched:  # kept only if the file's own code calls it on batches
        check = replace(check, note=ONE_MATRIX)
    if one_at_a_time and slip is not None:
        return explain(check, RANK)
    return explain(check, SLIPS.get(slip or "", "") or UNKNOWN)


def _one_matrix_only(results: list[Check], namespace: dict[str, Any], name: str,
                     run_learner: Callable[[], object]) -> list[Check]:
    """Run the file's own code once (`run_learner()`: its model or parts), watching how it calls its
    attention function: the rank checks of a function written for one matrix at a time are SKIPped
    unless that code calls it on batches, where they are the classic `.T` bug."""
    fn, ranks = namespace.get(name), list[int]()

    def recording(*args: Any, **kwargs: Any) -> Any:
        ranks.extend(a.dim() for a in args[:1] if isinstance(a, torch.Tensor))
        return fn(*args, **kwargs)  # type: ignore[misc]

    watch = callable(fn) and any(c.note == ONE_MATRIX for c in results)
    if watch:
        namespace[name] = recording  # the file's modules look the function up in these globals
    try:
        run_learner()
    finally:
        if watch:
            namespace[name] = fn
    if not watch or any(rank >= 3 for rank in ranks):
        return results
    why = (f"{name} is written for one (T, d) matrix at a time, and the file's own code calls it only so: "
           "fine for the handout's equations (batches are checked by calling it on each matrix)")
    return [skipped(c.section, c.name, why) if c.note == ONE_MATRIX else c for c in results]


def _mask_checks(att: AttentionFunction, slip: str) -> list[Check]:
    """§3.2 and §7.3 with the causal mask, in whichever convention the function uses (found by behaviour)."""
    name = "masked: output i ignores queries, keys and values after i"
    if att.mask_param is None:
        return [skipped("§7.3", name, f"{att.label} takes no mask argument: the causal mask is checked in "
                        "the model")]
    T = 5
    q, k, v = probe((2,), T, T, seed=4)
    keep = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T): key j <= query i
    measured, errors = {}, []
    for convention in [FLAG] if att.flag else list(CONVENTIONS):
        att.convention = convention
        try:
            measured[convention] = att.attend(q, k, v, keep)
        except LearnerError as error:
            errors.append(error)
    if not measured:
        raise errors[0]  # no convention runs: the masked call itself crashes
    found = next(((c, m) for m in MASK_SLIPS for c, y in measured.items()
                  if agrees(y, reference(q, k, v, keep, slip, m))), None)
    att.convention = found[0] if found else next(iter(measured))
    cause = MASK_SLIPS[found[1]] if found and found[1] != "none" else (SLIPS[slip] or UNKNOWN)

    def masked(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return att.attend(a, b, c, keep)

    outputs = []
    generator = torch.Generator().manual_seed(7)
    for cut in range(1, T):
        redrawn = [t.clone() for t in (q, k, v)]
        for t in redrawn:
            t[:, cut:] = torch.randn(t.size(0), T - cut, t.size(2), generator=generator)
        outputs.append(masked(*redrawn))  # (B, T, d): every input from `cut` on redrawn
    note = f"mask: {att.convention}"
    evidence = changes(masked(q, k, v), torch.stack(outputs))
    return [explain(c, cause) for c in (*rows_and_columns(weights_of(masked, q, k), "masked"),
                                        ignores_later_inputs(evidence, name, note=note))]
