"""Checkpoints (gptlab.checkpoint): what is saved comes back bit for bit, a run folder gives the checkpoint
it is asked for, and a damaged, foreign or misplaced file is one line that names it.

The references are independent of the code under test: the model's own state_dict, files written or
broken by hand here, and safetensors' own writer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gptlab.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    data_folder,
    load_checkpoint,
    load_header,
    model_tensors,
    portable,
    resolve_checkpoint,
    save_checkpoint,
)
from gptlab.config import ModelConfig, Seq2SeqConfig, TrainConfig
from gptlab.inference.loading import load, ready_model
from gptlab.model import GPT
from gptlab.seq2seq.model import EncoderDecoder
from gptlab.text.tokenizer import ByteTokenizer


def checkpoint_of(model: GPT | EncoderDecoder, **more: Any) -> Checkpoint:
    return Checkpoint(model.config, ByteTokenizer().to_dict(), model_tensors(model), **more)


@pytest.mark.parametrize("tied", [True, False])
def test_weights_come_back_bit_for_bit_and_a_tied_head_is_stored_once(
    tiny_config: Callable[..., ModelConfig], tmp_path: Path, tied: bool
) -> None:
    model = GPT(tiny_config(vocab_size=256, tied=tied))
    state = {"step": 7, "best_val_loss": 1.25}
    save_checkpoint(tmp_path / BEST, checkpoint_of(model, train_config=TrainConfig(lr=0.01), state=state))
    loaded = load_checkpoint(tmp_path)
    assert ("lm_head.weight" in loaded.model_state) is not tied
    rebuilt = loaded.build_model()
    expected = model.state_dict()
    assert rebuilt.state_dict().keys() == expected.keys()
    assert all(torch.equal(rebuilt.state_dict()[name], tensor) for name, tensor in expected.items())
    assert (rebuilt.lm_head.weight is rebuilt.transformer.wte.weight) is tied
    assert loaded.model_config == model.config and loaded.train_config == TrainConfig(lr=0.01)
    assert loaded.state == state and loaded.source == str(tmp_path / BEST)


def test_the_header_alone_and_weights_without_optimiser_slots(
    tiny_config: Callable[..., ModelConfig], tmp_path: Path
) -> None:
    model = GPT(tiny_config(vocab_size=256))
    slots = {name: {"exp_avg": torch.full_like(p, 0.5)} for name, p in model.named_parameters()}
    save_checkpoint(tmp_path / LAST, checkpoint_of(model, train_config=TrainConfig(), optimizer_state=slots))
    whole = load_checkpoint(tmp_path / LAST)
    assert whole.optimizer_state is not None
    assert all(torch.equal(whole.optimizer_state[n]["exp_avg"], s["exp_avg"]) for n, s in slots.items())
    assert load_checkpoint(tmp_path / LAST, optimizer=False).optimizer_state is None
    header = load_header(tmp_path / LAST)
    assert header.model_state == {} and header.model_config == model.config


def test_a_run_folder_gives_the_checkpoint_asked_for(tiny_config: Callable[..., ModelConfig],
                                                    tmp_path: Path) -> None:
    model = GPT(tiny_config(vocab_size=256))
    with pytest.raises(FileNotFoundError, match="no run folder or checkpoint at"):
        resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(last.safetensors or best"):
        resolve_checkpoint(tmp_path)
    save_checkpoint(tmp_path / LAST, checkpoint_of(model))
    assert resolve_checkpoint(tmp_path) == tmp_path / LAST  # the best one is not written yet
    save_checkpoint(tmp_path / BEST, checkpoint_of(model))
    assert resolve_checkpoint(tmp_path) == tmp_path / BEST
    assert resolve_checkpoint(tmp_path, prefer=LAST) == tmp_path / LAST
    assert resolve_checkpoint(tmp_path / LAST, prefer=BEST) == tmp_path / LAST  # a file is itself


def test_a_truncated_or_foreign_file_is_one_line_naming_it(tiny_config: Callable[..., ModelConfig],
                                                           tmp_path: Path) -> None:
    save_checkpoint(tmp_path / BEST, checkpoint_of(GPT(tiny_config(vocab_size=256))))
    data = (tmp_path / BEST).read_bytes()
    (tmp_path / BEST).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="best.safetensors is not a readable gptlab checkpoint") as err:
        load_checkpoint(tmp_path)
    assert "\n" not in str(err.value)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"other.safetensors is not a gptlab checkpoint \(format 'pt'\)"):
        load_checkpoint(tmp_path / "other.safetensors")


def test_weights_that_do_not_fit_the_header_are_named_damaged(tiny_config: Callable[..., ModelConfig],
                                                              tmp_path: Path) -> None:
    small, wide = GPT(tiny_config(vocab_size=256)), tiny_config(vocab_size=256, n_embd=16)
    save_checkpoint(tmp_path / BEST, Checkpoint(wide, ByteTokenizer().to_dict(), model_tensors(small)))
    with pytest.raises(ValueError, match="is damaged: its weights do not fit the model config in its header"):
        load_checkpoint(tmp_path).build_model()


def test_a_header_edited_by_hand_is_one_line(tiny_config: Callable[..., ModelConfig], tmp_path: Path) -> None:
    model = GPT(tiny_config(vocab_size=256))
    save_checkpoint(tmp_path / "good.safetensors", checkpoint_of(model))
    with safe_open(str(tmp_path / "good.safetensors"), framework="pt") as reader:
        metadata, tensors = reader.metadata(), {k: reader.get_tensor(k) for k in reader.keys()}
    metadata["model_config"] = json.dumps({"n_embd": "wide"})
    save_file(tensors, str(tmp_path / BEST), metadata=metadata)
    with pytest.raises(ValueError, match="has a damaged header .*use another checkpoint of the run"):
        load_checkpoint(tmp_path)


def test_a_seq2seq_run_loaded_as_a_language_model_says_which_commands_to_use(tmp_path: Path) -> None:
    config = Seq2SeqConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    save_checkpoint(tmp_path / BEST, checkpoint_of(EncoderDecoder(config)))
    with pytest.raises(ValueError, match="holds an encoder-decoder .*use the `gptlab seq2seq` commands"):
        load(tmp_path)
    model = ready_model(load_checkpoint(tmp_path), expect="encoder-decoder")
    assert isinstance(model, EncoderDecoder) and not model.training


def test_data_inside_a_run_is_found_after_the_run_moves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "meta.json").write_text("{}")
    state = portable({"data_dir": str(run / "data")}, run)
    assert state["data_dir"] == "data"
    moved = tmp_path / "moved"
    run.rename(moved)
    assert data_folder(moved, state) == moved / "data"
    outside = portable({"data_dir": str(tmp_path / "elsewhere")}, moved)
    assert outside["data_dir"] == str((tmp_path / "elsewhere").resolve())
    with pytest.raises(ValueError, match="which is not there: if the run or its data was moved"):
        data_folder(moved, outside)
    with pytest.raises(ValueError, match="was not trained by gptlab on text"):
        data_folder(moved, {})
