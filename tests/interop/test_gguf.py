"""GGUF export (gptlab.interop.gguf): the file read back gives the run's logits, llama.cpp's conventions
hold (tensor names, metadata keys, the llama graph's rotary order), and what llama.cpp cannot compute is
refused."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import SettingError
from gptlab.model import GPT
from gptlab.text.tokenizer import ByteTokenizer, ImportedTokenizer, Tokenizer, train_tokenizer

gguf = pytest.importorskip("gguf")
from gptlab.interop.gguf import export_gguf, interleave_heads, load_gguf  # noqa: E402

TEXT = "\n".join(f"{who} sat on the {what}." for who in ("the cat", "a dog") for what in ("mat", "rug")) * 20
PROMPT = "the cat sat on the"
GPT2_SHAPE: dict[str, Any] = {}
LLAMA_SHAPE: dict[str, Any] = {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False}
SHAPES = {
    "gpt2": GPT2_SHAPE,
    "gpt2-nobias": {"bias": False},
    "llama-gqa-untied": {**LLAMA_SHAPE, "n_kv_head": 1, "tied": False},
    "llama-tied": LLAMA_SHAPE,
    "qwen2": {**LLAMA_SHAPE, "qkv_bias": True},
}
ARCH = {"gpt2": "gpt2", "gpt2-nobias": "gpt2", "llama-gqa-untied": "llama", "llama-tied": "llama",
        "qwen2": "qwen2"}


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer("bpe", TEXT, 300)


@pytest.fixture
def make_run(tmp_path: Path, random_gpt: Callable[..., GPT],
             tiny_config: Callable[..., Any]) -> Callable[..., tuple[Path, GPT]]:
    """`make_run(tokenizer, spread=True, **changes)`: a run folder holding a 32-wide GPT and that tokenizer;
    its weights are N(0, 0.5) (random_gpt), or GPT's own initialisation without `spread`."""

    def make(tokenizer: Tokenizer, spread: bool = True, **changes: Any) -> tuple[Path, GPT]:
        sizes = {"vocab_size": 300, "block_size": 16, "n_embd": 32, **changes}
        model = random_gpt(**sizes) if spread else GPT(tiny_config(**sizes)).eval()
        run = tmp_path / "run"
        save_checkpoint(run / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
        return run, model

    return make


def logits(model: GPT, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return (out[0] if isinstance(out, tuple) else out)[0]  # (T, V)


def test_interleave_heads_is_llama_cpp_rotary_order() -> None:
    """Rotating halves (i, i + hs/2), as gptlab does, then interleaving equals interleaving then rotating
    adjacent pairs (2i, 2i + 1), as llama.cpp's llama graph does: both written out here from the formulas."""
    hs, base, pos = 8, 10000.0, 5
    theta = [pos * base ** (-2 * i / hs) for i in range(hs // 2)]
    q = torch.randn(hs, dtype=torch.float64)

    def rotate_halves(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        for i, t in enumerate(theta):
            a, b = x[i], x[i + hs // 2]
            out[i], out[i + hs // 2] = a * math.cos(t) - b * math.sin(t), b * math.cos(t) + a * math.sin(t)
        return out

    def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        for i, t in enumerate(theta):
            a, b = x[2 * i], x[2 * i + 1]
            out[2 * i], out[2 * i + 1] = a * math.cos(t) - b * math.sin(t), b * math.cos(t) + a * math.sin(t)
        return out

    # the permutation acts on rows: a (hs, 1) column of one head
    expected = interleave_heads(rotate_halves(q)[:, None], 1)[:, 0]
    torch.testing.assert_close(rotate_pairs(interleave_heads(q[:, None], 1)[:, 0]), expected)
    assert not torch.equal(interleave_heads(q[:, None], 1)[:, 0], q)


@pytest.mark.parametrize("shape", SHAPES)
def test_f32_export_read_back_gives_the_same_logits(shape: str, bpe: Tokenizer, make_run: Any,
                                                     tmp_path: Path) -> None:
    run, model = make_run(bpe, spread=False, **SHAPES[shape])
    written = export_gguf(run, tmp_path / "model.gguf")
    assert written.arch == ARCH[shape] and set(written.types.values()) == {"f32"}
    loaded, tokenizer = load_gguf(written.path)
    ids = bpe.encode(PROMPT)
    assert tokenizer.encode(PROMPT) == ids
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


# The largest logit error, as a fraction of the logits' standard deviation, measured over 4 seeds of GPT's own
# initialisation (gpt2, llama and qwen2 shapes): 1.4e-3 for f16, 3.8e-2 for q8_0. The bounds leave room.
TOLERANCE = {"f16": 5e-3, "q8_0": 1e-1}


@pytest.mark.parametrize("kind", TOLERANCE)
@pytest.mark.parametrize("shape", ["gpt2", "llama-gqa-untied"])
def test_f16_and_q8_0_stay_within_tolerance(kind: str, shape: str, bpe: Tokenizer, make_run: Any,
                                            tmp_path: Path) -> None:
    run, model = make_run(bpe, spread=False, **SHAPES[shape])
    written = export_gguf(run, tmp_path / "model.gguf", kind)
    assert written.types["token_embd.weight"] == kind and written.types["output_norm.weight"] == "f32"
    loaded, _ = load_gguf(written.path)
    ids = bpe.encode(PROMPT)
    expected = logits(model, ids)
    got = logits(loaded, ids)
    scale = expected.std().item()
    assert not torch.equal(got, expected)  # the weights were rounded
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[kind] * scale)


def test_metadata_follows_llama_cpp(bpe: Tokenizer, make_run: Any, tmp_path: Path) -> None:
    run, model = make_run(bpe, **SHAPES["llama-gqa-untied"])
    template = {"kind": "jinja", "source": "{{ messages }}", "tokens": {}}
    state = {"chat_template": template}
    checkpoint = Checkpoint(model.config, bpe.to_dict(), model_tensors(model), state=state)
    save_checkpoint(run / BEST, checkpoint)
    reader = gguf.GGUFReader(str(export_gguf(run, tmp_path / "m.gguf").path))

    def field(key: str) -> Any:
        return reader.get_field(key).contents()

    config = model.config
    assert field("general.architecture") == "llama"
    assert (field("llama.block_count"), field("llama.embedding_length"), field("llama.context_length")) == (
        config.n_layer, config.n_embd, config.block_size)
    assert (field("llama.attention.head_count"), field("llama.attention.head_count_kv")) == (2, 1)
    assert field("llama.feed_forward_length") == config.ffn_hidden
    assert field("llama.rope.dimension_count") == config.head_size
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert field("tokenizer.chat_template") == "{{ messages }}"
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(bpe.to_dict()["json"])
    tokens = field("tokenizer.ggml.tokens")
    assert tokens[: hf.get_vocab_size()] == [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    assert len(tokens) == config.vocab_size
    eot = hf.token_to_id("<|endoftext|>")
    assert field("tokenizer.ggml.eos_token_id") == eot
    assert field("tokenizer.ggml.token_type")[eot] == gguf.TokenType.CONTROL
    names = {t.name for t in reader.tensors}
    parts = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down")
    block = {f"blk.1.{part}.weight" for part in parts}
    assert {"token_embd.weight", "output.weight", "output_norm.weight", *block} <= names
    k = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    assert list(k.shape) == [config.n_embd, config.head_size]  # ggml order: (in, out); one key/value head


def test_gpt2_matrices_are_stored_out_by_in(bpe: Tokenizer, make_run: Any, tmp_path: Path) -> None:
    """llama.cpp multiplies by rows of (out, in) matrices, nn.Linear's layout, not Conv1D's (in, out)."""
    run, model = make_run(bpe)
    reader = gguf.GGUFReader(str(export_gguf(run, tmp_path / "m.gguf").path))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    block = model.transformer.h[0]
    for name, linear in (("attn_qkv", block.attn.c_attn), ("attn_output", block.attn.c_proj),
                         ("ffn_up", block.mlp.c_fc), ("ffn_down", block.mlp.c_proj)):
        torch.testing.assert_close(stored[f"blk.0.{name}.weight"], linear.weight.detach(), rtol=0, atol=0)


def test_byte_tokenizer_reads_back_as_bytes(make_run: Any, tmp_path: Path) -> None:
    byte = ByteTokenizer()
    run, _ = make_run(byte)
    written = export_gguf(run, tmp_path / "m.gguf")
    _, tokenizer = load_gguf(written.path)
    text = "héllo wörld — ✓"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ffn": "relu"}, "--ffn relu: llama.cpp's gpt2 graph needs --ffn gelu"),
        ({"arrangement": "post"}, "use --arrangement pre"),
        ({"positions": "sinusoidal"}, "use --positions learned or --positions rope"),
        ({"positions": "rope", "bias": False, "ffn": "swiglu"}, "--norm layernorm: llama.cpp's llama graph "
         "needs --norm rmsnorm"),
        ({**LLAMA_SHAPE, "bias": True}, "--bias: llama.cpp's llama graph needs --no-bias"),
        ({"n_kv_head": 1}, "--n-kv-head 1"),
        ({"tied": False}, "needs --tied"),
    ],
)
def test_what_llama_cpp_cannot_compute_is_refused(changes: dict[str, Any], message: str, bpe: Tokenizer,
                                                  make_run: Any, tmp_path: Path) -> None:
    run, _ = make_run(bpe, **changes)
    with pytest.raises(SettingError, match="llama.cpp cannot run this model as gptlab does") as err:
        export_gguf(run, tmp_path / "m.gguf")
    # The command line reads each setting as its option; a Python caller reads ModelConfig's fields.
    assert message in err.value.as_flags({}) and "\n" not in str(err.value)
    assert "--" not in str(err.value) and "ModelConfig." in str(err.value)
    assert not (tmp_path / "m.gguf").exists()


def test_a_vocabulary_llama_cpp_may_split_otherwise_is_refused(make_run: Any, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"the": 0, "cat": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    run, _ = make_run(ImportedTokenizer(hf.to_str(), eos_id=None))
    with pytest.raises(ValueError, match="convert that folder with llama.cpp's convert_hf_to_gguf.py"):
        export_gguf(run, tmp_path / "m.gguf")


def test_cli_writes_a_file_gguf_reads(bpe: Tokenizer, make_run: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    run, _ = make_run(bpe)
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", str(run), "--out", str(out), "--type", "q8_0"]) == 0
    assert "llama.cpp architecture gpt2, q8_0" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_qkv.bias"] == gguf.GGMLQuantizationType.F32


def test_an_existing_out_is_replaced_only_when_it_is_this_runs_export(
        bpe: Tokenizer, make_run: Any, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run, _ = make_run(bpe)
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", str(run), "--out", str(out)]) == 0
    assert main(["export-gguf", str(run), "--out", str(out)]) == 0  # the same command again redoes it
    other = tmp_path / "other"
    shutil.copytree(run, other)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    for source, target in ((run, notes), (run, other / BEST), (other, out)):
        before = target.read_bytes()
        capsys.readouterr()
        assert main(["export-gguf", str(source), "--out", str(target)]) == 2
        assert f"{target} exists and is not an earlier GGUF export of this run: choose another --out" in (
            capsys.readouterr().err)
        assert target.read_bytes() == before
    with pytest.raises(ValueError, match="choose another out "):
        export_gguf(run, notes)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["gpt2", "llama-gqa-untied"])
def test_llama_cpp_continues_greedily_as_gptlab(shape: str, bpe: Tokenizer, make_run: Any,
                                                tmp_path: Path) -> None:
    """llama.cpp itself (llama-cpp-python, built from source) runs the f32 file: the same prompt ids and the
    same greedy continuation as gptlab's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    run, model = make_run(bpe, **SHAPES[shape])
    written = export_gguf(run, tmp_path / "model.gguf")
    llm = llama_cpp.Llama(str(written.path), n_ctx=16, n_batch=16, verbose=False)
    ids = bpe.encode(PROMPT)
    assert llm.tokenize(PROMPT.encode(), add_bos=False) == ids
    ours, theirs = list(ids), []
    for _ in range(16 - len(ids)):
        ours.append(int(logits(model, ours)[-1].argmax()))
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == 16 - len(ids):
            break
    assert theirs == ours[len(ids):]
