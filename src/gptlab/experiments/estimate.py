"""How long a grid will take, measured: a few training steps of each distinct cell shape on this machine."""

from __future__ import annotations

import time

import torch

from gptlab.config import ModelConfig, TrainConfig

PROBE_STEPS = 3  # timed steps, after one untimed warm-up step


def step_seconds(model_config: ModelConfig, train_config: TrainConfig, threads: int) -> float:
    """Seconds one optimiser step of this model and batch takes here with `threads` threads (random
    tokens: the time does not depend on the text)."""
    from gptlab.checkpoint import new_model
    from gptlab.training.optim import make_optimizer

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = new_model(model_config)
        optimizer = make_optimizer(model, train_config)
        shape = (train_config.batch_size, model_config.block_size)
        x = torch.randint(model_config.vocab_size, shape)
        y = torch.randint(model_config.vocab_size, shape)
        times = []
        for _ in range(PROBE_STEPS + 1):
            begin = time.perf_counter()
            for _ in range(train_config.grad_accum):
                _, loss = model(x, y)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - begin)
        return min(times[1:])
    finally:
        torch.set_num_threads(previous)


def run_seconds(step: float, train_config: TrainConfig, steps_left: int) -> float:
    """A run's expected seconds: its steps, plus its evaluations (two splits of eval_batches forward passes,
    each about a third of a step)."""
    evaluations = steps_left // train_config.eval_interval + 1
    evaluation = 2 * train_config.eval_batches * step / (3 * train_config.grad_accum)
    return steps_left * step + evaluations * evaluation
