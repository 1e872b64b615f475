"""Inspection (handout §2.2): hook points, attention maps (PNG and HTML in a real browser), head
ablation, interventions and `verify`, on tiny trained, hand-built and Hugging Face-imported models.

References are independent of the code under test: attention written out from the weight matrices,
the residual stream summed by hand, head removal done by weight surgery on W_O, plain forward passes
on edited prompts, and a hand-built model whose answer is known to come from one head.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import tiny_config
from gptlab.checkpoint import BEST, Checkpoint, load_run, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data import prepare
from gptlab.inspection import (
    ablate_heads,
    attention_maps,
    edit_tokens,
    hook_points,
    hooked,
    intervene,
    record,
    save_attention_html,
    verify_model,
)
from gptlab.inspection.tokens import token_label
from gptlab.model import GPT, KVCache, SinusoidalPositions
from gptlab.tokenizer import ByteTokenizer, train_tokenizer

TEXT = "\n".join(f"{who} sat on the {what}." for who in ("the cat", "a dog", "my bird")
                 for what in ("mat", "rug", "chair", "step")) * 40
PROMPT = "the cat sat on"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models run one small op after another: a second thread only adds hand-over time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_gpt(seed: int = 0, **changes: Any) -> GPT:
    """A tiny GPT with weights far from GPT-2's init, so attention is far from uniform."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**changes)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def save_model(run: Path, model: GPT, tokenizer: Any) -> Path:
    save_checkpoint(run / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 2-head char model trained for 30 steps by gptlab's own training loop."""
    from gptlab.train import train

    root = tmp_path_factory.mktemp("trained")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
    model = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=24)
    steps = TrainConfig(batch_size=8, max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=3, eval_interval=30,
                        eval_batches=1, device="cpu", precision="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in _one_thread: a tiny model only loses time to a second thread
    try:
        train(root / "run", root / "data", model, steps, progress=False)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 saved by transformers, with a bpe tokenizer, imported by `gptlab import-hf`."""
    transformers = pytest.importorskip("transformers")
    from gptlab.convert import import_hf

    root = tmp_path_factory.mktemp("hf")
    bpe = train_tokenizer("bpe", TEXT, 300)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_head=2, n_layer=2,
                                     bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    (root / "gpt2" / "tokenizer.json").write_text(bpe.to_dict()["json"], encoding="utf-8")
    import_hf(root / "gpt2", root / "run")
    return root / "run"


# ------------------------------------------------------------------------------------------- hooks


def written_out_attention(model: GPT, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


@pytest.mark.parametrize("changes", [{}, {"attention": "naive"}, {"arrangement": "post", "tied": False},
                                     {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu"}])
def test_recording_every_point_leaves_the_logits_bit_identical(changes: dict) -> None:
    model = random_gpt(**changes)
    idx = torch.randint(0, 13, (2, 8))
    plain = model(idx)[0]
    with record(model, hook_points(model)) as values:
        inspected = model(idx)[0]
    assert torch.equal(inspected, plain)
    assert set(values) == set(hook_points(model))
    assert values["h.1.attn.heads"].shape == (2, 8, 2, 4)  # (B, T, H, hs)
    assert values["h.0.attn.weights"].shape == values["h.1.attn.scores"].shape == (2, 2, 8, 8)
    assert torch.equal(model(idx)[0], plain)  # and nothing stays registered


def test_recorded_values_match_a_written_out_forward_pass() -> None:
    model = random_gpt()
    idx = torch.randint(0, 13, (2, 8))
    with record(model, hook_points(model)) as v:
        model(idx)
    rows = model.transformer.wte.weight[idx] + model.transformer.wpe.weight[:8]  # E[w] + p_i, (B, T, D)
    assert_close(v["embed"], rows)
    assert_close(v["h.0.resid_pre"], rows)
    for n, block in enumerate(model.transformer.h):
        assert_close(v[f"h.{n}.attn.in"], block.ln_1(v[f"h.{n}.resid_pre"]))
        scores, weights = written_out_attention(model, n, v[f"h.{n}.attn.in"])
        assert_close(v[f"h.{n}.attn.scores"], scores)  # raw: the future entries are there too
        assert_close(v[f"h.{n}.attn.weights"], weights)
        assert_close(v[f"h.{n}.attn.out"], block.attn.c_proj(v[f"h.{n}.attn.heads"].flatten(2)))
        residual = v[f"h.{n}.resid_pre"] + v[f"h.{n}.attn.out"] + v[f"h.{n}.mlp.out"]  # pre-norm stream
        assert_close(v[f"h.{n}.resid_post"], residual)
    assert_close(v["h.1.resid_pre"], v["h.0.resid_post"])


def test_weights_are_recomputed_only_for_the_heads_asked_for() -> None:
    model = random_gpt(positions="rope")
    idx = torch.randint(0, 13, (1, 8))
    with record(model, ["h.1.attn.weights"]) as every:
        model(idx)
    with record(model, ["h.1.attn.weights"], heads=[1]) as one:
        model(idx)
    assert one["h.1.attn.weights"].shape == (1, 1, 8, 8)
    assert torch.equal(one["h.1.attn.weights"], every["h.1.attn.weights"][:, [1]])
    assert_close(every["h.1.attn.weights"], model.transformer.h[1].attn.attention_weights(
        model.transformer.h[1].ln_1(model.transformer.h[0](model.embed(idx)))))


def test_hooks_are_removed_even_when_the_forward_pass_fails() -> None:
    model = random_gpt()

    def explode(value: torch.Tensor, name: str) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), hooked(model, dict.fromkeys(hook_points(model), explode)):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_bad_hook_use_is_one_clear_error() -> None:
    model = random_gpt()
    idx = torch.zeros(1, 4, dtype=torch.long)
    for name in ("h.2.mlp.out", "h.01.mlp.out", "h.-1.mlp.out", "h.0.mlp", "blocks.0.mlp.out"):
        with pytest.raises(ValueError, match=rf"unknown hook point '{re.escape(name)}': .* N in 0\.\.1"):
            with hooked(model, {name: lambda v, n: None}):
                pass
    with pytest.raises(ValueError, match="cannot be replaced: replace h.0.attn.heads instead"):
        with hooked(model, {"h.0.attn.weights": lambda v, n: v * 2}):
            model(idx)
    with pytest.raises(ValueError, match=r"returned shape \(1, 4\); it must keep \(1, 4, 8\)"):
        with hooked(model, {"h.0.mlp.out": lambda v, n: v[..., 0]}):
            model(idx)
    with pytest.raises(ValueError, match="without a KV cache"):
        with record(model, ["h.0.attn.weights"]):
            model(idx, cache=KVCache(model.config, 1))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------------------------------------------- ablation


def previous_token_model(seed: int = 0) -> GPT:
    """A 2-layer, 4-head model built by hand whose next-token prediction copies the previous token.

    Residual features: 0-5 the token (one-hot), 6-7 the position as (cos, sin) of i * pi/8, 8-13 the
    copied token, 14-31 scratch. Layer 1's head 2 queries with the position turned back by one step,
    so it attends to position i - 1, and writes that token's one-hot into 8-13, which the vocabulary
    head reads. The other heads are random and write only small amounts into 8-31. No norms, no FFN.
    """
    V, D, H, hs, theta = 6, 32, 4, 8, math.pi / 8
    config = ModelConfig(vocab_size=V, block_size=8, n_layer=2, n_head=H, n_embd=D, norm="none", ffn="relu",
                         tied=False, bias=False)
    model = GPT(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight[:, :V] = torch.eye(V)
        angles = torch.arange(8.0) * theta
        model.transformer.wpe.weight[:, 6:8] = torch.stack([angles.cos(), angles.sin()], dim=1)
        for layer, block in enumerate(model.transformer.h):
            w, w_o = block.attn.c_attn.weight, block.attn.c_proj.weight  # (3D, D) = [W_Q; W_K; W_V], (D, D)
            for head in range(H):
                rows = torch.arange(head * hs, (head + 1) * hs)  # this head's features in q, k, v
                if (layer, head) != (1, 2):
                    for part in range(3):
                        w[part * D + rows] = 0.5 * torch.randn(hs, D, generator=generator)
                    w_o[8:, rows] = 0.1 * torch.randn(D - 8, hs, generator=generator)
                    continue
                c, s, sharp = math.cos(theta), math.sin(theta), 150 * math.sqrt(hs)  # cancels 1/sqrt(hs)
                w[rows[:2], 6:8] = sharp * torch.tensor([[c, s], [-s, c]])  # q_i = p_{i-1} (rotated back)
                w[D + rows[:2], 6:8] = torch.eye(2)  # k_j = p_j
                w[2 * D + rows[:V], :V] = torch.eye(V)  # v_j = the token one-hot
                w_o[8:8 + V, rows[:V]] = 5.0 * torch.eye(V)
        model.lm_head.weight[:, 8:8 + V] = torch.eye(V)
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ablation_finds_the_head_the_answer_depends_on(seed: int) -> None:
    model = previous_token_model(seed)
    ids = [3, 1, 4, 0, 5, 2]
    with record(model, ["h.1.attn.weights"]) as values:
        logits = model(torch.tensor([ids]))[0]
    assert values["h.1.attn.weights"][0, 2].diagonal(-1).min() > 0.99  # it does attend to i - 1
    assert logits[0, -1].argmax() == ids[-2]
    result = ablate_heads(model, ids)
    assert result.target == ids[-2]
    for by in ("zero", "mean"):
        first, second = result.ranked(by)[:2]
        assert (first.layer, first.head) == (1, 2)
        assert getattr(first, by) < -1.0 and abs(getattr(second, by)) < 0.1


def target_logprob(model: GPT, idx: torch.Tensor, target: int) -> torch.Tensor:
    return model(idx)[0][0, -1].log_softmax(-1)[target]


@pytest.mark.parametrize("layer, head", [(0, 1), (1, 0)])
def test_zero_and_mean_ablation_equal_surgery_on_w_o(layer: int, head: int) -> None:
    model = random_gpt(1)
    idx = torch.tensor([[1, 5, 2, 7, 7, 0]])
    effects = ablate_heads(model, idx[0].tolist(), target=4).effects
    effect = next(e for e in effects if (e.layer, e.head) == (layer, head))
    base = target_logprob(model, idx, 4)
    with record(model, [f"h.{layer}.attn.heads"]) as v:
        model(idx)
    mean = v[f"h.{layer}.attn.heads"][0, :, head].mean(0)  # (hs,), over the prompt's positions
    columns = slice(head * 4, (head + 1) * 4)  # the head's input features of W_O
    zeroed, averaged = random_gpt(1), random_gpt(1)
    with torch.no_grad():  # a head reaches the residual stream only through its columns of W_O
        for surgery in (zeroed, averaged):
            surgery.transformer.h[layer].attn.c_proj.weight[:, columns] = 0
        w_o = model.transformer.h[layer].attn.c_proj.weight
        averaged.transformer.h[layer].attn.c_proj.bias += w_o[:, columns] @ mean  # a constant contribution
    assert_close(torch.tensor(effect.zero), target_logprob(zeroed, idx, 4) - base)
    assert_close(torch.tensor(effect.mean), target_logprob(averaged, idx, 4) - base)
    assert abs(effect.zero) > 1e-3 and abs(effect.mean) > 1e-3  # not trivially 0 = 0


# ------------------------------------------------------------------------------------ attention view


def test_attention_maps_are_the_models_weights_and_predictions(trained_run: Path) -> None:
    model, tokenizer = load_run(trained_run)
    ids = tokenizer.encode(PROMPT)
    idx = torch.tensor([ids])
    maps = attention_maps(model, tokenizer, PROMPT, ids, layer=1, head=0)
    assert (maps.layers, maps.heads, maps.labels[:4]) == ([1], [0], ["t", "h", "e", "\u2423"])
    x = model.transformer.h[1].ln_1(model.transformer.h[0](model.embed(idx)))  # layer 1's attention input
    assert_close(maps.weights[0, 0], written_out_attention(model, 1, x)[1][0, 0])
    assert_close(maps.probs, F.softmax(model(idx)[0][0], dim=-1))
    with pytest.raises(ValueError, match=r"--head 2 does not exist: the model has 2, numbered 0\.\.1"):
        attention_maps(model, tokenizer, PROMPT, ids, head=2)


def test_attention_png_grid_and_single_map_are_valid_images(trained_run: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    grid, single = tmp_path / "grid.png", tmp_path / "single.png"
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", str(grid)]) == 0
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", str(single), "--layer", "1",
                 "--head", "0"]) == 0
    assert grid.read_bytes()[:8] == single.read_bytes()[:8] == PNG_SIGNATURE
    pixels, one = imread(grid), imread(single)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert pixels.shape[0] > one.shape[0] and pixels.shape[1] > one.shape[1]  # 2 x 2 maps against 1
    assert pixels[..., :3].std() > 0.05  # something is drawn


def test_html_page_is_self_contained_and_escapes_its_data(tmp_path: Path) -> None:
    model, tokenizer = random_gpt(vocab_size=256, block_size=32), ByteTokenizer()
    prompt = '</script><b>"x"\n</b>'
    ids = tokenizer.encode(prompt)
    maps = attention_maps(model, tokenizer, prompt, ids)
    page = tmp_path / "page.html"
    save_attention_html(maps, tokenizer, page)
    text = page.read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the data block's and the code's: the prompt's own is escaped
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\(", text)  # nothing to fetch
    inline = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
    data = json.loads(inline.group(1))
    assert data["labels"] == maps.labels and data["labels"][-5] == "\\n"
    assert_close(torch.tensor(data["weights"]), maps.weights, atol=5e-5, rtol=0)
    assert [row[0][0] for row in data["predictions"]] == [token_label(tokenizer, int(t)) for t in
                                                         maps.probs.argmax(-1)]


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Chromium:
    """Headless chromium driven with the DevTools protocol over a pipe (JSON ending in NUL on fds 3, 4).

    The pipe needs neither a websocket library nor a driver binary: only Debian's `chromium` package.
    """

    def __init__(self, binary: str, profile: Path) -> None:
        to_child, self._out = os.pipe()  # chromium reads commands on its fd 3
        self._in, from_child = os.pipe()  # and writes replies and events on its fd 4

        def plumb() -> None:  # in the child before exec; dup first, so neither end is overwritten
            read, write = os.dup(to_child), os.dup(from_child)
            os.dup2(read, 3)
            os.dup2(write, 4)

        command = [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        self.process = subprocess.Popen(command, close_fds=False, preexec_fn=plumb,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer, self._id, self.session = b"", 0, None
        self.events: list[dict] = []

    def call(self, method: str, **params: Any) -> dict:
        """Send one command (to the attached page, once there is one) and wait for its reply."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    assert "error" not in reply, f"{method}: {reply['error']}"
                    return reply["result"]
                self.events.append(reply)
            ready, _, _ = select.select([self._in], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._in, 1 << 16) if ready else b""
            assert chunk, f"chromium gave no reply to {method}"
            self._buffer += chunk

    def open(self, page: Path) -> None:
        target = self.call("Target.createTarget", url=page.as_uri())["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Runtime.enable")
        for _ in range(100):
            if self.js("document.readyState") == "complete":
                return
            time.sleep(0.05)
        raise AssertionError(f"{page} did not finish loading")

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def press(self, selector: str, key: str) -> None:
        """Focus an element and press a key on it, as a reader with a keyboard would."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=KEYS[key])

    def hover(self, selector: str) -> None:
        """Move the mouse over the middle of an element."""
        found = f"document.querySelector({json.dumps(selector)})"
        box = json.loads(self.js(f"JSON.stringify({found}.getBoundingClientRect())"))
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box["x"] + box["width"] / 2,
                  y=box["y"] + box["height"] / 2)

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(timeout=10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            os.close(self._out)
            os.close(self._in)


KEYS = {"ArrowDown": 40, "ArrowUp": 38}


@pytest.fixture
def browser(tmp_path: Path) -> Any:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("Debian's chromium is not installed and could not be: .ci/run installs it with "
                    "`apt-get install chromium` where apt works; install it to run this browser test")
    chromium = Chromium(binary, Path(tempfile.mkdtemp(dir=tmp_path)))
    yield chromium
    chromium.close()


ROW = ("Array.from(document.querySelectorAll('#map tbody tr')[{}].cells).slice(1)"
       ".map(c => Number(c.dataset.weight))")  # one query's weights as the map shows them
SHOWN = "[document.getElementById('map').dataset.layer, document.getElementById('map').dataset.head]"


def test_html_page_controls_change_the_head_in_headless_chromium(trained_run: Path, tmp_path: Path,
                                                                 browser: Chromium) -> None:
    model, tokenizer = load_run(trained_run)
    ids = tokenizer.encode(PROMPT)
    maps = attention_maps(model, tokenizer, PROMPT, ids)
    page = tmp_path / "attention.html"
    save_attention_html(maps, tokenizer, page)
    browser.open(page)
    last = len(ids) - 1
    assert browser.js(SHOWN) == ["0", "0"]
    assert_close(torch.tensor(browser.js(ROW.format(last))), maps.weights[0, 0, last], atol=1e-4, rtol=0)
    browser.press("#head", "ArrowDown")  # the next head, picked with the keyboard
    assert browser.js(SHOWN) == ["0", "1"]
    assert_close(torch.tensor(browser.js(ROW.format(last))), maps.weights[0, 1, last], atol=1e-4, rtol=0)
    browser.press("#layer", "ArrowDown")
    assert browser.js(SHOWN) == ["1", "1"]
    assert_close(torch.tensor(browser.js(ROW.format(2))), maps.weights[1, 1, 2], atol=1e-4, rtol=0)
    assert not torch.allclose(maps.weights[1, 1], maps.weights[0, 0], atol=1e-3)  # so the change shows
    browser.hover("#tokens span[data-pos='4']")  # the "c" of "cat"
    assert browser.js("document.getElementById('focus').textContent").startswith("position 4 (c) attends")
    shown = browser.js("Array.from(document.querySelectorAll('#predictions li')).map(li => li.textContent)")
    top = maps.probs[4].topk(len(shown))
    assert shown == [f"{token_label(tokenizer, int(t))}  {100 * float(p):.1f}%"
                     for p, t in zip(top.values, top.indices, strict=True)]
    strip = browser.js("Array.from(document.querySelectorAll('#tokens span')).map(s => s.title)")
    assert strip[:5] == [f"weight {float(w):.4f}" for w in maps.weights[1, 1, 4, :5]]
    assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    screenshot = browser.call("Page.captureScreenshot", format="png")["data"]
    assert base64.b64decode(screenshot)[:8] == PNG_SIGNATURE  # the page rendered


# ------------------------------------------------------------------------------------ interventions


def test_edit_tokens_replaces_and_drops_by_position() -> None:
    assert edit_tokens([10, 11, 12, 13], replace=[(1, 99), (-1, 98)], drop=[0]) == [99, 12, 98]
    assert edit_tokens([10, 11, 12, 13], drop=[-2, 1]) == [10, 13]
    for replace, drop, message in (
        ([(4, 1)], [], r"--replace position 4 is outside the prompt's 4 tokens: use 0\.\.3, or -4\.\.-1"),
        ([], [-5], "--drop position -5 is outside"),
        ([(1, 5), (-3, 6)], [], "--replace names position 1 twice"),
        ([(2, 5)], [-2], "position 2 is both replaced and dropped"),
        ([], [0, 1, 2, 3], "removes every token"),
    ):
        with pytest.raises(ValueError, match=message):
            edit_tokens([10, 11, 12, 13], replace, drop)


def test_intervene_compares_plain_forward_passes_of_both_prompts() -> None:
    model = random_gpt(3)
    result = intervene(model, [1, 2, 3, 4, 5], replace=[(0, 9)], drop=[2])
    assert result.after == [9, 2, 4, 5]
    for ids, probs in ((result.before, result.probs_before), (result.after, result.probs_after)):
        assert_close(probs, F.softmax(model(torch.tensor([ids]))[0][0, -1], dim=-1))
    rows = result.top(3)
    tops = {*result.probs_before.topk(3).indices.tolist(), *result.probs_after.topk(3).indices.tolist()}
    assert {token for token, _, _ in rows} == tops and len(rows) == len(tops)
    assert [max(b, a) for _, b, a in rows] == sorted((max(b, a) for _, b, a in rows), reverse=True)


def table_rows(out: str, columns: int) -> list[list[str]]:
    """Whitespace-split lines of a printed table that have `columns` fields, the last ones numbers."""
    number = re.compile(r"^[+-]?\d+(\.\d+)?(e[+-]\d+)?$")
    rows = [line.split() for line in out.splitlines()]
    return [row for row in rows if len(row) == columns and all(number.match(f) for f in row[-3:])]


def test_intervene_command(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    # "the cat sat on": c a t are tokens 4 5 6
    args = ["intervene", str(trained_run), "--prompt", PROMPT, "--replace", "4=d", "--replace", "5=o",
            "--replace=-8=g", "--drop=-1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "before: 'the cat sat on' (14 tokens)" in out and "after:  'the dog sat o' (13 tokens)" in out
    assert "replaced position 6: 't' -> 'g'" in out and "dropped position 13: 'n'" in out
    model, tokenizer = load_run(trained_run)
    with torch.no_grad():
        after = F.softmax(model(torch.tensor([tokenizer.encode("the dog sat o")]))[0][0, -1], dim=-1)
    rows = table_rows(out, 4)
    assert len(rows) >= 5
    token_of = {f"'{token_label(tokenizer, t)}'": t for t in range(tokenizer.vocab_size)}
    for label, before, p_after, change in rows:
        token = token_of[label]
        assert abs(float(p_after) - float(after[token])) < 1e-4
        assert abs(float(change) - (float(p_after) - float(before))) < 2e-4


@pytest.mark.parametrize(("args", "message"), [
    (["--replace", "4=dog"], "--replace 'dog' is 3 tokens for the char tokenizer; give text that is exactly"),
    (["--replace", "4"], "--replace '4' must be POS=TOKEN"),
    (["--drop", "40"], "--drop position 40 is outside the prompt's 14 tokens"),
    (["--replace", "1=Q"], "character 'Q' at position 0 is not in the char tokenizer's vocabulary"),
    ([], "nothing to change: give --replace POS=TOKEN or --drop POS"),
    (["--drop", "0", "--prompt", "the cat " * 4],
     "--prompt is 32 tokens but the model sees at most block_size=24: shorten the prompt"),
])
def test_intervene_mistakes_are_one_line(trained_run: Path, capsys: pytest.CaptureFixture, args: list[str],
                                         message: str) -> None:
    assert main(["intervene", str(trained_run), "--prompt", PROMPT, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and message in err and err.count("\n") == 1


def test_ablate_command_prints_a_sorted_table_and_a_heatmap(trained_run: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out_png = tmp_path / "heads.png"
    assert main(["ablate", str(trained_run), "--prompt", PROMPT, "--target", " ", "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, 4)
    assert [(int(r[0]), int(r[1])) for r in rows] != [] and len(rows) == 4  # 2 layers x 2 heads
    assert [float(r[2]) for r in rows] == sorted(float(r[2]) for r in rows)  # largest drop first
    model, tokenizer = load_run(trained_run)
    result = ablate_heads(model, tokenizer.encode(PROMPT), target=tokenizer.encode(" ")[0])
    assert f"target next token '\u2423': log p = {result.logprob:.4f}" in out
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    assert main(["ablate", str(trained_run), "--prompt", PROMPT, "--target", "at"]) == 2
    assert "--target 'at' is 2 tokens" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- verify


def by_name(properties: list) -> dict[str, Any]:
    return {p.name: p for p in properties}


def test_verify_passes_on_a_trained_model(trained_run: Path) -> None:
    properties = by_name(verify_model(load_run(trained_run)[0]))
    assert [p.passed for p in properties.values()] == [True, True, True, True, True, None]
    assert properties["logits at i ignore every input after i"].deviation == 0.0
    assert 0 <= properties["attention rows sum to one"].deviation < 1e-5


def unmask_one_block(model: GPT) -> None:
    model.transformer.h[1].attn.causal = False  # through the library's own switch, on one block only


def untie(model: GPT) -> None:
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())


def scale_queries(model: GPT) -> None:
    attn = model.transformer.h[0].attn
    kernel = attn.kernel
    attn.kernel = lambda q, k, v, causal: kernel(2 * q, k, v, causal)


def ignore_cache_mask(model: GPT) -> None:
    for block in model.transformer.h:
        block.attn.masked_kernel = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v)


def add_positions(model: GPT) -> None:
    model.transformer.wpe = SinusoidalPositions(model.config)


@pytest.mark.parametrize(("changes", "breaks", "name"), [
    ({}, unmask_one_block, "logits at i ignore every input after i"),
    ({}, ignore_cache_mask, "cached generation = uncached"),
    ({"positions": "rope"}, scale_queries, "fused projection = separate projections"),
    ({}, untie, "tied head is the embedding tensor"),
    ({"positions": "none"}, add_positions, "no positions, no mask: permutation equivariant"),
])
def test_each_property_fails_on_a_model_that_breaks_it(changes: dict, breaks: Any, name: str) -> None:
    model = random_gpt(2, block_size=16, **changes)
    assert by_name(verify_model(model))[name].passed is True
    breaks(model)
    broken = by_name(verify_model(model))
    assert broken[name].passed is False
    assert broken["attention rows sum to one"].passed is True  # the others still measure


def test_rows_check_catches_weights_that_are_not_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_gpt(2)
    monkeypatch.setattr("gptlab.inspection.hooks.masked_softmax",
                        lambda scores, mask: scores.masked_fill(~mask, -math.inf).softmax(-2))  # over queries
    assert by_name(verify_model(model))["attention rows sum to one"].passed is False


def test_verify_command_exit_status(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(trained_run)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and out.count("n/a") == 1 and "0 failed" in out
    model, tokenizer = load_run(trained_run)
    open_model = GPT(model.config.replace(causal=False))  # the same weights without the mask
    open_model.load_state_dict(model.state_dict())
    save_model(tmp_path / "open", open_model, tokenizer)
    assert main(["verify", str(tmp_path / "open")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("FAIL   §7.3") for line in lines)
    assert any(line.startswith("FAIL   §7.1") and "not causal" in line for line in lines)
    assert "2 failed" in lines[-1]


# ------------------------------------------------------------------------------- every command, two models


def test_attention_command_refuses_unknown_formats(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", "map.svg"]) == 2
    assert "--out map.svg must end in .png (a picture) or .html" in capsys.readouterr().err


def test_every_command_on_an_imported_hugging_face_gpt2(hf_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    run = str(hf_run)
    assert main(["attention", run, "--prompt", PROMPT, "--out", str(tmp_path / "a.png")]) == 0
    assert main(["attention", run, "--prompt", PROMPT, "--out", str(tmp_path / "a.html"), "--layer=1"]) == 0
    assert main(["ablate", run, "--prompt", PROMPT, "--out", str(tmp_path / "b.png")]) == 0
    assert main(["intervene", run, "--prompt", PROMPT, "--replace", "0=x"]) == 0
    assert main(["verify", run]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "a.png").read_bytes()[:8] == (tmp_path / "b.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "2 layer(s) x 2 head(s)" in out and "1 layer(s) x 2 head(s)" in out
    assert "0 failed" in out and "n/a" not in out.split("tied head")[1].splitlines()[0]
