"""Sharded checkpoints (torch.distributed.checkpoint folders behind a pointer file), in one process.

The multi-process side (save on 2 FSDP processes, resume on 1 and on 4) is in test_distributed.py. Here
a run saves sharded with --checkpoint-format sharded, and the single-file format is the reference: the
same run saved as files, or the same checkpoint consolidated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import INSPECT_TEXT, assert_identical_runs
from gptlab import sharded
from gptlab.checkpoint import BEST, LAST, load_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.inference.loading import load
from gptlab.training.loop import train
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)
TRAIN = TrainConfig(batch_size=4, max_steps=8, lr=3e-3, warmup_steps=2, eval_interval=4, eval_batches=1,
                    device="cpu", precision="float32", save_every=0)
SHARDED = TRAIN.replace(checkpoint_format="sharded")


@pytest.fixture(scope="module")
def data_dir(char_corpus) -> Path:  # noqa: ANN001 (a conftest fixture)
    return char_corpus(INSPECT_TEXT)


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same 8 steps saved as files and saved sharded."""
    root = tmp_path_factory.mktemp("runs")
    train(root / "files", data_dir, MODEL, TRAIN, progress=False)
    train(root / "shards", data_dir, MODEL, SHARDED, progress=False)
    return root / "files", root / "shards"


def stdout_of(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.slow
def test_a_sharded_run_holds_folders_and_pointers_and_no_single_file(runs: tuple[Path, Path]) -> None:
    run = runs[1]
    assert not (run / LAST).exists() and not (run / BEST).exists()
    pointed = {json.loads((run / name).read_text())["folder"] for name in ("last.shards.json",
                                                                            "best.shards.json")}
    folders = {f"shards/{p.name}" for p in (run / "shards").iterdir()}
    assert folders == pointed  # no folder is left that no pointer names
    for folder in folders:
        assert {p.name for p in (run / folder).iterdir()} == {".metadata", "__0_0.distcp", "header.json"}


def test_a_sharded_checkpoint_holds_what_a_file_holds(runs: tuple[Path, Path]) -> None:
    assert_identical_runs(*runs)
    files, shards = (load_checkpoint(run, prefer=LAST) for run in runs)
    timed = ("train_time_s",)
    assert {k: v for k, v in files.state.items() if k not in timed} == {
        k: v for k, v in shards.state.items() if k not in timed}
    assert files.train_config.replace(checkpoint_format="sharded") == shards.train_config
    assert files.tokenizer == shards.tokenizer and files.model_config == shards.model_config


@pytest.mark.slow
def test_a_sharded_run_resumes_bit_for_bit(data_dir: Path, runs: tuple[Path, Path], tmp_path: Path) -> None:
    train(tmp_path / "split", data_dir, MODEL, SHARDED, stop_at=3, progress=False)
    assert load_checkpoint(tmp_path / "split", prefer=LAST).state["step"] == 3
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(runs[0], tmp_path / "split")


@pytest.mark.slow
def test_resuming_as_files_retires_the_shards(data_dir: Path, runs: tuple[Path, Path],
                                              tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, SHARDED, stop_at=3, progress=False)
    resume(tmp_path / "run", progress=False, changes={"checkpoint_format": "file"})
    assert_identical_runs(runs[0], tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "shards" in p.name or "safetensors" in
                  p.name) == [BEST, LAST]


@pytest.mark.parametrize("command", [
    ["eval", "{run}"],
    ["verify", "{run}"],
    ["sample", "{run}", "--prompt", "the cat", "--max-new-tokens", "12", "--seed", "3"],
    ["lens", "{run}", "--prompt", "the cat sat on", "--out", "{tmp}/lens.png"],
    ["ablate", "{run}", "--prompt", "the cat sat on", "--out", "{tmp}/ablation.png"],
])
@pytest.mark.slow
def test_every_command_reads_a_sharded_run_as_it_reads_files(runs: tuple[Path, Path], command: list[str],
                                                             tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    outputs = [stdout_of([part.format(run=run, tmp=tmp_path) for part in command], capsys) for run in runs]
    assert outputs[0].replace(str(runs[0]), "RUN") == outputs[1].replace(str(runs[1]), "RUN")


def test_serving_and_exporting_read_a_sharded_run(runs: tuple[Path, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    files_model, shards_model = (load(run).model for run in runs)  # what `gptlab serve` loads
    ids = torch.arange(10).unsqueeze(0)  # (1, 10)
    files_state, shards_state = files_model.state_dict(), shards_model.state_dict()
    assert all(torch.equal(tensor, shards_state[name]) for name, tensor in files_state.items())
    # The same weights; the logits of two loads may still round apart on some CPUs (oneDNN's AVX2 paths).
    torch.testing.assert_close(files_model(ids)[0], shards_model(ids)[0], rtol=0, atol=1e-6)
    for run, out in zip(runs, ("hf-files", "hf-shards"), strict=True):
        stdout_of(["export-hf", str(run), str(tmp_path / out)], capsys)
    first, second = (load_file(tmp_path / out / "model.safetensors") for out in ("hf-files", "hf-shards"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_fine_tuning_starts_from_a_sharded_base(runs: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps({"prompt": f"a {w}", "completion": " sat."}) + "\n"
                                for w in ("cat", "dog", "bird") * 4))
    for run, out in zip(runs, ("ft-files", "ft-shards"), strict=True):
        stdout_of(["finetune", str(run), "--data", str(examples), "--out", str(tmp_path / out),
                   "--max-steps", "2", "--no-progress", "--device", "cpu", "--precision", "float32"], capsys)
    assert_identical_runs(tmp_path / "ft-files", tmp_path / "ft-shards")


def test_consolidate_writes_the_files_and_removes_the_shards(runs: tuple[Path, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs[1], run)
    out = stdout_of(["consolidate", str(run)], capsys)
    assert out.splitlines() == [f"wrote {run / LAST}", f"wrote {run / BEST}"]
    assert not (run / "shards").exists() and not list(run.glob("*.shards.json"))
    assert_identical_runs(runs[0], run)
    for name in (LAST, BEST):  # the files are the single files the same run saved
        assert load_file(run / name).keys() == load_file(runs[0] / name).keys()
    again = stdout_of(["consolidate", str(run)], capsys)  # the same command twice just works
    assert again == f"{run} holds single-file checkpoints already: nothing to consolidate\n"


# ---------------------------------------------------------------------------------------------
# Faults: a save killed half-way is never taken for a checkpoint; damage is one line


@pytest.mark.slow
def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(data_dir: Path, runs: tuple[Path, Path],
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, SHARDED, stop_at=4, progress=False)
    before = (run / "last.shards.json").read_text()

    def die_after_writing(tensors: dict, checkpoint_id: str, no_dist: bool) -> None:
        real_save(tensors, checkpoint_id=checkpoint_id, no_dist=no_dist)  # the shards are all there ...
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")  # ... one of them half written
        raise OSError(28, "No space left on device")

    import torch.distributed.checkpoint as dcp

    real_save = dcp.save
    monkeypatch.setattr(dcp, "save", die_after_writing)
    with pytest.raises(OSError, match="the previous one, if any, is untouched"):
        resume(run, progress=False)
    monkeypatch.undo()
    assert (run / "last.shards.json").read_text() == before
    assert load_checkpoint(run, prefer=LAST).state["step"] == 4
    assert len(list((run / "shards").glob(".*.tmp-*"))) == 1  # what the failed save left
    resume(run, progress=False)  # removes it and finishes as an unbroken run
    assert not list((run / "shards").glob(".*.tmp-*"))
    assert_identical_runs(runs[0], run)


def damage_pointer(run: Path) -> str:
    folder = run / json.loads((run / "last.shards.json").read_text())["folder"]
    shutil.rmtree(folder)
    return "which is missing or incomplete"


def damage_header(run: Path) -> str:
    folder = run / json.loads((run / "last.shards.json").read_text())["folder"]
    (folder / "header.json").write_text("{broken")
    return "header.json is damaged"


def damage_shard(run: Path) -> str:
    folder = run / json.loads((run / "last.shards.json").read_text())["folder"]
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return "is damaged (a shard file is missing or cut short)"


@pytest.mark.parametrize("damage", [damage_pointer, damage_header, damage_shard])
def test_a_damaged_sharded_checkpoint_is_one_line(runs: tuple[Path, Path], tmp_path: Path, damage,  # noqa: ANN001
                                                  capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs[1], run)
    (run / "best.shards.json").unlink()
    message = damage(run)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and err.count("\n") == 1 and message in err, err
    assert "use another checkpoint of the run" in err


def test_a_damaged_pointer_keeps_every_folder(runs: tuple[Path, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs[1], run)
    folders = sorted((run / "shards").iterdir())
    (run / "best.shards.json").write_text("{half")
    assert sharded.remove_unnamed(run) == [] and sorted((run / "shards").iterdir()) == folders
