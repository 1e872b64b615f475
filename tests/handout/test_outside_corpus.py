"""Issue 39: `gptlab check` on a corpus of learner files written outside gptlab's own style.

tests/handout/outside/ holds small plain-PyTorch files in the styles courses actually produce (the
video-tutorial per-head modules, nanoGPT's fused c_attn, F.scaled_dot_product_attention,
nn.MultiheadAttention, Llama-like RoPE/RMSNorm/SwiGLU, Hugging Face-style configs, CS336-style own
Linear/Embedding, explicit loops, required mask arguments, ...). Each file says in its docstring
which style it is and whether it is correct or which single bug it has, and carries:

- `STYLE`: the style, in words;
- `BUG`: None for a correct file, else the bug in words;
- `EXPECTED_CAUSE` (bug files): a regex, matched case-insensitively against the causes of the failed
  checks, that a cause naming this bug matches;
- `FLAGS`: the `gptlab check` flags a learner would pass (--attention, --heads, --block, --model).

The done-when of the issue: every correct file gets no FAIL and at least 12 PASS lines; every bug
file gets at least one FAIL, and a FAIL whose cause names the bug. The verdicts are compared with what
each file says about itself, never with grade's output.

Cases that fail today are listed in KNOWN_FAILING and run as strict xfails: a fix that makes one pass
turns it into a failure until its entry is removed here.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from gptlab.handout.learner.grade import Names, grade
from gptlab.handout.properties import Check

# ok_single_matrix's `.T` warns when the checker tries it on a batch, as it is meant to
pytestmark = pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")

CORPUS = Path(__file__).parent / "outside"
MIN_PASSES = 12  # a correct file must pass at least this many checks

KNOWN_FAILING: dict[str, str] = {  # file -> what goes wrong today; remove an entry once it passes
    # correct files: false alarms, or not graded at all
    "ok_post_norm.py": "issue 39: false alarm §4 'MultiHeadAttention runs': its forward(Q, K, V, "
                       "mask=None) is called as forward(x, mask), TypeError missing 'V'",
    "ok_llama_rope.py": "issue 39: false alarms §4 'Attention runs' and §5 'TransformerBlock runs': "
                        "forward(x, freqs_cis, mask) called as forward(x, mask); only 5 PASS",
    "ok_loops.py": "issue 39: false alarm §7.1 'GPT runs': the gradient check swaps the embedding output "
                   "for a leaf, so the file's in-place x[:, t] = x[:, t] + wpe.weight[t] raises",
    "ok_required_mask_modules.py": "issue 39: false alarm §5 'DecoderLayer runs': forward(x, mask) is given "
                                   "a mask the file's MultiHeadedAttention cannot broadcast (it unsqueezes "
                                   "a (1, T, T) mask)",
    "ok_hf_dict.py": "issue 39: with no flags grade raises LearnerError 'defines none of attention, "
                     "MultiHeadAttention, Block or a model': MiniLMForCausalLM is not discovered",
    "ok_single_matrix.py": "issue 39: false alarms §3.2 rank-3 and rank-4 input with the `.T` cause, though "
                           "attention is written for one (T, d) matrix, where .T is the matrix transpose",
    # bug files: not caught, or caught with a cause that does not name the bug
    "bug_scale_width.py": "issue 39: caught at §4.2/§4.1 with 'none of the classic mistakes explains': "
                          "dividing by D (no square root) is not among the slips",
    "bug_mask_hides_diagonal.py": "issue 39: caught (the NaN row spreads), but the causes say batch items "
                                  "mix, no norm on the residual path, positions mix outside the blocks, the "
                                  "loss; none names the hidden diagonal",
    "bug_mask_hides_diagonal_triu.py": "issue 39: caught at §6.1/§7.1/§7.3 with the generic leak cause; "
                                       "nothing names the hidden diagonal",
    "bug_mask_off_by_one.py": "issue 39: caught at §4.2 ('none of the classic mistakes') and §7.1/§7.3 (the "
                              "generic leak cause); nothing names query i seeing key i + 1",
    "bug_mask_inverted.py": "issue 39: caught at §7.1/§7.3 with the generic leak cause (plus §4/§5 'runs' "
                            "crashes on forward(x, cos, sin, mask)); nothing names the inverted mask",
    "bug_split_heads_no_transpose.py": "issue 39: caught, but the causes are 'none of the classic mistakes', "
                                       "'uses the position index' and the generic leak; nothing names the "
                                       "head split",
    "bug_merge_heads_no_transpose.py": "issue 39: caught, but the causes are 'none of the classic mistakes', "
                                       "'uses the position index' and the generic leak; nothing names the "
                                       "merge without transpose",
    "bug_pos_by_batch.py": "issue 39: not caught: §6.1 'input rows carry positions' is SKIP (identical rows "
                           "taken for a choice of no positions); no FAIL",
    "bug_pos_by_token.py": "issue 39: not caught: §6.1 'input rows carry positions' is SKIP (identical rows "
                           "taken for a choice of no positions); no FAIL",
    "bug_no_residual.py": "issue 39: caught at §5 arrangement, but the cause says 'no norm on the residual "
                          "path', not the missing residual connection",
    "bug_targets_unshifted.py": "issue 39: caught at §7.3 loss, but the cause is the generic 'not the "
                                "cross-entropy ... against the next token', not the missing shift",
}


def _load(path: Path) -> dict[str, Any]:
    """Import a corpus file under a name of its own and return its namespace."""
    spec = importlib.util.spec_from_file_location(f"outside_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


@functools.cache
def _namespace(name: str) -> dict[str, Any]:
    return _load(CORPUS / name)


def _names(flags: list[str]) -> Names:
    """The Names a learner's `gptlab check` flags give: --attention, --heads, --block, --model."""
    assert len(flags) % 2 == 0, f"flags come in pairs: {flags}"
    given = {flag.removeprefix("--"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}
    assert set(given) <= {"attention", "heads", "block", "model"}, f"unknown flags: {flags}"
    return Names(**given)


@functools.cache
def _graded(name: str) -> tuple[tuple[Check, ...], str]:
    """Every check grade gives the file (with its FLAGS), or () and why grade raised."""
    namespace = _namespace(name)
    try:
        return tuple(grade(namespace, _names(namespace["FLAGS"]))), ""
    except Exception as error:  # noqa: BLE001 - any exception is the verdict for this file
        return (), f"grade raised {type(error).__name__}: {error}"


def _line(c: Check) -> str:
    return f"{c.verdict} {c.section} {c.name}: expected {c.expected}, computed {c.computed}; cause: {c.cause}"


FILES = sorted(p.name for p in CORPUS.glob("*.py"))
CORRECT = [f for f in FILES if _namespace(f)["BUG"] is None]
BUGGY = [f for f in FILES if _namespace(f)["BUG"] is not None]


def _cases(files: list[str]) -> list[Any]:
    """One case per file, a strict xfail where KNOWN_FAILING lists it."""
    return [pytest.param(f, id=f.removesuffix(".py"),
                         marks=[pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[f])] if f in KNOWN_FAILING
                         else []) for f in files]


def test_the_corpus_is_what_the_issue_asks_for() -> None:
    counts = len(FILES), len(CORRECT), len(BUGGY)
    assert counts[0] >= 30 and counts[1] >= 12 and counts[2] >= 15, counts
    styles = {_namespace(f)["STYLE"] for f in FILES}
    assert len(styles) >= 10, sorted(styles)
    for f in FILES:
        namespace = _namespace(f)
        doc, bug = namespace["__doc__"] or "", namespace["BUG"]
        assert doc.startswith("Style:"), f"{f}: the docstring starts with its style"
        assert isinstance(namespace["FLAGS"], list), f"{f}: FLAGS is a list"
        _names(namespace["FLAGS"])
        if bug is None:
            assert "\nCorrect" in doc, f"{f}: a correct file says so in its docstring"
            assert "EXPECTED_CAUSE" not in namespace, f"{f}: a correct file has no EXPECTED_CAUSE"
        else:
            assert "\nBug:" in doc, f"{f}: a bug file names its bug in its docstring"
            re.compile(namespace["EXPECTED_CAUSE"])
    assert set(KNOWN_FAILING) <= set(FILES), sorted(set(KNOWN_FAILING) - set(FILES))


@pytest.mark.parametrize("name", _cases(CORRECT))
def test_a_correct_file_gets_no_fail_and_enough_passes(name: str) -> None:
    results, crash = _graded(name)
    assert not crash, crash
    failures = [_line(c) for c in results if c.passed is False]
    assert not failures, "\n".join(failures)
    passes = sum(c.passed is True for c in results)
    assert passes >= MIN_PASSES, f"only {passes} PASS (at least {MIN_PASSES} expected):\n" + "\n".join(
        _line(c) for c in results if c.passed is None)


@pytest.mark.parametrize("name", _cases(BUGGY))
def test_a_bug_fails_with_a_cause_naming_it(name: str) -> None:
    results, crash = _graded(name)
    assert not crash, crash
    failed = [c for c in results if c.passed is False]
    bug, expected = _namespace(name)["BUG"], _namespace(name)["EXPECTED_CAUSE"]
    assert failed, f"{bug}: nothing failed"
    named = [c for c in failed if re.search(expected, c.cause, re.IGNORECASE)]
    assert named, f"{bug}: no failed check's cause matches /{expected}/:\n" + "\n".join(map(_line, failed))
