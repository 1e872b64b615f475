"""Chat templates: Hugging Face Jinja rendered as transformers renders it; the native template's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptlab.adapt.chat import add_chat_tokens, chat_template_for, load_hf_chat_template
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.text.chat_template import (
    JinjaTemplate,
    NativeTemplate,
    missing_tokens,
    template_from_dict,
    template_from_state,
)
from gptlab.text.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "un"},
     {"role": "user", "content": "two, <b>&'\"é"}, {"role": "assistant", "content": "deux\n"}],
    [{"role": "user", "content": "only a question"}],
]


def hf_tokenizer(chat_template: str, **tokens: str):
    """A transformers fast tokenizer (any vocabulary: rendering ignores it) carrying the template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    vocabulary = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=vocabulary, chat_template=chat_template,
                                                **tokens)


def assert_renders_as_transformers(template: JinjaTemplate, reference) -> None:
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == expected


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared chat templates are not in this checkout")
@pytest.mark.parametrize("name", ["smollm2-instruct", "zephyr-tinyllama-chat"])
def test_real_templates_render_as_transformers(name: str) -> None:
    config = json.loads((SHARED / f"{name}.json").read_text(encoding="utf-8"))
    tokens = {name: config[name] for name in ("bos_token", "eos_token")}
    reference = hf_tokenizer(config["chat_template"], **tokens)
    assert_renders_as_transformers(chat_template_for(config), reference)


def test_jinja_features_as_transformers() -> None:
    """tojson without HTML escaping, loop controls, namespace, trim/lstrip of blocks, raise_exception."""
    source = ("{% set ns = namespace(n=0) %}\n  {% for m in messages %}\n    {% if m.role == 'system' %}"
              "{% continue %}{% endif %}\n{{ bos_token }}{{ m | tojson }}\n    {% set ns.n = ns.n + 1 %}"
              "{% if ns.n > 3 %}{% break %}{% endif %}\n  {% endfor %}\n"
              "{% if add_generation_prompt %}{{ eos_token }}{{ {'a': [1, 'x']} | tojson(indent=2) }}"
              "{% endif %}")
    reference = hf_tokenizer(source, bos_token="<s>", eos_token="</s>")
    template = JinjaTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    assert_renders_as_transformers(template, reference)
    failing = JinjaTemplate("{{ raise_exception('no tools here') }}", {})
    with pytest.raises(ValueError, match="refused the conversation: no tools here"):
        failing.render(CONVERSATIONS[0])


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(ValueError, match="refused"):
        JinjaTemplate("{{ messages.__class__.__mro__ }}", {}).render(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="refused"):
        JinjaTemplate("{% set ns = namespace(_x=1) %}", {}).render(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="does not parse"):
        JinjaTemplate("{% for m in messages %}", {})


def test_template_read_from_a_saved_hf_folder(tmp_path: Path) -> None:
    """What save_pretrained writes (wherever this transformers version puts the template) is found."""
    source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    reference = hf_tokenizer(source, eos_token="</s>", bos_token="<s>")
    reference.save_pretrained(tmp_path)
    template = load_hf_chat_template(tmp_path)
    assert_renders_as_transformers(template, reference)
    assert template_from_dict(json.loads(json.dumps(template.to_dict()))).render(CONVERSATIONS[1]) == \
        reference.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert chat_template_for({"eos_token": "</s>"}) is None


@pytest.mark.slow  # imports a model folder
def test_import_hf_keeps_the_folders_template_with_the_run(tmp_path: Path) -> None:
    """`gptlab import-hf` saves the folder's template in the run's header; read back, it renders as the
    folder's own tokenizer does in transformers."""
    from test_llama import hf_model, tokenizer_folder

    from gptlab.checkpoint import load_header
    from gptlab.cli import main

    source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    hf_model("llama", 4, 2, True, 300).save_pretrained(tmp_path / "hf")
    tokenizer_folder(tmp_path / "hf")
    reference = hf_tokenizer(source, eos_token="</s>", bos_token="<s>")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(chat_template=source, eos_token="</s>", bos_token="<s>")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert_renders_as_transformers(template_from_state(load_header(tmp_path / "run").state), reference)


def test_native_template_and_stored_templates() -> None:
    text = NativeTemplate().render(CONVERSATIONS[1], add_generation_prompt=True)
    assert text == ("<|system|>\nBe brief.<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n"
                    "<|assistant|>\n")
    assert isinstance(template_from_state({"step": 0}), NativeTemplate)
    saved = {"chat_template": JinjaTemplate("{{ eos_token }}", {"eos_token": "</s>"}).to_dict()}
    assert template_from_state(saved).render([]) == "</s>"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train("the cat sat on the mat.\nHello there, how are you?\n" * 30, 300)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_added_tokens_are_single_ids_and_old_logits_stay(bpe: BPETokenizer, tied: bool) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=bpe.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16,
                            tied=tied)).eval()
    template = NativeTemplate()
    assert missing_tokens(bpe, template) == list(template.special_tokens)
    grown, tokenizer = add_chat_tokens(model, bpe, template)
    assert missing_tokens(tokenizer, template) == []
    new_ids = [tokenizer.encode(t)[0] for t in template.special_tokens]
    assert new_ids == list(range(bpe.vocab_size, bpe.vocab_size + 4))
    assert grown.config.vocab_size == bpe.vocab_size + 4
    text = "the cat sat on the mat."
    assert tokenizer.encode(text) == bpe.encode(text)  # old text encodes as before
    ids = torch.tensor([bpe.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(grown(ids)[0][..., :bpe.vocab_size], model(ids)[0])
    for name in ("transformer.wte.weight", "lm_head.weight"):
        old = model.state_dict()[name]
        torch.testing.assert_close(grown.state_dict()[name][new_ids], old.mean(0).expand(4, -1))
    assert (grown.lm_head.weight is grown.transformer.wte.weight) == tied
    marked = tokenizer.encode(template.render([{"role": "user", "content": "Hello"}]))
    assert marked[0] == new_ids[1] and new_ids[3] in marked


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_char_and_byte_tokenizers_take_the_markers_as_special_tokens(kind: str) -> None:
    tokenizer = CharTokenizer.train("abcde\n") if kind == "char" else ByteTokenizer()
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=1,
                            n_embd=8)).eval()
    grown, chat = add_chat_tokens(model, tokenizer, NativeTemplate())
    assert missing_tokens(chat, NativeTemplate()) == []
    first = tokenizer.vocab_size
    assert chat.encode("<|user|>\nabc<|end|>\n") == [first + 1, *tokenizer.encode("\nabc"), first + 3,
                                                    *tokenizer.encode("\n")]
    ids = torch.tensor([tokenizer.encode("abcde")])  # (1, T)
    with torch.no_grad():
        # old tokens' logits unchanged; the head's width differs, and a BLAS may block products of
        # different shapes differently, so within float32 rounding, not bit for bit
        torch.testing.assert_close(grown(ids)[0][..., :first], model(ids)[0])
