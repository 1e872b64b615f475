"""Hugging Face interop: gptlab <-> transformers' GPT-2, checked against transformers itself.

Every model is built from a small random config (odd widths, head counts, vocabularies); nothing is
downloaded. The reference is `transformers.GPT2LMHeadModel`: logits within 1e-5 in float32, the same
loss on the same batch, the same 50 greedy tokens (transformers decodes with its KV cache, gptlab
recomputes the prefix), and bit-identical weights after a round trip.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from gptlab.checkpoint import BEST, Checkpoint, load_checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.files import RunLock
from gptlab.generate import generate
from gptlab.interop import gpt2, hf_tokenizer, huggingface
from gptlab.model import GPT
from gptlab.text.tokenizer import EOT, BPETokenizer, Tokenizer, train_tokenizer

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[hf]' (make test installs it)",
)
from gptlab.inference.loading import load  # noqa: E402

TEXT = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8") * 2
PROMPT = 5
STEPS = 50

# Export: gptlab configs GPT-2 can represent, with the tokenizer each run used.
EXPORT_CASES = [
    (dict(vocab_size=97, block_size=61, n_layer=1, n_head=3, n_embd=48), "char"),
    (dict(vocab_size=300, block_size=64, n_layer=3, n_head=3, n_embd=48, ffn_mult=2.0, norm_eps=1e-6,
          dropout=0.1, attention="naive"), "bpe"),
    (dict(vocab_size=256, block_size=57, n_layer=2, n_head=5, n_embd=20), "byte"),
    # what `make demo` trains (the erf GELU), nanoGPT's CPU recipe (no biases), biases on all but q, k, v
    (dict(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=32, ffn="gelu_exact"), "char"),
    (dict(vocab_size=300, block_size=60, n_layer=2, n_head=2, n_embd=24, ffn="gelu_exact", bias=False),
     "bpe"),
    (dict(vocab_size=256, block_size=56, n_layer=1, n_head=3, n_embd=18, qkv_bias=False), "byte"),
]
# Import: GPT2Config arguments; a bpe tokenizer of 300 ids goes beside the weights.
IMPORT_CASES = [
    dict(vocab_size=301, n_positions=61, n_embd=48, n_head=3, n_layer=1),
    dict(vocab_size=300, n_positions=64, n_embd=48, n_head=3, n_layer=3, n_inner=100,
         layer_norm_epsilon=1e-6),
    dict(vocab_size=333, n_positions=57, n_embd=20, n_head=5, n_layer=2),
]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    tokenizer = train_tokenizer("bpe", TEXT, 300)
    assert isinstance(tokenizer, BPETokenizer)
    return tokenizer


def make_tokenizer(kind: str, vocab_size: int, bpe: BPETokenizer) -> Tokenizer:
    if kind == "char":
        return train_tokenizer("char", "".join(chr(33 + i) for i in range(vocab_size)))
    return bpe if kind == "bpe" else train_tokenizer(kind, TEXT)


def spread(model: torch.nn.Module) -> None:
    """Redraw the weights far from GPT-2's init, so greedy decoding does not repeat one token forever.

    Token rows get std 1, position rows 2 (each position then steers the output), the rest 0.2.
    """
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if "wte" in name else 2.0 if "wpe" in name else 0.2
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def save_run(run_dir: Path, config: ModelConfig, tokenizer: Tokenizer) -> GPT:
    model = GPT(config)
    spread(model)
    checkpoint = Checkpoint(config, tokenizer.to_dict(), model_tensors(model), state={"step": 0})
    save_checkpoint(run_dir / BEST, checkpoint)
    return model.eval()


def hf_gpt2(**values: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**values, bos_token_id=None, eos_token_id=None))
    spread(model)
    return model.eval()


def write_tokenizer_json(folder: Path, tokenizer: BPETokenizer) -> None:
    (folder / "tokenizer.json").write_text(tokenizer.to_dict()["json"], encoding="utf-8")


def assert_same_behaviour(ours: GPT, hf: Any, vocab_size: int) -> dict[str, float]:
    """Logits, loss and 50 greedy tokens agree; returns the largest differences seen."""
    ids = torch.randint(0, vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    # gptlab's targets[:, i] is the token after ids[:, i] (none for the last); HF shifts labels itself.
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -1)], dim=1)
    with torch.no_grad():
        logits, loss = ours(ids, targets)
        reference = hf(ids, labels=ids)
    assert_close(logits, reference.logits, atol=1e-5, rtol=0)
    assert_close(loss, reference.loss, atol=1e-5, rtol=0)
    prompt = ids[:1, :PROMPT]
    greedy = torch.cat(list(generate(ours, prompt, SamplingConfig(temperature=0, max_new_tokens=STEPS))), 1)
    hf_greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=STEPS, pad_token_id=0)[:, PROMPT:]
    assert torch.equal(greedy, hf_greedy)
    assert len(set(greedy[0].tolist())) > 3, "a degenerate model would make this comparison weak"
    return {"logits": (logits - reference.logits).abs().max().item(),
            "loss": (loss - reference.loss).abs().item()}


# ------------------------------------------------------------------------------------ export


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize(("values", "kind"), EXPORT_CASES)
def test_export_loads_in_transformers_and_behaves_the_same(
    tmp_path: Path, values: dict[str, Any], kind: str, bpe: BPETokenizer
) -> None:
    from transformers import GPT2LMHeadModel

    config = ModelConfig(**values)
    tokenizer = make_tokenizer(kind, config.vocab_size, bpe)
    model = save_run(tmp_path / "run", config, tokenizer)
    result = huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    hf, info = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert hf.config.n_inner in (None, config.ffn_hidden) and hf.config.layer_norm_epsilon == config.norm_eps
    assert_same_behaviour(model, hf.eval(), config.vocab_size)
    assert "tokenizer.json" in result.files  # every kind, char and byte too (test_hf_char_tokenizer.py)
    assert result.notes == []


@needs_transformers
def test_exported_bpe_tokenizer_loads_in_auto_tokenizer_with_the_same_ids(
    tmp_path: Path, bpe: BPETokenizer
) -> None:
    from transformers import AutoTokenizer

    save_run(tmp_path / "run", ModelConfig(vocab_size=bpe.vocab_size, block_size=16, n_layer=1, n_head=2,
                                           n_embd=8), bpe)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = f"Train a GPT on Shakespeare{EOT}  héllo, wörld!\n\n\tdef f(x): return x  "
    ids = bpe.encode(text)
    assert hf_tokenizer.encode(text) == ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == bpe.eot_id


def test_gpt2_tokenizer_exports_from_tiktoken_ranks(
    tmp_path: Path, bpe: BPETokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gpt2 kind's files are rebuilt from tiktoken's ranks; a stand-in encoding checks the wiring."""
    ranks = bpe_ranks(bpe)
    by_id = {rank: token for token, rank in ranks.items()}

    class Encoding:  # the three members of tiktoken.Encoding that export uses
        n_vocab, eot_token = bpe.vocab_size, bpe.eot_id

        def decode_single_token_bytes(self, i: int) -> bytes:
            return by_id[i]

    monkeypatch.setattr("gptlab.text.tokenizer.load_gpt2_encoding", Encoding)
    config = ModelConfig(vocab_size=bpe.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=8)
    save_checkpoint(tmp_path / "run" / BEST, Checkpoint(config, {"kind": "gpt2"}, model_tensors(GPT(config))))
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    exported = BPETokenizer((tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8"))
    assert exported.encode(TEXT) == bpe.encode(TEXT)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == bpe.eot_id


def test_incompatible_configs_list_every_field() -> None:
    config = ModelConfig(positions="rope", norm="rmsnorm", ffn="swiglu", arrangement="post", tied=False,
                         bias=False, causal=False)
    with pytest.raises(ValueError) as err:
        gpt2.check_exportable(config)
    message = str(err.value)
    for field, value, need in [("positions", "'rope'", "'learned'"), ("norm", "'rmsnorm'", "'layernorm'"),
                               ("ffn", "'swiglu'", "one of 'gelu', 'gelu_exact'"),
                               ("arrangement", "'post'", "'pre'"), ("tied", "False", "True"),
                               ("causal", "False", "True")]:
        assert f"{field}={value} (GPT-2 needs {need})" in message
    assert "\n" not in message and "bias" not in message  # biases GPT-2 has room for: zeros
    # Options GPT-2 has room for (any kernel, dropout, feed-forward width, epsilon) all export.
    gpt2.check_exportable(ModelConfig(attention="naive", dropout=0.2, ffn_mult=3.0, norm_eps=1e-6))


# ------------------------------------------------------------------------------------ import


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("values", IMPORT_CASES)
@pytest.mark.parametrize("weights", ["safetensors", "pytorch_model.bin"])
def test_import_from_transformers_behaves_the_same(
    tmp_path: Path, values: dict[str, Any], weights: str, bpe: BPETokenizer
) -> None:
    hf = hf_gpt2(**values)
    hf.save_pretrained(tmp_path / "hf")
    if weights == "pytorch_model.bin":  # the older format: a pickled state dict, read with weights_only
        (tmp_path / "hf" / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    write_tokenizer_json(tmp_path / "hf", bpe)
    result = huggingface.import_hf(tmp_path / "hf", tmp_path / "run")
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    assert tokenizer.to_dict() == bpe.to_dict()
    assert result.notes == [f"tokenizer from tokenizer.json: {bpe.vocab_size} ids (bpe kind)"]
    assert_same_behaviour(model, hf, values["vocab_size"])


@needs_transformers
@pytest.mark.slow
def test_original_gpt2_layout_imports_skipping_only_the_mask_buffers(
    tmp_path: Path, bpe: BPETokenizer
) -> None:
    """OpenAI's release: GPT2Model names (no `transformer.`), no lm_head, causal-mask buffers per block."""
    hf = hf_gpt2(**IMPORT_CASES[1])
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    state = {name.removeprefix("transformer."): t for name, t in hf.state_dict().items()
             if name != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "hf" / "pytorch_model.bin")
    write_tokenizer_json(tmp_path / "hf", bpe)
    result = huggingface.import_hf(tmp_path / "hf", tmp_path / "run")
    assert "skipped 6 causal-mask buffers" in result.notes[1]
    assert_same_behaviour(load(tmp_path / "run").model, hf, 300)


@needs_transformers
def test_vocab_and_merges_files_give_the_same_ids_as_transformers(tmp_path: Path, bpe: BPETokenizer) -> None:
    from transformers import GPT2Tokenizer

    hf_gpt2(**IMPORT_CASES[0]).save_pretrained(tmp_path / "hf")
    saved = json.loads(bpe.to_dict()["json"])["model"]
    (tmp_path / "hf" / "vocab.json").write_text(json.dumps(saved["vocab"]), encoding="utf-8")
    merges = "".join(f"{a} {b}\n" for a, b in saved["merges"])
    (tmp_path / "hf" / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")
    result = huggingface.import_hf(tmp_path / "hf", tmp_path / "run")
    assert result.notes[0] == "tokenizer from vocab.json and merges.txt: 300 ids (bpe kind)"
    tokenizer = load(tmp_path / "run").tokenizer
    reference = GPT2Tokenizer.from_pretrained(tmp_path / "hf")
    text = TEXT[:3000] + f"{EOT}tail"
    assert tokenizer.encode(text) == reference.encode(text) == bpe.encode(text)


@needs_transformers
def test_missing_tokenizer_files(tmp_path: Path) -> None:
    hf_gpt2(vocab_size=50257, n_positions=8, n_embd=8, n_head=2, n_layer=1).save_pretrained(tmp_path / "gpt2")
    result = huggingface.import_hf(tmp_path / "gpt2", tmp_path / "run")
    assert "GPT-2's own encoding" in result.notes[0]
    assert load_checkpoint(tmp_path / "run").tokenizer == {"kind": "gpt2"}
    hf_gpt2(vocab_size=97, n_positions=8, n_embd=8, n_head=2, n_layer=1).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="no tokenizer files .* vocabulary of 97 is not GPT-2's 50257"):
        huggingface.import_hf(tmp_path / "small", tmp_path / "run2")


@needs_transformers
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update({"transformer.h.0.attn.extra": torch.zeros(1)}),
         r"unused \['transformer.h.0.attn.extra'\]"),
        (lambda s: s.pop("transformer.h.0.mlp.c_fc.bias"), r"missing \['transformer.h.0.mlp.c_fc.bias'\]"),
        (lambda s: s.update({"transformer.wpe.weight": torch.zeros(60, 48)}), "wpe.weight has shape"),
        (lambda s: s.update({"lm_head.weight": torch.zeros(301, 48)}), "lm_head.weight differs"),
    ],
)
def test_every_source_tensor_is_used_and_every_target_filled(change: Any, message: str) -> None:
    hf = hf_gpt2(**IMPORT_CASES[0])
    config = gpt2.model_config_from_gpt2(hf.config.to_dict())
    state = dict(hf.state_dict())
    change(state)
    with pytest.raises(ValueError, match=message):
        gpt2.from_gpt2_state(state.items(), config)


def test_gpt2_configs_gptlab_cannot_run_are_refused_with_every_reason() -> None:
    with pytest.raises(ValueError) as err:
        gpt2.model_config_from_gpt2({"model_type": "gpt2", "activation_function": "relu",
                                        "scale_attn_by_inverse_layer_idx": True,
                                        "tie_word_embeddings": False})
    message = str(err.value)
    assert "activation_function='relu'" in message and "scale_attn_by_inverse_layer_idx=True" in message
    assert "tie_word_embeddings=False" in message
    # Fields a config.json leaves out take GPT2Config's defaults: this is GPT-2 small.
    assert gpt2.model_config_from_gpt2({}) == ModelConfig(vocab_size=50257, block_size=1024, n_layer=12,
                                                             n_head=12, n_embd=768, dropout=0.1)


# ------------------------------------------------------------------------------------ round trips


@needs_transformers
def test_gptlab_to_hf_to_gptlab_is_bit_identical(tmp_path: Path, bpe: BPETokenizer) -> None:
    config = ModelConfig(**EXPORT_CASES[1][0])
    model = save_run(tmp_path / "run", config, bpe)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    huggingface.import_hf(tmp_path / "hf", tmp_path / "back")
    back = load_checkpoint(tmp_path / "back")
    original = model_tensors(model)
    assert back.model_state.keys() == original.keys()
    assert all(torch.equal(back.model_state[name], t) for name, t in original.items())
    assert back.tokenizer == bpe.to_dict()
    assert back.model_config == config.replace(attention="sdpa")  # the kernel is not part of GPT-2


@needs_transformers
def test_erf_gelu_without_biases_comes_back_with_zero_biases(tmp_path: Path, bpe: BPETokenizer) -> None:
    """nanoGPT's recipe (erf GELU, no biases) exports, and imports back as the same function: the erf
    GELU again, and biases that are all zero."""
    config = ModelConfig(**EXPORT_CASES[4][0])
    model = save_run(tmp_path / "run", config, bpe)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu"
    huggingface.import_hf(tmp_path / "hf", tmp_path / "back")
    back = load_checkpoint(tmp_path / "back")
    assert back.model_config == config.replace(bias=True)
    biases = [t for name, t in back.model_state.items() if name.endswith(".bias")]
    assert len(biases) == 6 * config.n_layer + 1 and all(not t.any() for t in biases)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(load(tmp_path / "back").model(ids)[0], model(ids)[0], atol=1e-5, rtol=0)


@needs_transformers
def test_hf_to_gptlab_to_hf_is_bit_identical(tmp_path: Path, bpe: BPETokenizer) -> None:
    hf = hf_gpt2(**IMPORT_CASES[1])
    hf.save_pretrained(tmp_path / "hf")
    write_tokenizer_json(tmp_path / "hf", bpe)
    huggingface.import_hf(tmp_path / "hf", tmp_path / "run")
    huggingface.export_hf(tmp_path / "run", tmp_path / "again")
    first = load_file(tmp_path / "hf" / "model.safetensors")
    second = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


@needs_transformers
def test_in_memory_conversion_both_ways() -> None:
    model = GPT(ModelConfig(**EXPORT_CASES[2][0]))
    spread(model)
    hf = huggingface.to_transformers(model)
    assert_same_behaviour(model.eval(), hf, 256)
    back = huggingface.from_transformers(hf)
    pairs = zip(model.state_dict().values(), back.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


# ------------------------------------------------------------------------------------ tokenizer pieces


def bpe_ranks(tokenizer: BPETokenizer) -> dict[bytes, int]:
    """tiktoken's form of a byte-level BPE: each token's bytes -> its id (special tokens left out)."""
    to_byte = {char: byte for byte, char in hf_tokenizer.byte_to_unicode().items()}
    vocab = json.loads(tokenizer.to_dict()["json"])["model"]["vocab"]
    return {bytes(to_byte[c] for c in token): i for token, i in vocab.items() if token != EOT}


def test_merges_are_recovered_from_ranks(bpe: BPETokenizer) -> None:
    rebuilt = hf_tokenizer.bpe_json_from_ranks(bpe_ranks(bpe), {EOT: bpe.eot_id})
    assert json.loads(rebuilt)["model"]["merges"] == json.loads(bpe.to_dict()["json"])["model"]["merges"]
    assert BPETokenizer(rebuilt).encode(TEXT) == bpe.encode(TEXT)


@needs_transformers
def test_byte_map_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert hf_tokenizer.byte_to_unicode() == bytes_to_unicode()


# ------------------------------------------------------------------------------------ command line


@needs_transformers
def test_cli_import_then_sample_eval_and_export(
    tmp_path: Path, bpe: BPETokenizer, capsys: pytest.CaptureFixture
) -> None:
    hf_gpt2(**IMPORT_CASES[0]).save_pretrained(tmp_path / "hf")
    write_tokenizer_json(tmp_path / "hf", bpe)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["sample", str(tmp_path / "run"), "--prompt", "The model", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.count("The model") == 1
    (tmp_path / "text.txt").write_text(TEXT[:2000], encoding="utf-8")
    assert main(["eval", str(tmp_path / "run"), "--data", str(tmp_path / "text.txt")]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out


@pytest.mark.parametrize("problem", ["incompatible", "not empty", "no config"])
def test_cli_errors_are_one_line(tmp_path: Path, problem: str, capsys: pytest.CaptureFixture) -> None:
    config = ModelConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8,
                         positions="rope" if problem == "incompatible" else "learned")
    save_run(tmp_path / "run", config, train_tokenizer("byte", ""))
    (tmp_path / "out").mkdir()
    if problem == "not empty":
        (tmp_path / "out" / "x").write_text("x")
    argv = ["import-hf", str(tmp_path), str(tmp_path / "new")] if problem == "no config" else \
        ["export-hf", str(tmp_path / "run"), str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and err.count("\n") == 1
    expected = {"incompatible": "positions='rope' (GPT-2 needs 'learned')",
                "not empty": "is not an empty folder", "no config": "holds no config.json"}[problem]
    assert expected in err


def test_a_new_run_never_replaces_an_imported_model(hf_run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "imported"
    shutil.copytree(hf_run, run)
    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != RunLock.NAME}

    before = files()
    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n" * 50, encoding="utf-8")
    assert main(["train", "--preset", "tiny", "--data", str(tmp_path / "text.txt"), "--max-steps", "1",
                 "--no-progress", "--out", str(run)]) == 2
    assert "holds a model (best.safetensors, as import-hf and merge write)" in capsys.readouterr().err
    assert files() == before


TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 300, "n_positions": 8, "n_embd": 8, "n_layer": 1,
             "n_head": 2}


@pytest.mark.parametrize("damage", ["config not JSON", "config not UTF-8", "tokenizer.json corrupt",
                                    "tokenizer.json not JSON", "vocab.json not JSON"])
def test_a_damaged_file_in_an_import_is_one_line_naming_it(tmp_path: Path, damage: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(TINY_GPT2), encoding="utf-8")
    name, content = {"config not JSON": ("config.json", b"<html>not found</html>"),
                     "config not UTF-8": ("config.json", b'{"model_type": "gpt\xe9"}'),
                     "tokenizer.json corrupt": ("tokenizer.json", b'{"version": "1.0", "model": {'),
                     "tokenizer.json not JSON": ("tokenizer.json", b"\x00\x01 garbage"),
                     "vocab.json not JSON": ("vocab.json", b"{oops")}[damage]
    (hf / name).write_bytes(content)
    (hf / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    assert main(["import-hf", str(hf), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptlab: error: {hf / name} is not ") and err.count("\n") == 1
    assert not (tmp_path / "run" / BEST).exists()


def test_a_damaged_llama_tokenizer_json_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'tokenizer.json'))} is not a readable"):
        hf_tokenizer.read_llama_tokenizer(tmp_path, {"eos_token_id": 2}, 300)


# ------------------------------------------------------------------- an existing OUT, a failed write


def small_run(tmp_path: Path) -> Path:
    config = ModelConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8)
    save_run(tmp_path / "run", config, train_tokenizer("byte", ""))
    return tmp_path / "run"


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_export_hf_twice_redoes_the_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = small_run(tmp_path), tmp_path / "out"
    assert main(["export-hf", str(run), str(out)]) == 0
    first = load_file(out / "model.safetensors")
    assert main(["export-hf", str(run), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_close(load_file(out / "model.safetensors"), first)
    assert json.loads((out / "config.json").read_text(encoding="utf-8"))["n_embd"] == 8
    assert siblings(out) == []
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        transformers.AutoModelForCausalLM.from_pretrained(out)


def test_import_hf_twice_redoes_the_import(hf_run: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    assert main(["export-hf", str(hf_run), str(hf)]) == 0
    assert main(["import-hf", str(hf), str(tmp_path / "run")]) == 0
    assert main(["import-hf", str(hf), str(tmp_path / "run")]) == 0
    assert load_checkpoint(tmp_path / "run").model_config.n_embd == 16
    assert siblings(tmp_path / "run") == []


@pytest.mark.parametrize("existing", ["user file", "another run's export", "another command"])
def test_an_out_the_command_did_not_write_is_refused_untouched(
    tmp_path: Path, existing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run, out = small_run(tmp_path), tmp_path / "out"
    if existing == "user file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif existing == "another run's export":
        other = tmp_path / "other"
        shutil.copytree(run, other)
        assert main(["export-hf", str(other), str(out)]) == 0
    else:  # an export of this run, then a file of the user's beside it
        assert main(["export-hf", str(run), str(out)]) == 0
        (out / "notes.txt").write_text("mine")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["export-hf", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an empty folder" in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert siblings(out) == []


def test_an_import_is_not_redone_from_another_folder(hf_run: Path, tmp_path: Path) -> None:
    assert main(["export-hf", str(hf_run), str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(["import-hf", str(tmp_path / "a"), str(tmp_path / "run")]) == 0
    before = (tmp_path / "run" / BEST).read_bytes()
    assert main(["import-hf", str(tmp_path / "b"), str(tmp_path / "run")]) == 2
    assert (tmp_path / "run" / BEST).read_bytes() == before


@pytest.mark.parametrize("redo", [False, True])
def test_a_failed_write_leaves_no_out_and_no_temporary_folder(
    tmp_path: Path, redo: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, out = small_run(tmp_path), tmp_path / "out"
    if redo:
        assert main(["export-hf", str(run), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()} if redo else None
    written = []
    real = huggingface.atomic_write_text

    def full_disk(path: Path, text: str) -> None:
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        real(path, text)

    monkeypatch.setattr(huggingface, "atomic_write_text", full_disk)
    assert main(["export-hf", str(run), str(out)]) == 2
    assert written  # the weights and one file were written before the disk filled
    if redo:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert siblings(out) == []


def test_a_killed_calls_temporary_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    run, out = small_run(tmp_path), tmp_path / "out"
    stale = tmp_path / ".out.tmp-999999999"  # no such process
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert main(["export-hf", str(run), str(out)]) == 0
    assert not stale.exists() and (out / "model.safetensors").is_file()
