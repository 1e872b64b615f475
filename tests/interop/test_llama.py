"""Hugging Face interop for the Llama family, checked against transformers' LlamaForCausalLM and
Qwen2ForCausalLM on small random configs of odd shapes (nothing is downloaded): logits within 1e-5 in
float32, the same 50 greedy tokens with both KV caches, bit-identical weights after round trips, and
the imported tokenizer encoding exactly as AutoTokenizer does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from gptlab.checkpoint import BEST, Checkpoint, load_checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import generate, text_chunks
from gptlab.interop import huggingface
from gptlab.interop.llama import model_config_from_llama
from gptlab.model import GPT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install -e '.[hf]' (make test installs it)",
)
from gptlab.inference.loading import load  # noqa: E402

PROMPT, STEPS = 5, 50
# (family, heads, key/value heads, tied, vocabulary): every ratio, 1 included, both head kinds.
CASES = [
    ("llama", 6, 6, False, 101),
    ("llama", 6, 2, True, 97),
    ("llama", 6, 1, False, 131),
    ("qwen2", 6, 3, False, 103),
    ("qwen2", 4, 1, True, 89),
]


def hf_model(family: str, n_head: int, n_kv_head: int, tied: bool, vocab: int) -> Any:
    """A random transformers model, weights spread so that greedy decoding varies."""
    import transformers

    config = transformers.AutoConfig.for_model(
        family, vocab_size=vocab, hidden_size=8 * n_head, intermediate_size=70, num_hidden_layers=2,
        num_attention_heads=n_head, num_key_value_heads=n_kv_head, max_position_embeddings=64,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    model = cls(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = (0.25 if tied else 1.0) if "embed" in name else (0.3 if tied else 0.12)
            p.copy_(torch.randn(p.shape, generator=generator) * std + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.mark.parametrize(("family", "n_head", "n_kv_head", "tied", "vocab"), CASES)
def test_imported_models_match_transformers(family: str, n_head: int, n_kv_head: int, tied: bool,
                                            vocab: int) -> None:
    hf = hf_model(family, n_head, n_kv_head, tied, vocab)
    ours = huggingface.from_transformers(hf)
    assert (ours.config.kv_heads, ours.config.tied, ours.config.rope_base) == (n_kv_head, tied, 500.0)
    assert ours.config.attn_bias == (family == "qwen2")
    ids = torch.randint(0, vocab, (3, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(ids)[0], hf(ids).logits, atol=1e-5, rtol=0)
    prompt = ids[:1, :PROMPT]
    greedy = torch.cat(list(generate(ours, prompt, SamplingConfig(temperature=0, max_new_tokens=STEPS))), 1)
    hf.generation_config.eos_token_id = None  # neither side stops early, nor is any token suppressed
    hf_greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=True,
                            max_new_tokens=STEPS, pad_token_id=0)[:, PROMPT:]
    assert torch.equal(greedy, hf_greedy)
    assert len(set(greedy[0].tolist())) > 3, "a degenerate model would make this comparison weak"
    back = huggingface.to_transformers(ours).state_dict()
    assert all(torch.equal(tensor, back[name]) for name, tensor in hf.state_dict().items())


def tokenizer_folder(folder: Path) -> None:
    """A small BPE tokenizer.json with <s> and </s>, whose post-processor puts <s> first (as TinyLlama)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    tokenizer.train_from_iterator([readme], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))


def test_folder_import_tokenizer_and_generation_end(tmp_path: Path) -> None:
    """save_pretrained -> import-hf: same logits, the tokenizer adds <s> as AutoTokenizer does, and the
    end-of-sequence id from config.json ends generation."""
    from transformers import AutoTokenizer

    hf = hf_model("llama", 4, 1, False, 300)
    hf.save_pretrained(tmp_path / "hf")
    tokenizer_folder(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    text = "Train a GPT on Shakespeare, then  héllo!\n"
    assert tokenizer.encode(text) == AutoTokenizer.from_pretrained(tmp_path / "hf").encode(text)
    assert tokenizer.encode(text)[0] == 1 and tokenizer.eot_id == 2
    assert tokenizer.encode_array(text).tolist() == tokenizer.encode(text)[1:]  # corpora get no <s>
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        assert_close(model(ids)[0], hf(ids).logits, atol=1e-5, rtol=0)
    # </s>, config.json's eos_token_id, is the id that ends generation (stream_text reads eot_id)
    ending = iter([torch.tensor([[2]])])
    chunks = list(text_chunks(ending, tokenizer, []))
    assert chunks[-1].stop_reason == "eot"


def test_gptlab_to_hf_to_gptlab_is_bit_identical(tmp_path: Path) -> None:
    config = ModelConfig(vocab_size=307, block_size=32, n_layer=2, n_head=6, n_kv_head=2, n_embd=48,
                         ffn_mult=70 / 48, positions="rope", norm="rmsnorm", ffn="swiglu", tied=False,
                         bias=False, qkv_bias=True, rope_base=123.0)
    model = GPT(config)
    tokenizer_folder(tmp_path / "tok")
    tokenizer = {"kind": "hf", "json": (tmp_path / "tok" / "tokenizer.json").read_text(), "eos_id": 2,
                 "bos_id": 1}
    save_checkpoint(tmp_path / "run" / BEST, Checkpoint(config, tokenizer, model_tensors(model), state={}))
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["Qwen2ForCausalLM"] and hf_config["num_key_value_heads"] == 2
    assert hf_config["eos_token_id"] == 2 and hf_config["rope_theta"] == 123.0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    again = load_checkpoint(tmp_path / "back")
    assert again.model_config.to_dict() == config.to_dict()
    original = model_tensors(model)
    assert set(again.model_state) == set(original)
    assert all(torch.equal(again.model_state[k], v) for k, v in original.items())
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) >= {"lm_head.weight"}


@pytest.mark.parametrize(("change", "reason"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"num_local_experts": 8}, "num_local_experts=8"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16"),
])
def test_unsupported_fields_are_named(change: dict[str, Any], reason: str) -> None:
    values = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match="cannot be loaded") as err:
        model_config_from_llama(values)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_every_unsupported_field_in_one_message() -> None:
    values = {"model_type": "qwen2", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "use_sliding_window": True,
              "rope_scaling": {"rope_type": "yarn"}, "num_experts": 4}
    with pytest.raises(ValueError) as err:
        model_config_from_llama(values)
    assert all(field in str(err.value) for field in ("use_sliding_window", "rope_scaling", "num_experts"))


@pytest.mark.slow
def test_every_tool_runs_on_an_imported_llama(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """sample, eval, attention, ablate, intervene, lens, heads, verify and fine-tuning with --init-from,
    on a grouped-query Llama imported from a save_pretrained folder."""
    hf_model("llama", 4, 2, False, 300).save_pretrained(tmp_path / "hf")
    tokenizer_folder(tmp_path / "hf")
    run = str(tmp_path / "run")
    assert main(["import-hf", str(tmp_path / "hf"), run]) == 0
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")[:6000]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    prompt = ["--prompt", "Train a small model"]
    commands = [
        ["sample", run, *prompt, "--max-new-tokens", "8"],
        ["eval", run, "--data", str(tmp_path / "text.txt")],
        ["attention", run, *prompt, "--out", str(tmp_path / "attention.png")],
        ["ablate", run, *prompt, "--out", str(tmp_path / "ablation.png")],
        ["intervene", run, *prompt, "--drop", "1"],
        ["lens", run, *prompt, "--out", str(tmp_path / "lens.png")],
        ["heads", run, "--out", str(tmp_path / "heads.png")],
        ["verify", run],
        ["train", "--data", str(tmp_path / "text.txt"), "--init-from", run, "--out", str(tmp_path / "tuned"),
         "--max-steps", "3", "--batch-size", "2", "--eval-interval", "3", "--eval-batches", "1",
         "--no-progress"],
    ]
    for argv in commands:
        assert main(argv) == 0, argv
    output = capsys.readouterr().out
    assert "perplexity" in output and "failed" in output and "0 failed" in output
    pictures = ("attention", "ablation", "lens", "heads")
    assert all((tmp_path / f"{name}.png").stat().st_size > 0 for name in pictures)
    tuned = load_checkpoint(tmp_path / "tuned")
    assert tuned.model_config.kv_heads == 2 and tuned.tokenizer["kind"] == "hf"


# ---------------------------------------------------------------------------------------------
# Folders as larger models ship them: shards, several end-of-sequence ids, generation_config.json


def sharded_folder(folder: Path, family: str, eos: list[int], generation: dict[str, Any]) -> Any:
    """A random model saved in shards of at most 20 kB, with a tokenizer, several eos ids in config.json
    and `generation` as its generation_config.json; returns the transformers model read back from it."""
    from transformers import AutoModelForCausalLM

    hf = hf_model(family, 4, 2, family == "qwen2", 300)
    hf.config.eos_token_id = eos
    hf.generation_config.eos_token_id = None  # written below, as the model's authors would
    hf.save_pretrained(folder, max_shard_size="20KB")
    (folder / "generation_config.json").write_text(json.dumps(generation))
    tokenizer_folder(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize(("family", "eos", "generation", "stop_ids", "defaults"), [
    ("llama", [2, 5], {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
                       "eos_token_id": [2, 7]},
     [2, 5, 7], {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}),
    ("qwen2", [9], {"do_sample": False, "max_new_tokens": 6, "eos_token_id": 9},
     [9], {"temperature": 0.0, "max_new_tokens": 6}),
])
@pytest.mark.slow
def test_sharded_import_keeps_every_eos_id_and_the_generation_defaults(
        tmp_path: Path, family: str, eos: list[int], generation: dict[str, Any], stop_ids: list[int],
        defaults: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    from gptlab.checkpoint import generation_defaults

    hf = sharded_folder(tmp_path / "hf", family, eos, generation)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    ids = torch.tensor([tokenizer.encode("Train a GPT on Shakespeare, then sample it.")])
    # Two float32 implementations: logits near 2 round apart by up to ~1e-5 on AVX-512 and 1.2e-5 on AVX2
    # (a wrong name map is off by whole units).
    with torch.no_grad():
        assert_close(model(ids)[0], hf(ids).logits, rtol=1e-5, atol=5e-5)
    assert list(tokenizer.stop_ids) == stop_ids  # config.json's, then generation_config.json's others
    assert generation_defaults(tmp_path / "run") == defaults
    # `gptlab sample` takes the file's settings for the options it is not given; greedy is comparable
    # with transformers' own generate, which reads the same generation_config.json
    capsys.readouterr()
    given = [] if defaults["temperature"] == 0 else ["--temperature", "0"]
    assert main(["sample", str(tmp_path / "run"), "--prompt", "Train a GPT", "--json", *given]) == 0
    record = json.loads(capsys.readouterr().out)
    prompt = torch.tensor([tokenizer.encode("Train a GPT")])
    reference = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            pad_token_id=0)[0, prompt.size(1):].tolist()
    assert record["tokens"] == reference[:len(record["tokens"])]
    assert len(reference) == defaults["max_new_tokens"] or reference[-1] in tokenizer.stop_ids
    assert len(record["tokens"]) == len(reference) or record["stop_reason"] == "eot"


def test_runs_without_a_generation_config_have_no_defaults(tmp_path: Path) -> None:
    from gptlab.checkpoint import generation_defaults

    hf_model("llama", 4, 2, False, 300).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    tokenizer_folder(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert generation_defaults(tmp_path / "run") == {}


def test_tensors_are_built_as_soon_as_their_parts_are_read() -> None:
    """The shard reader hands tensors over one at a time; each target is built before the next is read,
    so a sharded checkpoint is never held twice."""
    from gptlab.interop.shapes import gather_tensors

    built: list[str] = []
    read: list[str] = []

    def stream() -> Any:
        for name in ("q", "k", "other", "v", "norm"):
            read.append(name)
            yield name, torch.ones(1)

    def build(target: str, parts: list[torch.Tensor]) -> torch.Tensor:
        built.append(f"{target} after {read[-1]}")
        return torch.cat(parts)

    out, others, missing = gather_tensors(stream(), {"qkv": ("q", "k", "v"), "ln": ("norm",), "x": ("y",)},
                                          build)
    assert built == ["qkv after v", "ln after norm"]
    assert out["qkv"].shape == (3,) and set(others) == {"other"} and missing == ["y"]


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"}])
def test_default_rope_scaling_is_plain_rope(scaling: dict[str, Any]) -> None:
    values = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4}
    assert model_config_from_llama({**values, "rope_scaling": scaling}) == model_config_from_llama(values)
    with pytest.raises(ValueError, match="rope type 'dynamic'") as err:
        model_config_from_llama({**values, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert "\n" not in str(err.value)
