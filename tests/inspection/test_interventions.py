"""Ablation and interventions (handout §2.2): head removal checked against weight surgery on W_O and
against a hand-built model whose answer is known to come from one head; prompt edits checked against
plain forward passes of the edited prompt; the `ablate` and `intervene` commands; and every inspection
command on a Hugging Face-imported GPT-2."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.inference.loading import load
from gptlab.inspection.hooks import record
from gptlab.inspection.interventions import ablate_heads, edit_tokens, intervene
from gptlab.inspection.tokens import token_label
from gptlab.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the cat sat on"  # in the characters of conftest's INSPECT_TEXT, which `trained_run` learned
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- ablation


def previous_token_model(seed: int = 0) -> GPT:
    """A 2-layer, 4-head model built by hand whose next-token prediction copies the previous token.

    Residual features: 0-5 the token (one-hot), 6-7 the position as (cos, sin) of i * pi/8, 8-13 the
    copied token, 14-31 scratch. Layer 1's head 2 queries with the position turned back by one step,
    so it attends to position i - 1, and writes that token's one-hot into 8-13, which the vocabulary
    head reads. The other heads are random and write only small amounts into 8-31. No norms, no FFN.
    """
    V, D, H, hs, theta = 6, 32, 4, 8, math.pi / 8
    config = ModelConfig(vocab_size=V, block_size=8, n_layer=2, n_head=H, n_embd=D, norm="none", ffn="relu",
                         tied=False, bias=False)
    model = GPT(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight[:, :V] = torch.eye(V)
        angles = torch.arange(8.0) * theta
        model.transformer.wpe.weight[:, 6:8] = torch.stack([angles.cos(), angles.sin()], dim=1)
        for layer, block in enumerate(model.transformer.h):
            w, w_o = block.attn.c_attn.weight, block.attn.c_proj.weight  # (3D, D) = [W_Q; W_K; W_V], (D, D)
            for head in range(H):
                rows = torch.arange(head * hs, (head + 1) * hs)  # this head's features in q, k, v
                if (layer, head) != (1, 2):
                    for part in range(3):
                        w[part * D + rows] = 0.5 * torch.randn(hs, D, generator=generator)
                    w_o[8:, rows] = 0.1 * torch.randn(D - 8, hs, generator=generator)
                    continue
                c, s, sharp = math.cos(theta), math.sin(theta), 150 * math.sqrt(hs)  # cancels 1/sqrt(hs)
                w[rows[:2], 6:8] = sharp * torch.tensor([[c, s], [-s, c]])  # q_i = p_{i-1} (rotated back)
                w[D + rows[:2], 6:8] = torch.eye(2)  # k_j = p_j
                w[2 * D + rows[:V], :V] = torch.eye(V)  # v_j = the token one-hot
                w_o[8:8 + V, rows[:V]] = 5.0 * torch.eye(V)
        model.lm_head.weight[:, 8:8 + V] = torch.eye(V)
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ablation_finds_the_head_the_answer_depends_on(seed: int) -> None:
    model = previous_token_model(seed)
    ids = [3, 1, 4, 0, 5, 2]
    with record(model, ["h.1.attn.weights"]) as values:
        logits = model(torch.tensor([ids]))[0]
    assert values["h.1.attn.weights"][0, 2].diagonal(-1).min() > 0.99  # it does attend to i - 1
    assert logits[0, -1].argmax() == ids[-2]
    result = ablate_heads(model, ids)
    assert result.target == ids[-2]
    for by in ("zero", "mean"):
        first, second = result.ranked(by)[:2]
        assert (first.layer, first.head) == (1, 2)
        assert getattr(first, by) < -1.0 and abs(getattr(second, by)) < 0.1


def target_logprob(model: GPT, idx: torch.Tensor, target: int) -> torch.Tensor:
    return model(idx)[0][0, -1].log_softmax(-1)[target]


@pytest.mark.parametrize("layer, head", [(0, 1), (1, 0)])
def test_zero_and_mean_ablation_equal_surgery_on_w_o(layer: int, head: int, random_gpt: Any) -> None:
    model = random_gpt(1)
    idx = torch.tensor([[1, 5, 2, 7, 7, 0]])
    effects = ablate_heads(model, idx[0].tolist(), target=4).effects
    effect = next(e for e in effects if (e.layer, e.head) == (layer, head))
    base = target_logprob(model, idx, 4)
    with record(model, [f"h.{layer}.attn.heads"]) as v:
        model(idx)
    mean = v[f"h.{layer}.attn.heads"][0, :, head].mean(0)  # (hs,), over the prompt's positions
    columns = slice(head * 4, (head + 1) * 4)  # the head's input features of W_O
    zeroed, averaged = random_gpt(1), random_gpt(1)
    with torch.no_grad():  # a head reaches the residual stream only through its columns of W_O
        for surgery in (zeroed, averaged):
            surgery.transformer.h[layer].attn.c_proj.weight[:, columns] = 0
        w_o = model.transformer.h[layer].attn.c_proj.weight
        averaged.transformer.h[layer].attn.c_proj.bias += w_o[:, columns] @ mean  # a constant contribution
    assert_close(torch.tensor(effect.zero), target_logprob(zeroed, idx, 4) - base)
    assert_close(torch.tensor(effect.mean), target_logprob(averaged, idx, 4) - base)
    assert abs(effect.zero) > 1e-3 and abs(effect.mean) > 1e-3  # not trivially 0 = 0


# ------------------------------------------------------------------------------------ interventions


def test_edit_tokens_replaces_and_drops_by_position() -> None:
    assert edit_tokens([10, 11, 12, 13], replace=[(1, 99), (-1, 98)], drop=[0]) == [99, 12, 98]
    assert edit_tokens([10, 11, 12, 13], drop=[-2, 1]) == [10, 13]
    for replace, drop, message in (
        ([(4, 1)], [], r"^replace position 4 is outside the prompt's 4 tokens: use 0\.\.3, or -4\.\.-1"),
        ([], [-5], "^drop position -5 is outside"),
        ([(1, 5), (-3, 6)], [], "^replace names position 1 twice"),
        ([(2, 5)], [-2], "position 2 is both replaced and dropped"),
        ([], [0, 1, 2, 3], "^drop removes every token"),
    ):
        with pytest.raises(ValueError, match=message):
            edit_tokens([10, 11, 12, 13], replace, drop)


def test_intervene_compares_plain_forward_passes_of_both_prompts(random_gpt: Any) -> None:
    model = random_gpt(3)
    result = intervene(model, [1, 2, 3, 4, 5], replace=[(0, 9)], drop=[2])
    assert result.after == [9, 2, 4, 5]
    for ids, probs in ((result.before, result.probs_before), (result.after, result.probs_after)):
        assert_close(probs, F.softmax(model(torch.tensor([ids]))[0][0, -1], dim=-1))
    rows = result.top(3)
    tops = {*result.probs_before.topk(3).indices.tolist(), *result.probs_after.topk(3).indices.tolist()}
    assert {token for token, _, _ in rows} == tops and len(rows) == len(tops)
    assert [max(b, a) for _, b, a in rows] == sorted((max(b, a) for _, b, a in rows), reverse=True)


def table_rows(out: str, columns: int) -> list[list[str]]:
    """Whitespace-split lines of a printed table that have `columns` fields, the last ones numbers."""
    number = re.compile(r"^[+-]?\d+(\.\d+)?(e[+-]\d+)?$")
    rows = [line.split() for line in out.splitlines()]
    return [row for row in rows if len(row) == columns and all(number.match(f) for f in row[-3:])]


def test_intervene_command(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    # "the cat sat on": c a t are tokens 4 5 6
    args = ["intervene", str(trained_run), "--prompt", PROMPT, "--replace", "4=d", "--replace", "5=o",
            "--replace=-8=g", "--drop=-1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "before: 'the cat sat on' (14 tokens)" in out and "after:  'the dog sat o' (13 tokens)" in out
    assert "replaced position 6: 't' -> 'g'" in out and "dropped position 13: 'n'" in out
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    with torch.no_grad():
        after = F.softmax(model(torch.tensor([tokenizer.encode("the dog sat o")]))[0][0, -1], dim=-1)
    rows = table_rows(out, 4)
    assert len(rows) >= 5
    token_of = {f"'{token_label(tokenizer, t)}'": t for t in range(tokenizer.vocab_size)}
    for label, before, p_after, change in rows:
        token = token_of[label]
        assert abs(float(p_after) - float(after[token])) < 1e-4
        assert abs(float(change) - (float(p_after) - float(before))) < 2e-4


@pytest.mark.parametrize(("args", "message"), [
    (["--replace", "4=dog"], "--replace 'dog' is 3 tokens for the char tokenizer; give text that is exactly"),
    (["--replace", "4"], "--replace '4' must be POS=TOKEN"),
    (["--drop", "40"], "--drop position 40 is outside the prompt's 14 tokens"),
    (["--replace", "1=Q"], "character 'Q' at position 0 is not in the char tokenizer's vocabulary"),
    ([], "nothing to change: give --replace POS=TOKEN or --drop POS"),
    (["--drop", "0", "--prompt", "the cat " * 4],
     "--prompt is 32 tokens but the model sees at most block_size=24: shorten the prompt"),
])
def test_intervene_mistakes_are_one_line(trained_run: Path, capsys: pytest.CaptureFixture, args: list[str],
                                         message: str) -> None:
    assert main(["intervene", str(trained_run), "--prompt", PROMPT, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and message in err and err.count("\n") == 1


def test_ablate_command_prints_a_sorted_table_and_a_heatmap(trained_run: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out_png = tmp_path / "heads.png"
    assert main(["ablate", str(trained_run), "--prompt", PROMPT, "--target", " ", "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, 4)
    assert [(int(r[0]), int(r[1])) for r in rows] != [] and len(rows) == 4  # 2 layers x 2 heads
    assert [float(r[2]) for r in rows] == sorted(float(r[2]) for r in rows)  # largest drop first
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    result = ablate_heads(model, tokenizer.encode(PROMPT), target=tokenizer.encode(" ")[0])
    assert f"target next token '\u2423': log p = {result.logprob:.4f}" in out
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    assert main(["ablate", str(trained_run), "--prompt", PROMPT, "--target", "at"]) == 2
    assert "--target 'at' is 2 tokens" in capsys.readouterr().err


# --------------------------------------------------------------------------------- every command, two models


@pytest.mark.slow  # builds and imports a Hugging Face GPT-2
def test_every_command_on_an_imported_hugging_face_gpt2(hf_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    run = str(hf_run)
    assert main(["attention", run, "--prompt", PROMPT, "--out", str(tmp_path / "a.png")]) == 0
    assert main(["attention", run, "--prompt", PROMPT, "--out", str(tmp_path / "a.html"), "--layer=1"]) == 0
    assert main(["ablate", run, "--prompt", PROMPT, "--out", str(tmp_path / "b.png")]) == 0
    assert main(["intervene", run, "--prompt", PROMPT, "--replace", "0=x"]) == 0
    assert main(["verify", run]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "a.png").read_bytes()[:8] == (tmp_path / "b.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "2 layer(s) x 2 head(s)" in out and "1 layer(s) x 2 head(s)" in out
    assert "0 failed" in out and "n/a" not in out.split("tied head")[1].splitlines()[0]
