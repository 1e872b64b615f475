"""`gptlab break BUG --train`: a gallery bug trained beside the correct model, and what it does.

`train_side_by_side` trains the bugged and the correct model (each file's own GPT and GPTConfig) for
the same number of seconds on a character-level corpus, step by step in turn so that the machine's
load slows both alike. Its validation loss is honest for both: the harness, not the model, scores
each position against the next token, and each prediction sees only its prefix (the text is cut
after the position), so a model that reads the answer from later inputs cannot do it there.

Shape legend: N windows, T positions, V vocabulary.
"""

from __future__ import annotations

import math
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gptlab.common import on_terminal, resolve_device
from gptlab.data.corpora import load_text
from gptlab.data.prepare import tail_split
from gptlab.files import atomic_write
from gptlab.handout.learner.bugs import Bug, bug_named, bug_text, reference_text
from gptlab.text.tokenizer import CharTokenizer

MODEL = dict(block_size=64, n_layer=2, n_embd=64)  # GPTConfig fields of reference.py, with Bug.n_head
BATCH = 32
SEED = 0
EVALS = 20  # evaluations per run, evenly spaced in training time
EVAL_WINDOWS = 32  # held-out windows scored at each evaluation
EVAL_STRIDE = 8  # validation scores the prefixes of length 8, 16, ..., T of each window
PROMPT_CHARS = 32
SAMPLE_CHARS = 160
VAL_FRACTION = 0.1


@dataclass
class Run:
    """One model's training: losses at each evaluation and a sample at the end."""

    label: str
    model: torch.nn.Module
    seconds: list[float] = field(default_factory=list)  # training time at each evaluation
    train: list[float] = field(default_factory=list)  # the model's own loss, mean since the last evaluation
    val: list[float] = field(default_factory=list)  # honest held-out loss (see honest_loss)
    steps: int = 0
    diverged: bool = False  # the training loss stopped being finite
    error: str = ""  # the learner code's exception, in one line, when it crashed
    sample: str = ""


def train_side_by_side(name: str, seconds: float = 60, out: str | Path = ".", data: str = "shakespeare",
                       device: str = "auto", progress: bool | None = None) -> list[str]:
    """Train bug `name` and the reference for `seconds` each on `data` (a corpus name or a file, char
    level), draw out/break-NAME.png, and return the lines `gptlab break NAME --train` prints."""
    bug = bug_named(name)
    if not seconds > 0:
        raise ValueError(f"seconds={seconds} must be positive: give the training time of each model")
    tok, train_ids, val_ids = _corpus(data)
    dev = resolve_device(device)
    T = MODEL["block_size"]
    windows = torch.Generator().manual_seed(SEED)  # the same held-out windows at every evaluation
    starts = torch.randint(0, len(val_ids) - T, (EVAL_WINDOWS,), generator=windows)
    val_windows = torch.stack([val_ids[s:s + T + 1] for s in starts.tolist()]).to(dev)  # (N, T + 1)
    prompt = val_ids[:PROMPT_CHARS]
    trainers = [_Trainer(label, source, tok.vocab_size, bug, dev)
                for label, source in (("reference", reference_text()), (name, bug_text(name)))]
    show = on_terminal() if progress is None else progress
    with tqdm(total=2 * seconds, unit="s", disable=not show, dynamic_ncols=True, desc="training both",
              bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s") as bar:
        while active := [t for t in trainers if not t.done(seconds)]:
            # The one behind in training time steps next, so a change in the machine's load slows both alike.
            min(active, key=lambda t: t.elapsed).advance(train_ids, val_windows, seconds)
            bar.update(sum(t.elapsed for t in trainers) - bar.n)
        bar.update(bar.total - bar.n)  # the time a crashed or diverged run did not use
    runs = [t.run for t in trainers]
    for run in runs:
        if not (run.error or run.diverged):
            run.sample = tok.decode(_sample(run.model, prompt.to(dev)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    picture = out / f"break-{name}.png"
    _draw(bug, runs, picture)
    return _lines(bug, runs, seconds, data, dev, tok.decode(prompt.tolist()), picture)


def _corpus(data: str) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """The character tokenizer of `data` and its train and validation ids (the last VAL_FRACTION)."""
    text = load_text(data)
    tok = CharTokenizer.train(text)
    ids = tok.encode_array(text)
    train_ids, val_ids, _ = tail_split(ids, VAL_FRACTION)
    T = MODEL["block_size"]
    if len(val_ids) < EVAL_WINDOWS + T + 1 or len(train_ids) < BATCH + T + 1:
        raise ValueError(f"{data} holds {len(ids):,} characters, too few for windows of {T + 1}: "
                         f"give a text of at least {int((EVAL_WINDOWS + T + 1) / VAL_FRACTION):,} characters")
    return tok, torch.from_numpy(train_ids), torch.from_numpy(val_ids)


def _load(source: str, name: str) -> types.ModuleType:
    """Run a learner-style file's text as module `name` (registered while it runs, for its dataclasses)."""
    module = types.ModuleType(name)
    module.__file__ = f"<gptlab break: {name}>"
    sys.modules[name] = module
    try:
        exec(compile(source, module.__file__, "exec", dont_inherit=True), module.__dict__)
    finally:
        del sys.modules[name]
    return module


class _Trainer:
    """One of the two models in training: its optimiser, its batches, and the training time it has used."""

    def __init__(self, label: str, source: str, vocab: int, bug: Bug, device: torch.device) -> None:
        module = _load(source, f"gptlab_break_{label.replace(' ', '_')}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)  # both models start from the same seed
            model = module.GPT(module.GPTConfig(vocab_size=vocab, n_head=bug.n_head, **MODEL)).to(device)
        self.run = Run(label, model)
        self.device = device
        self.opt = torch.optim.AdamW(model.parameters(), lr=bug.lr)
        warmup = max(bug.warmup_steps, 1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warmup))
        self.batches = torch.Generator().manual_seed(SEED)  # both models see the same windows, in order
        self.elapsed = 0.0  # training time used, evaluations not counted
        self.losses: list[float] = []  # the model's own losses since the last evaluation

    def done(self, seconds: float) -> bool:
        """Whether the run has used its time, diverged, or crashed."""
        return self.elapsed >= seconds or self.run.diverged or bool(self.run.error)

    def advance(self, train_ids: torch.Tensor, val_windows: torch.Tensor, seconds: float) -> None:
        """One training step, with the evaluations that fall due (EVALS of them, evenly in training time);
        a crash of the learner's code ends the run and is kept, in one line, as `run.error`."""
        try:
            if not self.run.seconds:
                self._evaluate(val_windows)  # the untrained model, at time 0
            self._step(train_ids, seconds)
            if self.elapsed >= seconds * len(self.run.seconds) / EVALS or self.run.diverged:
                self._evaluate(val_windows)
        except Exception as exc:  # the learner's code is arbitrary: any failure of it is the finding
            self.run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _step(self, train_ids: torch.Tensor, seconds: float) -> None:
        """One AdamW step on BATCH random training windows; only its own time counts."""
        T = MODEL["block_size"]
        starts = torch.randint(0, len(train_ids) - T, (BATCH,), generator=self.batches).tolist()
        windows = torch.stack([train_ids[s:s + T + 1] for s in starts]).to(self.device)  # (B, T + 1)
        began = time.perf_counter()
        _, loss = self.run.model(windows[:, :-1], windows[:, 1:])  # targets: the next tokens
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.schedule.step()
        self.losses.append(loss.item())  # .item() waits for the device, so the time below is the step's
        self.elapsed = min(self.elapsed + time.perf_counter() - began, seconds)
        self.run.steps += 1
        self.run.diverged = not math.isfinite(self.losses[-1])

    def _evaluate(self, val_windows: torch.Tensor) -> None:
        """Record the mean training loss since the last evaluation and the honest validation loss."""
        run = self.run
        val = math.nan if run.diverged else honest_loss(run.model, val_windows)  # first: it may crash
        run.seconds.append(self.elapsed)
        run.train.append(sum(self.losses) / len(self.losses) if self.losses else math.nan)
        run.val.append(val)
        self.losses = []


@torch.no_grad()
def honest_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-token loss over windows (N, T + 1), each scored position seeing only its prefix.

    The window is cut right after the position scored, as in generation, so no model can read the
    answer from a later input: the honest measure for a model that leaks the future (§7.3).
    """
    model.eval()
    losses = []
    for t in range(EVAL_STRIDE, windows.size(1), EVAL_STRIDE):  # prefix length t, its next token at t
        logits, _ = model(windows[:, :t])  # (N, t, V)
        losses.append(F.cross_entropy(logits[:, -1].float(), windows[:, t]).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def _sample(model: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    """SAMPLE_CHARS ids after `prompt` (P,), drawn from the model's softmax with a fixed seed."""
    model.eval()
    generator = torch.Generator().manual_seed(SEED)
    idx = prompt[None]  # (1, P)
    for _ in range(SAMPLE_CHARS):
        logits, _ = model(idx[:, -MODEL["block_size"]:])  # (1, t, V)
        probs = logits[0, -1].float().softmax(-1).cpu()
        chosen = torch.multinomial(probs, 1, generator=generator).to(idx.device)  # (1,)
        idx = torch.cat([idx, chosen[None]], dim=1)
    return idx[0, len(prompt):].tolist()


def _draw(bug: Bug, runs: list[Run], path: Path) -> None:
    """Both models' training and validation losses against training time in one picture, their samples
    beneath."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 5.6), dpi=110, layout="constrained")
    ax, notes = fig.subplots(2, 1, height_ratios=[5, 1])
    for run, color in zip(runs, ("tab:blue", "tab:red"), strict=True):
        ax.plot(run.seconds, run.train, color=color, linestyle="--", linewidth=1.2,
                label=f"{run.label}: training loss, as its forward reports it")
        ax.plot(run.seconds, run.val, color=color, linewidth=2.2, marker="o", markersize=3.5,
                label=f"{run.label}: validation loss (held-out, next token, prefix only)")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("loss (nats per character)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"gptlab break {bug.name}: {bug.title}", fontsize=10)
    notes.axis("off")
    for row, run in enumerate(runs):
        notes.text(0, 0.75 - 0.5 * row, f"{run.label:<19} {_shown(run)}", family="monospace", fontsize=7.5,
                   color=("tab:blue", "tab:red")[row], transform=notes.transAxes, parse_math=False)
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))  # whole or not at all


def _shown(run: Run, chars: int = 100) -> str:
    """The start of a run's sample on one line (newlines as ⏎), or why it has none, in `chars` at most."""
    if run.error:
        shown = f"crashed at step {run.steps + 1}: {run.error}"
    elif run.diverged:
        shown = f"diverged: the loss was not finite at step {run.steps}"
    else:
        shown = "sample: " + run.sample.replace("\n", "⏎")
    return shown if len(shown) <= chars else shown[:chars - 3] + "..."


def _last(values: list[float]) -> str:
    """The last finite value with three decimals, or a dash when there is none."""
    finite = [v for v in values if math.isfinite(v)]
    return f"{finite[-1]:.3f}" if finite else "-"


def _lines(bug: Bug, runs: list[Run], seconds: float, data: str, device: torch.device, prompt: str,
           picture: Path) -> list[str]:
    """What `gptlab break NAME --train` prints: the verdict, the final losses, the samples, the picture."""
    verdict = (f"a bug: gptlab check fails it at {bug.section}" if bug.kind == "bug"
               else f"a choice, not a bug: gptlab check fails nothing ({bug.section})")
    warmup = f"after {bug.warmup_steps} warm-up steps" if bug.warmup_steps else "with no warm-up"
    lines = [f"{bug.name}: {bug.title} ({verdict})",
             f"trained {seconds:g} s each on {data} ({device.type}): "
             + ", ".join(f"{run.label} {run.steps:,} steps" for run in runs),
             f"both: {MODEL['n_layer']} layers, {MODEL['n_embd']} wide, {bug.n_head} head"
             f"{'s' if bug.n_head > 1 else ''}, context {MODEL['block_size']}, AdamW at {bug.lr:g} {warmup}",
             f"{'':21}{'training loss':>15}{'validation loss':>17}   (nats per character, at the end)"]
    lines += [f"  {run.label:<19}{_last(run.train):>15}{_last(run.val):>17}" for run in runs]
    lines.append(f"prompt: {prompt!r}")
    lines += [f"  {run.label:<19} {_shown(run)}" for run in runs]
    lines += [f"what to look for: {bug.shows}", f"picture: {picture}"]
    return lines
