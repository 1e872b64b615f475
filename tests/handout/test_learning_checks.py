"""Issue 39 point 4: `learning_checks`, the bugs that pass every unit test but stop a model learning.

Every correct file of the outside corpus passes the three checks (the initial loss near ln V, a gradient
for every parameter, one batch memorised); learner-style files with a learning bug written into the
gallery's reference fail the check that names it; the learner's own model is never changed.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gptlab.handout.learner.bugs import reference_text
from gptlab.handout.learner.build import build, find_class, sizes
from gptlab.handout.learner.grade import MODEL_CLASSES
from gptlab.handout.learner.learning import INITIAL_GAP, MEMORISED, STEPS, learning_checks
from gptlab.handout.properties import Check, Evidence, judge

pytestmark = [pytest.mark.usefixtures("one_thread"),  # as grade runs them
              pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")]

CORPUS = Path(__file__).parent / "outside"
CORRECT = sorted(path.name for path in CORPUS.glob("ok_*.py"))
HEAD = "        logits = self.head(self.ln_f(x))  # (B, T, V)\n"
HEAD_INIT = "        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)\n"
LN2 = "        self.ln2 = nn.LayerNorm(n_embd)\n"
ATTN = "x = x + self.attn(self.ln1(x), mask)"
PATCHES = {  # a learning bug written into the gallery's reference: (its text, its replacement)
    "detached-attention": (ATTN, ATTN + ".detach()"),
    "unused-module": (LN2, LN2 + "        self.unused = nn.Linear(n_embd, n_embd)\n"),
    "embedding-data": ("x = self.tok(idx)", "x = self.tok.weight.data[idx]"),
    "head-std-1": (HEAD_INIT, HEAD_INIT + "        nn.init.normal_(self.head.weight, std=1.0)\n"),
    "softmax-logits": (HEAD, HEAD.replace("self.head(self.ln_f(x))", "self.head(self.ln_f(x)).softmax(-1)")),
}


def _load(path: Path) -> dict[str, Any]:
    """Import a learner file under a name of its own and return its namespace."""
    spec = importlib.util.spec_from_file_location(f"learning_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _model(namespace: dict[str, Any]) -> tuple[nn.Module, str]:
    """The file's model as `gptlab check` builds it: its --model expression, else the first model class."""
    flags = namespace.get("FLAGS", [])
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if "--model" in given:
            return eval(given["--model"], namespace), given["--model"]  # noqa: S307 - the corpus's own flag
        for name in MODEL_CLASSES:
            cls = find_class(namespace, name)
            if cls is not None:
                return build(cls, name, sizes(16, 2), namespace), name
    pytest.skip("no model class under a known name here: grade finds it by behaviour, and its learning "
                "checks run in test_outside_corpus.py")


def _patched(name: str, folder: Path) -> tuple[nn.Module, str]:
    """The gallery's reference GPT with learning bug `name` written in."""
    old, new = PATCHES[name]
    text = reference_text()
    assert text.count(old) == 1, f"{name}: {old!r} occurs {text.count(old)} times"
    path = folder / f"learning_{name.replace('-', '_')}.py"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return _model(_load(path))


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name.split(" (")[0]: check for check in checks}


@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.slow
def test_every_correct_corpus_model_learns_with_margin(name: str) -> None:
    model, label = _model(_load(CORPUS / name))
    checks = learning_checks(model, label)
    assert [c.passed for c in checks] == [True, True, True], [(c.name, c.computed, c.cause) for c in checks]
    initial, _, memorised = checks
    assert initial.deviation is not None and initial.deviation <= INITIAL_GAP / 2  # measured: at most 0.45
    assert memorised.computed.endswith("steps") and int(memorised.computed.split()[-2]) <= STEPS / 3  # <= 52


def test_the_learners_model_is_left_as_it_was() -> None:
    model, label = _model(_load(CORPUS / "ok_nanogpt_fused.py"))
    model.train()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    first = learning_checks(model, label)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    again = learning_checks(model, label)
    assert [(c.passed, c.computed) for c in again] == [(c.passed, c.computed) for c in first]  # seeded


def test_the_verdicts_are_recomputed_from_the_evidence_alone(tmp_path: Path) -> None:
    checks = learning_checks(*_patched("embedding-data", tmp_path))
    assert [c.passed for c in checks] == [True, False, True]
    for check in checks:
        assert check.evidence is not None
        sent = Evidence.from_record(check.evidence.record())  # as the child sends it to the parent
        judged = judge(replace(check, evidence=sent))
        assert (judged.passed, judged.cause) == (check.passed, check.cause)
        assert judged.deviation == pytest.approx(check.deviation, rel=1e-6)  # sent as float32


@pytest.mark.parametrize(("bug", "failing", "words"), [
    ("detached-attention", "every parameter gets a gradient", ("blocks.0.attn.qkv.weight", ".detach()")),
    ("unused-module", "every parameter gets a gradient", ("blocks.0.unused.weight", "never called")),
    ("embedding-data", "every parameter gets a gradient", ("tok.weight", ".data")),
    ("head-std-1", "the loss at initialisation is near ln V", ("initial scale",)),
    ("softmax-logits", "memorises one batch", ("probabilities",)),
])
def test_a_learning_bug_fails_the_check_that_names_it(bug: str, failing: str, words: tuple[str, ...],
                                                      tmp_path: Path) -> None:
    checks = _by_name(learning_checks(*_patched(bug, tmp_path)))
    assert [name for name, c in checks.items() if c.passed is False] == [failing]
    text = checks[failing].computed + " " + checks[failing].cause
    assert all(word in text for word in words), text


def test_a_nan_loss_fails_with_the_hidden_diagonal_as_cause() -> None:
    model, label = _model(_load(CORPUS / "bug_mask_hides_diagonal.py"))
    initial, _, memorised = learning_checks(model, label)
    assert initial.passed is False and memorised.passed is False
    assert memorised.tolerance == pytest.approx(MEMORISED * math.log(11))
    assert "diagonal" in initial.cause and "NaN" in memorised.cause
    assert math.isnan(float(initial.computed.split()[0]))
