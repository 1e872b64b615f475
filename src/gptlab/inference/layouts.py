"""Weight layouts for batch-1 decoding on the CPU: which storage (row- or column-major) of the nn.Linear
weights a matrix-vector product reads faster, measured on the running machine, and the switch to it.

Inference only: `gptlab.load` applies `decoding_layout` to the models it loads onto the CPU;
training keeps nn.Linear's own layout. It depends on torch alone.
"""

from __future__ import annotations

import time

import torch

LAYOUTS = ("measure", "column", "row")
LAYOUT_SAMPLE_BYTES = 64 * 2**20  # weights timed when measuring: enough to stream from memory, not cache


def faster_layout(model: torch.nn.Module, rounds: int = 3) -> str:
    """"column" or "row": the storage in which batch-1 products over this model's nn.Linear weights run
    faster on this CPU, timed now (the best of `rounds` alternating passes over up to 64 MB of them).

    Which layout a matrix-vector product reads faster differs between CPUs and between days on one
    shared machine (column-major won by 2x on a 2-core EPYC; on a 2-core Xeon the two were within 15%,
    either way round), so it is measured rather than fixed.
    """
    weights, seen, total = [], set(), 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module.weight.data_ptr() not in seen and total < LAYOUT_SAMPLE_BYTES:
            seen.add(module.weight.data_ptr())
            weights.append(module.weight.detach())
            total += module.weight.numel() * module.weight.element_size()
    if not weights:
        return "row"
    rows = [w.contiguous() for w in weights]
    columns = [w.t().contiguous().t() for w in weights]
    inputs = {w.size(1): torch.ones(1, w.size(1), dtype=w.dtype, device=w.device) for w in weights}

    def seconds(layout: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for w in layout:
            torch.nn.functional.linear(inputs[w.size(1)], w)
        return time.perf_counter() - start

    best = {"row": float("inf"), "column": float("inf")}
    for _ in range(rounds):
        best["row"] = min(best["row"], seconds(rows))
        best["column"] = min(best["column"], seconds(columns))
    return min(best, key=best.__getitem__)


def decoding_layout(model: torch.nn.Module, layout: str = "measure") -> torch.nn.Module:
    """Store every nn.Linear weight in the layout batch-1 decoding reads fastest, in place: the same
    values and shape, only the strides change ("column": (in, out) contiguous; "row": nn.Linear's own).

    At batch 1 a decoding step is one matrix-vector product per weight, read from memory once the
    weights outgrow the caches. "measure" times both on this CPU (`faster_layout`). Logits are
    unchanged. `gptlab.load` applies it to models loaded for inference on the CPU; training keeps the
    usual layout. Applying it twice changes nothing.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "measure":
        layout = faster_layout(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # a tied head is converted once
            weight = module.weight.data
            module.weight.data = weight.t().contiguous().t() if layout == "column" else weight.contiguous()
    return model
