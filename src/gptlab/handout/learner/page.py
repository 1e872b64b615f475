"""`gptlab check`'s page: one offline HTML file per learner file, each check beside a picture of it.

The page lists the checks (PASS, FAIL, SKIP coloured, the likely cause beside each failure), draws the
learner's attention weights on the handout's worked inputs beside the reference's, and for each block
the dependence of its output row i on its input row j (the largest |gradient|), where any entry above
the diagonal is a leak from the future: it is outlined in red and the first block that has one is
named. A failing check carries a small copy of its picture. Everything is inline (CSS, SVG drawn here):
the page fetches nothing. `pictures_for` runs the learner's code, so it belongs where the checks run
(the child process); `Pictures` travels as JSON, and `write_page` draws it in the parent.

Shape legend: Tq queries, Tk keys, T positions, D model width.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gptlab.files import HTML_MARK, atomic_write_text
from gptlab.handout.learner.calling import AttentionFunction, LanguageModel, LearnerError, probe, run
from gptlab.handout.learner.lm import T, block_dependence, find_blocks, sharpen
from gptlab.handout.learner.outputs import page_file
from gptlab.handout.properties import Check
from gptlab.handout.worked import retrieval_inputs, weights_of

Matrix = list[list[float]]
VERDICT = {True: "PASS", False: "FAIL", None: "SKIP"}  # as the text report prints them
SEED = 11  # the redrawn matrices of the model whose blocks are pictured
TOKENS_SEED = 71  # the ids model_checks feeds the model, so the picture shows what its §7.3 checks measured
FILLS = {"nan": "#f0c000", "future": "#e6e6e6"}  # a NaN (yellow), a future cell that is 0 (grey)
ATTENTION_WORDS = ("weights", "rows", "columns", "rank", "retrieval", "variance")  # §3.2 names of attention
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table.checks { border-collapse: collapse; width: 100%; }
table.checks td, table.checks th { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left;
  vertical-align: top; }
.verdict { font-weight: bold; font-family: monospace; }
tr.pass .verdict { color: #1a7f37; } tr.fail .verdict { color: #cf222e; } tr.skip .verdict { color: #777; }
tr.fail { background: #fff5f5; }
.cause { color: #8a1c1c; } .error { color: #cf222e; font-weight: bold; }
figure { display: inline-block; margin: 0 1.5em 1em 0; vertical-align: top; }
figcaption { font-size: 12px; color: #555; max-width: 26em; }
svg.heatmap { margin-right: 12px; } svg.heatmap text { font: 9px monospace; }
rect.leak { stroke: #cf222e; stroke-width: 2.5; }
.leaks { color: #cf222e; font-weight: bold; } .clean { color: #1a7f37; font-weight: bold; }
"""


class Report(Protocol):
    """What the page reads of a checked file: isolate.FileReport (not imported: isolate may import this)."""

    @property
    def path(self) -> Path: ...

    @property
    def checks(self) -> list[Check]: ...

    @property
    def error(self) -> str | None: ...

    @property
    def traceback(self) -> str: ...


@dataclass(frozen=True)
class WeightsPair:
    """The learner's attention weights (Tq, Tk) on one worked input, and the handout's."""

    title: str
    learner: Matrix
    reference: Matrix


@dataclass(frozen=True)
class Pictures:
    """The numbers the page draws, computed where the learner's code runs; empty lists: nothing to draw."""

    attention: list[WeightsPair] = field(default_factory=list)
    blocks: list[Matrix] = field(default_factory=list)  # per block (T, T): max |d output i / d input j|

    def record(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_record(record: dict[str, Any]) -> Pictures:
        """The pictures `record()` wrote; a ValueError if the numbers are not matrices."""
        pairs = [WeightsPair(str(pair["title"]), _checked(pair["learner"]), _checked(pair["reference"]))
                 for pair in record["attention"]]
        return Pictures(pairs, [_checked(matrix) for matrix in record["blocks"]])


def _checked(rows: Any) -> Matrix:
    """rows as a list of equally long lists of floats, or a ValueError."""
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ValueError("a picture's matrix is not a list of rows")
    matrix = [[float(value) for value in row] for row in rows]
    if len({len(row) for row in matrix}) > 1:
        raise ValueError("a picture's matrix has rows of different lengths")
    return matrix


def _matrix(tensor: torch.Tensor) -> Matrix:
    """A (rows, columns) tensor as nested lists of floats."""
    return tensor.detach().double().tolist()


# ---------------------------------------------------------------------------------------------
# The numbers, where the learner's code runs


def pictures_for(attention: Callable[..., Any] | None, model: nn.Module | None,
                 block_class: type | None = None) -> Pictures:
    """The pictures of a learner's attention function and model (either may be None); a part whose code
    crashes is left out, as its checks report the crash. The model is copied, never changed."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        torch.set_num_threads(1)  # tiny tensors, one op after another: a second thread only adds hand-over
        try:
            return Pictures([] if attention is None else attention_pairs(attention),
                            [] if model is None else block_dependences(model, block_class))
        finally:
            torch.set_num_threads(threads)


def attention_pairs(fn: Callable[..., Any]) -> list[WeightsPair]:
    """The learner's weights beside the handout's: §2.1's retrieval, and random queries and keys (§3.2)."""
    query, keys, _ = retrieval_inputs()  # (1, 1, 2), (1, 3, 2)
    q, k, _ = probe((1,), 4, 5, seed=1)  # (1, 4, 5), (1, 5, 5)
    scaled = (q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)
    try:
        attend = AttentionFunction(fn, "attention").attend
        learner = [weights_of(attend, query, keys)[0], weights_of(attend, q, k)[0]]
    except LearnerError:
        return []
    titles = ("§2.1: query [1, 0] against the three worked keys",
              "§3.2: four random queries against five keys, softmax(q k^T / sqrt(d_k))")
    references = (torch.tensor([[0.5, 0.25, 0.25]]), scaled[0])
    return [WeightsPair(title, _matrix(mine), _matrix(theirs))
            for title, mine, theirs in zip(titles, learner, references, strict=True)]


def block_dependences(model: nn.Module, block_class: type | None) -> list[Matrix]:
    """Per block, (T, T): how much its output row i moves with its input row j, in a copy of `model`
    whose matrices are redrawn as model_checks redraws them."""
    try:
        lm = LanguageModel(run("copy.deepcopy(model)", copy.deepcopy, model), "model")
        sharpen(lm.model)
        blocks = find_blocks(lm.model, block_class)
        idx = torch.randint(0, lm.vocab, (1, T + 1), generator=torch.Generator().manual_seed(TOKENS_SEED))
        rows = block_dependence(lm, blocks, idx[:, :T]) if blocks else []
    except (LearnerError, RuntimeError):  # RuntimeError: autograd refusing the learner's in-place writes
        return []
    return [_matrix(r.abs().amax(-1)) for r in rows]


# ---------------------------------------------------------------------------------------------
# The page, in the parent


def leaking_blocks(pictures: Pictures) -> list[int]:
    """The blocks whose output row i moves with an input row j > i."""
    return [b for b, matrix in enumerate(pictures.blocks)
            if any(value > 0 for i, row in enumerate(matrix) for value in row[i + 1:])]


def write_page(report: Report, folder: Path, pictures: Pictures | None = None) -> Path:
    """Write the page of one checked file into `folder` as NAME.html (NAME the file's stem), marked as
    gptlab's (files.HTML_MARK: the next `check --html` writes it again); its path."""
    pictures = pictures or Pictures()
    passed, failed, skipped = (sum(c.passed is verdict for c in report.checks) for verdict in VERDICT)
    parts = [f"<h1>gptlab check: {_text(report.path)}</h1>",
             f'<p class="summary">{passed} passed, {failed} failed, {skipped} skipped</p>']
    if report.error:
        parts.append(f'<p class="error">ERROR {_text(report.error)}</p>')
        parts.append(f"<pre>{_text(report.traceback)}</pre>" if report.traceback else "")
    rows = "".join(_row(check, pictures) for check in report.checks)
    parts.append('<table class="checks"><thead><tr><th>verdict</th><th>section</th><th>check</th>'
                 f"<th>details</th><th>picture</th></tr></thead><tbody>{rows}</tbody></table>")
    parts += [_attention_section(pictures.attention), _blocks_section(pictures)]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{HTML_MARK}'
            f"<title>gptlab check: {_text(report.path.name)}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")
    folder.mkdir(parents=True, exist_ok=True)
    path = page_file(folder, report.path)
    atomic_write_text(path, page)
    return path


def _text(value: object) -> str:
    return html.escape(str(value))


def _row(check: Check, pictures: Pictures) -> str:
    """One check: verdict, section, name, and what a failure measured, its cause and its picture."""
    verdict = VERDICT[check.passed]
    if check.passed is False:
        details = f"expected {_text(check.expected)}; measured {_text(check.computed)}"
        if check.cause:
            details += f'<div class="cause">likely cause: {_text(check.cause)}</div>'
    else:
        details = _text(check.note if check.passed is None else check.computed)
    return (f'<tr class="check {verdict.lower()}"><td class="verdict">{verdict}</td>'
            f"<td>{_text(check.section)}</td><td>{_text(check.name)}</td><td>{details}</td>"
            f"<td>{_beside(check, pictures) if check.passed is False else ''}</td></tr>")


def _beside(check: Check, pictures: Pictures) -> str:
    """A small picture of what a failed check measured: the attention weights, or the first leaking block."""
    attention = check.section in ("§2.1", "§3.1") or (
        check.section == "§3.2" and any(word in check.name for word in ATTENTION_WORDS))
    if attention and pictures.attention:
        worked = check.section == "§2.1"  # §2.1's one query, with its numbers; else the random queries
        pair, cell = (pictures.attention[0], 28) if worked else (pictures.attention[-1], 12)
        return (_heatmap(pair.learner, "learner", cell=cell, numbers=worked)
                + _heatmap(pair.reference, "handout", cell=cell, numbers=worked))
    leaky = leaking_blocks(pictures)
    if check.section in ("§7.1", "§7.3") and "loss" not in check.name and leaky:
        return _heatmap(pictures.blocks[leaky[0]], f"block {leaky[0]}", cell=9, future=True, numbers=False)
    return ""


def _attention_section(pairs: Sequence[WeightsPair]) -> str:
    """Each worked input's weights, the learner's beside the handout's, with the largest difference."""
    if not pairs:
        return ""
    figures = []
    for pair in pairs:
        diffs = [abs(a - b) for mine, theirs in zip(pair.learner, pair.reference, strict=False)
                 for a, b in zip(mine, theirs, strict=False)]
        worst = max(diffs, default=math.nan) if len(pair.learner) == len(pair.reference) else math.nan
        figures.append(f'<figure class="attention">{_heatmap(pair.learner, "learner")}'
                       f'{_heatmap(pair.reference, "handout")}<figcaption>{_text(pair.title)}: max '
                       f"|learner - handout| = {worst:.2e} (rows: queries, columns: keys)</figcaption>"
                       "</figure>")
    return ('<section id="attention"><h2>Attention weights on the handout\'s worked inputs</h2>'
            + "".join(figures) + "</section>")


def _blocks_section(pictures: Pictures) -> str:
    """Each block's dependence matrix, leaks outlined, and the first block that leaks named."""
    if not pictures.blocks:
        return ""
    leaky = leaking_blocks(pictures)
    verdict = (f'<p class="leaks">first leak from the future: block {leaky[0]} (leaking blocks: {leaky})</p>'
               if leaky else '<p class="clean">no block lets output row i read an input row j &gt; i</p>')
    figures = "".join(
        f'<figure class="dependence" data-block="{b}">'
        f'{_heatmap(matrix, f"block {b}", future=True, numbers=False)}<figcaption>block {b}: max |d output '
        "i / d input j| (rows i: outputs, columns j: inputs); above the diagonal it must be 0</figcaption>"
        "</figure>" for b, matrix in enumerate(pictures.blocks))
    return ('<section id="blocks"><h2>What each block\'s output row i reads of its input rows</h2>'
            f"{verdict}{figures}</section>")


def _heatmap(matrix: Matrix, title: str, cell: int = 30, future: bool = False, numbers: bool = True) -> str:
    """An inline SVG heatmap of `matrix`, darker for larger |value|; with `future`, cells above the diagonal
    are the future: grey when 0, outlined red (class "leak") when not."""
    finite = [abs(v) for row in matrix for v in row if math.isfinite(v)]
    top = max(finite, default=0.0) or 1.0
    cells = []
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            kind = "nan" if not math.isfinite(value) else "cell"
            if future and j > i:
                kind = "leak" if value > 0 else "future"
            fill = _colour(abs(value) / top) if kind in ("cell", "leak") else FILLS[kind]
            x, y = 1 + j * cell, 14 + i * cell
            cells.append(f'<rect class="{kind}" x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                         f'fill="{fill}"><title>({i}, {j}): {value:.4g}</title></rect>')
            if numbers:
                ink = "#fff" if kind == "cell" and abs(value) / top > 0.6 else "#222"
                cells.append(f'<text x="{x + cell / 2 - 0.5}" y="{y + cell / 2 + 3}" text-anchor="middle" '
                             f'fill="{ink}">{value:.2f}</text>')
    width, height = 2 + cell * max((len(row) for row in matrix), default=0), 15 + cell * len(matrix)
    return (f'<svg class="heatmap" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="{_text(title)}"><text x="1" y="10">{_text(title)}</text>'
            + "".join(cells) + "</svg>")


def _colour(fraction: float) -> str:
    """White (0) to dark blue (1)."""
    low, high = (255, 255, 255), (8, 69, 148)
    part = min(max(fraction, 0.0), 1.0)
    return "#" + "".join(f"{round(a + (b - a) * part):02x}" for a, b in zip(low, high, strict=True))
