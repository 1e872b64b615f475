"""The docs cannot drift: every shell block in README.md and docs/ is marked runnable (and its fast form
runs here) or not run with a reason, and README.md's links point to files that exist.

The marker convention is described in docs/contributing.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGUAGES = {"bash", "console", "sh", "shell"}
PROMPT_COMMAND = re.compile(r"^\s*\$ (gptlab|torchrun|make|python)\b")
FENCE = re.compile(r"^(\s*)(`{3,})(\S*)")

# The runs fast forms may name, each trained once per session at tiny size by these commands (in order;
# a builder naming another shared run gets that one built first).
TINY = "gptlab train --preset tiny --block-size 64 --max-steps 3 --samples 0"
# runs/demo is what `make demo` leaves: the demo preset (its char tokenizer, its exact GELU), a few steps.
DEMO = "gptlab train --preset demo --max-steps 3 --eval-interval 3 --eval-batches 1 --samples 0 --no-progress"
SHARED_RUNS = {
    "demo": [f"{DEMO} --data shakespeare --out runs/demo"],
    "shakespeare": ["cp -r runs/demo runs/shakespeare"],
    "base": [f"{TINY} --data corpus.txt --tokenizer bpe --vocab-size 300 --out runs/base"],
    "sft": ["gptlab finetune runs/base --data chats.jsonl --max-steps 3 --out runs/sft"],
    # 40 steps, not 3: attribution's pages need clean and corrupted prompts the model tells apart
    "induction": ["gptlab train --preset induction --data repeats --max-steps 40 --out runs/induction"],
}

# A small text with every letter, digit and the punctuation the prompts use, so char models encode them.
CORPUS = "\n".join([
    "ROMEO:", "But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "JULIET:", "O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name;",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",
    "Six or seven (and 0 1 2 3 4 5 6 7 8 9) - 'quoth' he; \"hark!\" & [exeunt] ... zany, vexing quiz.",
    "",
]) * 60
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
TASKS = "".join(json.dumps({"prompt": f"{w}:", "completion": f" {w[::-1]}"}) + "\n" for w in WORDS)
CHATS = "".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                         {"role": "assistant", "content": w}]}) + "\n" for w in WORDS)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and lines, and the marker above it (None: no marker)."""

    path: Path
    line: int
    language: str
    lines: tuple[str, ...]
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.language in SHELL_LANGUAGES or any(PROMPT_COMMAND.match(x) for x in self.lines)

    @property
    def runnable(self) -> bool:
        return self.marker is not None and self.marker.startswith("run:")

    @property
    def fast_form(self) -> list[str]:
        """The commands of a run marker, one a line."""
        assert self.marker is not None
        return [x.strip() for x in self.marker[len("run:"):].strip().splitlines() if x.strip()]


def marker_above(lines: list[str], index: int) -> str | None:
    """The HTML comment ending on the last non-blank line before lines[index], without its delimiters."""
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or not lines[j].strip().endswith("-->"):
        return None
    end = j
    while j >= 0 and "<!--" not in lines[j]:
        j -= 1
    text = "\n".join(x.strip() for x in lines[j:end + 1]).strip()
    return text.removeprefix("<!--").removesuffix("-->").strip()


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, end = opening.group(2), i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        language, body = opening.group(3).lower(), tuple(lines[i + 1:end])
        found.append(Block(path, i + 1, language, body, marker_above(lines, i)))
        i = end + 1
    return found


COMMAND_BLOCKS = [b for path in DOC_FILES for b in blocks(path) if b.is_command]
RUNNABLE = [b for b in COMMAND_BLOCKS if b.runnable]


def subcommands(text: str) -> set[str]:
    """The gptlab subcommands a text's command lines call (`seq2seq train` counts as one)."""
    calls = set()
    for command in re.split(r"\n|&&|\|\||;|\|", text):
        words = command.split()
        words = words[1:] if words[:1] == ["$"] else words
        if len(words) > 1 and words[0] == "gptlab":
            calls.add(" ".join(words[1:3]) if words[1] == "seq2seq" else words[1])
    return calls


def test_every_command_block_is_marked() -> None:
    problems = []
    for block in COMMAND_BLOCKS:
        if block.marker is None:
            problems.append(f"{block.name}: no <!-- run: ... --> or <!-- not run: REASON --> line above it")
        elif block.marker.startswith("not run:"):
            if not block.marker[len("not run:"):].strip():
                problems.append(f"{block.name}: 'not run' without a reason")
        elif not block.runnable or not block.fast_form:
            problems.append(f"{block.name}: unknown marker {block.marker.splitlines()[0]!r}")
    assert not problems, "\n".join(problems)
    assert len(RUNNABLE) >= 15  # the parser found the marked blocks


def test_fast_forms_keep_the_subcommands_shown_and_leave_shared_runs_alone() -> None:
    problems = []
    for block in RUNNABLE:
        fast = "\n".join(block.fast_form)
        missing = subcommands("\n".join(block.lines)) - subcommands(fast)
        if missing:
            problems.append(f"{block.name}: the fast form does not run gptlab {', '.join(sorted(missing))}")
        for name in re.findall(r"--out runs/([\w.-]+)", fast):
            if name in SHARED_RUNS:
                problems.append(f"{block.name}: writes the shared run runs/{name}; name it otherwise")
    assert not problems, "\n".join(problems)


def test_readme_links_point_to_existing_files() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    missing = [t for t in targets if not re.match(r"[a-z]+:", t) and not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_marker_parser_on_a_sample(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- run:\ngptlab lab\ngptlab model --n-embd 8\n-->\n```bash\ngptlab lab\n```\n\n"
                    "```text\n$ gptlab eval RUN\n```\n\n<!-- not run: a browser -->\n\n```console\nx\n```\n")
    found = [b for b in blocks(page) if b.is_command]
    marked = [(b.line, b.runnable, b.marker) for b in found]
    assert marked[1:] == [(9, False, None), (15, False, "not run: a browser")]
    assert found[0].fast_form == ["gptlab lab", "gptlab model --n-embd 8"]
    calls = subcommands("gptlab seq2seq train --task reverse && gptlab check x.py")
    assert calls == {"seq2seq train", "check"}


# ---------------------------------------------------------------------------------------------------
# Running the fast forms


class CommandFailed(Exception):
    """A command line of a fast form (or of a shared run's recipe) exited non-zero."""


def run_line(line: str, cwd: Path, env: dict[str, str]) -> None:
    """Run one command line in bash; raise with its output's tail when it exits non-zero."""
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise CommandFailed(f"`{line}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")


class Workspace:
    """The session's inputs and shared tiny runs, built on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "cache").mkdir(parents=True)
        (root / "cache" / "shakespeare.txt").write_text(CORPUS, encoding="utf-8")
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    "GPTLAB_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
        self.shared = root / "shared"
        self.shared.mkdir()
        self.fill(self.shared)
        self.locks = {name: threading.Lock() for name in SHARED_RUNS}

    @staticmethod
    def fill(folder: Path) -> None:
        (folder / "corpus.txt").write_text(CORPUS, encoding="utf-8")
        (folder / "scene.txt").write_text("JULIET:\nO Romeo, Romeo!", encoding="utf-8")
        (folder / "tasks.jsonl").write_text(TASKS, encoding="utf-8")
        (folder / "chats.jsonl").write_text(CHATS, encoding="utf-8")
        shutil.copytree(ROOT / "examples" / "data", folder / "examples" / "data", dirs_exist_ok=True)

    def ensure(self, name: str) -> Path:
        """The shared run `name`, trained (with the runs it starts from) when first asked for."""
        run = self.shared / "runs" / name
        with self.locks[name]:
            if not run.exists():
                commands = SHARED_RUNS[name]
                for other in re.findall(r"runs/([\w.-]+)", " ".join(commands)):
                    if other != name and other in SHARED_RUNS:
                        self.ensure(other)
                for line in commands:
                    run_line(line, self.shared, self.env)
        return run

    def folder_for(self, block: Block, tmp: Path) -> Path:
        """A fresh folder with the inputs and copies of the shared runs the block's fast form names."""
        self.fill(tmp)
        for name in sorted(set(re.findall(r"runs/([\w.-]+)", "\n".join(block.fast_form)))):
            if name in SHARED_RUNS:
                shutil.copytree(self.ensure(name), tmp / "runs" / name)
        return tmp


    def run(self, block: Block) -> str | None:
        """Run a block's fast form in a folder of its own: None when every line passed, else why not."""
        folder = self.root / "blocks" / re.sub(r"[^\w.-]", "_", block.name)
        folder.mkdir(parents=True)
        try:
            self.folder_for(block, folder)
            for line in block.fast_form:
                run_line(line, folder, self.env)
        except CommandFailed as failure:
            return str(failure)
        return None


@pytest.fixture(scope="session")
def fast_form_results(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Run the selected blocks' fast forms, a few at a time, before the first of their tests asks.

    Most of each command is Python starting up on one core, and each runs with one thread, so two at a
    time nearly halve the wall time on two cores."""
    params = [item.callspec.params for item in request.session.items if hasattr(item, "callspec")]
    selected = [p["block"] for p in params if isinstance(p.get("block"), Block)]
    workspace = Workspace(tmp_path_factory.mktemp("docs-workspace"))
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(zip([b.name for b in selected], pool.map(workspace.run, selected), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_fast_form_runs(block: Block, fast_form_results: dict[str, str | None]) -> None:
    failure = fast_form_results[block.name]
    assert failure is None, f"{block.name}: {failure}"
