"""Int8 weight-only decoding against independent references: the dequantised weight multiplied by plain
torch ops, the round-trip bound of symmetric rounding, cached against recomputed int8 decoding, and the
float32 model's loss."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from gptlab.cli import main
from gptlab.config import POSITIONS, ModelConfig, SamplingConfig, Seq2SeqConfig
from gptlab.generate import Decoder, generate
from gptlab.inference.loading import load
from gptlab.inference.quantize import Int8Linear, inference_weights, quantize, quantize_int8, quantize_rows
from gptlab.model import GPT
from gptlab.seq2seq import tasks
from gptlab.seq2seq.model import EncoderDecoder, decode_answers

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread

WINDOW = 16
STEPS = 100
BF16_STEP = 2.0**-8  # bfloat16 keeps 8 significant bits: a rounding moves a value by at most this, relatively


def linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.5)
        layer.weight[0] = 0.0  # an all-zero row
        layer.weight[1, 3] = 40.0  # an outlier that sets its row's scale
    return layer


def reference_product(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ (q * s)^T + b in float64 from the layer's stored int8 weights and scales, by plain torch ops."""
    dequantised = layer.weight.double() * layer.scales.double()[:, None]  # (out, in)
    y = x.double() @ dequantised.T
    return y if layer.bias is None else y + layer.bias.double()


# ---------------------------------------------------------------- the layer and its weights


@pytest.mark.parametrize("in_features", [32, 24])  # 32: the int8 kernel; 24: not a width the kernel takes
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: past the rows the kernel is used for
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_multiplies_by_its_dequantised_weight(in_features: int, rows: int, bias: bool) -> None:
    layer = linear(in_features, 48, bias)
    x = torch.randn(2, rows, in_features)  # (B, T, in)
    exact = Int8Linear.from_linear(layer, activations=torch.float32)
    assert_close(exact(x), reference_product(exact, x).float(), atol=1e-5, rtol=1e-5)
    fast = Int8Linear.from_linear(layer)  # bfloat16 activations in, product rounded to bfloat16 out
    assert fast.packed == (in_features % 16 == 0)
    expected = reference_product(fast, x.bfloat16().float())  # the same rounding of the inputs
    y = fast(x)
    assert y.dtype == torch.float32 and y.shape == (2, rows, 48)
    scale = expected.abs().amax(-1, keepdim=True)  # (B, T, 1): each output row's size
    assert ((y.double() - expected).abs() <= 2 * BF16_STEP * scale).all()
    assert not torch.equal(y, layer(x))  # it really is another weight


def test_quantised_weights_round_trip_within_half_a_scale() -> None:
    layer = linear(64, 96)
    q, scales = quantize_rows(layer.weight)
    w = layer.weight.detach()
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and q.abs().amax(1)[1:].min() >= 126
    largest = w.abs().amax(1)  # (out,)
    assert torch.equal(scales[0], torch.tensor(1.0)) and not q[0].any()  # the zero row
    assert (scales[1:] >= largest[1:] / 127).all() and (scales[1:] <= largest[1:] / 127 * (1 + 2**-7)).all()
    assert torch.equal(scales.bfloat16().float(), scales)  # exact in the kernel's bfloat16
    error = (q.float() * scales[:, None] - w).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-6)).all()
    assert error[1:].amax(1).min() > scales[1:].min() / 10  # the bound is not loose by orders of magnitude
    # the layer keeps what quantize_rows made, whatever the nn.Linear's memory layout
    column_major = linear(64, 96)
    column_major.weight.data = column_major.weight.data.t().contiguous().t()  # gptlab's decoding layout
    stored = Int8Linear.from_linear(column_major)
    assert torch.equal(stored.weight, q) and stored.weight.is_contiguous()
    assert torch.equal(stored.dequantized(), q.float() * scales[:, None])


def test_every_linear_is_replaced_and_a_tied_embedding_stays_float(random_gpt: Callable[..., GPT]) -> None:
    model = random_gpt(n_embd=32, tied=True)
    embedding = model.transformer.wte.weight.detach().clone()
    quantize_int8(model)
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 2 * 4 + 1  # per block c_attn, c_proj, c_fc, mlp c_proj; and the head
    assert all(m.packed for m in int8)  # n_embd 32: every product takes the int8 kernel
    wte = model.transformer.wte.weight
    assert wte.dtype == torch.float32 and torch.equal(wte, embedding)
    head = model.lm_head
    assert (head.dequantized() - embedding).abs().max() <= head.scales.float().max() / 2


def test_quantize_refuses_other_devices_and_methods(random_gpt: Callable[..., GPT]) -> None:
    with pytest.raises(ValueError, match="CPU only, not on meta: use device cpu, or quantize none"):
        quantize(random_gpt().to("meta"), "int8")
    with pytest.raises(ValueError, match="quantize='int4' is not one of none, int8"):
        quantize(random_gpt(), "int4")
    model = random_gpt()
    assert quantize(model, "none") is model and isinstance(model.lm_head, nn.Linear)


# ---------------------------------------------------------------- cached = recomputed int8 decoding


def int8_model(tiny_config: Callable[..., ModelConfig], activations: torch.dtype, **changes: object) -> GPT:
    """A 32-wide random model (every product on the int8 kernel in bfloat16) with large weights, quantised."""
    model = GPT(tiny_config(block_size=WINDOW, n_embd=32, **changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return quantize_int8(model, activations)


def rows_of(stream: object) -> list[list[int]]:
    return torch.cat(list(stream), dim=1).tolist()  # type: ignore[arg-type]


# 8 combinations of about 0.7 s: `make test-fast` decodes two (learned untied, rope tied), `make test` all.
COMBINATIONS = [c if i in (1, 4) else pytest.param(*c, marks=pytest.mark.slow)
                for i, c in enumerate(itertools.product(POSITIONS, (True, False)))]


@pytest.mark.slow
@pytest.mark.parametrize(("positions", "tied"), COMBINATIONS)
def test_cached_int8_decoding_equals_recomputed_int8_decoding(
    positions: str, tied: bool, tiny_config: Callable[..., ModelConfig]
) -> None:
    """With float32 activations the two decoders agree as a float32 model's do (tokens for 100 greedy
    steps, logits to 1e-5). With the fast bfloat16 products each layer's output is rounded to 8 bits, so a
    difference of 1e-7 in the attention sums can move a logit by one bfloat16 step: there they agree to a
    few steps of the logits' size, far inside what a wrong mask or position gives (checked below)."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]  # of different lengths: the batch is left-padded
    for activations, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 8 * BF16_STEP)):
        model = int8_model(tiny_config, activations, positions=positions, tied=tied)
        if activations == torch.float32:
            greedy = SamplingConfig(temperature=0, max_new_tokens=STEPS)
            cached = rows_of(generate(model, prompts, greedy))
            assert cached == rows_of(generate(model, prompts, greedy, use_cache=False))
        # the same tokens into both decoders (sampled, so the rows vary and cross the window many times)
        fast, slow = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
        generator = torch.Generator().manual_seed(0)
        differences = []
        for _ in range(STEPS):
            logits = fast.logits()  # (2, V)
            scale = logits.abs().max()
            differences.append(((logits - slow.logits()).abs().max() / scale).item())
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # (2, 1)
            fast.append(tokens)
            slow.append(tokens)
        assert max(differences) <= tolerance, activations
        assert len(set(fast.rows[0])) > 5  # the sampled rows really vary (greedy ones end in a loop)


def test_the_bfloat16_tolerance_catches_a_wrong_cache(tiny_config: Callable[..., ModelConfig]) -> None:
    """The check above can fail: shifting the cached positions by one moves the logits far past it."""
    model = int8_model(tiny_config, torch.bfloat16, positions="learned")
    prompts = [[1, 2, 3, 4, 5, 6]]
    fast, slow = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
    fast.logits()
    fast.append(torch.tensor([[7]]))
    slow.append(torch.tensor([[7]]))
    fast.cache.advance = lambda n, advance=fast.cache.advance: advance(n) + 1  # type: ignore[method-assign]
    right, wrong = slow.logits(), fast.logits()
    assert (wrong - right).abs().max() / wrong.abs().max() > 8 * BF16_STEP


@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_padded_batch_rows_get_their_own_int8_tokens(activations: torch.dtype,
                                                     tiny_config: Callable[..., ModelConfig]) -> None:
    model = int8_model(tiny_config, activations, positions="rope")
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 7, 2, 9, 1]]
    greedy = SamplingConfig(temperature=0, max_new_tokens=2 * WINDOW)
    together = Decoder(model, prompts).logits()  # the prefill of the padded batch
    for b, prompt in enumerate(prompts):
        alone = Decoder(model, [prompt]).logits()[0]
        tolerance = 1e-5 if activations == torch.float32 else 8 * BF16_STEP * alone.abs().max().item()
        assert_close(together[b], alone, atol=tolerance, rtol=0)
    if activations == torch.float32:
        batched = rows_of(generate(model, prompts, greedy))
        assert batched == [rows_of(generate(model, [p], greedy))[0] for p in prompts]


def test_int8_encoder_decoder_decodes_the_same_with_and_without_its_cache() -> None:
    torch.manual_seed(0)
    config = Seq2SeqConfig(vocab_size=tasks.vocabulary().vocab_size, block_size=12, n_layer=2,
                           n_encoder_layer=2, n_head=2, n_embd=32)
    model = quantize_int8(EncoderDecoder(config).eval(), torch.float32)
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    generator = torch.Generator().manual_seed(5)
    src = torch.randint(len(tasks.SPECIALS), config.vocab_size, (4, 9), generator=generator)  # no specials
    cached = decode_answers(model, src, tasks.BOS, -1, use_cache=True)  # eos -1: answers run to the end
    assert cached == decode_answers(model, src, tasks.BOS, -1, use_cache=False)


# ---------------------------------------------------------------- the commands


def perplexity(out: str) -> float:
    return float(re.search(r"perplexity ([0-9.]+)", out).group(1))  # type: ignore[union-attr]


def test_eval_and_sample_with_int8_weights(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", str(trained_run)]) == 0
    float32 = perplexity(capsys.readouterr().out)
    assert main(["eval", str(trained_run), "--quantize", "int8"]) == 0
    int8 = perplexity(capsys.readouterr().out)
    assert abs(int8 / float32 - 1) < 0.01  # int8's promise: under 1% on the perplexity
    args = ["sample", str(trained_run), "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "20",
            "--quantize", "int8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- sample 1 ---\nthe cat") and len(out) > len("--- sample 1 ---\nthe cat") + 10
    # the same text as the int8 model gives from Python (bfloat16 products, so not necessarily float32's)
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    quantize_int8(model)
    tokens = rows_of(generate(model, [tokenizer.encode("the cat")], SamplingConfig(temperature=0,
                                                                                   max_new_tokens=20)))[0]
    assert out.rstrip("\n").endswith(tokenizer.decode(tokens))


def test_bad_quantize_options_are_one_line(trained_run: Path, capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["eval", str(trained_run), "--quantize", "int4"]) == 2
    assert "argument --quantize: invalid choice: 'int4'" in capsys.readouterr().err
    # a device other than the CPU (meta stands in for a GPU this machine may not have): wiring only,
    # the library's refusal itself is tested above
    import gptlab.inference.loading

    monkeypatch.setattr(gptlab.inference.loading, "resolve_device", lambda name: torch.device("meta"))
    assert main(["sample", str(trained_run), "--device", "cuda", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert err == ("gptlab: error: --quantize int8 runs on the CPU only, not on meta: use --device cpu, "
                   "or --quantize none\n")


def test_load_for_inference_holds_a_runs_weights_as_asked(trained_run: Path) -> None:
    """The one loader of the commands that run a model: load_run's model and tokenizer, then
    inference_weights."""
    lm = load(trained_run, device="cpu", dtype="bfloat16")
    model, tokenizer = lm.model, lm.tokenizer
    lm = load(trained_run)
    reference, reference_tokenizer = lm.model, lm.tokenizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    assert tokenizer.to_dict() == reference_tokenizer.to_dict()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs.to(torch.bfloat16))
    int8 = load(trained_run, quantize="int8").model
    assert isinstance(int8.lm_head, Int8Linear)


def test_bfloat16_weights_for_sample_and_eval(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    """--dtype bfloat16 runs the commands on bfloat16 weights; with --quantize it is a one-line error."""
    model = inference_weights(load(trained_run).model, "bfloat16", "none")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert main(["sample", str(trained_run), "--prompt", "the", "--max-new-tokens", "5", "--dtype",
                 "bfloat16"]) == 0
    assert main(["eval", str(trained_run), "--dtype", "bfloat16"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["eval", str(trained_run), "--dtype", "bfloat16", "--quantize", "int8"]) == 2
    assert "choose one" in capsys.readouterr().err
