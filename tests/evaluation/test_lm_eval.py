"""lm-eval itself agrees with gptlab, offline: its `hf` backend on the folder `export-hf` writes, and its
`local-completions` model against `gptlab serve`, score a local multiple-choice task (a YAML and a JSONL in
tmp_path, no hub) with the per-document log-likelihoods gptlab computes in process, and the same accuracies.

References: `gptlab.evaluation.scoring.loglikelihoods` where it exists, and always a plain forward pass on
the pair tokenised as lm-eval does (context and context + continuation encoded, the continuation the
difference). The model is GPT-2-shaped with a BPE tokenizer trained here (a char one has no transformers
equivalent). Skipped where lm_eval is not installed."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

# Looked up, not imported: importing lm_eval at collection would cost every test run its seconds.
NEEDED = ("lm_eval", "transformers", "uvicorn")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in NEEDED),
                                reason="needs lm-eval, transformers and uvicorn (gptlab[harness,hf,serve])")

from test_serve import start_server  # noqa: E402

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint  # noqa: E402
from gptlab.config import ModelConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.interop.huggingface import export_hf  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.text.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
TASK = "gptlab_tiny_choice"
BLOCK = 64
SCORING = "gptlab.evaluation.scoring"  # helper E's in-process scorer, compared with when it exists
TEXT = "\n".join(f"{who} sat on the {what}." for who in ("the cat", "a dog", "my bird", "her fox")
                 for what in ("mat", "rug", "chair", "step", "sofa")) * 20
DOCS = [  # a trailing space in a context moves onto the continuation, as lm-eval does
    {"context": "the cat sat on the", "choices": ["mat", "rug", "chair"], "gold": 0},
    {"context": "a dog sat on", "choices": ["the step", "the sofa", "a fox"], "gold": 1},
    {"context": "my bird sat ", "choices": ["on the chair.", "on the rug.", "under it."], "gold": 2},
    {"context": "her fox", "choices": ["sat on the mat.", "ran", "sat"], "gold": 0},
    {"context": "the cat sat on the mat.\n" * 6 + "a dog", "choices": ["sat", "ran away"], "gold": 0},
]


@dataclass
class Tiny:
    model: GPT
    tokenizer: Tokenizer
    hf_dir: Path
    task_dir: Path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A random GPT-2-shaped model with a BPE tokenizer, exported for transformers, and the local task."""
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = train_tokenizer("bpe", TEXT, 320)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=2,
                            n_embd=32)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)  # far from uniform, so the choices' scores differ widely
    save_checkpoint(root / "run" / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    export_hf(root / "run", root / "hf")
    task_dir = root / "task"
    task_dir.mkdir()
    (task_dir / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    (task_dir / f"{TASK}.yaml").write_text("\n".join([
        f"task: {TASK}", "dataset_path: json",
        f"dataset_kwargs:\n  data_files:\n    test: {task_dir / 'docs.jsonl'}",
        "test_split: test", "output_type: multiple_choice", "doc_to_text: '{{context}}'",
        "doc_to_choice: choices", "doc_to_target: gold", "target_delimiter: ' '",
        "metric_list:\n  - metric: acc\n  - metric: acc_norm", ""]), encoding="utf-8")
    return Tiny(model, tokenizer, root / "hf", task_dir)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    yield


def pairs() -> list[tuple[str, str]]:
    """Every (context, continuation) lm-eval asks for, in document and choice order."""
    return [(d["context"], " " + c) for d in DOCS for c in d["choices"]]


def forward_pass_loglikelihoods(tiny: Tiny) -> list[float]:
    """Each continuation's summed log-probability by one plain forward pass, tokenised as lm-eval's
    `_encode_pair` does: the context's trailing spaces moved onto the continuation, the whole encoded and
    the continuation the ids after the context's own."""
    scores = []
    for context, continuation in pairs():
        stripped = context.rstrip()
        continuation, context = context[len(stripped):] + continuation, stripped
        whole, ctx = tiny.tokenizer.encode(context + continuation), tiny.tokenizer.encode(context)
        assert len(whole) <= BLOCK
        with torch.no_grad():
            logits, _ = tiny.model(torch.tensor([whole]))  # (1, T, V)
        logp = torch.log_softmax(logits[0].double(), -1)
        scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
    return scores


def references(tiny: Tiny) -> dict[str, list[float]]:
    """The in-process log-likelihoods: the plain forward pass, and gptlab's scoring once it exists."""
    found = {"forward pass": forward_pass_loglikelihoods(tiny)}
    if importlib.util.find_spec("gptlab.evaluation") and importlib.util.find_spec(SCORING):
        from gptlab.evaluation.scoring import Request, loglikelihoods

        scored = loglikelihoods(tiny.model, tiny.tokenizer, [Request(c, x) for c, x in pairs()], batch_size=4)
        found["gptlab.evaluation.scoring"] = [ll for ll, _ in scored]
    return found


def run_lm_eval(tiny: Tiny, model: str, model_args: str) -> list[dict[str, Any]]:
    """lm-eval's samples for the local task, in document order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, device="cpu",
                              task_manager=TaskManager(include_path=str(tiny.task_dir)), log_samples=True,
                              bootstrap_iters=0)
    assert results is not None
    return sorted(results["samples"][TASK], key=lambda s: s["doc_id"])


def check_agreement(tiny: Tiny, samples: list[dict[str, Any]]) -> None:
    """lm-eval's per-choice log-likelihoods within 1e-4 of each reference, and its accuracies equal."""
    theirs = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
    for name, ours in references(tiny).items():
        assert_close(torch.tensor(theirs, dtype=torch.float64), torch.tensor(ours, dtype=torch.float64),
                     rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        gap = max(abs(a - b) for a, b in zip(theirs, ours, strict=True))
        print(f"lm-eval against {name}: {len(theirs)} log-likelihoods, largest difference {gap:.2e}")  # -s
    ours, start = forward_pass_loglikelihoods(tiny), 0
    for doc, sample in zip(DOCS, samples, strict=True):
        scores = ours[start:start + len(doc["choices"])]
        start += len(doc["choices"])
        best = max(range(len(scores)), key=scores.__getitem__)
        # acc_norm as lm-eval defines it: each score divided by its continuation's length in characters.
        norm = max(range(len(scores)), key=lambda i: scores[i] / len(" " + doc["choices"][i]))
        assert sample["acc"] == float(best == doc["gold"]), sample["doc_id"]
        assert sample["acc_norm"] == float(norm == doc["gold"]), sample["doc_id"]
    assert len({s["acc"] for s in samples}) == 2  # the documents do not all score the same


def test_lm_eval_hf_backend_on_the_exported_folder_agrees(tiny: Tiny, offline: None) -> None:
    samples = run_lm_eval(tiny, "hf", f"pretrained={tiny.hf_dir},dtype=float32")
    check_agreement(tiny, samples)


def test_lm_eval_local_completions_against_gptlab_serve_agrees(tiny: Tiny, offline: None) -> None:
    pytest.importorskip("tenacity")  # lm-eval's API models need its `api` extra
    app = create_app(LM.from_model(tiny.model, tiny.tokenizer), "tiny-bpe", max_batch=4)
    url, server, thread = start_server(app)
    try:
        # The remote tokenizer is the server's own (/tokenize); lm-eval keeps max_length - 1 prompt tokens.
        samples = run_lm_eval(tiny, "local-completions",
                              f"model=tiny-bpe,base_url={url}/v1/completions,tokenizer_backend=remote,"
                              f"max_length={BLOCK},num_concurrent=1,max_retries=1")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    check_agreement(tiny, samples)
