"""`gptlab verify` on a fine-tuned run (issue 25, point 5): the bugs fine-tuning is known for, measured.

A run from `gptlab finetune` records its data file, the options that shaped its examples and its chat
template (adapt/finetune.py); an adapter run (`--lora`) also records its base run. From those, verify adds:
- merged = unmerged: the logits after folding (alpha / r) B A into W match the adapted model's, within
  verify's float tolerance (the sum W x + s B A x is rounded in another order once merged);
- adapters disabled = base: with every LoRA layer off, the logits equal those of the base run loaded on
  its own, bit for bit (torch.equal): the base is untouched and the adapters are all of the change (for
  tokens the run added, the base grown as fine-tuning grew it, their rows the mean of the others);
- masks: the run's examples, rebuilt from its data file exactly as fine-tuning built them, each checked
  by `adapt.sft.mask_problems` (the bytes each token spells against the trained text's byte ranges);
- template round trip: every conversation rendered again with the run's saved template, as `gptlab chat`
  and `/v1/chat/completions` render it, gives the ids the run trained on, and the prompt those render for
  each assistant turn is exactly what training put before that turn.
A check that cannot be made says why (n/a): a data file that is gone or changed, a tokenizer whose tokens
do not spell the text byte for byte (sentencepiece), data without conversations.

The handout's properties of an adapter run are measured on its merged copy (`measured_model`): the §4.2
check splits W_QKV's weight, which in a LoRA layer is the base's alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gptlab.adapt.finetune import SFTConfig, file_digest
from gptlab.adapt.sft import Example, load_examples, mask_problems, read_records
from gptlab.checkpoint import ADAPTER, Checkpoint, load_checkpoint
from gptlab.handout import properties as checks
from gptlab.handout.verify import evaluating
from gptlab.lora import adapters_disabled, grow_embeddings, lora_layers, merge_lora
from gptlab.model import GPT
from gptlab.text.chat_template import ChatTemplate, template_from_state
from gptlab.text.tokenizer import Tokenizer

LORA, SFT = "lora", "sft"  # the section column of verify's table
MERGED = "merged = unmerged logits"
DISABLED = "adapters disabled = base logits"
MASKS = "loss masks match the trained text"
TEMPLATE = "chat template round trip"
Conversations = Mapping[int, Sequence[Mapping[str, Any]]]  # JSONL line -> its messages


def measured_model(model: GPT) -> GPT:
    """The model the handout's properties are measured on: a merged copy of an adapted model (the §4.2
    check reads a LoRA layer's weight, which is its base's alone), else the model itself."""
    return merge_lora(copy.deepcopy(model)) if lora_layers(model) else model


# ---------------------------------------------------------------------------------------------
# LoRA: merging changes nothing but rounding, and the base is untouched


def check_merge(model: GPT, idx: torch.Tensor, eps: float) -> checks.Check:
    """The adapted model's logits against those of a copy with the adapters merged into its weights."""
    merged = merge_lora(copy.deepcopy(model)).eval()
    check = checks.close(LORA, MERGED, merged(idx)[0], model(idx)[0], checks.relative(eps))
    cause = ("" if check.passed else "; likely cause: the merge folds another update than the layers apply "
             "(wrong scale alpha / r, or B A transposed)")
    note = (f"{len(lora_layers(model))} LoRA layers; tolerance {checks.EPSILONS} float epsilons x the "
            f"logits' size (float rounding: W x + s B A x is summed in another order){cause}")
    return dataclasses.replace(check, note=note)


def check_disabled(model: GPT, base: GPT, idx: torch.Tensor) -> checks.Check:
    """The adapted model with its adapters off against the base run loaded on its own: bit-identical."""
    with adapters_disabled(model):
        off = model(idx)[0]
    check = checks.identical(LORA, DISABLED, off, base(idx)[0], "the base run's logits")
    note = ("exact: the base is untouched and the adapters are all of the change" if check.passed else
            "likely cause: the base weights under the adapters are not the base run's (changed in place, "
            "e.g. merged, or loaded from another file), or a disabled LoRA layer does more than W x + b")
    return dataclasses.replace(check, note=note)


def lora_checks(model: GPT, state: Mapping[str, Any], idx: torch.Tensor, eps: float) -> list[checks.Check]:
    """Both LoRA checks on an adapter run, or the two rows marked n/a for a full fine-tuning run."""
    if ADAPTER not in state:
        note = "full fine-tuning: no adapters, every weight was trained"
        return [checks.Check(LORA, MERGED, None, note=note), checks.Check(LORA, DISABLED, None, note=note)]
    base = load_checkpoint(state[ADAPTER]["base"]).build_gpt()
    new_rows = state[ADAPTER].get("new_rows")  # tokens the run added: the base with their first rows
    if new_rows is not None:
        base = grow_embeddings(base, new_rows["ids"], new_rows["mean_of"])
    base = base.to(idx.device).eval()
    return [check_merge(model, idx, eps), check_disabled(model, base, idx)]


# ---------------------------------------------------------------------------------------------
# The run's own data: masks and the chat template


def spells(example: Example, tokenizer: Tokenizer) -> bool:
    """Whether the example's tokens spell the start of its text byte for byte (not sentencepiece's ▁)."""
    return example.text.encode("utf-8").startswith(b"".join(tokenizer.token_bytes(i) for i in example.ids))


def check_masks(examples: Sequence[Example], tokenizer: Tokenizer) -> checks.Check:
    """Each example's mask, checked by bytes (`mask_problems`): a token is trained exactly when its bytes
    lie in a trained span, and no token straddles a span's edge."""
    checkable = [e for e in examples if spells(e, tokenizer)]
    if not checkable:
        return checks.Check(SFT, MASKS, None, note="the tokenizer's tokens do not spell the text byte for "
                            "byte (e.g. sentencepiece's ▁ for a space), so masks cannot be checked by bytes")
    problems = [problem for e in checkable for problem in mask_problems(e, tokenizer)]
    unchecked = len(examples) - len(checkable)
    scope = (f"{len(checkable)} examples, {sum(sum(e.trained) for e in checkable):,} trained tokens"
             + (f" ({unchecked} not spelled byte for byte, unchecked)" if unchecked else ""))
    if problems:
        note = (f"{problems[0]} ({len(problems)} problems in all); likely cause: the mask is shifted from "
                "the trained text (an off-by-one span), so the run learned from the wrong tokens: see "
                "gptlab masks RUN --data FILE")
    else:
        note = f"{scope}: every token is trained exactly when its bytes lie in the trained text"
    return checks.Check(SFT, MASKS, not problems, "no token masked against its bytes",
                        f"{len(problems)} problem(s)", float(len(problems)), 0.0, note)


def template_problem(example: Example, messages: Sequence[Mapping[str, Any]], template: ChatTemplate,
                     tokenizer: Tokenizer) -> str | None:
    """What differs between a conversation as chat renders it and the example trained on it, or None."""

    def encode(text: str) -> list[int]:  # as chat and serve encode a prompt: no BOS or post-processing
        return tokenizer.encode_array(text).tolist()

    n = len(example.ids)  # a truncated example trained on the first n tokens only
    text = template.render(messages)
    if text != template.render(messages) or text != example.text:
        return f"line {example.line}: the template renders the conversation differently each time"
    if encode(text)[:n] != example.ids:
        return f"line {example.line}: the rendered conversation's tokens are not the ids trained on"
    for turn in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        prompt = encode(template.render(messages[:turn], add_generation_prompt=True))[:n]
        if example.ids[:len(prompt)] != prompt:
            return (f"line {example.line}: the prompt chat renders before message {turn + 1} (the "
                    "assistant's) is not what training put before it")
    return None


def check_template(examples: Sequence[Example], conversations: Conversations, template: ChatTemplate,
                   tokenizer: Tokenizer) -> checks.Check:
    """Rendering each conversation again, as inference does, gives the ids the run trained on."""
    problems = [p for e in examples
                if (p := template_problem(e, conversations[e.line], template, tokenizer)) is not None]
    if problems:
        note = (f"{problems[0]} ({len(problems)} examples in all); likely cause: the template is not "
                "deterministic (a date, a random choice), or its generation prompt does not open the "
                "assistant's turn as the whole conversation renders it, so chat shows the model a prompt "
                "it never trained on")
    else:
        note = (f"{len(examples)} conversations: rendered twice alike, tokenised to the trained ids, and "
                "each assistant turn's chat prompt is what training put before it")
    return checks.Check(SFT, TEMPLATE, not problems, "every conversation gives its trained ids",
                        f"{len(problems)} example(s) differ", float(len(problems)), 0.0, note)


def data_checks(checkpoint: Checkpoint) -> list[checks.Check]:
    """The mask and template checks on the run's examples, rebuilt from its recorded data file."""
    saved = checkpoint.state["sft"]
    path = Path(saved["data"])

    def unchecked(why: str, passed: bool | None = None) -> list[checks.Check]:
        return [checks.Check(SFT, MASKS, passed, note=why), checks.Check(SFT, TEMPLATE, passed, note=why)]

    if not path.is_file():
        return unchecked(f"the run's data file {path} is not there: put it back to check masks and template")
    if file_digest(path) != saved["sha256"]:
        return unchecked(f"{path} has changed since the run was trained (its SHA-256 differs): its "
                         "examples are not those trained on")
    config = SFTConfig.from_dict({key: value for key, value in saved.items() if key != "sha256"})
    tokenizer, template = checkpoint.load_tokenizer(), template_from_state(checkpoint.state)
    try:
        data = load_examples(path, tokenizer, template, checkpoint.model_config.block_size, config.loss_on,
                             config.too_long)
    except ValueError as err:  # it built when the run trained: the tokenizer or the template changed
        return unchecked(f"the examples no longer build as when the run trained: {err}", passed=False)
    found = [check_masks(data.examples, tokenizer)]
    if data.shape != "messages":
        return [*found, checks.Check(SFT, TEMPLATE, None, note=f"{data.shape} examples are raw text: "
                                     "no chat template renders them")]
    conversations = {line: record["messages"] for line, record in read_records(path)[1]}
    return [*found, check_template(data.examples, conversations, template, tokenizer)]


def verify_finetuned(checkpoint: Checkpoint, model: GPT, seed: int = 0,
                     length: int = 32) -> list[checks.Check]:
    """The fine-tuning checks of a run from `gptlab finetune` (none for another run); `model` is the
    checkpoint's model, adapted for an adapter run, and the logits are compared on random ids."""
    if "sft" not in checkpoint.state:
        return []
    with evaluating(model) as eps:
        generator = torch.Generator().manual_seed(seed)
        T = min(length, model.config.block_size)
        idx = torch.randint(model.config.vocab_size, (2, T), generator=generator)  # (2, T)
        found = lora_checks(model, checkpoint.state, idx.to(next(model.parameters()).device), eps)
    return [*found, *data_checks(checkpoint)]
