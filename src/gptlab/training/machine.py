"""What this machine is fast at, measured at start-up: the settings that depend on the CPU, not the run.

Whether bfloat16 autocast beats float32 on a CPU depends on the chip and on the model's shape: on one
2-core Xeon it made a 128-wide model slower and a 384-wide one about twice as fast, and other CPUs draw
the line elsewhere. So `--precision auto` is not a fixed rule but a probe: a few forward and
backward passes of a fresh model of the run's shape, on random tokens, in float32 and under bfloat16
autocast, alternating, the faster kept (the figures say "a step" for one such pass: the optimiser's
update, the same in both precisions, is left out). A new run decides once and saves the concrete value in its
config.json; a resumed run reuses it and never measures again. Muon's Newton-Schulz precision is chosen
from the CPU's features (float32 where bfloat16 is not native). The thread count is reported, not chosen:
torch's default (one per physical core) unless OMP_NUM_THREADS or the caller set it.

The probe stays short (1 warm-up and 3 timed passes in each precision): a pass does at most PROBE_FLOPS
of work, at fewer rows than the run's micro-batch where needed. A model too large for one row within
that, or whose first timed pass is slower than MAX_PASS_S, is not probed: common.resolve_precision's
width rule, measured on one machine, decides instead.

`decide` is the one entry point: a new run (gptlab.training.runs) and a comparison
(gptlab.experiments.compare) both call it, and a comparison shares the cores among its runs here too
(`share_cores`).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gptlab.checkpoint import architecture, new_model
from gptlab.common import autocast, cpu_has_bf16_matmul, cpu_name, resolve_precision
from gptlab.config import ModelConfig, Seq2SeqConfig, SettingError

WARMUP_PASSES, TIMED_PASSES = 1, 3  # per precision, alternating; the median of the timed ones is compared
# Work per probe pass at most, in floating-point operations (6 x parameters x tokens): the speedrun
# preset is measured on 22 of its 48 rows, a larger model on fewer, and one too large for a single row
# is not probed. A pass of this size takes 20-60 ms on a 2-core CPU, the whole probe about 0.4 s.
PROBE_FLOPS = 5e9
# bfloat16 must win the probe by this fraction to be chosen: the probe leaves out the step's casts of
# the weights' gradients and the optimiser, which only bfloat16 adds to, and a tie is noise.
BF16_MARGIN = 0.05
MAX_PASS_S = 0.25  # a slower first timed pass (a busy or slow machine) ends the probe: the width rule decides


@dataclass(frozen=True)
class Decision:
    """One setting decided for this machine: its name, the value chosen, and why (in words); `ms` holds
    the probe's milliseconds per pass for each candidate, empty when nothing was measured."""

    name: str
    value: str
    why: str
    ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        ms = {name: round(value, 2) for name, value in self.ms.items()}
        return {"value": self.value, "why": self.why, **({"ms_per_step": ms} if ms else {})}


def pass_seconds(model: torch.nn.Module, batch: list[torch.Tensor], dtype: torch.dtype) -> float:
    """Seconds one forward and backward pass of `model` on `batch` (inputs then targets) takes in `dtype`."""
    device = batch[0].device
    begin = time.perf_counter()
    with autocast(device, dtype):
        _, loss = model(*batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - begin


def random_batch(config: ModelConfig, rows: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Random token ids shaped as a training batch: (input, targets) for a GPT, (source, decoder input,
    targets) for an encoder-decoder, each (rows, block_size). The time of a pass does not depend on them."""
    count = 3 if architecture(config) == "encoder-decoder" else 2
    return [torch.randint(config.vocab_size, (rows, config.block_size), generator=generator)
            for _ in range(count)]


@contextlib.contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch threads (None: as they are), restoring the count after."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pass_flops(config: ModelConfig) -> float:
    """Floating-point operations of one row's forward and backward pass, roughly: 6 x parameters x tokens
    (12 D^2 weights per block, the embedding and head V x D)."""
    layers = config.n_layer + (config.n_encoder_layer if isinstance(config, Seq2SeqConfig) else 0)
    parameters = 12 * layers * config.n_embd**2 + config.vocab_size * config.n_embd
    return 6 * parameters * config.block_size


def measure(config: ModelConfig, rows: int) -> tuple[dict[str, float], int] | None:
    """Median milliseconds per pass in float32 and in bfloat16 (alternating) and the rows measured, or None
    when the model is too large to probe quickly. The caller's random state is left untouched."""
    rows = min(rows, math.floor(PROBE_FLOPS / pass_flops(config)))
    if rows < 1:
        return None
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    with torch.random.fork_rng(devices=[]):
        model = new_model(config)
        batch = random_batch(config, rows, generator)
        for i in range(WARMUP_PASSES + TIMED_PASSES):
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                seconds = pass_seconds(model, batch, dtype)
                if i == WARMUP_PASSES and name == "float32" and seconds > MAX_PASS_S:  # warm: no set-up cost
                    return None
                if i >= WARMUP_PASSES:
                    times[name].append(seconds)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}, rows


def decide_precision(precision: str, device: torch.device, config: ModelConfig, rows: int,
                     threads: int | None = None) -> Decision:
    """The concrete precision (float32 or bfloat16) for `precision` on `device`, probed for "auto" on a CPU
    that multiplies bfloat16 natively, at `rows` sequences per pass and `threads` threads (None: as set)."""
    if precision != "auto":
        return Decision("precision", precision, "given")
    fallback = str(resolve_precision("auto", device, config.n_embd)).removeprefix("torch.")
    if device.type != "cpu":
        return Decision("precision", fallback, f"what {device.type} supports")
    if not cpu_has_bf16_matmul():
        return Decision("precision", "float32", "this CPU has no native bfloat16 matmul")
    with thread_count(threads):
        measured = measure(config, rows)
    if measured is None:
        why = f"too slow to probe here: the width rule at n_embd={config.n_embd}"
        return Decision("precision", fallback, why)
    ms, probed = measured
    chosen = "bfloat16" if ms["bfloat16"] < (1 - BF16_MARGIN) * ms["float32"] else "float32"
    other = "float32" if chosen == "bfloat16" else "bfloat16"
    where = "" if probed == rows else f" at {probed} of {rows} rows"
    why = f"{milliseconds(ms[chosen])} against {milliseconds(ms[other])} a step in {other}{where}"
    return Decision("precision", chosen, why, ms)


def decide_muon_precision(precision: str, device: torch.device) -> Decision:
    """The concrete precision of Muon's Newton-Schulz products for `precision` on `device`: "auto" keeps
    torch.optim.Muon's bfloat16 where the device multiplies it natively and takes float32 on a CPU without,
    where bfloat16 products ran 8-14x slower than float32 (2-core AMD EPYC) and made a step 8x longer."""
    if precision != "auto":
        return Decision("muon_precision", precision, "given")
    if device.type == "cpu" and not cpu_has_bf16_matmul():
        return Decision("muon_precision", "float32", "this CPU has no native bfloat16 matmul")
    return Decision("muon_precision", "bfloat16", f"native on this {device.type}")


def milliseconds(value: float) -> str:
    """`61 ms`, or `2.6 ms` below 10, where a whole number would hide the difference."""
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def decide_threads() -> Decision:
    """The torch threads this process computes with, and who chose them (reported; nothing is changed)."""
    count = torch.get_num_threads()
    given = os.environ.get("OMP_NUM_THREADS")
    why = f"OMP_NUM_THREADS={given}" if given else "torch's count (one per physical core unless set)"
    return Decision("threads", str(count), why)


def decide(device: torch.device, model_config: ModelConfig, rows: int, *, precision: str | None,
           muon_precision: str | None = None, threads: int | None = None,
           earlier: Mapping[str, Any] | None = None) -> list[Decision]:
    """What this machine is fast at: the precision (None: not asked; "auto" probed on `model_config` at
    `rows` sequences a pass), Muon's Newton-Schulz precision (None: no Muon), then the threads: `threads`,
    each run's share of the cores (the probe runs with them), or None for torch's count, reported.

    A precision that `earlier` (a "machine" record, as `record` writes it) holds is kept, not decided
    again."""
    earlier = earlier or {}

    def kept(name: str) -> Decision | None:
        if name not in earlier:
            return None
        entry = earlier[name]
        return Decision(name, entry["value"], entry["why"], entry.get("ms_per_step", {}))

    decisions = []
    if precision is not None:
        decisions.append(kept("precision")
                         or decide_precision(precision, device, model_config, rows, threads))
    if muon_precision is not None:
        decisions.append(kept("muon_precision") or decide_muon_precision(muon_precision, device))
    decisions.append(decide_threads() if threads is None
                     else Decision("threads", str(threads), "each run's share of the cores"))
    return decisions


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_jobs(n_cores: int) -> int:
    """Runs trained at once by default: one per core. Small models use a second thread poorly: two speedrun
    runs took 79 s as 2 jobs of 1 thread and 90 s as 1 job of 2 (2-core AMD EPYC, 2026-12-02)."""
    return max(1, n_cores)


def share_cores(jobs: int | None) -> tuple[int, int]:
    """The runs trained at once (`jobs`; default: `default_jobs`) and the threads each gets."""
    n = cores()
    jobs = default_jobs(n) if jobs is None else jobs
    if jobs < 1:
        raise SettingError(f"{{jobs}} {jobs} must be at least 1", jobs="jobs")
    return jobs, max(1, math.floor(n / jobs))


def describe(decisions: list[Decision], auto: bool) -> str:
    """The one line a command prints: `decided for this machine: precision bfloat16 (61 ms against 72 ms
    a step in float32), 2 threads; --precision float32 overrides` (the override only for an "auto")."""
    parts = []
    for decision in decisions:
        if decision.name == "threads":
            parts.append(f"{decision.value} thread{'s' if decision.value != '1' else ''}")
        else:
            parts.append(f"{decision.name.replace('_', ' ')} {decision.value} ({decision.why})")
    line = "decided for this machine: " + ", ".join(parts)
    precision = next((d for d in decisions if d.name == "precision"), None)
    if auto and precision is not None:
        other = "float32" if precision.value == "bfloat16" else "bfloat16"
        line += f"; --precision {other} overrides"
    return line


def record(decisions: list[Decision]) -> dict[str, Any]:
    """The decisions as config.json's "machine" entry, with the CPU they were made on."""
    return {"cpu": cpu_name(), **{d.name: d.to_dict() for d in decisions}}
