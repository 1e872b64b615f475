"""Shared fixtures: tiny configs, deterministic seeds, small models and trained runs."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# The tests mirror the package in folders; a test file imports another's helpers by its basename (each
# basename is unique), as it did when they shared one folder.
sys.path[:0] = [str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                if folder.is_dir() and folder.name.isidentifier() and not folder.name.startswith("_")]

from browser import Chromium  # noqa: E402
from gptlab.checkpoint import BEST, LAST, Checkpoint, load_checkpoint, model_tensors, save_checkpoint  # noqa: E402
from gptlab.config import ModelConfig, TrainConfig  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.text.tokenizer import CharTokenizer  # noqa: E402

# The text the inspection runs are trained on: the prompts of test_attention_view, test_interventions
# and test_verify ("the cat sat on", "the dog sat o") use only its characters.
SAT_LINES = [f"{who} sat on the {what}." for who in ("the cat", "a dog", "my bird")
             for what in ("mat", "rug", "chair", "step")]
INSPECT_TEXT = "\n".join(SAT_LINES) * 40


def covering(options: list[tuple[Any, ...]]) -> list[Any]:
    """Option tuples as pytest params, all slow but a few that show every value of every position once.

    A grid of combinations stays whole in `make test`; `make test-fast` runs the covering few."""
    seen: set[tuple[int, Any]] = set()
    params = []
    for option in options:
        new = {(i, value) for i, value in enumerate(option)} - seen
        seen |= new
        params.append(pytest.param(*option, marks=() if new else pytest.mark.slow))
    return params


@pytest.fixture(scope="session")
def char_corpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Prepare a text with the char tokenizer into a new folder: `char_corpus(text)` is that folder."""
    from gptlab.data.prepare import prepare

    def make(text: str) -> Path:
        root = tmp_path_factory.mktemp("corpus")
        (root / "text.txt").write_text(text, encoding="utf-8")
        prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
        return root / "data"
    return make


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_config() -> Callable[..., ModelConfig]:
    """`tiny_config(**changes)`: a model small enough to build and run in milliseconds."""

    def make(**changes: object) -> ModelConfig:
        base = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
        return ModelConfig(**{**base, **changes})

    return make


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run one small op after another: a second thread only adds hand-over time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def random_gpt(tiny_config: Callable[..., ModelConfig]) -> Callable[..., GPT]:
    """`random_gpt(seed=0, **changes)`: a tiny GPT with weights far from GPT-2's init, so attention is far
    from uniform."""

    def make(seed: int = 0, **changes: Any) -> GPT:
        torch.manual_seed(seed)
        model = GPT(tiny_config(**changes)).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.5)
        return model

    return make


@pytest.fixture
def save_model() -> Callable[[Path, GPT, Any], Path]:
    """`save_model(run, model, tokenizer)`: write a model as a run folder's best checkpoint."""

    def save(run: Path, model: GPT, tokenizer: Any) -> Path:
        save_checkpoint(run / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
        return run

    return save


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 2-head char model trained for 30 steps by gptlab's own training loop, once a session."""
    from gptlab.data.prepare import prepare
    from gptlab.training.loop import train

    root = tmp_path_factory.mktemp("trained")
    (root / "text.txt").write_text(INSPECT_TEXT, encoding="utf-8")
    prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=24)
    steps = TrainConfig(batch_size=8, max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=3, eval_interval=30,
                        eval_batches=1, device="cpu", precision="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in one_thread: a tiny model only loses time to a second thread
    try:
        train(root / "run", root / "data", model, steps, progress=False)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


@pytest.fixture(scope="session")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 saved by transformers, with a bpe tokenizer, imported by `gptlab import-hf`."""
    transformers = pytest.importorskip("transformers")
    from gptlab.interop.huggingface import import_hf
    from gptlab.text.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hf")
    bpe = train_tokenizer("bpe", INSPECT_TEXT, 300)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_head=2, n_layer=2,
                                     bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    (root / "gpt2" / "tokenizer.json").write_text(bpe.to_dict()["json"], encoding="utf-8")
    import_hf(root / "gpt2", root / "run")
    return root / "run"


@pytest.fixture
def written_out_attention() -> Callable[[GPT, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`written_out_attention(model, layer, x)`: one layer's attention from its input, by hand."""

    def scores_and_weights(model: GPT, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and causal weights (B, H, T, T) of one layer from its input, by hand from the weights."""
        attn, H = model.transformer.h[layer].attn, model.config.n_head
        B, T, D = x.shape
        w_q, w_k, _ = attn.c_attn.weight.split(D)
        b_q, b_k, _ = attn.c_attn.bias.split(D)
        q = (x @ w_q.T + b_q).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hs)
        k = (x @ w_k.T + b_k).view(B, T, H, D // H).transpose(1, 2)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D // H)
        future = torch.arange(T)[None, :] > torch.arange(T)[:, None]  # (T, T), True where j > i
        return scores, scores.masked_fill(future, -math.inf).softmax(-1)

    return scores_and_weights


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    """Headless Chromium driven over the DevTools pipe (tests/browser.py); skips where it is not installed."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("Debian's chromium is not installed and could not be: .ci/run installs it with "
                    "`apt-get install chromium` where apt works; install it to run this browser test")
    chromium = Chromium(binary, Path(tempfile.mkdtemp(dir=tmp_path)))
    yield chromium
    chromium.close()


def assert_identical_runs(a: Path, b: Path) -> None:
    """The last checkpoints of two runs hold the same bits: every weight, optimiser slot and random state."""
    first, second = (load_checkpoint(run, prefer=LAST) for run in (a, b))
    assert first.state["step"] == second.state["step"]
    for name, tensor in first.model_state.items():
        assert torch.equal(second.model_state[name], tensor), name
    assert first.optimizer_state is not None and second.optimizer_state is not None
    assert first.optimizer_state.keys() == second.optimizer_state.keys()
    for name, slots in first.optimizer_state.items():
        assert slots.keys() == second.optimizer_state[name].keys(), name
        for slot, tensor in slots.items():
            assert torch.equal(second.optimizer_state[name][slot], tensor), (name, slot)
    assert first.rng.keys() == second.rng.keys()
    for name, tensor in first.rng.items():
        assert torch.equal(second.rng[name], tensor), name


class TwoStops(CharTokenizer):
    """A char tokenizer whose generations end at either of two ids."""

    def __init__(self, chars: str, stops: tuple[int, ...]) -> None:
        super().__init__(chars)
        self.stops = stops

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.stops


def tiny_chat_runs(root: Path, text: str, chats: list[Any], finetune: list[str], out: str = "lora") -> None:
    """`gptlab train --preset tiny` for 3 steps on `text` into root/base, then `gptlab finetune` of it on the
    conversations `chats` into root/`out` with the options `finetune`, on one thread (a few seconds)."""
    import json

    from gptlab.cli import main

    (root / "text.txt").write_text(text, encoding="utf-8")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), "utf-8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--preset", "tiny", "--data", str(root / "text.txt"), "--max-steps", "3",
                     "--samples", "0", "--no-progress", "--out", str(root / "base")]) == 0
        assert main(["finetune", str(root / "base"), "--data", str(root / "chats.jsonl"), "--out",
                     str(root / out), *finetune]) == 0
    finally:
        torch.set_num_threads(threads)
