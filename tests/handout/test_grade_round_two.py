"""`gptlab check` never fails correct code for the way it is written (issue 39): a fused projection laid
out per head, a block class the tool cannot build (checked inside the model instead), LayerNorm with the
unbiased variance, attention written for one matrix at a time, and a block built on torch's own
nn.MultiheadAttention. Each file here is correct, so any FAIL is the checker's defect."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from gptlab.handout.learner.grade import LearnerError, Names, grade
from gptlab.handout.properties import Check

TINY_LM = '''
class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd, n_head, n_layer):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([BLOCK for _ in range(n_layer)])
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
'''

INTERLEAVED = '''
import math
import torch
from torch import nn
import torch.nn.functional as F

class MultiHeadAttention(nn.Module):
    """One fused projection, each head's q, k and v rows side by side (a view as (B, T, H, 3, hs))."""
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, self.h, 3, D // self.h).permute(3, 0, 2, 1, 4)  # 3 x (B, H, T, hs)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.h)
        y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))
'''

EXTRA_ARGUMENT = '''
import torch
from torch import nn
import torch.nn.functional as F

class Block(nn.Module):
    """A block whose constructor takes an argument no checker can guess."""
    def __init__(self, n_embd, n_head, fill):
        super().__init__()
        self.fill = fill
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        T = x.size(1)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: hidden
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))
''' + TINY_LM.replace("BLOCK", "Block(n_embd, n_head, fill=float('-inf'))")

UNBIASED_NORM = '''
import torch
from torch import nn

class Norm(nn.Module):
    """LayerNorm by hand, dividing by the unbiased variance."""
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.gain, self.shift = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=True)
        return self.gain * (x - mean) / torch.sqrt(var + self.eps) + self.shift
'''

ONE_MATRIX = '''
import math
import torch

def attention(q, k, v):
    """One (T, d) matrix at a time, as the handout writes it: softmax(Q K^T / sqrt(d)) V."""
    scores = torch.mm(q, k.t()) / math.sqrt(q.shape[1])
    return torch.softmax(scores, dim=1) @ v
'''


def globals_of(folder: Path, name: str, text: str) -> dict[str, Any]:
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return vars(module)


def failures(checks: list[Check]) -> list[str]:
    return [f"{c.section} {c.name}: {c.computed} ({c.cause})" for c in checks if c.passed is False]


def test_a_fused_projection_laid_out_per_head_is_read_as_such(tmp_path: Path) -> None:
    checks = grade(globals_of(tmp_path, "interleaved", INTERLEAVED), Names())
    assert not failures(checks), failures(checks)
    written = next(c for c in checks if c.section == "§4.2")
    assert written.passed and "interleaved" in written.note
    assert [c.passed for c in checks if c.section == "§4.1"] == [True, True, True]


def test_a_block_the_tool_cannot_build_is_checked_inside_the_model(tmp_path: Path) -> None:
    checks = grade(globals_of(tmp_path, "extra_argument", EXTRA_ARGUMENT), Names())
    assert not failures(checks), failures(checks)
    block = [c for c in checks if c.section == "§5" and c.passed]
    assert len(block) >= 5  # the norms and the arrangement, measured on the model's own blocks
    causal = [c for c in checks if c.section == "§7.3" and "ignores" in c.name]
    assert causal and all(c.passed for c in causal)


def test_layer_norm_with_the_unbiased_variance_passes_with_a_note(tmp_path: Path) -> None:
    block = EXTRA_ARGUMENT.split("class GPT")[0].replace("nn.LayerNorm(n_embd)", "Norm(n_embd)")
    text = UNBIASED_NORM + block.replace("n_head, fill)", "n_head, fill=None)")
    checks = grade(globals_of(tmp_path, "unbiased_norm", text), Names())
    assert not failures(checks), failures(checks)
    variance = next(c for c in checks if c.name == "LayerNorm: per-token variance over features")
    assert variance.passed and "unbiased" in variance.note
    assert f"{15 / 16:.4f}" in variance.expected  # (D - 1) / D at the block's D = 16


def test_attention_for_one_matrix_at_a_time_skips_the_rank_checks(tmp_path: Path) -> None:
    checks = grade(globals_of(tmp_path, "one_matrix", ONE_MATRIX), Names())
    assert not failures(checks), failures(checks)
    ranks = [c for c in checks if c.name.startswith("rank-")]
    assert ranks and all(c.passed is None and "one (T, d) matrix" in c.note for c in ranks)
    assert sum(c.passed is True for c in checks) >= 12


REQUIRED_MASK = '''
import math
import torch
from torch import nn

def attention(q, k, v, mask):
    """The mask is required: 1 where a query may see a key, 0 where it may not."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = scores.softmax(-1)
    return weights @ v, weights

class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.c_attn(x).split(D, dim=-1))
        y = attention(q, k, v, mask)[0]
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))
'''


def test_a_required_mask_argument_gets_one_that_hides_nothing(tmp_path: Path) -> None:
    checks = grade(globals_of(tmp_path, "required_mask", REQUIRED_MASK), Names())
    assert not failures(checks), failures(checks)
    assert sum(c.passed is True for c in checks) >= 20
    masked = next(c for c in checks if c.name.startswith("masked: output i ignores"))
    assert masked.passed  # the causal mask, in the function's own convention


OUTSIDE = Path(__file__).parent / "outside"


@pytest.mark.slow
def test_a_correct_outside_file_never_fails_without_its_flags() -> None:
    """A learner who passes no flag gets SKIPs or one ERROR naming a flag, never a FAIL (issue 39)."""
    for path in sorted(OUTSIDE.glob("ok_*.py")):
        namespace = globals_of(OUTSIDE, path.stem, path.read_text(encoding="utf-8"))
        if not namespace["FLAGS"]:
            continue  # graded without flags by test_outside_corpus.py
        try:
            checks = grade(namespace, Names())
        except LearnerError as error:  # the one ERROR line: it names the flag to pass
            assert "--" in str(error), (path.name, str(error))
            continue
        assert not failures(checks), (path.name, failures(checks))
