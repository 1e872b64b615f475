"""Tests for gptlab.handout.learner.grade: learner files in six styles pass, and classic bugs fail with their
cause.

The learner files in tests/handout/learners/ are written independently of gptlab (plain PyTorch, each in its
own style); the broken variants are small text patches of them. The verdicts are compared with
what the handout says about each file, never with grade's own output.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import pytest

from gptlab.handout.learner.grade import LearnerError, Names, grade
from gptlab.handout.properties import Check

LEARNERS = Path(__file__).parent / "learners"
NANOGPT = Path(__file__).parents[3] / "shared" / "thirdparty" / "nanogpt" / "model.py"
NANOGPT_MODEL = "GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8))"
_count = itertools.count()


def _load(path: Path, patches: tuple[tuple[str, str], ...] = (), tmp: Path | None = None) -> dict[str, Any]:
    """Import a learner file (patched into tmp if patches are given) and return its namespace."""
    if patches:
        text = path.read_text()
        for old, new in patches:
            assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path.name}"
            text = text.replace(old, new)
        assert tmp is not None
        path = tmp / path.name
        path.write_text(text)
    name = f"learner_{path.stem}_{next(_count)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _describe(c: Check) -> str:
    return f"{c.verdict} {c.section} {c.name}: expected {c.expected}, computed {c.computed}; cause: {c.cause}"


def _failures(results: list[Check]) -> list[str]:
    return [_describe(c) for c in results if c.passed is False]


def _passed_sections(results: list[Check]) -> set[str]:
    return {c.section for c in results if c.passed}


def _skipped(results: list[Check]) -> dict[str, str]:
    return {c.name: c.note for c in results if c.passed is None}


# ---------------------------------------------------------------------------------------------
# Correct files pass every check that applies; what does not apply is skipped with a reason

ATTENTION = {"§2.1", "§3.1", "§3.2", "§7.3"}  # an attention function with a mask argument
HEADS = {"§3.2", "§4", "§4.1", "§4.2"}
BLOCK = {"§3.2", "§5"}
MODEL = {"§6.1", "§7.1", "§7.3"}

CORRECT = {  # file -> (sections that must pass, names of the checks that must be skipped)
    "einsum_attention": (ATTENTION, {"multi-head module", "block", "language model"}),
    "per_head": (HEADS | BLOCK, {"attention function", "language model"}),
    "fused_qkv": (ATTENTION | HEADS | BLOCK, {"language model"}),
    "torch_mha": (HEADS | BLOCK | {"§6.1"}, {"attention function", "language model"}),
    "sdpa": (ATTENTION | HEADS, {"block", "language model"}),
    "small_gpt": (ATTENTION | HEADS | BLOCK | MODEL, set()),
}


@pytest.mark.parametrize("stem", CORRECT)
def test_a_correct_learner_file_passes_every_check_that_applies(stem: str) -> None:
    results = grade(_load(LEARNERS / f"{stem}.py"))
    assert not _failures(results), "\n".join(_failures(results))
    must_pass, must_skip = CORRECT[stem]
    never = must_pass - _passed_sections(results)
    assert not never, f"never passed: {sorted(never)}"
    skipped = _skipped(results)
    assert must_skip <= set(skipped), f"not skipped: {must_skip - set(skipped)}"
    assert all(skipped.values()), f"a skipped check without its reason: {skipped}"


@pytest.mark.parametrize(("stem", "convention"), [
    ("einsum_attention", "additive mask"), ("fused_qkv", "True = hidden"), ("small_gpt", "True = may attend"),
    ("sdpa", "causal flag"),
])
def test_the_mask_convention_is_found_by_behaviour(stem: str, convention: str) -> None:
    results = grade(_load(LEARNERS / f"{stem}.py"))
    masked = [c for c in results if c.section == "§7.3" and c.name.startswith("masked")]
    assert len(masked) == 1 and masked[0].passed, [_describe(c) for c in masked]
    assert convention in masked[0].note


def test_parts_without_their_own_names_are_found_inside_the_model() -> None:
    # small_gpt defines SelfAttention and TransformerBlock, not MultiHeadAttention and Block.
    results = grade(_load(LEARNERS / "small_gpt.py"))
    four = {c.name: c for c in results if c.section == "§4"}
    assert four["attention parameters, D=8, H=2"].computed == "256 weights + 0 biases"
    arrangement = next(c for c in results if c.name == "pre-norm or post-norm arrangement")
    assert arrangement.passed and arrangement.computed.startswith("pre-norm")


def test_post_norm_is_recognised_and_not_failed() -> None:
    results = grade(_load(LEARNERS / "fused_qkv.py"))
    arrangement = next(c for c in results if c.name == "pre-norm or post-norm arrangement")
    assert arrangement.passed and arrangement.computed.startswith("post-norm"), _describe(arrangement)


# ---------------------------------------------------------------------------------------------
# Broken variants fail at the right section with the right cause

_SOFTMAX_THEN_MASK = ('        att = att.masked_fill(mask == 0, float("-inf"))\n'
                      '    att = F.softmax(att, dim=-1)\n',
                      '        pass\n    att = F.softmax(att, dim=-1)\n    if mask is not None:\n'
                      '        att = att.masked_fill(mask == 0, 0.0)\n')
_LAST_BLOCK_ONLY = (
    ("self.mask[:T, :T])", "self.mask[:T, :T] if self.masked else None)"),
    ("        self.n_heads = args.n_heads\n",
     "        self.n_heads = args.n_heads\n        self.masked = True\n"),
    ("        self.norm = nn.LayerNorm",
     "        for layer in self.layers[:-1]:\n            layer.attention.masked = False\n"
     "        self.norm = nn.LayerNorm"),
)
_AVERAGED = (
    ("self.out = nn.Linear(config.d_model, config.d_model",
     "self.out = nn.Linear(config.d_model // config.n_heads, config.d_model"),
    ("self.out(y.permute(0, 2, 1, 3).reshape(B, T, D))", "self.out(y.mean(dim=1))"),
)
_UNSHIFTED = (("logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)",
               "logits.reshape(-1, logits.size(-1)), tokens.reshape(-1)"),)
BUGS = {  # name -> (file, patches, section that must fail, words its cause must contain)
    "no scale": ("einsum_attention", (("/ math.sqrt(q.size(-1))", ""),), "§3.1", "sqrt(d_k)"),
    "softmax over the queries": ("einsum_attention", (("dim=-1)", "dim=-2)"),), "§3.2", "dim=-1"),
    ".T on batches": ("fused_qkv", (("k.transpose(-1, -2)", "k.T"),), "§3.2", "transpose(-2, -1)"),
    "mask after the softmax": ("small_gpt", (_SOFTMAX_THEN_MASK,), "§7.3", "after the softmax"),
    "mask filled with 0": ("small_gpt", (('float("-inf")', "0.0"),), "§7.3", "-inf"),
    "mask missing": ("small_gpt", (("attention(q, k, v, self.mask[:T, :T])", "attention(q, k, v)"),), "§7.3",
                     "no causal mask"),
    "mask only in the final block": ("small_gpt", _LAST_BLOCK_ONLY, "§7.3", "mask every block"),
    "heads averaged": ("fused_qkv", _AVERAGED, "§4.1", "concatenate"),
    "unshifted targets": ("small_gpt", _UNSHIFTED, "§7.3", "shift"),
}


@pytest.mark.parametrize("bug", BUGS)
def test_a_classic_bug_fails_at_its_section_with_its_cause(bug: str, tmp_path: Path) -> None:
    stem, patches, section, words = BUGS[bug]
    results = grade(_load(LEARNERS / f"{stem}.py", patches, tmp_path))
    caught = [c for c in results if c.passed is False and c.section == section and words in c.cause]
    assert caught, "\n".join(_failures(results)) or "nothing failed"


@pytest.mark.slow
def test_the_heads_averaged_count_says_concatenate(tmp_path: Path) -> None:
    _, patches, _, _ = BUGS["heads averaged"]
    results = grade(_load(LEARNERS / "fused_qkv.py", patches, tmp_path))
    count = next(c for c in results if c.section == "§4")
    assert count.passed is False and count.computed == "224 weights + 0 biases", _describe(count)
    assert "concatenate" in count.cause


# ---------------------------------------------------------------------------------------------
# nanoGPT's model.py, unchanged, through a factory expression; and with its causal mask removed


def _nanogpt(patches: tuple[tuple[str, str], ...], tmp: Path) -> dict[str, Any]:
    if not NANOGPT.is_file():
        pytest.skip(f"{NANOGPT} is absent (../shared is not checked out here)")
    return _load(NANOGPT, patches, tmp)


def test_nanogpt_passes_through_a_factory_expression(tmp_path: Path) -> None:
    results = grade(_nanogpt((), tmp_path), Names(model=NANOGPT_MODEL))
    assert not _failures(results), "\n".join(_failures(results))
    assert HEADS | BLOCK | MODEL <= _passed_sections(results)
    appended = next(c for c in results if c.section == "§7.1")
    assert appended.passed and appended.name == "appending a token leaves earlier logits unchanged"


@pytest.mark.parametrize("patches", [
    (("is_causal=True", "is_causal=False"),),
    (("self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')", "self.flash = False"),
     ("            att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))\n", "")),
], ids=["is_causal=False", "slow path without masked_fill"])
def test_nanogpt_without_its_causal_mask_fails_at_7_3(patches: tuple[tuple[str, str], ...],
                                                       tmp_path: Path) -> None:
    results = grade(_nanogpt(patches, tmp_path), Names(model=NANOGPT_MODEL))
    leaks = [c for c in results if c.passed is False and c.section == "§7.3"]
    assert leaks, "\n".join(_failures(results)) or "nothing failed"
    assert all("mask" in c.cause for c in leaks), [_describe(c) for c in leaks]


# ---------------------------------------------------------------------------------------------
# What the learner's file lacks or crashes on is one line


def test_a_file_defining_nothing_is_one_error() -> None:
    with pytest.raises(LearnerError, match="defines none of attention"):
        grade({"__name__": "empty"})


def test_a_named_definition_that_is_missing_is_one_error() -> None:
    with pytest.raises(LearnerError, match="--attention attend: the file defines no attend"):
        grade(_load(LEARNERS / "einsum_attention.py"), Names(attention="attend"))


def test_a_crash_in_the_learners_code_is_one_failed_line_naming_it(tmp_path: Path) -> None:
    first = '    scores = torch.einsum("...id,...jd->...ij", q, k)'
    patches = ((first, '    raise RuntimeError("not written yet")\n' + first),)
    results = grade(_load(LEARNERS / "einsum_attention.py", patches, tmp_path))
    crashed = [c for c in results if c.passed is False]
    assert len(crashed) == 1 and crashed[0].name == "attention runs", [_describe(c) for c in crashed]
    assert "RuntimeError: not written yet" in crashed[0].cause
    assert "line 13: raise RuntimeError" in crashed[0].cause  # the learner's own line
