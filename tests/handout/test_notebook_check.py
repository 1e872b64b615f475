"""Tests for gptlab.check (gptlab.handout.learner.notebook): the handout's checks on live objects, in process.

The fast tests call gptlab.check on functions, classes and instances written here in plain PyTorch; the
slow one executes check_in_notebook.ipynb in a real Jupyter kernel (nbclient, ipykernel: the
notebook-tests extra) and reads what its cells displayed.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gptlab
from gptlab.handout.learner import notebook
from gptlab.handout.learner.formats import check_line

NOTEBOOK = Path(__file__).parent / "check_in_notebook.ipynb"
LINE = re.compile(r"^  (PASS|FAIL|SKIP)  §")
WRONG_AXIS = "softmax over the query axis"


def scaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The handout's attention; mask True where query i may see key j."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def wrong_axis(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The classic slip: the softmax normalises over the queries."""
    return (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(dim=-2) @ v


class Heads(nn.Module):
    """Fused multi-head attention, the heads averaged instead of concatenated where `average` (a bug)."""

    def __init__(self, d_model: int, n_head: int, causal: bool = False, average: bool = False) -> None:
        super().__init__()
        self.n_head, self.causal, self.average = n_head, causal, average
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def heads(self) -> int:
        return self.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads(), -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, T, hs)
        if self.average:
            y = y.mean(1, keepdim=True).expand_as(y)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Anonymous(Heads):
    """The same module keeping its head count under a name the checks do not know."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__(d_model, n_head)
        self.groups = self.__dict__.pop("n_head")

    def heads(self) -> int:
        return self.groups


@dataclass
class TinyConfig:
    vocab_size: int = 11
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16


class TinyBlock(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        D = config.n_embd
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Heads(D, config.n_head, causal=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(TinyBlock(config) for _ in range(config.n_layer))
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Unbuildable(nn.Module):
    def __init__(self, weights_file: str) -> None:
        super().__init__()


def verdicts(result: notebook.CheckResult) -> dict[str, list[str]]:
    """Check names by verdict."""
    found: dict[str, list[str]] = {"PASS": [], "FAIL": [], "SKIP": []}
    for c in result.checks:
        found[{True: "PASS", False: "FAIL", None: "SKIP"}[c.passed]].append(f"{c.section} {c.name}")
    return found


def test_gptlab_check_is_the_lazy_public_name() -> None:
    assert gptlab.check is notebook.check


def test_correct_function_and_classes_pass_and_print_as_gptlab_check_does() -> None:
    result = gptlab.check(attention=scaled_attention, heads=Heads, model=TinyGPT)
    assert result.failed == 0 and result.ok and result.error is None, str(result)
    assert result.passed + result.skipped == len(result.checks) and result.passed >= 30
    lines = str(result).splitlines()
    assert "no time or memory limit" in lines[0] and "attention=scaled_attention" in lines[0]
    assert lines[1:-1] == ["  " + check_line(c) for c in result.checks]
    assert lines[-1] == f"  {result.passed} passed, 0 failed, {result.skipped} skipped"
    assert repr(result) == str(result)
    sections = {c.section for c in result.checks if c.passed}
    assert {"§2.1", "§3.1", "§3.2", "§4", "§4.1", "§4.2", "§5", "§7.1", "§7.3"} <= sections
    assert "§4 attention parameters, D=8, H=2" in verdicts(result)["PASS"]  # the class, at the handout's D, H


def test_the_wrong_axis_fails_with_its_cause_and_kinds_not_given_say_so() -> None:
    result = gptlab.check(attention=wrong_axis)
    assert result.failed > 0 and not result.ok
    failures = [c for c in result.checks if c.passed is False]
    assert all(WRONG_AXIS in c.cause for c in failures)
    assert any(line.startswith("  FAIL  §2.1  retrieval output y") and WRONG_AXIS in line
               for line in str(result).splitlines())
    not_given = {c.section: c.note for c in result.checks if c.note.startswith("not given")}
    assert set(not_given) == {"§4", "§5", "§7.3"} and "heads=" in not_given["§4"]


def test_instances_are_checked_on_a_copy_at_their_own_sizes() -> None:
    heads = Heads(32, 4).train()
    model = TinyGPT(TinyConfig(vocab_size=50, n_embd=32, n_head=4))
    before = {name: p.clone() for name, p in [*heads.named_parameters(), *model.named_parameters()]}
    result = gptlab.check(heads=heads, model=model)
    assert result.failed == 0 and result.ok, str(result)
    assert "heads=Heads instance" in result.title and "model=TinyGPT instance" in result.title
    after = dict([*heads.named_parameters(), *model.named_parameters()])
    assert all(torch.equal(before[name], p) for name, p in after.items())  # model checks redraw weights
    assert heads.training and model.training
    skipped = {c.section: c.note for c in result.checks if c.passed is None}
    assert "an instance is checked at its own sizes" in skipped["§4"]
    assert "an instance is checked at its own sizes" in skipped["§4.1"]
    assert "§4.2 module equals its projections written out per head" in verdicts(result)["PASS"]
    assert "§7.3 output i ignores tokens after i (replacing them)" in verdicts(result)["PASS"]


def test_an_instance_that_hides_its_head_count_skips_what_needs_it_and_bugs_still_fail() -> None:
    hidden = gptlab.check(heads=Anonymous(32, 4))
    assert hidden.failed == 0, str(hidden)
    assert "states no head count" in next(c.note for c in hidden.checks if c.section == "§4.2")
    averaged = gptlab.check(heads=Heads(32, 4, average=True))
    assert "§4.2 module equals its projections written out per head" in verdicts(averaged)["FAIL"]


def test_a_block_instance_and_a_model_class_that_cannot_be_built() -> None:
    block = gptlab.check(block=TinyBlock(TinyConfig(n_embd=24, n_head=3)))
    assert block.failed == 0 and any(c.section == "§5" and c.passed for c in block.checks), str(block)
    result = gptlab.check(attention=scaled_attention, model=Unbuildable)
    assert [c.name for c in result.checks if c.section == "§7.1"] == ["Unbuildable builds"]
    assert "language model" not in [c.name for c in result.checks]  # grade's line for a missing model
    assert "pass an instance" in result.checks[-1].note and result.error is None


def test_the_html_table_colours_each_verdict_and_escapes_the_text() -> None:
    result = gptlab.check(attention=wrong_axis, heads=Heads(32, 4, average=True))
    page = result._repr_html_()
    assert page.count("<tr") == len(result.checks) + 1  # the header row, then one row per check
    for verdict, colour in (("PASS", "#1a7f37"), ("FAIL", "#cf222e"), ("SKIP", "#6e7781")):
        assert re.search(f"background:{colour};font-weight:bold\">{verdict}</td>", page)
    assert "no time or memory limit" in page and "&lt;tensor of shape" in page and "<tensor" not in page
    assert WRONG_AXIS in page and f"{result.passed} passed, {result.failed} failed" in page


def test_what_cannot_be_checked_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="needs attention="):
        gptlab.check()
    with pytest.raises(TypeError, match="attention= takes a function"):
        gptlab.check(attention=Heads)
    with pytest.raises(TypeError, match="heads= takes an nn.Module"):
        gptlab.check(heads=scaled_attention)  # type: ignore[arg-type]


def _outputs(cell: dict[str, Any]) -> tuple[str, str]:
    """A cell's text (streams and text/plain) and its text/html, joined."""
    text, page = [], []
    for output in cell["outputs"]:
        if output["output_type"] == "stream":
            text.append(output["text"])
        elif output["output_type"] in ("execute_result", "display_data"):
            text.append(output["data"].get("text/plain", ""))
            page.append(output["data"].get("text/html", ""))
        elif output["output_type"] == "error":
            raise AssertionError("\n".join(output["traceback"]))
    return "\n".join(text), "\n".join(page)


def _kernel(folder: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec running this interpreter (so the kernel imports this gptlab), found first by name."""
    spec = folder / "kernels" / "gptlab-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gptlab test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(folder))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(folder / "runtime"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("IPYTHONDIR", str(folder / "ipython"))  # the kernel's profile, not the user's
    return "gptlab-test"


@pytest.mark.slow
def test_the_notebook_shows_pass_lines_and_the_wrong_axis_failure(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    why = "the notebook test needs nbclient and ipykernel: pip install 'gptlab[notebook-tests]'"
    nbclient = pytest.importorskip("nbclient", reason=why)
    pytest.importorskip("ipykernel", reason=why)
    import nbformat

    book = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, startup_timeout=120,
                                     kernel_name=_kernel(tmp_path, monkeypatch),
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    started = time.monotonic()
    client.execute()
    print(f"notebook executed in {time.monotonic() - started:.1f} s")
    cells = {tag: cell for cell in book.cells for tag in cell.metadata.get("tags", [])}
    assert "torch imported by import gptlab: False" in _outputs(cells["imports"])[0]
    text, page = _outputs(cells["correct"])
    lines = text.splitlines()
    assert "no time or memory limit" in lines[0] and sum(bool(LINE.match(x)) for x in lines) >= 30
    assert "  PASS  §2.1  retrieval output y" in lines and "FAIL" not in text and "FAIL" not in page
    assert "<table" in page and page.count(">PASS</td>") >= 30
    text, page = _outputs(cells["wrong-axis"])
    lines = text.splitlines()
    assert any(x.startswith("  FAIL  §2.1  retrieval output y") and WRONG_AXIS in x for x in lines)
    assert ">FAIL</td>" in page and WRONG_AXIS in page
    text, page = _outputs(cells["instances"])
    assert "failed=0" in text and "FAIL" not in page and "an instance is checked at its own sizes" in text
