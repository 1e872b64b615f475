"""The demo model in GGUF: char and byte vocabularies as llama.cpp's rwkv model (gptlab.interop.gguf_vocab),
and the exact GELU measured against llama.cpp's tanh GELU (gptlab.interop.gguf_gelu)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gptlab.checkpoint import BEST, Checkpoint, load_checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, SettingError, TrainConfig
from gptlab.data.tokens import TokenData
from gptlab.model import GPT
from gptlab.text.tokenizer import ImportedTokenizer, Tokenizer, tokenizer_from_dict

gguf = pytest.importorskip("gguf")
from gptlab.interop.gguf import export_gguf, load_gguf  # noqa: E402
from gptlab.interop.gguf_gelu import (  # noqa: E402
    TIE,
    GeluCheck,
    compare_gelus,
    gelu_check,
    sample_windows,
    ties,
)
from gptlab.interop.gguf_vocab import rwkv_bytes, rwkv_piece  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread

LINES = ["the cat sat on the mat.", "a dog sat on the rug!", "café au lait, 3 × 4 = 12 ✓",
         "back\\slash\tand tab"]
TEXT = "\n".join(LINES) * 30
SPECIALS = ["<|user|>", "<|end|>", "<|u"]  # "<|u" starts "<|user|>": the longest one wins
PROMPTS = ["the cat sat", "café ✓\n", "<|user|>a dog<|end|>", "<|u<|user|>\\\t"]


def char_tokenizer(specials: list[str] | None = None) -> Tokenizer:
    """The char tokenizer of TEXT, with these special tokens (as its saved dict has them)."""
    saved = {"kind": "char", "chars": "".join(sorted(set(TEXT)))}
    return tokenizer_from_dict({**saved, **({"specials": specials} if specials else {})})


def byte_tokenizer(specials: list[str] | None = None) -> Tokenizer:
    return tokenizer_from_dict({"kind": "byte", **({"specials": specials} if specials else {})})


def save_run(run: Path, model: GPT, tokenizer: Tokenizer, state: dict[str, Any] | None = None) -> Path:
    save_checkpoint(run / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model),
                                           state=state or {}))
    return run


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gelu_exact char model trained briefly by gptlab's own loop (its data folder kept), as `make demo`
    trains one, only smaller."""
    from gptlab.data.prepare import prepare
    from gptlab.training.loop import train

    root = tmp_path_factory.mktemp("exact")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, ffn="gelu_exact")
    steps = TrainConfig(batch_size=8, max_steps=60, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=60,
                        eval_batches=1, device="cpu", precision="float32")
    train(root / "run", root / "data", model, steps, progress=False)
    return root / "run"


def logits(model: GPT, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0]  # (T, V)


# ---------------------------------------------------------------------------------------------
# The vocabulary


def llama_cpp_rwkv_encode(tokens: list[str], text: str) -> list[int]:
    """llama.cpp's rwkv tokenizer written out from llama-vocab.cpp (llm_tokenizer_rwkv_session): from each
    byte on, the longest piece of the vocabulary (pieces unescaped as llama_unescape_rwkv_token does)."""
    pieces = {rwkv_bytes(piece): i for i, piece in enumerate(tokens)}
    data, ids, at = text.encode("utf-8"), [], 0
    while at < len(data):
        size = max(n for n in range(1, len(data) - at + 1) if data[at:at + n] in pieces)
        ids.append(pieces[data[at:at + size]])
        at += size
    return ids


@pytest.mark.parametrize("piece", [b"a", b" ", b"\n", b"\t", b"\r", b"\\", b"\x00", b"\x7f", "é".encode(),
                                   "✓".encode(), b"\x80", b"\xff", b"<|end|>", b"\\x41"])
def test_rwkv_pieces_spell_every_byte_back(piece: bytes) -> None:
    spelled = rwkv_piece(piece)
    assert rwkv_bytes(spelled) == piece
    assert spelled.isprintable() and not any(c in "ABCDEF" for c in spelled.partition("\\x")[2][:2])


@pytest.mark.parametrize("make", [char_tokenizer, byte_tokenizer])
@pytest.mark.parametrize("specials", [None, SPECIALS])
def test_llama_cpp_rules_encode_and_decode_as_gptlab(make: Callable[..., Tokenizer],
                                                     specials: list[str] | None,
                                                     random_gpt: Callable[..., GPT], tmp_path: Path) -> None:
    tokenizer = make(specials)
    run = save_run(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size + 3), tokenizer)
    reader = gguf.GGUFReader(str(export_gguf(run, tmp_path / "m.gguf").path))
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    for prompt in PROMPTS if specials else [p for p in PROMPTS if "<|" not in p]:
        ids = tokenizer.encode(prompt)
        assert llama_cpp_rwkv_encode(tokens, prompt) == ids
        assert b"".join(rwkv_bytes(tokens[i]) for i in ids).decode("utf-8") == tokenizer.decode(ids)


def test_a_char_vocabulary_is_llama_cpp_rwkv_model_without_bos_or_eos(random_gpt: Callable[..., GPT],
                                                                      tmp_path: Path) -> None:
    tokenizer = char_tokenizer(SPECIALS)
    run = save_run(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size + 2), tokenizer)
    reader = gguf.GGUFReader(str(export_gguf(run, tmp_path / "m.gguf").path))

    def field(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    assert field("tokenizer.ggml.model") == "rwkv"
    assert field("tokenizer.ggml.add_bos_token") is False
    # rwkv is llama.cpp's one tokenizer model without a default BOS or EOS; none is written either
    assert field("tokenizer.ggml.bos_token_id") is None and field("tokenizer.ggml.eos_token_id") is None
    chars = tokenizer.to_dict()["chars"]
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert [rwkv_bytes(t).decode("utf-8") for t in tokens[:len(chars)]] == list(chars)
    assert tokens[len(chars):tokenizer.vocab_size] == SPECIALS
    assert tokens[chars.index("\\")] == "\\\\" and tokens[chars.index("\t")] == "\\x09"
    normal, control, unused = (int(t) for t in (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL,
                                                gguf.TokenType.UNUSED))
    assert types == [normal] * len(chars) + [control] * len(SPECIALS) + [unused] * 2
    assert all(rwkv_bytes(pad).startswith(b"\xff") for pad in tokens[tokenizer.vocab_size:])  # never in UTF-8


@pytest.mark.parametrize("make", [char_tokenizer, byte_tokenizer])
def test_char_and_byte_runs_read_back_exactly(make: Callable[..., Tokenizer], random_gpt: Callable[..., GPT],
                                              tmp_path: Path) -> None:
    tokenizer = make(SPECIALS)
    model = random_gpt(vocab_size=tokenizer.vocab_size)
    run = save_run(tmp_path / "run", model, tokenizer)
    loaded, read = load_gguf(export_gguf(run, tmp_path / "m.gguf").path)
    assert read.to_dict() == tokenizer.to_dict()
    ids = tokenizer.encode(PROMPTS[2])
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_where_llama_cpp_would_loop_the_export_says_so(random_gpt: Callable[..., GPT],
                                                       tmp_path: Path) -> None:
    """llama.cpp's rwkv tokenizer loops on an unknown character sharing its first byte with a known one
    (é: ê) or on text starting like a special token whose first character is unknown: a note warns."""
    ascii_chars = tokenizer_from_dict({"kind": "char", "chars": "abc<|>"})
    no_angle = tokenizer_from_dict({"kind": "char", "chars": "abc", "specials": SPECIALS})
    cases = [(char_tokenizer(), "é"), (no_angle, "<|user|>"), (ascii_chars, None),
             (byte_tokenizer(SPECIALS), None)]
    for tokenizer, example in cases:
        run = save_run(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size), tokenizer)
        notes = [n for n in export_gguf(run, tmp_path / "m.gguf").notes if "loops until memory runs out" in n]
        assert len(notes) == (example is not None) and (example is None or example in notes[0])
        (tmp_path / "m.gguf").unlink()


# ---------------------------------------------------------------------------------------------
# The exact GELU


def gap_amplifier(random_gpt: Callable[..., GPT], token: int = 1, gain: float = 1e6) -> GPT:
    """A gelu_exact GPT whose feed-forward layers add gain * (GELU(3) - exact GELU(3)) times token's embedding
    to the stream: nothing under the exact GELU, a strong push toward `token` under the tanh GELU (4e-4 above
    the exact one at 3)."""
    model = random_gpt(ffn="gelu_exact", vocab_size=char_tokenizer().vocab_size)
    direction = model.transformer.wte.weight[token].detach() / model.transformer.wte.weight[token].norm()
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_fc.weight.zero_()
            block.mlp.c_fc.bias.fill_(3.0)
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.weight[:, 0] = gain * direction
            block.mlp.c_proj.bias.copy_(-gain * F.gelu(torch.tensor(3.0)) * direction)
    return model


def test_a_model_the_tanh_gelu_changes_is_refused_with_the_figures(random_gpt: Callable[..., GPT],
                                                                    tmp_path: Path) -> None:
    model = gap_amplifier(random_gpt)
    windows = torch.arange(20).repeat(8).view(20, 8)
    check = compare_gelus(model, windows, "tokens")
    assert check.tokens == 160 and check.changed > 80 and check.max_change > 1 and not check.agrees
    run = save_run(tmp_path / "run", model, char_tokenizer())
    with pytest.raises(SettingError, match="llama.cpp computes the tanh GELU: on 4,0") as err:
        export_gguf(run, tmp_path / "m.gguf")
    message = err.value.as_flags({})
    assert "tokens the model sampled, the logits differ by at most" in message
    assert "the greedy token changes at" in message and message.endswith("use --ffn gelu")
    assert not (tmp_path / "m.gguf").exists()


def test_only_changes_at_ties_are_forgiven() -> None:
    """Two logits within half precision's step of the larger are a tie: llama.cpp's f16 keys, values and
    GELU table decide it either way, for a tanh model as well."""
    logits = torch.tensor([[4.0, 4.0 - 4.0 * TIE, 1.0], [4.0, 4.0 - 4.0 * TIE * 1.01, 1.0],
                           [-4.0, -4.0 - 4.0 * TIE * 0.99, -9.0]])
    assert ties(logits).tolist() == [True, False, True]
    tied = GeluCheck(4096, "validation tokens", 0.002, 0, 2)
    assert tied.agrees and tied.summary().endswith("agrees at every one but 2 ties (two tokens within half "
                                                   "precision's step, which llama.cpp's own rounding decides "
                                                   "either way)")
    changed = GeluCheck(4096, "validation tokens", 0.02, 3, 2)
    assert not changed.agrees and changed.summary().endswith("the greedy token changes at 3 of them (0.07%)")


@pytest.mark.slow
def test_the_demo_shaped_run_exports_with_the_figures_of_its_validation_tokens(
        exact_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    check = gelu_check(load_checkpoint(exact_run))
    assert check.sample == "validation tokens" and check.agrees and 0 < check.max_change < 0.05
    assert main(["export-gguf", str(exact_run), "--out", str(tmp_path / "m.gguf")]) == 0
    out = capsys.readouterr().out
    assert f"note: {check.summary()}\n" in out
    assert "and the greedy token agrees at every one" in out


def test_without_its_data_the_model_samples_its_own_text(exact_run: Path) -> None:
    checkpoint = load_checkpoint(exact_run)
    model = checkpoint.build_gpt()
    windows, sample = sample_windows(checkpoint, model, count=256)
    val = TokenData(exact_run.parent / "data").val
    assert sample == "validation tokens" and windows.shape == (8, 32)
    assert windows.flatten().tolist() == val[:256].tolist()
    checkpoint.state = {}  # as an imported run, or one whose data is gone
    windows, sample = sample_windows(checkpoint, model, count=256)
    assert sample == "tokens the model sampled" and windows.shape == (8, 32)
    again, _ = sample_windows(checkpoint, model, count=256)
    assert torch.equal(windows, again) and len(windows.unique()) > 5


def test_every_obstacle_is_named_at_once(random_gpt: Callable[..., GPT], tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"the": 0, "cat": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    model = gap_amplifier(random_gpt)
    post = GPT(model.config.replace(arrangement="post"))
    post.load_state_dict(model.state_dict(), strict=False)  # post-norm has no final norm
    run = save_run(tmp_path / "run", post, ImportedTokenizer(hf.to_str(), eos_id=None))
    assert main(["export-gguf", str(run), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for obstacle in ("use --arrangement pre", "convert_hf_to_gguf.py", "the greedy token changes at",
                     "use --ffn gelu"):
        assert obstacle in err


# ---------------------------------------------------------------------------------------------
# llama.cpp itself


def test_llama_cpp_writes_the_demo_shaped_runs_greedy_text(exact_run: Path, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, built from source) tokenizes as gptlab, continues greedily with the same
    tokens as gptlab, and writes them as the same text."""
    llama_cpp = pytest.importorskip("llama_cpp")
    written = export_gguf(exact_run, tmp_path / "m.gguf")
    model, tokenizer = load_gguf(written.path)
    llm = llama_cpp.Llama(str(written.path), n_ctx=32, n_batch=32, verbose=False)
    for prompt in ("the cat", "café ✓\nback\\"):
        ids = tokenizer.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False) == ids
        ours = list(ids)
        while len(ours) < 32:
            ours.append(int(logits(model, ours)[-1].argmax()))
        theirs = []
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(token)
            if len(ids) + len(theirs) == 32:
                break
        assert theirs == ours[len(ids):]
        assert llm.detokenize(theirs).decode("utf-8") == tokenizer.decode(theirs)


@pytest.mark.parametrize("make", [char_tokenizer, byte_tokenizer])
def test_llama_cpp_reads_special_tokens_as_gptlab(make: Callable[..., Tokenizer],
                                                  random_gpt: Callable[..., GPT], tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizer = make(SPECIALS)
    run = save_run(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size + 1), tokenizer)
    llm = llama_cpp.Llama(str(export_gguf(run, tmp_path / "m.gguf").path), n_ctx=8, verbose=False)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False) == ids
        assert llm.detokenize(ids, special=True).decode("utf-8") == tokenizer.decode(ids)
