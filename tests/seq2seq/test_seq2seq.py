"""The encoder-decoder: causality, padding, cross-attention rows, cached decoding, and the toy tasks."""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
from pathlib import Path

import pytest
import torch

from conftest import covering
from gptlab.checkpoint import load_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, Seq2SeqConfig, TaskConfig, TrainConfig
from gptlab.handout.properties import failed
from gptlab.handout.verify_seq2seq import verify_seq2seq
from gptlab.inference.loading import load_seq2seq
from gptlab.inspection.cross_attention import cross_attention_maps, cross_inputs
from gptlab.kv_cache import KVCache
from gptlab.model import Block, CausalSelfAttention
from gptlab.seq2seq import tasks
from gptlab.seq2seq.model import DecoderBlock, EncoderDecoder, decode_answers
from gptlab.training.loop import train_seq2seq
from gptlab.training.resume import resume

VOCAB = tasks.vocabulary()
OPTIONS = list(itertools.product(("learned", "sinusoidal", "rope", "none"), ("pre", "post"),
                                 ("layernorm", "rmsnorm"), ("gelu", "swiglu")))


def tiny(**changes: object) -> Seq2SeqConfig:
    base = dict(vocab_size=VOCAB.vocab_size, block_size=12, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=16)
    return Seq2SeqConfig(**{**base, **changes})


def model_of(config: Seq2SeqConfig, seed: int = 0) -> EncoderDecoder:
    torch.manual_seed(seed)
    return EncoderDecoder(config).eval()


def random_ids(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Token ids that are never padding or special tokens."""
    return torch.randint(len(tasks.SPECIALS), VOCAB.vocab_size, shape, generator=generator)


def embedding_gradients(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor,
                        position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d logits[:, position].sum() / d (input rows) of the source (B, S, D) and the target (B, T, D)."""
    rows: dict[str, torch.Tensor] = {}

    def keep(name: str):  # noqa: ANN202 - a forward hook
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            output.retain_grad()
            rows[name] = output
        return hook

    handles = [model.encoder.drop.register_forward_hook(keep("source")),
               model.decoder.drop.register_forward_hook(keep("target"))]
    try:
        logits, _ = model(src, tgt)
        logits[:, position].sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return rows["source"].grad, rows["target"].grad


@pytest.mark.parametrize(("positions", "arrangement", "norm", "ffn"), covering(OPTIONS))
def test_decoder_position_sees_its_past_and_the_whole_source_but_no_padding(
        positions: str, arrangement: str, norm: str, ffn: str) -> None:
    model = model_of(tiny(positions=positions, arrangement=arrangement, norm=norm, ffn=ffn))
    g = torch.Generator().manual_seed(1)
    src, tgt = random_ids(g, 2, 7), random_ids(g, 2, 6)
    src[1, 4:] = tasks.PAD  # the second source has 4 real tokens and 3 of padding
    for i in range(tgt.size(1)):
        source_grad, target_grad = embedding_gradients(model, src, tgt, i)
        assert torch.count_nonzero(target_grad[:, i + 1 :]) == 0  # nothing after i, exactly
        assert (target_grad[:, : i + 1].abs().sum(-1) > 0).all()  # every earlier position counts
        assert (source_grad[0].abs().sum(-1) > 0).all()  # every source position counts
        assert (source_grad[1, :4].abs().sum(-1) > 0).all()
        assert torch.count_nonzero(source_grad[1, 4:]) == 0  # padding, exactly not


def test_padded_rows_give_the_logits_they_give_alone() -> None:
    model = model_of(tiny())
    g = torch.Generator().manual_seed(2)
    sources = [random_ids(g, n) for n in (3, 9, 6)]
    answers = [random_ids(g, n) for n in (5, 2, 8)]
    src = tasks.pad([s.tolist() for s in sources], tasks.PAD)
    tgt = tasks.pad([a.tolist() for a in answers], tasks.PAD)
    batched, _ = model(src, tgt)
    for b, (s, a) in enumerate(zip(sources, answers, strict=True)):
        alone, _ = model(s[None], a[None])
        torch.testing.assert_close(batched[b, : len(a)], alone[0], atol=1e-5, rtol=1e-5)


def test_cross_attention_rows_sum_to_one_and_give_padding_exactly_zero() -> None:
    model = model_of(tiny())
    g = torch.Generator().manual_seed(3)
    src, tgt = random_ids(g, 2, 8), random_ids(g, 2, 5)
    src[0, 5:] = tasks.PAD
    source = model.encode(src)
    inputs = cross_inputs(model, tgt, source)
    for layer, block in enumerate(model.decoder.h):
        weights = block.cross.attention_weights(inputs[layer], source.keys_values[layer], source.mask)
        assert weights.shape == (2, 2, 5, 8)  # (B, H, T, S)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5))
        assert torch.count_nonzero(weights[0, :, :, 5:]) == 0
        assert (weights[1] > 0).all()


def test_cross_attention_of_an_answer_that_fills_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # An untrained decoder may never say <eos>: its answer is then block_size tokens long, and the rows
    # drawn are the block_size tokens fed (<bos> and all but the last answer token), each labelled with
    # the token it predicts; no row predicts an <eos> that never came.
    model = model_of(tiny())
    endless = [len(tasks.SPECIALS)] * model.config.block_size
    monkeypatch.setattr("gptlab.inspection.cross_attention.decode_answers", lambda *args: [endless])
    maps = cross_attention_maps(model, VOCAB, TaskConfig(task="reverse"), "abcd")
    assert maps.weights.shape == (2, 2, 12, 5)  # (L, H, T = block_size, S = 4 + <eos>)
    assert maps.answer_labels == [VOCAB.decode([len(tasks.SPECIALS)])] * 12
    monkeypatch.setattr("gptlab.inspection.cross_attention.decode_answers", lambda *args: [endless[:3]])
    maps = cross_attention_maps(model, VOCAB, TaskConfig(task="reverse"), "abcd")
    assert maps.weights.shape[2] == 4 and maps.answer_labels[-1] == "<eos>"


def test_naive_and_fused_kernels_compute_the_same_model() -> None:
    g = torch.Generator().manual_seed(4)
    src, tgt = random_ids(g, 3, 8), random_ids(g, 3, 6)
    src[2, 3:] = tasks.PAD
    fused = model_of(tiny(attention="sdpa"))
    naive = model_of(tiny(attention="naive"))
    naive.load_state_dict(fused.state_dict())
    torch.testing.assert_close(naive(src, tgt)[0], fused(src, tgt)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("positions", "arrangement", "norm", "ffn"), OPTIONS[::3])
def test_cached_decoding_equals_recomputing(positions: str, arrangement: str, norm: str, ffn: str) -> None:
    model = model_of(tiny(positions=positions, arrangement=arrangement, norm=norm, ffn=ffn, block_size=16))
    g = torch.Generator().manual_seed(5)
    src = random_ids(g, 6, 9)
    src[1, 6:] = tasks.PAD
    # With eos_id -1 (an id no model outputs) every answer runs to the end of the window.
    for eos in (tasks.EOS, -1):
        cached = decode_answers(model, src, tasks.BOS, eos, use_cache=True)
        assert cached == decode_answers(model, src, tasks.BOS, eos, use_cache=False)
    assert {len(answer) for answer in cached} == {model.config.block_size}


def test_step_by_step_logits_with_a_cache_equal_teacher_forcing() -> None:
    model = model_of(tiny(positions="rope"))
    g = torch.Generator().manual_seed(6)
    src, tgt = random_ids(g, 2, 7), random_ids(g, 2, 10)
    full, _ = model(src, tgt)  # (B, T, V)
    source = model.encode(src)
    cache = KVCache(model.config, 2)
    steps = [model.decode(tgt[:, t : t + 1], source, cache) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_encoder_decoder_is_made_of_the_decoder_only_models_parts() -> None:
    model = model_of(tiny())
    assert all(type(block) is Block and not block.attn.causal for block in model.encoder.h)
    assert all(isinstance(block, DecoderBlock) and isinstance(block, Block) for block in model.decoder.h)
    assert all(isinstance(block.attn, CausalSelfAttention) and block.attn.causal for block in model.decoder.h)


def test_parameter_count_by_the_handouts_arithmetic() -> None:
    """Pre-norm LayerNorm, learned positions, tied head: every term written out by hand."""
    c = tiny()
    D, V, T, F = c.n_embd, c.vocab_size, c.block_size, c.ffn_hidden
    attention, ffn, norm = 4 * D * D + 4 * D, 2 * D * F + F + D, 2 * D
    encoder = T * D + c.n_encoder_layer * (attention + ffn + 2 * norm) + norm
    decoder = T * D + c.n_layer * (2 * attention + ffn + 3 * norm) + norm
    assert model_of(c).num_parameters() == V * D + encoder + decoder


def test_config_refuses_an_unmasked_decoder_and_a_bad_pad_id() -> None:
    with pytest.raises(ValueError, match="decoder must stay causal"):
        tiny(causal=False)
    with pytest.raises(ValueError, match="pad_id=99"):
        tiny(pad_id=99)
    assert tiny().encoder_config() == ModelConfig(**{**tiny().encoder_config().to_dict()})
    assert not tiny().encoder_config().causal and tiny().encoder_config().n_layer == 2


# ------------------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize(("name", "source", "answer"), [
    ("reverse", "gptlab", "baltpg"), ("sort", "31415", "11345"), ("add", "57+68", "125"), ("add", "0+0", "0"),
])
def test_task_answers(name: str, source: str, answer: str) -> None:
    assert tasks.get_task(name).answer(source) == answer


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_training_and_held_out_sources_never_overlap(name: str) -> None:
    config = TaskConfig(task=name, min_len=2, max_len=5)
    train = tasks.draw_sources(config, torch.Generator().manual_seed(0), 4000, held_out=False)
    held = tasks.draw_sources(config, torch.Generator().manual_seed(1), 400, held_out=True)
    assert not set(train) & set(held)
    assert all(tasks.is_held_out(s) for s in held) and not any(map(tasks.is_held_out, train))
    drawn = tasks.TASKS[name].draw(torch.Generator(), 4000, (2, 5))
    assert 0.02 < sum(map(tasks.is_held_out, drawn)) / len(drawn) < 0.08  # about 1 in 20
    task = tasks.get_task(name)
    for source in train[:500]:
        tasks.check_source(config, source, tasks.required_block_size(config))
        parts = source.split("+") if name == "add" else [source]
        assert all(2 <= len(p) <= 5 and set(p) <= set(task.alphabet) for p in parts)
        assert all(p[0] != "0" for p in parts) if name == "add" else True


def test_a_task_with_no_held_out_sources_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "MAX_ROUNDS", 5)
    one_letter = TaskConfig(min_len=1, max_len=1)
    assert tasks.draw_sources(one_letter, torch.Generator(), 3, held_out=True) == ["o", "o", "o"]
    monkeypatch.setattr(tasks, "is_held_out", lambda source: False)
    with pytest.raises(ValueError, match="no held-out sources: raise max_len"):
        tasks.draw_sources(one_letter, torch.Generator(), 3, held_out=True)


def test_lengths_cover_the_whole_range() -> None:
    sources = tasks.draw_sources(TaskConfig(min_len=1, max_len=4), torch.Generator(), 2000, held_out=False)
    assert {len(s) for s in sources} == {1, 2, 3, 4}


def test_batches_are_laid_out_for_teacher_forcing() -> None:
    src, inputs, targets = tasks.make_batch(VOCAB, tasks.get_task("add"), ["12+5", "999+999"])
    e = tasks.EOS
    assert src.tolist() == [VOCAB.encode("12+5") + [e, 0, 0, 0], VOCAB.encode("999+999") + [e]]
    assert inputs.tolist() == [[tasks.BOS] + VOCAB.encode("17") + [0, 0], [tasks.BOS] + VOCAB.encode("1998")]
    assert targets.tolist() == [VOCAB.encode("17") + [e, -1, -1], VOCAB.encode("1998") + [e]]


@pytest.mark.parametrize(("name", "source", "message"), [
    ("reverse", "Hello", "not a valid reverse input"), ("sort", "12a", "not a valid sort input"),
    ("add", "12+", "not a valid add input"), ("add", "012+3", "not a valid add input"),
    ("reverse", "a" * 30, "too long"),
])
def test_bad_inputs_are_refused_with_the_reason(name: str, source: str, message: str) -> None:
    config = TaskConfig(task=name, max_len=6)
    with pytest.raises(ValueError, match=message):
        tasks.check_source(config, source, tasks.required_block_size(config))


def test_the_vocabulary_round_trips_and_refuses_unknown_characters() -> None:
    from gptlab.text.tokenizer import tokenizer_from_dict

    again = tokenizer_from_dict(VOCAB.to_dict())
    assert again.encode("az09+") == VOCAB.encode("az09+") and again.decode(VOCAB.encode("az09+")) == "az09+"
    assert VOCAB.decode([tasks.BOS, tasks.EOS]) == "<bos><eos>" and VOCAB.eot_id == tasks.EOS
    with pytest.raises(ValueError, match="'A' is not in this vocabulary"):
        VOCAB.encode("aA")


# ----------------------------------------------------------------------------- training and the CLI

FAST_TASK = TaskConfig(task="reverse", min_len=1, max_len=6, eval_examples=200)
FAST_MODEL = Seq2SeqConfig(block_size=7, n_layer=1, n_encoder_layer=1, n_head=2, n_embd=64)
FAST_TRAIN = TrainConfig(batch_size=64, max_steps=500, lr=3e-3, min_lr=3e-4, warmup_steps=20,
                         eval_interval=100, eval_batches=2, precision="float32", device="cpu")


@pytest.fixture(scope="module")
def reverse_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small reverse model, trained once for the tests below (the README's figure is the full preset)."""
    run = tmp_path_factory.mktemp("seq2seq") / "reverse"
    train_seq2seq(run, FAST_TASK, FAST_MODEL, FAST_TRAIN, progress=False)
    return run


@pytest.mark.slow  # reverse_run trains 500 steps
def test_reverse_reaches_99_percent_exact_match_on_held_out_strings(reverse_run: Path) -> None:
    model = load_seq2seq(reverse_run)[0]
    score = tasks.exact_match(model, FAST_TASK, 1000, seed=123, device=torch.device("cpu"))
    assert score >= 0.99
    rows = list(csv.DictReader((reverse_run / "metrics.csv").open()))
    assert float(rows[0]["val_exact_match"]) < 0.2 and float(rows[-1]["val_exact_match"]) >= 0.95
    assert (reverse_run / "loss.png").stat().st_size > 0


@pytest.mark.slow  # reverse_run trains 500 steps
def test_trained_cross_attention_reads_the_source_backwards(reverse_run: Path) -> None:
    model, vocab, _ = load_seq2seq(reverse_run)
    maps = cross_attention_maps(model, vocab, FAST_TASK, "abcdef")
    assert maps.answer == "fedcba"
    assert maps.weights.shape == (1, 2, 7, 7)  # (L, H, answer + <eos>, source + <eos>)
    torch.testing.assert_close(maps.weights.sum(-1), torch.ones(1, 2, 7))
    strongest = maps.weights[0, :, :6, :6].argmax(-1)  # (H, 6): the source position each answer token reads
    anti_diagonal = torch.arange(5, -1, -1)
    assert max((row == anti_diagonal).float().mean() for row in strongest) == 1.0


@pytest.mark.slow  # trains 12 steps twice and resumes
def test_seq2seq_resume_is_exact(tmp_path: Path) -> None:
    short = FAST_TRAIN.replace(max_steps=12, eval_interval=4)
    train_seq2seq(tmp_path / "whole", FAST_TASK, FAST_MODEL, short, progress=False)
    train_seq2seq(tmp_path / "split", FAST_TASK, FAST_MODEL, short, stop_at=5, progress=False)
    resume(tmp_path / "split", progress=False)
    whole, split = (load_checkpoint(tmp_path / run, prefer="last.safetensors") for run in ("whole", "split"))
    assert split.state["step"] == whole.state["step"] == 12
    for name, tensor in whole.model_state.items():
        assert torch.equal(tensor, split.model_state[name]), name
    for name, slots in whole.optimizer_state.items():  # and every optimiser slot, bit for bit
        for slot, tensor in slots.items():
            assert torch.equal(tensor, split.optimizer_state[name][slot]), (name, slot)


@pytest.mark.slow  # reverse_run trains 500 steps
def test_verify_passes_on_the_trained_model_and_fails_on_broken_ones(reverse_run: Path) -> None:
    code, out, _ = run_cli("verify", reverse_run)
    assert code == 0 and "8 of 8 hold" in out
    model = load_seq2seq(reverse_run)[0]
    assert not failed(verify_seq2seq(model))
    model.decoder.h[0].attn.causal = False  # one decoder block sees the future
    broken = [p.name for p in failed(verify_seq2seq(model))]  # a cache cannot match a model that looks ahead
    assert broken == ["decoder logits at i ignore every target after i",
                      "cached step logits = teacher forcing"]
    model.decoder.h[0].attn.causal = True
    model.config = model.config.replace(pad_id=tasks.EOS)  # <pad> now counts as a real source token
    assert "cross-attention gives padding zero weight" in [p.name for p in failed(verify_seq2seq(model))]


def test_fsdp_is_refused_for_seq2seq(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use TrainConfig.parallel ddp"):
        train_seq2seq(tmp_path / "run", FAST_TASK, FAST_MODEL, FAST_TRAIN.replace(parallel="fsdp"))


def run_cli(*argv: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow  # reverse_run trains 500 steps
def test_cli_answers_inputs_and_says_whether_they_are_right(reverse_run: Path) -> None:
    code, out, _ = run_cli("seq2seq", "sample", reverse_run, "--input", "gptlab", "--input", "abc")
    assert code == 0 and out.splitlines() == ["gptlab -> baltpg  (right)", "abc -> cba  (right)"]
    _, reference, _ = run_cli("seq2seq", "sample", reverse_run, "--input", "gptlab", "--no-kv-cache")
    assert reference.splitlines() == out.splitlines()[:1]
    code, out, _ = run_cli("seq2seq", "eval", reverse_run, "--examples", "300")
    assert code == 0 and "exact match on 300 held-out reverse examples" in out


@pytest.mark.slow  # reverse_run trains 500 steps
def test_cli_draws_the_cross_attention_of_a_seq2seq_run(reverse_run: Path, tmp_path: Path) -> None:
    code, out, _ = run_cli("attention", reverse_run, "--prompt", "abcd", "--out", tmp_path / "cross.png")
    assert code == 0 and "'abcd' -> 'dcba'" in out
    assert (tmp_path / "cross.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # reverse_run trains 500 steps
@pytest.mark.parametrize(("argv", "message"), [
    (("seq2seq", "sample", "RUN", "--input", "ABC"), "'ABC' is not a valid reverse input"),
    (("seq2seq", "sample", "RUN", "--input", "abcdefghij"), "too long for this model's window"),
    (("sample", "RUN"), "use the `gptlab seq2seq` commands"),
    (("train", "--resume", "--out", "RUN"), "use the `gptlab seq2seq` commands"),
    (("train", "--init-from", "RUN", "--out", "elsewhere"), "use the `gptlab seq2seq` commands"),
    (("export-hf", "RUN", "hf-folder"), "encoder-decoder (seq2seq) model"),
    (("attention", "RUN", "--prompt", "abc", "--out", "x.html"), "give --out FILE.png"),
    (("seq2seq", "eval", "RUN", "--examples", "0"), "argument --examples: 0 is not an integer of at least 1"),
])
def test_cli_mistakes_are_one_line(reverse_run: Path, argv: tuple[str, ...], message: str) -> None:
    code, _, err = run_cli(*(reverse_run if a == "RUN" else a for a in argv))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_trains_a_task_and_refuses_a_language_model_run(tmp_path: Path) -> None:
    code, out, _ = run_cli("seq2seq", "train", "--task", "add", "--max-len", "2", "--n-embd", "32",
                           "--max-steps", "6", "--eval-interval", "3", "--eval-examples", "20",
                           "--device", "cpu", "--out", tmp_path / "add", "--no-progress")
    assert code == 0 and "exact match on 20 held-out add examples" in out and " -> " in out
    config = json.loads((tmp_path / "add" / "config.json").read_text())
    assert config["task"]["task"] == "add" and config["model"]["block_size"] == 6  # "99+99" + <eos>
    code, _, err = run_cli("seq2seq", "train", "--out", tmp_path / "add")  # the default task: another run
    assert code == 2 and "holds a seq2seq run with other task or model settings" in err
