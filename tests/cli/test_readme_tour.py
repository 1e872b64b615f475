"""The README's tour, as printed, against a demo-preset run (issue 42): every line runs in a fresh folder
with only the step counts shrunk, and what it writes is checked against an independent reader
(transformers for export-hf, the gguf package and llama.cpp for export-gguf)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Options appended to each subcommand so the tour takes seconds, not minutes; nothing else changes.
SHRINK = {
    "train": "--max-steps 3 --eval-interval 3 --eval-batches 1 --samples 0 --no-progress",
    "finetune": "--max-steps 3 --no-progress",
    "sample": "--max-new-tokens 20",
    "chat": "--max-new-tokens 20",
    "eval": "--limit 4",
    "compare": "--max-steps 3 --eval-batches 1",
    "seq2seq": "--max-steps 3 --n-embd 32 --eval-examples 64",
}
EXPECTED_EXIT = {"check": 1}  # `gptlab check` on the planted bug reports it: exit 1, by design


def tour_lines() -> list[str]:
    """The command lines of the README's tour block (the one starting with the demo's training)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(gptlab train --preset demo .*?)```", text, re.S)
    assert block, "README.md has no tour block starting with `gptlab train --preset demo`"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def shrunk(line: str) -> str:
    """A tour line with each gptlab command's step counts shrunk (SHRINK)."""
    parts = []
    for command in line.split("&&"):
        words = shlex.split(command)
        extra = SHRINK.get(words[1], "") if words[0] == "gptlab" else ""
        parts.append(f"{command.strip()} {extra}".strip())
    return " && ".join(parts)


def corpus() -> str:
    """A small stand-in for Shakespeare holding every character of the tour's prompts and chat examples."""
    chats = [json.loads(x) for x in (ROOT / "examples/data/chat.jsonl").read_text().splitlines()]
    said = "\n".join(m["content"] for chat in chats for m in chat["messages"])
    pangrams = "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n"
    return ("ROMEO: and JULIET: 0123456789 (a-b) 'x' \"y\"\n" + pangrams + said + "\n") * 40


@pytest.fixture(scope="module")
def toured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """A folder holding what the tour wrote, and each line's finished process."""
    folder = tmp_path_factory.mktemp("tour")
    (folder / "cache").mkdir()
    (folder / "cache" / "shakespeare.txt").write_text(corpus(), encoding="utf-8")
    (folder / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GPTLAB_CACHE": str(folder / "cache"), "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    done = {}
    for line in tour_lines():
        done[line] = subprocess.run(["bash", "-c", shrunk(line)], cwd=folder, env=env, capture_output=True,
                                    text=True, timeout=600)
    return folder, done


@pytest.mark.slow  # the whole tour: about a dozen commands, each a few seconds
def test_every_tour_line_runs_as_printed(toured: tuple[Path, dict[str, subprocess.CompletedProcess]]) -> None:
    folder, done = toured
    assert len(done) >= 12
    for line, process in done.items():
        last = shlex.split(line.split("&&")[-1])[1]
        assert process.returncode == EXPECTED_EXIT.get(last, 0), f"{line}\n{process.stdout}{process.stderr}"
        assert "Traceback" not in process.stderr and "error:" not in process.stderr, (line, process.stderr)
    assert (folder / "runs/demo-chat").is_dir() and (folder / "runs/attention.html").is_file()
    assert not any(p.suffix in (".html", ".py", ".gguf") for p in folder.iterdir())  # nothing at the root


PROMPT = "ROMEO: and JULIET"


def gptlab_greedy(run: Path, tokens: int = 24) -> tuple[list[int], str, Any]:
    """The prompt's ids, gptlab's greedy continuation of it by `run` (as text), and the run's tokenizer."""
    from gptlab.config import SamplingConfig
    from gptlab.generate import generate
    from gptlab.inference.loading import load

    lm = load(run)
    model, tokenizer = lm.model, lm.tokenizer
    ids = tokenizer.encode(PROMPT)
    new = [int(t) for t in generate(model, [ids], SamplingConfig(temperature=0.0, max_new_tokens=tokens))]
    return ids, tokenizer.decode(new), tokenizer


@pytest.mark.slow
def test_the_exported_folder_generates_in_transformers_as_in_gptlab(
        toured: tuple[Path, dict[str, subprocess.CompletedProcess]]) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    folder, _ = toured
    ids, ours, _ = gptlab_greedy(folder / "runs/demo")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "runs/demo-hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder / "runs/demo-hf").eval()
    assert hf_tokenizer(PROMPT)["input_ids"] == ids and hf_tokenizer.decode(ids) == PROMPT
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
    assert hf_tokenizer.decode(theirs) == ours


@pytest.mark.slow
def test_the_gguf_file_reads_back_and_llama_cpp_continues_as_gptlab(
        toured: tuple[Path, dict[str, subprocess.CompletedProcess]]) -> None:
    gguf = pytest.importorskip("gguf")
    folder, _ = toured
    ids, ours, tokenizer = gptlab_greedy(folder / "runs/demo")
    reader = gguf.GGUFReader(folder / "runs/demo.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == tokenizer.vocab_size
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(folder / "runs/demo.gguf"), n_ctx=64, n_batch=64, verbose=False)
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
    assert llm(PROMPT, max_tokens=24, temperature=0.0)["choices"][0]["text"] == ours
