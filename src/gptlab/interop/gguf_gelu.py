"""Whether llama.cpp's tanh GELU keeps a gelu_exact model's greedy text, measured for export-gguf.

llama.cpp has no graph for a GPT-2-shaped model with the exact (erf) GELU: its gpt2 graph computes the tanh
form (llama-graph.cpp: LLM_FFN_GELU is ggml_gelu, and no architecture calls ggml_gelu_erf). So a gelu_exact
model is measured rather than refused: its logits with the exact GELU against its logits with the tanh GELU,
on the run's own validation tokens (or on text the model samples, when they are gone), and export-gguf goes
ahead only when the greedy token agrees at every position measured.

Only the form of the GELU is measured. llama.cpp's own arithmetic moves the logits of every model it runs,
and more: it keeps keys and values in half precision, and its CPU backend looks the GELU up in a table of
half-precision values (ggml-cpu/vec.h); on the demo model that moved logits by up to 0.01, the tanh form by
0.002 (docs/interop.md). So a position whose two likeliest tokens are within half precision's step of each
other (TIE) is a tie, which llama.cpp's rounding decides either way for any model: a change of the greedy
token there is reported, not refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gptlab.checkpoint import Checkpoint, data_folder
from gptlab.config import SamplingConfig
from gptlab.data.tokens import TokenData
from gptlab.generate import generate
from gptlab.model import GPT, MLP

SAMPLE_TOKENS = 4096
LOGITS_PER_PASS = 2**24  # logits held at once (64 MB of float32), whatever the vocabulary
TIE = 2**-11  # half precision's relative step: two logits closer than this share a rounding in llama.cpp


@dataclass(frozen=True)
class GeluCheck:
    """A gelu_exact model under the tanh GELU over `tokens` positions of `sample`: the largest change of a
    logit, and the positions whose greedy token changes, at ties (TIE) and elsewhere."""

    tokens: int
    sample: str
    max_change: float
    changed: int
    changed_ties: int

    @property
    def agrees(self) -> bool:
        """Whether the greedy token is the same at every position measured that is not a tie."""
        return self.changed == 0

    def summary(self) -> str:
        """The figures in one line, for a note or a refusal."""
        head = (f"llama.cpp computes the tanh GELU: on {self.tokens:,} {self.sample}, the logits differ by "
                f"at most {self.max_change:.2g} and the greedy token")
        if not self.agrees:
            return f"{head} changes at {self.changed:,} of them ({self.changed / self.tokens:.2%})"
        if not self.changed_ties:
            return f"{head} agrees at every one"
        ties = f"{self.changed_ties:,} tie{'s' if self.changed_ties > 1 else ''}"
        return (f"{head} agrees at every one but {ties} (two tokens within half precision's step, which "
                "llama.cpp's own rounding decides either way)")


def ties(logits: torch.Tensor) -> torch.Tensor:
    """Where the two highest logits (..., V) are within TIE of each other, relative to the larger: (...)."""
    top = logits.topk(2, dim=-1).values  # (..., 2)
    return top[..., 0] - top[..., 1] <= TIE * top.abs().amax(-1)


def with_activation(model: GPT, make: Callable[[], nn.Module]) -> GPT:
    """A copy of `model` sharing its weights whose feed-forward layers use the activation `make()` builds."""
    shared = {id(p): p for p in model.parameters()} | {id(b): b for b in model.buffers()}
    changed = copy.deepcopy(model, memo=shared)  # the memo hands back each weight itself: nothing is copied
    for mlp in changed.modules():
        if isinstance(mlp, MLP):
            assert isinstance(mlp.act, nn.GELU), "only a GELU model's activation is swapped"
            mlp.act = make()
    return changed


def compare_gelus(model: GPT, windows: torch.Tensor, sample: str) -> GeluCheck:
    """`model`'s logits (a gelu_exact model's) against its logits under the tanh GELU, on windows of token
    ids (N, T) taken from `sample`."""
    tanh = with_activation(model.eval(), lambda: nn.GELU(approximate="tanh"))
    rows = max(1, LOGITS_PER_PASS // (windows.shape[1] * model.config.vocab_size))
    max_change, changed, changed_ties = 0.0, 0, 0
    with torch.no_grad():
        for batch in windows.split(rows):  # (B, T)
            exact, approximate = model(batch)[0], tanh(batch)[0]  # (B, T, V) each
            max_change = max(max_change, (approximate - exact).abs().max().item())
            change, tie = approximate.argmax(-1) != exact.argmax(-1), ties(exact)  # (B, T) each
            changed += int((change & ~tie).sum())
            changed_ties += int((change & tie).sum())
    return GeluCheck(windows.numel(), sample, max_change, changed, changed_ties)


def _validation_ids(checkpoint: Checkpoint, count: int) -> np.ndarray | None:
    """The first `count` ids of the validation split the run was trained on, or None when it is gone."""
    try:
        data = TokenData(data_folder(Path(checkpoint.source).parent, checkpoint.state))
    except (OSError, ValueError):  # not trained by gptlab on text, or its data was moved or damaged
        return None
    if data.tokenizer.to_dict() != checkpoint.tokenizer:
        return None
    return np.asarray(data.val[:count], dtype=np.int64)


def sample_windows(checkpoint: Checkpoint, model: GPT,
                   count: int = SAMPLE_TOKENS) -> tuple[torch.Tensor, str]:
    """Windows of token ids (N, T), about `count` in all, and what they are: the run's validation tokens, or
    text the model samples itself (seed 0) when those are gone."""
    ids = _validation_ids(checkpoint, count)
    if ids is not None:
        width = min(model.config.block_size, len(ids))
        return torch.from_numpy(ids[: len(ids) // width * width]).view(-1, width), "validation tokens"
    vocab_size = checkpoint.load_tokenizer().vocab_size
    width = min(model.config.block_size, 256)
    prompts = torch.arange(max(1, count // width))[:, None] % vocab_size  # (N, 1): one row per start token
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=width - 1, seed=0)
    tokens = list(generate(model, prompts, sampling, vocab_size=vocab_size))  # each (N, 1)
    return torch.cat([prompts, *tokens], dim=1), "tokens the model sampled"


def gelu_check(checkpoint: Checkpoint) -> GeluCheck:
    """Measure a gelu_exact run under llama.cpp's tanh GELU (the module docstring says how)."""
    model = checkpoint.build_gpt().float().eval()
    windows, sample = sample_windows(checkpoint, model)
    return compare_gelus(model, windows, sample)
