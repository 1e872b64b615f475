"""Tests for gptlab.handout.learner.bugs (`gptlab break`): the gallery, the files it writes, --train, and
the test that `gptlab check` catches every bug in it.

The reference file is checked against the handout's own numbers (§2.1) and by changing later tokens
(§7.3); each bug file against the reference with difflib, line by line.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptlab.handout.learner.bugs import BUGS, reference_text, write_bug, write_reference
from gptlab.handout.learner.side_by_side import honest_loss, train_side_by_side

LABELS = ("reference", "no-mask")
TINY = "GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8))"
# The issue's list of classic bugs, in its words: each must have an entry whose title says it.
ISSUE_LIST = {"no scale": "bug", "query axis": "bug", "final block": "bug", "after the softmax": "bug",
              "filled with 0": "bug", "future leak": "bug", "averaged": "bug", ".T": "bug",
              "positions missing": "choice", "post-norm without warm-up": "choice"}


def _import(path: Path) -> types.ModuleType:
    """Import a learner file under a fresh module name, as `gptlab check` would."""
    name = f"learner_{path.stem.replace('-', '_')}_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _tiny_model(module: types.ModuleType) -> torch.nn.Module:
    torch.manual_seed(0)
    return eval(TINY, vars(module)).eval()


def _patched_lines(reference: str, old: str) -> set[int]:
    """The reference's line numbers that the text `old` covers."""
    start = reference.index(old)
    first = reference.count("\n", 0, start)
    return set(range(first, first + max(1, old.rstrip("\n").count("\n") + 1)))


# ---------------------------------------------------------------------------------------------
# The gallery


def test_list_names_every_classic_bug_of_the_issue() -> None:
    for words, kind in ISSUE_LIST.items():
        matches = [bug for bug in BUGS.values() if words.lower() in bug.title.lower()]
        assert matches, f"no gallery entry's title says {words!r}"
        assert {bug.kind for bug in matches} == {kind}, f"{words!r} should be a {kind}"
    for bug in BUGS.values():
        assert re.fullmatch(r"§\d+(\.\d+)?", bug.section), bug
        assert bug.kind in ("bug", "choice") and bool(bug.cause_words) == (bug.kind == "bug"), bug


def test_reference_reproduces_the_handout() -> None:
    """§2.1's retrieval [2, 1.5], §4's 256 weights at D=8, H=2, and §7.3 causality of the whole model."""
    module = types.ModuleType("reference")
    exec(compile(reference_text(), "reference.py", "exec", dont_inherit=True), vars(module))
    q = torch.tensor([[1.0, 0.0]])
    k = torch.tensor([[math.sqrt(2) * math.log(2), 0.0], [0.0, 1.0], [0.0, -1.0]])
    v = torch.tensor([[2.0, 0.0], [0.0, 2.0], [4.0, 4.0]])
    y, weights = module.attention(q, k, v)
    torch.testing.assert_close(y, torch.tensor([[2.0, 1.5]]))
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.25, 0.25]]))
    heads = module.MultiHeadAttention(8, 2)
    assert sum(p.numel() for n, p in heads.named_parameters() if n.endswith("weight")) == 256
    model = _tiny_model(module)
    ids = torch.randint(0, 11, (1, 16))
    changed = ids.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 11
    logits, loss = model(ids)
    assert logits.shape == (1, 16, 11) and loss is None
    torch.testing.assert_close(model(changed)[0][:, :9], logits[:, :9], rtol=0, atol=0)
    assert (model(changed)[0][:, 9:] - logits[:, 9:]).abs().max() > 1e-3
    targets = torch.randint(0, 11, (1, 16))
    torch.testing.assert_close(model(ids, targets)[1], F.cross_entropy(logits[0], targets[0]))


@pytest.mark.parametrize("name", BUGS)
def test_write_bug_differs_from_the_reference_only_where_its_bug_says(name: str, tmp_path: Path) -> None:
    path = write_bug(name, tmp_path / f"{name}.py")
    reference, written = reference_text().splitlines(), path.read_text().splitlines()
    expected = set().union(*(_patched_lines(reference_text(), old) for old, _ in BUGS[name].patches))
    changed = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(a=reference, b=written, autojunk=False).get_opcodes():
        if tag != "equal":
            changed |= set(range(i1, max(i2, i1 + 1)))
    assert changed and changed <= expected, f"changed reference lines {sorted(changed)}, patched {expected}"
    for old, new in BUGS[name].patches:
        assert old not in path.read_text() and new in path.read_text()
    module = _import(path)
    for definition in ("attention", "MultiHeadAttention", "Block", "GPTConfig", "GPT"):
        assert callable(getattr(module, definition)), definition
    if name != "dot-T":  # `.T` reverses a batch's axes: that model crashes, which is its bug
        logits, _ = _tiny_model(module)(torch.randint(0, 11, (2, 16)))
        assert logits.shape == (2, 16, 11)


def test_write_reference_writes_the_reference(tmp_path: Path) -> None:
    path = write_reference(tmp_path / "mine.py")
    assert path.read_text() == reference_text()
    assert _import(path).GPTConfig().n_embd > 0


def test_writing_again_works_and_other_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "exercise.py"
    write_bug("mask-zero", path)
    write_bug("mask-zero", path)  # the same command twice just works
    before = path.read_text()
    with pytest.raises(ValueError, match="already exists"):
        write_bug("no-scale", path)
    with pytest.raises(ValueError, match="already exists"):
        write_reference(path)
    assert path.read_text() == before
    with pytest.raises(ValueError, match=r"\.py"):
        write_bug("no-scale", tmp_path / "exercise.txt")
    with pytest.raises(ValueError, match="no-scale"):  # an unknown name lists the known ones
        write_bug("no-such-bug", tmp_path / "other.py")
    assert not (tmp_path / "other.py").exists()


# ---------------------------------------------------------------------------------------------
# --train


class _Oracle(torch.nn.Module):
    """Reads the answer from the input: the logits at i are a one-hot of token i + 1 (uniform at the end)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        logits = torch.zeros(*idx.shape, self.vocab)  # (B, T, V)
        logits[:, :-1] = 50.0 * F.one_hot(idx[:, 1:], self.vocab)
        return logits, None


def test_honest_loss_does_not_let_a_model_read_the_answer() -> None:
    vocab = 7
    windows = torch.randint(0, vocab, (5, 17))
    leaky = F.cross_entropy(_Oracle(vocab)(windows[:, :-1])[0].flatten(0, 1), windows[:, 1:].flatten())
    # scored the usual way, the oracle is sure of every position but the last of 16
    torch.testing.assert_close(leaky, torch.tensor(math.log(vocab) / 16))
    torch.testing.assert_close(honest_loss(_Oracle(vocab), windows), math.log(vocab))


@pytest.mark.slow
def test_train_side_by_side_draws_and_reports(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the {w} sat on the {m} and then it slept.\n" for w in ("cat", "dog", "owl")
                              for m in ("mat", "rug", "log", "step")) * 60)
    lines = train_side_by_side("no-mask", seconds=2, out=tmp_path / "out", data=str(corpus), device="cpu",
                               progress=False)
    picture = tmp_path / "out" / "break-no-mask.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = "\n".join(lines)
    assert BUGS["no-mask"].title in text and f"picture: {picture}" in text
    rows = {label: [float(x) for x in re.findall(r"\d+\.\d+", line)] for line in lines for label in LABELS
            if line.strip().startswith(label) and "sample" not in line}
    assert set(rows) == set(LABELS) and all(len(r) == 2 for r in rows.values()), lines
    assert sum(line.startswith("  ") and "sample: " in line for line in lines) == 2, lines


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The use of `x.T`")  # the learner's `.T`, which torch warns about
def test_a_crashing_bug_is_one_line_beside_the_trained_reference(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question.\n" * 500)
    lines = train_side_by_side("dot-T", 1, tmp_path, data=str(corpus), device="cpu", progress=False)
    crashed = [line for line in lines if "crashed at step 1: RuntimeError" in line]
    assert len(crashed) == 1 and crashed[0].strip().startswith("dot-T"), lines
    assert (tmp_path / "break-dot-T.png").is_file()


def test_train_side_by_side_refuses_mistakes_in_one_line(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short to hold a window of 65 characters and a validation split")
    for kwargs, message in (({"name": "no-such-bug"}, "no-scale"), ({"seconds": 0}, "positive"),
                            ({"data": str(short)}, "too few")):
        with pytest.raises(ValueError, match=message):
            train_side_by_side(**{"name": "no-mask", "seconds": 1, "out": tmp_path, "data": str(short),
                                  **kwargs})
    assert not list(tmp_path.glob("*.png"))


def test_a_leak_trains_to_a_low_loss_that_honest_loss_sees_through(tmp_path: Path, one_thread: None) -> None:
    """On random text no model can beat log V; the unmasked one reads the next token and seems to."""
    vocab = 8
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (20_000,), generator=generator)
    held_out = torch.randint(0, vocab, (32, 17), generator=generator)  # (N, T + 1)
    found = {}
    for name in ("reference", "no-mask"):
        path = tmp_path / f"{name}.py"
        module = _import(write_reference(path) if name == "reference" else write_bug(name, path))
        torch.manual_seed(0)
        model = module.GPT(module.GPTConfig(vocab_size=vocab, block_size=16, n_layer=1, n_head=2, n_embd=32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(100):
            starts = torch.randint(0, len(text) - 17, (16,), generator=generator).tolist()
            windows = torch.stack([text[s:s + 17] for s in starts])  # (16, T + 1)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        found[name] = loss.item(), honest_loss(model, held_out)
    assert abs(found["reference"][0] - math.log(vocab)) < 0.1, found  # nothing to learn: log V
    assert abs(found["reference"][1] - math.log(vocab)) < 0.1, found
    assert found["no-mask"][0] < 0.3 * math.log(vocab), found  # it read the answers...
    assert found["no-mask"][1] > math.log(vocab), found  # ...which are not there when it must predict


# ---------------------------------------------------------------------------------------------
# The checks bite: `gptlab check` fails every bug at its section with its cause, and nothing else


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", ["reference", *BUGS])
@pytest.mark.slow
def test_check_catches_every_bug_and_fails_no_choice(name: str, tmp_path: Path) -> None:
    grade_module = pytest.importorskip("gptlab.handout.learner.grade")
    path = tmp_path / f"{name}.py"
    if name == "reference":
        write_reference(path)
    else:
        write_bug(name, path)
    checks = grade_module.grade(vars(_import(path)), grade_module.Names())
    failures = [f"{c.section} {c.name}: {c.cause}" for c in checks if c.passed is False]
    if name == "reference" or BUGS[name].kind == "choice":
        assert not failures, failures
        return
    bug = BUGS[name]
    caught = [c for c in checks if c.passed is False and c.section == bug.section
              and all(word.lower() in c.cause.lower() for word in bug.cause_words)]
    assert caught, f"{name}: no failure at {bug.section} whose cause says {bug.cause_words}; got {failures}"
