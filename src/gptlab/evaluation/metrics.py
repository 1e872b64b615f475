"""Benchmark metrics as lm-eval (0.4, `api/task.py` and `api/metrics.py`) defines them, per document and
aggregated, with their standard errors.

acc: the choice of highest log-likelihood is gold. acc_norm: the same after dividing each log-likelihood
by its choice's length in characters (the choice without lm-eval's " " target delimiter). bits_per_byte:
-sum(log-likelihood) / sum(UTF-8 bytes) / ln 2 over the whole task (lm-eval's weighted mean). Standard
errors: sample standard deviation / sqrt(n) for means (lm-eval's mean_stderr; "N/A" for one document).
lm-eval gives bits_per_byte none; here it gets the delta-method error of a ratio of means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One aggregated metric of a task: its value, standard error (None when undefined) and direction."""

    name: str
    value: float
    stderr: float | None
    higher_is_better: bool = True


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean, sample standard deviation (n - 1) over sqrt(n); None below two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def mean_metric(name: str, values: Sequence[float]) -> Metric:
    """A metric that is the mean of per-document values (acc, acc_norm)."""
    return Metric(name, sum(values) / len(values), mean_stderr(values))


def choice_length(continuation: str) -> int:
    """Characters acc_norm divides by: the choice lm-eval would hold, without the leading target delimiter."""
    return len(continuation) - 1 if continuation.startswith(" ") else len(continuation)


def argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy's rule, so ties break as lm-eval's do)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def correct(loglikelihoods: Sequence[float], gold: int) -> float:
    """1.0 when the gold choice has the highest log-likelihood, else 0.0."""
    return float(argmax(loglikelihoods) == gold)


def correct_normalised(loglikelihoods: Sequence[float], continuations: Sequence[str], gold: int) -> float:
    """1.0 when the gold choice has the highest log-likelihood per character, else 0.0."""
    per_char = [ll / max(1, choice_length(c)) for ll, c in zip(loglikelihoods, continuations, strict=True)]
    return correct(per_char, gold)


def bits_per_byte(loglikelihoods: Sequence[float], byte_counts: Sequence[int]) -> Metric:
    """Bits per UTF-8 byte over the whole task, and the delta-method standard error of that ratio."""
    n = len(loglikelihoods)
    bits = [-ll / math.log(2) for ll in loglikelihoods]
    ratio = sum(bits) / sum(byte_counts)
    stderr = None
    if n > 1:  # Var(sum x / sum b) ~ sum (x_i - r b_i)^2 / (n (n - 1) mean(b)^2)
        residual = sum((x - ratio * b) ** 2 for x, b in zip(bits, byte_counts, strict=True))
        stderr = math.sqrt(residual / (n * (n - 1))) / (sum(byte_counts) / n)
    return Metric("bits_per_byte", ratio, stderr, higher_is_better=False)
