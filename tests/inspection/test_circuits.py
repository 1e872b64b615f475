"""Circuits: attention-only models, head detectors, the logit lens, activation patching and heads over
training, each checked against a model wired by hand whose answer is known."""

from __future__ import annotations

import csv
import html
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from gptlab.cli import main
from gptlab.config import ModelConfig, SamplingConfig, TrainConfig
from gptlab.generate import generate
from gptlab.inference.loading import load
from gptlab.inspection.detectors import repeat_ablation, repeated_tokens, score_heads
from gptlab.inspection.hooks import hook_points, record
from gptlab.inspection.lens import logit_lens, stage_points
from gptlab.inspection.patching import patch_activations, patch_value
from gptlab.inspection.tokens import token_label
from gptlab.model import GPT
from gptlab.text.tokenizer import tokenizer_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

V, N = 8, 8  # vocabulary; tokens per half of the detectors' probe (min(32, block_size // 2, V))
TOKEN, POS, PREV, ANSWER, FIRST, ONE = 0, 8, 10, 18, 26, 27  # where each feature starts in the stream
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def induction_model() -> GPT:
    """A 2-layer, 2-head attention-only model wired by hand to run an induction circuit.

    Residual features: 0-7 the token (one-hot), 8-9 the position as (cos, sin) of i * pi/16, 10-17 the
    previous token (written by layer 0 head 0), 18-25 the answer (written by layer 1 head 0 and read by
    the head), 26 "is position 0", 27 a constant 1. Layer 0 head 0 queries with the position turned
    back one step, so it attends to i - 1, and copies that token into 10-17. Layer 1 head 0 queries
    with the current token against keys 10-17, so it attends to the position after an earlier copy of
    the current token, and copies that position's token into the answer. Layer 0 head 1 attends to
    position 0 and writes nothing; layer 1 head 1 is all zeros. No norms.
    """
    D, hs, theta = 32, 16, math.pi / 16
    config = ModelConfig(vocab_size=V, block_size=2 * N, n_layer=2, n_head=2, n_embd=D, norm="none",
                         ffn="none", tied=False, bias=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight[:, TOKEN:TOKEN + V] = torch.eye(V)
        angles = torch.arange(2 * N) * theta
        wpe = model.transformer.wpe.weight
        wpe[:, POS:POS + 2] = torch.stack([angles.cos(), angles.sin()], dim=1)
        wpe[0, FIRST], wpe[:, ONE] = 1.0, 1.0
        (w0, o0), (w1, o1) = ((b.attn.c_attn.weight, b.attn.c_proj.weight) for b in model.transformer.h)
        q, k, v = 0, D, 2 * D  # row offsets of W_Q, W_K, W_V in the fused (3D, D) weight
        c, s = math.cos(theta), math.sin(theta)
        w0[q:q + 2, POS:POS + 2] = 2000.0 * torch.tensor([[c, s], [-s, c]])  # q_i = p_{i-1}, sharply
        w0[k:k + 2, POS:POS + 2] = torch.eye(2)  # k_j = p_j
        w0[v:v + V, TOKEN:TOKEN + V] = torch.eye(V)  # v_j = the token at j
        o0[PREV:PREV + V, 0:V] = torch.eye(V)  # ... written into "previous token"
        w0[q + hs, ONE] = 200.0  # head 1: the same query everywhere ...
        w0[k + hs, FIRST] = 1.0  # ... matching only position 0; its values stay zero
        w1[q:q + V, TOKEN:TOKEN + V] = 200.0 * torch.eye(V)  # q_i = the current token
        w1[k:k + V, PREV:PREV + V] = torch.eye(V)  # k_j = the token before j
        w1[v:v + V, TOKEN:TOKEN + V] = torch.eye(V)  # v_j = the token at j
        o1[ANSWER:ANSWER + V, 0:V] = torch.eye(V)
        model.lm_head.weight[:, ANSWER:ANSWER + V] = 20.0 * torch.eye(V)
    return model


# --------------------------------------------------------------------------------------- the model


def test_attention_only_cached_generation_equals_recomputation(random_gpt: Any) -> None:
    model = random_gpt(3, ffn="none", n_kv_head=1)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    cached = torch.cat(list(generate(model, [[1, 2, 3]], greedy)), dim=1)
    recomputed = torch.cat(list(generate(model, [[1, 2, 3]], greedy, use_cache=False)), dim=1)
    assert torch.equal(cached, recomputed)
    assert not any(".mlp." in name for name in hook_points(model))


# ------------------------------------------------------------------------------------- detectors


def test_hand_wired_heads_score_the_jobs_they_were_wired_for() -> None:
    scores = score_heads(induction_model())
    s = scores.scores  # detector -> (L, H)
    assert scores.length == N
    assert s["previous_token"][0, 0] > 0.99
    assert s["first_token"][0, 1] > 0.99
    # at i = n the first position also "follows" x_0 (it holds itself as its previous token): 1/2 there
    assert s["induction"][1, 0] > 0.9
    wired = {"previous_token": (0, 0), "first_token": (0, 1), "induction": (1, 0)}
    for detector, (layer, head) in wired.items():
        others = [float(s[detector][i, j]) for i in range(2) for j in range(2) if (i, j) != (layer, head)]
        assert max(others) < 0.35, (detector, others)
    assert all(((v >= 0) & (v <= 1)).all() for v in s.values())
    # every repeated token is predicted, but the first one scored (i = n) only half: ln 2 over n - 1 targets
    assert scores.repeat_loss == pytest.approx(math.log(2) / (N - 1), abs=0.01)


def test_zeroing_the_circuit_raises_the_repeat_loss_and_nothing_else_does() -> None:
    change = repeat_ablation(induction_model())  # (L, H), nats
    assert change[0, 0] > 1.0 and change[1, 0] > 1.0
    assert change[0, 1] == 0.0 and change[1, 1] == 0.0  # they write nothing into the stream


def test_probe_is_distinct_tokens_repeated_and_leaves_the_global_generator_alone() -> None:
    state = torch.get_rng_state()
    idx = repeated_tokens(50, 10, 4, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(idx[:, :10], idx[:, 10:])
    assert all(len(set(row[:10].tolist())) == 10 for row in idx)
    assert torch.equal(idx, repeated_tokens(50, 10, 4, seed=3))


def test_recording_for_the_tools_keeps_the_logits_bit_identical(random_gpt: Any) -> None:
    for model in (random_gpt(1), random_gpt(2, ffn="none", n_head=4, n_embd=16, n_kv_head=2)):
        idx = torch.randint(0, 13, (3, 8))
        plain = model(idx)[0]
        names = [*stage_points(model), *(f"h.{n}.attn.{p}" for n in range(2) for p in ("weights", "heads"))]
        with record(model, names) as values:
            recorded = model(idx)[0]
        assert torch.equal(plain, recorded)
        assert values["h.1.attn.weights"].shape == (3, model.config.n_head, 8, 8)
        assert score_heads(model).scores["induction"].shape == (2, model.config.n_head)  # per query head


# ------------------------------------------------------------------------------------- the lens


def test_lens_last_stage_is_the_model_and_the_answer_appears_after_block_1() -> None:
    model = induction_model()
    ids = [3, 1, 4, 0, 5, 3, 1, 4, 0]
    tokenizer = tokenizer_from_dict({"kind": "char", "chars": "abcdefgh"})
    lens = logit_lens(model, tokenizer, "dbeafdbea", ids)
    own = model(torch.tensor([ids]))[0][0].float().softmax(-1)  # (T, V)
    # the lens runs the head on all stages at once (S, T, D), the model on one (1, T, D): different shapes,
    # which a BLAS may block differently, so within float32 rounding, not bit for bit
    assert_close(lens.top_probs[-1], own.topk(5, dim=-1).values)
    assert lens.stages == ["embed", "block 0", "block 1"]
    assert (lens.next_probs[2, 6:] > 0.99).all()  # positions 6 and 7 find their answer by induction
    assert (lens.next_probs[:2, 5:] < 0.2).all()  # nothing before block 1 writes the answer


# ------------------------------------------------------------------------------------- patching

# A patched run repeats the clean run's arithmetic downstream of the patch, but only as long as every
# kernel computes a row the same way whatever the other rows hold; BLAS libraries and GPU kernels do not
# promise that (the batch or the blocking may change the summation order), so "the same" is to rounding.
# The fraction restored divides a logit difference by the clean-corrupted gap: float32 rounding of
# logits of a few units (1e-6) over the random model's gap of 0.025 stays below 1e-4; a value that
# truly carries part of the prediction moves the fraction by a tenth or more.
PATCH_ATOL = 1e-3


def test_patching_the_whole_residual_stream_restores_one(random_gpt: Any) -> None:
    model = random_gpt(4)
    clean, corrupt = [1, 5, 2, 7, 7, 0], [1, 5, 9, 7, 3, 0]
    result = patch_activations(model, clean, corrupt)
    idx, bad = torch.tensor([clean]), torch.tensor([corrupt])
    for point in stage_points(model):
        with record(model, [point]) as values:
            clean_logits = model(idx)[0]
        assert_close(patch_value(model, bad, point, values[point], (slice(None),)), clean_logits)
    # the last position's last stage is its whole prediction; nothing else at the last stage reaches it
    assert_close(result.residual[-1], torch.eye(6)[-1], atol=PATCH_ATOL, rtol=0)
    assert_close(result.residual[0, [0, 1, 3, 5]], torch.zeros(4), atol=PATCH_ATOL, rtol=0)  # prompts agree


def test_patching_traces_the_hand_wired_induction_path() -> None:
    model = induction_model()
    # clean: ... 4 0 ... 4 -> 0 by induction; corrupt: the 4 before the 0 is now 2, so nothing follows 4
    clean, corrupt = [3, 1, 4, 0, 5, 6, 1, 4], [3, 1, 2, 0, 5, 6, 1, 4]
    result = patch_activations(model, clean, corrupt)
    assert result.target == 0 and result.clean > result.corrupted
    assert result.heads[0, 0] > 0.9 and result.heads[1, 0] > 0.9  # previous-token head, then induction head
    assert_close(result.heads[:, 1], torch.zeros(2), atol=PATCH_ATOL, rtol=0)  # they write nothing
    assert result.residual[0, 2] > 0.9  # the input token at the changed position ...
    assert result.residual[1, 3] > 0.9  # ... moved one position on by layer 0 ...
    # ... and to the last position by layer 1
    assert_close(result.residual[2, -1], torch.tensor(1.0), atol=PATCH_ATOL, rtol=0)


def test_patching_refuses_prompts_of_different_lengths(random_gpt: Any) -> None:
    with pytest.raises(ValueError, match="clean is 3 tokens but corrupt is 2"):
        patch_activations(random_gpt(0), [1, 2, 3], [1, 2])


# ------------------------------------------------------------------------------------- commands


@pytest.mark.slow
def test_heads_lens_and_patch_commands(trained_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    run = str(trained_run)
    assert main(["heads", run, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["layer"], r["head"]) for r in rows] != [] and len(rows) == 4
    for row in rows:
        assert set(row) == {"layer", "head", "previous_token", "duplicate_token", "induction", "first_token"}
        assert all(0.0 <= row[d] <= 1.0 for d in row if d not in ("layer", "head"))
    assert [r["induction"] for r in rows] == sorted((r["induction"] for r in rows), reverse=True)
    assert main(["heads", run, "--ablate", "--out", str(tmp_path / "h.png")]) == 0
    assert "ablated" in capsys.readouterr().out
    assert main(["lens", run, "--prompt", "the cat sat on", "--out", str(tmp_path / "l.png"),
                 "--position=-1"]) == 0
    assert main(["patch", run, "--clean", "the cat sat on", "--corrupt", "the dog sat on",
                 "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "block 1" in out and "position 13" in out and "share of the difference restored" in out
    for name in ("h.png", "l.png", "p.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE


def test_lens_page_shows_the_lens_and_the_models_own_prediction(trained_run: Path, tmp_path: Path) -> None:
    prompt = "the cat sat on"
    assert main(["lens", str(trained_run), "--prompt", prompt, "--out", str(tmp_path / "l.html")]) == 0
    page = (tmp_path / "l.html").read_text(encoding="utf-8")
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    ids = tokenizer.encode(prompt)
    lens = logit_lens(model, tokenizer, prompt, ids)
    rows = re.findall(r"<tr><th>(.*?)</th>(.*?)</tr>", page)
    assert [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", rows[0][1])] == lens.labels
    assert [html.unescape(stage) for stage, _ in rows[1:]] == lens.stages
    cell = re.compile(r'<td title="(.*?)" style="background:rgba\(40,110,200,([0-9.]+)\)">(.*?)</td>')
    cells = [cell.findall(row) for _, row in rows[1:]]  # per stage: (top five, p(next), top token) each
    assert [[html.unescape(top) for _, _, top in row] for row in cells] == [
        [token_label(tokenizer, int(i)) for i in stage[:, 0]] for stage in lens.top_ids]
    shaded = torch.tensor([[float(p) for _, p, _ in row] for row in cells])  # (S, T); the last has no next
    assert_close(shaded[:, :-1], lens.next_probs, atol=5e-4, rtol=0)
    # The last stage is the model itself: its top five on the page are the softmax of its own logits.
    with torch.no_grad():
        own = model(torch.tensor([ids]))[0][0].softmax(-1).topk(5)  # (T, 5)
    pairs = [re.findall(r"(.+?) ([0-9.]+)(?:, |$)", html.unescape(title)) for title, _, _ in cells[-1]]
    assert [[label for label, _ in row] for row in pairs] == [
        [token_label(tokenizer, int(i)) for i in row] for row in own.indices]
    assert_close(torch.tensor([[float(p) for _, p in row] for row in pairs]), own.values, atol=5e-4, rtol=0)


@pytest.mark.parametrize(("args", "message"), [
    (["heads", "RUN", "--layer", "2"], "--layer 2 does not exist: the model has 2, numbered 0..1"),
    (["heads", "RUN", "--head", "-1"], "argument --head: -1 is not an integer of at least 0"),
    (["heads", "RUN", "--history"], "holds no head scores: train with --track-heads"),
    (["lens", "RUN", "--prompt", "the cat", "--position", "7"], "--position position 7 is outside"),
    (["lens", "RUN", "--prompt", ""], "--prompt encodes to no tokens"),
    (["lens", "RUN", "--prompt", "the Cat"], "not in the char tokenizer's vocabulary"),
    (["patch", "RUN", "--clean", "the cat", "--corrupt", "the ca"], "--clean is 7 tokens but --corrupt is 6"),
    (["patch", "RUN", "--clean", "the cat " * 4, "--corrupt", "a"], "--clean is 32 tokens but the model"),
    (["patch", "RUN", "--clean", "the cat", "--corrupt", "the cat"], "nothing to restore"),
    (["patch", "RUN", "--clean", "the cat", "--corrupt", "the dog", "--target", "at"], "--target 'at' is 2"),
])
def test_tool_mistakes_are_one_line(trained_run: Path, capsys: pytest.CaptureFixture, args: list[str],
                                    message: str) -> None:
    assert main([str(trained_run) if a == "RUN" else a for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and message in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------- training


@pytest.mark.slow  # trains 4 steps (2 s)
def test_track_heads_writes_scores_at_every_evaluation(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gptlab.data.prepare import prepare
    from gptlab.training.loop import train

    (tmp_path / "text.txt").write_text("abcdefgh" * 200, encoding="utf-8")
    prepare(str(tmp_path / "text.txt"), tmp_path / "data", tokenizer="char", progress=False)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, ffn="none")
    steps = TrainConfig(batch_size=4, max_steps=4, eval_interval=2, eval_batches=1, warmup_steps=1,
                        device="cpu", precision="float32", track_heads=True)
    train(tmp_path / "run", tmp_path / "data", model, steps, progress=False)
    with (tmp_path / "run" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["0", "2", "4"]
    scores = [float(row[f"L{layer}H{head}_{d}"]) for row in rows for layer in range(2) for head in range(2)
              for d in ("previous_token", "duplicate_token", "induction", "first_token")]
    assert len(scores) == 3 * 16 and all(0.0 <= s <= 1.0 for s in scores)
    assert all(float(row["repeat_loss"]) > 0 for row in rows)
    assert main(["heads", str(tmp_path / "run"), "--history", "--out", str(tmp_path / "history.png")]) == 0
    assert "3 evaluations, steps 0 to 4" in capsys.readouterr().out
    assert (tmp_path / "history.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow  # trains 12 steps twice
def test_resume_with_track_heads_is_exact(tmp_path: Path) -> None:
    from gptlab.checkpoint import LAST, load_checkpoint
    from gptlab.data.prepare import prepare
    from gptlab.training.loop import train
    from gptlab.training.resume import resume

    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n" * 80, encoding="utf-8")
    prepare(str(tmp_path / "text.txt"), tmp_path / "data", tokenizer="char", progress=False)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, dropout=0.1)
    steps = TrainConfig(batch_size=4, max_steps=12, eval_interval=4, eval_batches=1, warmup_steps=2,
                        device="cpu", precision="float32", track_heads=True)
    train(tmp_path / "whole", tmp_path / "data", model, steps, progress=False)
    train(tmp_path / "split", tmp_path / "data", model, steps, stop_at=5, progress=False)
    resume(tmp_path / "split", progress=False)
    whole, split = (load_checkpoint(tmp_path / name, prefer=LAST) for name in ("whole", "split"))
    for name, tensor in whole.model_state.items():
        assert torch.equal(tensor, split.model_state[name]), name
    for name, slots in whole.optimizer_state.items():  # and every optimiser slot, bit for bit
        for slot, tensor in slots.items():
            assert torch.equal(tensor, split.optimizer_state[name][slot]), (name, slot)
    assert (tmp_path / "whole" / "metrics.csv").read_text().splitlines()[-1].split(",")[:-2] == \
        (tmp_path / "split" / "metrics.csv").read_text().splitlines()[-1].split(",")[:-2]
