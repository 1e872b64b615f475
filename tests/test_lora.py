"""LoRA layers, merge and PEFT export (gptlab.lora), checked against the plain forward pass, the
merged weights, and transformers + peft loading the exported base and adapter (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from gptlab.config import ModelConfig, TrainConfig
from gptlab.interop.huggingface import export_hf
from gptlab.interop.peft import export_peft_adapter
from gptlab.lora import (
    LoraConfig,
    LoraLinear,
    adapters_disabled,
    add_lora,
    load_lora_state,
    lora_layers,
    lora_state,
    merge_lora,
    trainable_parameters,
)
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer
from gptlab.training.optim import adamw

# A GPT-2-shaped model and a Llama-shaped one (grouped heads, SwiGLU with its gate, untied head).
GPT2_SHAPE: dict[str, Any] = dict(vocab_size=29, block_size=16, n_layer=2, n_head=2, n_embd=16)
LLAMA_SHAPE: dict[str, Any] = dict(vocab_size=31, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                                   norm="rmsnorm", ffn="swiglu", positions="rope", bias=False, tied=False)
QWEN2_SHAPE: dict[str, Any] = {**LLAMA_SHAPE, "qkv_bias": True}
SHAPES = {"gpt2": GPT2_SHAPE, "llama": LLAMA_SHAPE, "qwen2": QWEN2_SHAPE}
needs_peft = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
    reason="peft and transformers are not installed: pip install -e '.[hf]'",
)


def random_model(shape: dict[str, Any], seed: int = 0) -> GPT:
    """A model whose weights are far from the init (norm gains around 1), so every layer matters."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**shape)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if "ln_" in name and "weight" in name else 0.0))
    return model


def randomise_adapters(model: GPT, std: float = 0.3) -> None:
    """Give every B (and A) random values, so the adapters change the logits."""
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_A.weight.normal_(0.0, std)
            layer.lora_B.weight.normal_(0.0, std)


def ids(vocab: int, batch: int = 3, length: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("field", "value"), [("r", 0), ("alpha", -1.0), ("dropout", 1.0), ("targets", ()),
                                              ("targets", ("c_attn", " ")), ("r", 2.5)])
def test_config_refuses_bad_fields(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"LoraConfig.{field}"):
        LoraConfig(**{field: value})


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_fresh_adapters_leave_logits_unchanged_and_wrap_the_projections(shape: str) -> None:
    model = random_model(SHAPES[shape])
    x = ids(model.config.vocab_size)
    with torch.no_grad():
        base = model(x)[0]
    add_lora(model, LoraConfig(r=4))
    per_block = {"gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
                 "llama": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_gate", "mlp.c_proj"]}[shape]
    assert list(lora_layers(model)) == [f"transformer.h.{i}.{p}" for i in range(2) for p in per_block]
    for layer in lora_layers(model).values():
        bound = 1 / math.sqrt(layer.in_features)  # Kaiming-uniform with a = sqrt(5), as PEFT initialises A
        assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 4
        assert not layer.lora_B.weight.any()
    with torch.no_grad():
        assert torch.equal(model(x)[0], base)


def test_targets_are_patterns_and_mistakes_are_refused() -> None:
    model = add_lora(random_model(GPT2_SHAPE), LoraConfig(targets=("c_proj",)))
    both = [f"transformer.h.{i}.{p}.c_proj" for i in range(2) for p in ("attn", "mlp")]
    assert list(lora_layers(model)) == both
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model, LoraConfig())
    with pytest.raises(ValueError, match="c_atn match no linear layer"):
        add_lora(random_model(GPT2_SHAPE), LoraConfig(targets=("c_attn", "c_atn")))
    with pytest.raises(ValueError, match="tied"):
        add_lora(random_model(GPT2_SHAPE), LoraConfig(targets=("lm_head",)))
    assert list(lora_layers(add_lora(random_model(GPT2_SHAPE), LoraConfig(targets=("h.1.*",))))) == [
        f"transformer.h.1.{p}" for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_disabled_adapters_give_the_base_logits_exactly(shape: str) -> None:
    model = random_model(SHAPES[shape])
    x = ids(model.config.vocab_size)
    with torch.no_grad():
        base = model(x)[0]
        add_lora(model, LoraConfig(r=4))
        randomise_adapters(model)
        adapted = model(x)[0]
        with adapters_disabled(model):
            disabled = model(x)[0]
        after = model(x)[0]
    assert (adapted - base).abs().max() > 0.1, "the adapters must matter for this test to mean anything"
    assert torch.equal(disabled, base)
    assert torch.equal(after, adapted)  # enabled again on leaving the block


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_merged_weights_give_the_adapted_logits(shape: str) -> None:
    model = random_model(SHAPES[shape])
    x = ids(model.config.vocab_size)
    add_lora(model, LoraConfig(r=4, alpha=8))
    randomise_adapters(model)
    with torch.no_grad():
        adapted = model(x)[0]
        merged = merge_lora(model)(x)[0]
    assert not lora_layers(model)
    projections = [m for n, m in model.named_modules() if n.endswith(("c_attn", "c_proj"))]
    assert projections and all(type(m) is torch.nn.Linear for m in projections)
    assert trainable_parameters(model) == model.num_parameters()
    # float32: W x + s B (A x) and (W + s B A) x sum the same products in another order; logits of size
    # ~5 then differ by a few float32 ulps per layer (up to 6e-6 seen), far below any real merge bug (~0.1).
    assert_close(merged, adapted, atol=2e-5, rtol=1e-5)


def test_lora_state_holds_only_the_adapters_and_loads_back() -> None:
    model = add_lora(random_model(LLAMA_SHAPE), LoraConfig(r=2))
    randomise_adapters(model)
    state = lora_state(model)
    assert sorted(state) == sorted(f"{name}.lora_{m}.weight" for name in lora_layers(model) for m in "AB")
    assert sum(t.numel() for t in state.values()) == trainable_parameters(model)
    fresh = add_lora(random_model(LLAMA_SHAPE), LoraConfig(r=2))
    x = ids(model.config.vocab_size)
    load_lora_state(fresh, state)
    with torch.no_grad():
        assert torch.equal(fresh(x)[0], model(x)[0])
    with pytest.raises(ValueError, match="missing.*lora_B"):
        partial = {k: v for k, v in state.items() if not k.endswith("h.0.mlp.c_fc.lora_B.weight")}
        load_lora_state(fresh, partial)
    with pytest.raises(ValueError, match="wrong shape"):
        load_lora_state(add_lora(random_model(LLAMA_SHAPE), LoraConfig(r=3)), state)


def test_training_updates_only_the_adapters() -> None:
    model = add_lora(random_model(GPT2_SHAPE), LoraConfig(r=4, dropout=0.1)).train()
    base_before = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    adapters_before = lora_state(model)
    optimizer = adamw(list(model.parameters()), TrainConfig(lr=1e-2, weight_decay=0.1))  # training's own
    x = ids(model.config.vocab_size, batch=4, length=12)
    losses = []
    for _ in range(5):
        _, loss = model(x[:, :-1], x[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not losses:
            with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
            assert with_grad == sorted(adapters_before)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(model.state_dict()[n], t) for n, t in base_before.items())
    assert all(not torch.equal(lora_state(model)[n], t) for n, t in adapters_before.items())


@needs_peft
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_peft_loads_the_exported_adapter_with_the_same_logits(
    family: str, tmp_path: Path, save_model: Callable[[Path, GPT, Any], Path]
) -> None:
    import transformers
    from peft import PeftModel

    model = random_model(SHAPES[family])
    tokenizer = CharTokenizer("".join(chr(97 + i) for i in range(model.config.vocab_size)))
    save_model(tmp_path / "run", model, tokenizer)
    export_hf(tmp_path / "run", tmp_path / "hf")
    # Every projection the model has, and an untied head too (PEFT adapts lm_head like any linear layer).
    targets = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj") + (("mlp.c_gate", "lm_head")
                                                                         if family != "gpt2" else ())
    config = LoraConfig(r=4, alpha=12, targets=targets)
    add_lora(model, config)
    randomise_adapters(model, std=0.2)
    # A folder of its own: transformers applies an adapter it finds beside config.json when loading.
    export_peft_adapter(model, config, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    x = ids(model.config.vocab_size)
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        ours, base = model(x)[0], base_hf(x).logits
        with adapters_disabled(model):
            assert_close(base, model(x)[0], atol=1e-5, rtol=0)  # the exported base is our base
        peft_model = PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
        theirs = peft_model(input_ids=x).logits
    assert (ours - base).abs().max() > 0.1, "the adapters must matter for this test to mean anything"
    assert_close(theirs, ours, atol=1e-5, rtol=0)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sum(t.numel() for t in tensors.values()) >= trainable_parameters(model)  # A copied for q, k, v
    with pytest.raises(ValueError, match="already holds"):
        export_peft_adapter(model, config, tmp_path / "adapter")


def test_export_refuses_a_config_the_adapters_were_not_built_with(tmp_path: Path) -> None:
    model = add_lora(random_model(LLAMA_SHAPE), LoraConfig(r=2))
    with pytest.raises(ValueError, match="another r or alpha"):
        export_peft_adapter(model, LoraConfig(r=4), tmp_path)
    assert not any(tmp_path.iterdir())


def test_lora_linear_keeps_the_base_parameters() -> None:
    model = random_model(GPT2_SHAPE)
    weight = model.transformer.h[0].attn.c_attn.weight
    add_lora(model, LoraConfig())
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, LoraLinear) and layer.weight is weight and not weight.requires_grad
    base_names = {n for n in model.state_dict() if "lora_" not in n}
    assert base_names == set(random_model(GPT2_SHAPE).state_dict())
