"""Batch-size and sequence-length warm-up: the shape of each step's training batch, from the step alone.

Both start small and grow linearly to the configured size over their warm-up steps, so early steps,
whose gradients are noisy anyway, cost less. Each is a pure function of the step index, like the
learning rate, so a resumed run draws batches of exactly the shapes the uninterrupted one drew.
Window lengths move in multiples of WINDOW_STEP tokens, which keeps the number of distinct shapes
(and so torch.compile's recompilations) small and the matrix products' tiles full.
"""

from __future__ import annotations

from gptlab.config import TrainConfig

WINDOW_STEP = 16  # the first window length and the increment of the sequence-length warm-up


def batch_size_at(step: int, config: TrainConfig, processes: int = 1) -> int:
    """Sequences per micro-batch at `step`: a quarter of batch_size growing linearly to all of it over
    batch_warmup steps, always a multiple of `processes` (batch_size is one) so each rank gets a share."""
    full = config.batch_size
    if step >= config.batch_warmup:
        return full
    first = max(processes, full // 4 // processes * processes)
    grown = first + (full - first) * step // config.batch_warmup  # integers: no rounding drift
    return grown // processes * processes


def block_size_at(step: int, config: TrainConfig, block_size: int) -> int:
    """Window length at `step`: WINDOW_STEP tokens (block_size if shorter) growing linearly to block_size
    over seq_warmup steps, rounded down to a multiple of WINDOW_STEP until it reaches block_size."""
    if step >= config.seq_warmup:
        return block_size
    first = min(WINDOW_STEP, block_size)
    grown = first + (block_size - first) * step // config.seq_warmup
    return max(first, grown // WINDOW_STEP * WINDOW_STEP)
