"""Sharded checkpoints: every process writes its own shards with torch.distributed.checkpoint (DCP).

Under `torchrun ... --parallel fsdp` nothing is gathered to one process to save. A checkpoint is a
folder in RUN/shards/ holding one `__R_0.distcp` file per rank, DCP's `.metadata` index and gptlab's
`header.json` (the configs, tokenizer, training state and random streams a single file keeps in its
header). The folder is written under a temporary name and renamed when whole; then a small pointer file,
`last.shards.json` or `best.shards.json`, is replaced atomically to name it. Readers follow the pointer,
so a save killed half-way is never taken for a checkpoint (the pointer still names the previous folder),
and folders no pointer names are deleted.

Any number of processes reads one: FSDP ranks load just their shards (DCP reshards them when the number
of processes changed, 2 -> 4 say); any other reader loads whole tensors.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from gptlab.files import atomic_write_text, fsync

FORMAT = "gptlab-sharded-1"
SUFFIX = ".shards.json"  # of a pointer file: last.safetensors -> last.shards.json
FOLDER = "shards"
HEADER = "header.json"
INDEX = ".metadata"  # DCP's own index of the shards


def pointer(run_dir: Path, name: str) -> Path:
    """The pointer file that stands for checkpoint `name` (last.safetensors, best.safetensors)."""
    return run_dir / (name.removesuffix(".safetensors") + SUFFIX)


def is_sharded(path: Path) -> bool:
    """Whether `path` is a pointer file or a sharded checkpoint folder (rather than a single file)."""
    return path.name.endswith(SUFFIX) or (path.is_dir() and (path / HEADER).is_file())


def folder_of(path: Path) -> Path:
    """The checkpoint folder a pointer names (or `path` itself when it is one); one line when it is gone."""
    if path.is_dir():
        folder = path
    else:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            folder = path.parent / saved["folder"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a readable pointer to a sharded checkpoint ({err})") from None
    if not ((folder / HEADER).is_file() and (folder / INDEX).is_file()):
        raise ValueError(f"{path} names the sharded checkpoint {folder}, which is missing or incomplete: "
                         "use another checkpoint of the run")
    return folder


def read_header(path: Path) -> dict[str, str]:
    """The header of a sharded checkpoint (pointer or folder): the same keys as a single file's."""
    folder = folder_of(path)
    try:
        header = json.loads((folder / HEADER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder / HEADER} is damaged ({err}): use another checkpoint of the run") from None
    if not isinstance(header, dict):
        raise ValueError(f"{folder / HEADER} is damaged: use another checkpoint of the run")
    return header


def _dcp() -> ModuleType:
    """torch.distributed.checkpoint, its event log kept out of gptlab's console (a damaged file is
    reported in one line, not as DCP's exception record)."""
    import torch.distributed.checkpoint as dcp

    logging.getLogger("c10d-NullHandler-dcp_logger").propagate = False
    return dcp


def shapes(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every saved tensor's full shape and dtype, from DCP's index (no shard is read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = folder_of(path)
    try:
        index = _dcp().FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # DCP's index is its own pickle: any damage surfaces as some exception
        raise ValueError(f"{folder} has a damaged {INDEX} ({err}): use another checkpoint of the "
                         "run") from None
    return {key: (entry.size, entry.properties.dtype) for key, entry in index.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}


def read_whole(path: Path, keep: Callable[[str], bool] = lambda key: True) -> dict[str, torch.Tensor]:
    """The saved tensors whose keys `keep` accepts, whole, on the CPU, in this process alone (consolidation:
    no process group)."""
    from torch.distributed.checkpoint.api import CheckpointException

    dcp = _dcp()
    tensors = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in shapes(path).items()
               if keep(key)}
    folder = folder_of(path)
    try:
        with warnings.catch_warnings():  # DCP warns that it reads in one process, as asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException):  # a missing or truncated shard file
        raise ValueError(f"{folder} is damaged (a shard file is missing or cut short): use another "
                         "checkpoint of the run") from None
    return tensors


def load_into(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Fill `tensors` (this rank's DTensor shards, or whole tensors) in place from the checkpoint; a
    collective call under torchrun, which reshards when the saving run had another number of processes."""
    _dcp().load(tensors, checkpoint_id=str(folder_of(path)), no_dist=not dist.is_initialized())


def write(run_dir: Path, names: list[str], tensors: dict[str, torch.Tensor], header: dict[str, str],
          step: int) -> None:
    """Save `tensors` (DTensor shards or whole tensors) as one checkpoint folder and point `names` at it.

    Every process calls this (a collective under torchrun); rank 0 writes the header and the pointers,
    removes the single files `names` replace and the folders no pointer names any more.
    """
    dcp = _dcp()
    main = not dist.is_initialized() or dist.get_rank() == 0
    chosen = [f"step-{step:07d}-{secrets.token_hex(4)}"]  # rank 0's choice, shared with every rank
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    name = chosen[0]
    shards = run_dir / FOLDER
    temporary = shards / f".{name}.tmp-0"
    if main:
        shards.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    with warnings.catch_warnings():  # DCP warns when it saves in one process, as asked
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(tensors, checkpoint_id=str(temporary), no_dist=not dist.is_initialized())  # fsynced
    if main:
        atomic_write_text(temporary / HEADER, json.dumps(header))
        os.replace(temporary, shards / name)
        fsync(shards)
        for checkpoint in names:
            atomic_write_text(pointer(run_dir, checkpoint), json.dumps({"format": FORMAT,
                                                                        "folder": f"{FOLDER}/{name}"}))
            (run_dir / checkpoint).unlink(missing_ok=True)  # the single file this one replaces
        remove_unnamed(run_dir)
    if dist.is_initialized():
        dist.barrier()  # no rank reads or writes the run folder before the checkpoint is committed


def retire(run_dir: Path, name: str) -> None:
    """After a single file `name` was written: drop its sharded counterpart and the folders left unnamed."""
    stale = pointer(run_dir, name)
    if stale.exists():
        stale.unlink()
        remove_unnamed(run_dir)


def remove_unnamed(run_dir: Path) -> list[Path]:
    """Delete the checkpoint folders (and killed saves' temporaries) that no pointer names; call it
    under the run's lock, on one process."""
    shards = run_dir / FOLDER
    if not shards.is_dir():
        return []
    named = set()
    for file in run_dir.glob(f"*{SUFFIX}"):
        try:
            named.add((run_dir / json.loads(file.read_text(encoding="utf-8"))["folder"]).resolve())
        except (OSError, ValueError, KeyError, TypeError):
            return []  # a damaged pointer: which folder it meant is unknown, so keep them all
    removed = [p for p in sorted(shards.iterdir()) if p.resolve() not in named]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if not named:
        shards.rmdir()
    return removed
