"""`train_sae` on a trained run: figures checked against hand computations, a folder the same call
continues exactly or leaves alone, refusals in one line, and the features page driven in Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptlab.config import SettingError
from gptlab.inference.loading import load
from gptlab.inspection.hooks import hooked, record
from gptlab.sae import training as sae_training
from gptlab.sae.config import SAEConfig
from gptlab.sae.data import held_out_windows, sae_text
from gptlab.sae.export import read_saelens
from gptlab.sae.model import SAETrainer
from gptlab.sae.training import train_sae
from gptlab.text.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from browser import Chromium

pytestmark = pytest.mark.usefixtures("one_thread")

SITE = "h.1.resid_post"  # the last block's output of conftest's 2-layer trained_run
SMALL = SAEConfig(site=SITE, k=4, expansion=4, tokens=2048, batch_size=256)  # 8 steps: one buffer


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_figures_match_hand_computations(trained_run: Path, tmp_path: Path) -> None:
    result = train_sae(trained_run, SMALL, tmp_path / "sae")
    assert (result.tokens, result.trained_now, result.config.width) == (2048, 2048, 64)
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    sae, provenance = read_saelens(tmp_path / "sae")
    text = sae_text(trained_run, json.loads((trained_run / "config.json").read_text()), tokenizer, None)
    inputs, targets = held_out_windows(text.val, model.config.block_size)
    with torch.no_grad(), record(model, [SITE]) as values:
        clean = F.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())
        x = values[SITE].flatten(0, 1)  # (N, D)
        with hooked(model, {SITE: lambda value, name: sae(value)}):
            spliced = F.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())
        # Zeroing the last block's output leaves the head reading ln_f(0): the same logits everywhere.
        constant = model.lm_head(model.transformer.ln_f(torch.zeros(model.config.n_embd)))
        zeroed = F.cross_entropy(constant.expand(targets.numel(), -1), targets.flatten())
        codes = sae.encode(x)
        explained = 1 - (sae.decode(codes) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    m = result.metrics
    assert m.tokens == len(x) == inputs.numel()
    assert_close(torch.tensor([m.loss_clean, m.loss_spliced, m.loss_zero, m.explained_variance]),
                 torch.stack([clean, spliced, zeroed, explained]), rtol=1e-4, atol=1e-5)
    assert m.l0 == pytest.approx(float((codes > 0).sum(-1).float().mean())) and m.l0 <= 4
    assert m.dead == pytest.approx(float(((codes > 0).sum(0) == 0).float().mean()))
    assert m.loss_recovered == pytest.approx((m.loss_zero - m.loss_spliced) / (m.loss_zero - m.loss_clean))
    assert provenance.hook_name == SITE and provenance.context_size == model.config.block_size


def test_the_same_call_again_does_nothing_and_more_tokens_train_on(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "sae"
    first = train_sae(trained_run, SMALL, out)
    before = folder_bytes(out)
    again = train_sae(trained_run, SMALL, out)
    assert (again.trained_now, again.metrics) == (0, first.metrics)
    assert folder_bytes(out) == before
    more = train_sae(trained_run, SMALL.replace(tokens=4096), out)
    assert (more.tokens, more.trained_now) == (4096, 2048)
    assert json.loads((out / "sae.json").read_text())["tokens"] == 4096


def test_an_interrupted_run_continues_to_the_weights_of_an_uninterrupted_one(
        trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SMALL.replace(tokens=4096)  # 16 steps: two buffers of 8
    whole = train_sae(trained_run, config, tmp_path / "whole")
    step = SAETrainer.step

    def stop_in_the_second_buffer(self: SAETrainer, x: torch.Tensor) -> float:
        if self.steps == 12:
            raise KeyboardInterrupt
        return step(self, x)

    monkeypatch.setattr(sae_training, "SAVE_SECONDS", 0.0)  # save after every buffer
    monkeypatch.setattr(SAETrainer, "step", stop_in_the_second_buffer)
    with pytest.raises(KeyboardInterrupt):
        train_sae(trained_run, config, tmp_path / "cut")
    assert json.loads((tmp_path / "cut" / "sae.json").read_text())["tokens"] == 8 * 256
    monkeypatch.setattr(SAETrainer, "step", step)
    resumed = train_sae(trained_run, config, tmp_path / "cut")
    assert resumed.trained_now == 8 * 256 and resumed.metrics == whole.metrics
    for name, tensor in read_saelens(tmp_path / "whole")[0].state_dict().items():
        assert torch.equal(read_saelens(tmp_path / "cut")[0].state_dict()[name], tensor), name


def test_other_settings_model_or_data_are_refused_and_the_folder_is_left_alone(
        trained_run: Path, tmp_path: Path, char_corpus: Any) -> None:
    out = tmp_path / "sae"
    train_sae(trained_run, SMALL, out)
    before = folder_bytes(out)
    with pytest.raises(SettingError) as info:
        train_sae(trained_run, SMALL.replace(k=8, lr=3e-3), out)
    assert info.value.as_flags({"out": "--out"}) == (
        f"{out} holds an SAE trained with --k 4, not 8; --lr 0.001, not 0.003: give the same settings to "
        "continue it, or choose another --out (nothing in it was changed)")
    with pytest.raises(SettingError, match=r"SAEConfig\.tokens 2048 already, more than 1024"):
        train_sae(trained_run, SMALL.replace(tokens=1024), out)
    other = char_corpus((trained_run.parent / "text.txt").read_text())  # the same text, prepared again
    own = (trained_run.parent / "data").resolve()
    with pytest.raises(SettingError, match=re.escape(f"the data {own}, not {other.resolve()}")):
        train_sae(trained_run, SMALL, out, data=str(other))
    assert folder_bytes(out) == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(SettingError, match=r"is not empty and holds no gptlab SAE"):
        train_sae(trained_run, SMALL, tmp_path / "notes")
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def test_a_run_without_data_of_its_own_needs_data(tmp_path: Path, random_gpt: Any, save_model: Any) -> None:
    text = "the cat sat on the mat. " * 60
    tokenizer = train_tokenizer("char", text)
    run = save_model(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size + 2), tokenizer)  # padded
    with pytest.raises(SettingError, match=r"not trained by gptlab on text .*: give the text to read "
                       r"activations from with data"):
        train_sae(run, SMALL.replace(site="h.0.mlp.out"), tmp_path / "sae")
    assert not (tmp_path / "sae").exists()
    (tmp_path / "text.txt").write_text(text)
    data = str(tmp_path / "text.txt")
    result = train_sae(run, SMALL.replace(site="h.0.mlp.out"), tmp_path / "sae", data=data)
    assert result.metrics.tokens > 0 and result.config.width == 4 * 8
    with pytest.raises(SettingError, match=r"^SAEConfig\.site h\.0\.attn\.weights is not one vector"):
        train_sae(run, SMALL.replace(site="h.0.attn.weights"), tmp_path / "other", data=data)


def page_data(page: Path) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', page.read_text())
    assert found is not None
    return json.loads(found.group(1))


def test_the_page_shows_each_features_strongest_contexts(trained_run: Path, tmp_path: Path) -> None:
    train_sae(trained_run, SMALL, tmp_path / "sae")
    data = page_data(tmp_path / "sae" / "features.html")
    sae, _ = read_saelens(tmp_path / "sae")
    model = load(trained_run).model
    assert len(data["features"]) == 64 and data["site"] == SITE
    feature = max(data["features"], key=lambda f: f["frequency"])
    strongest = [c["acts"][c["at"]] for c in feature["contexts"]]
    assert strongest == sorted(strongest, reverse=True) and strongest[0] == feature["max"] > 0
    context = feature["contexts"][0]  # its activations, read again through the model and the SAE
    with torch.no_grad(), record(model, [SITE]) as values:
        model(torch.tensor([context["ids"]]))
        acts = sae.encode(values[SITE])[0, :, feature["id"]]
    assert_close(acts[context["at"]], torch.tensor(context["acts"][context["at"]]), atol=2e-3, rtol=0)
    assert all(data["labels"][str(i)] for i in context["ids"])


@pytest.mark.slow
def test_the_page_works_in_a_browser(trained_run: Path, tmp_path: Path, browser: Chromium) -> None:
    train_sae(trained_run, SMALL, tmp_path / "sae")
    data = page_data(tmp_path / "sae" / "features.html")
    browser.open(tmp_path / "sae" / "features.html")
    rows = browser.js("Array.from(document.querySelectorAll('#features tbody tr')).map(r => r.dataset.id)")
    by_frequency = sorted(data["features"], key=lambda f: (-f["frequency"], f["id"]))
    assert rows == [str(f["id"]) for f in by_frequency]
    last = by_frequency[-1]["id"]
    browser.js(f"document.querySelector('#features tr[data-id=\"{last}\"]').click()")
    assert browser.js("document.getElementById('feature').textContent") == f"feature {last}"
    lines = browser.js("document.querySelectorAll('#contexts div').length")
    assert lines == len(data["features"][last]["contexts"])
    assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
