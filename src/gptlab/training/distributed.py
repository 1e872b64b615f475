"""Several processes, one training run: PyTorch's own engine (torchrun, DDP, FSDP2), applied from outside.

gptlab never starts processes itself. `torchrun --nproc_per_node=N -m gptlab train ...` (or with
`--nnodes`, `--node-rank` and `--rdzv-endpoint` across machines) starts N copies and sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `session` joins that group with NCCL on CUDA and
gloo on CPU. The model stays a plain single-device module: `wrap` applies DistributedDataParallel
or FSDP2's `fully_shard` around it, and the helpers below move weights and optimiser state in and
out: as full, unsharded tensors for a single-file checkpoint, or as each rank's own shards for a
sharded one (gptlab.sharded), which any number of processes reads back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gptlab import sharded
from gptlab.common import resolve_device
from gptlab.model import Block

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs



class Optimiser(Protocol):
    """What checkpointing needs of an optimiser: its per-parameter slots (torch's, or optim.Optimizers')."""

    @property
    def state(self) -> Any: ...


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the run: rank 0 of 1 when not launched by torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Only the main process logs, shows progress and writes files."""
        return self.rank == 0


def this_process() -> Dist:
    """This process's rank and the world size, from torchrun's environment (no process group needed)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def session(device_name: str) -> Iterator[tuple[Dist, torch.device]]:
    """Join torchrun's process group (when launched by it) and pick this process's device; leave on exit."""
    info = this_process()
    device = resolve_device(device_name)
    if info.world_size == 1:
        yield info, device
        return
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={info.world_size} is set but {' and '.join(missing)} is not: start the run "
            "with torchrun (e.g. torchrun --nproc_per_node=2 -m gptlab train ...)"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart:  # keys the lost round left in torchrun's store must not be read as this round's
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(minutes=10)))
            dist.init_process_group(backend, store=dist.PrefixStore(f"gptlab/restart-{restart}", store),
                                    rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
        else:
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
    except (RuntimeError, ValueError) as err:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise ValueError(f"could not join the process group at {where}: {err}") from err
    if not info.is_main:
        logging.getLogger("gptlab").setLevel(logging.WARNING)  # one voice: rank 0 reports
    try:
        yield info, device
    finally:
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap(model: nn.Module, parallel: str, info: Dist, device: torch.device) -> nn.Module:
    """The model as the training loop should call it: unchanged, DDP-wrapped, or sharded in place."""
    if info.world_size == 1:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in [m for m in model.modules() if isinstance(m, Block)]:  # a shard group per block,
            fully_shard(block)  # the rest at the root
        fully_shard(model)  # in place: the same module, now also an FSDPModule
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on non-final micro-steps of gradient accumulation."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # an FSDP2 module's
    if set_sync is not None:
        set_sync(enabled)
    yield


def seed_dropout(seed: int, info: Dist, step: int) -> None:
    """Reseed every rank but 0 for this step's dropout masks, from (seed, rank, step).

    Rank 0 draws from the run's own stream, which checkpoints save, like a single process. The other
    ranks' streams are not saved, so they restart at every step: a resumed run then draws the masks an
    unbroken one would, on every rank. (Ranks draw different masks, so a run with dropout is not the
    one-process run, only one like it.)
    """
    if info.rank:
        torch.manual_seed(seed + (info.rank << 32) + step)  # steps stay below 2**32: no two ranks meet


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over all processes (the values themselves in a single process)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (an FSDP2 model is its own module, sharded in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return unwrap(model).named_parameters()


def is_sharded(tensor: torch.Tensor) -> TypeIs[DTensor]:
    """Whether `tensor` is an FSDP2 shard (a DTensor). DTensor is imported only under torchrun: the
    import costs 0.6 s, a tenth of a short run's wall time."""
    if not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if is_sharded(tensor) else tensor).detach().cpu()


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if is_sharded(tensor) else tensor.detach().cpu()


def model_state(model: nn.Module, gather: bool = True) -> dict[str, torch.Tensor]:
    """Every weight: full CPU tensors (a collective call under FSDP: every rank must make it), or with
    `gather` off this rank's shards as they are (DTensors; nothing is communicated)."""
    keep = _full if gather else _kept
    return {name: keep(t) for name, t in unwrap(model).state_dict().items()}


def optimizer_state(model: nn.Module, optimizer: Optimiser,
                    gather: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimiser slots by parameter name: full CPU tensors (collective under FSDP), or
    with `gather` off this rank's shards."""
    keep = _full if gather else _kept
    return {
        name: {slot: keep(value) for slot, value in optimizer.state[param].items()}
        for name, param in _named_parameters(model)
        if param in optimizer.state
    }


def load_shards(model: nn.Module, optimizer: Optimiser, path: Path,
                skip: set[str]) -> None:
    """Load a sharded checkpoint's weights and optimiser slots into a sharded run, each rank reading its
    own shards (a collective call); `skip` names the weights it does not hold (a tied head's alias)."""
    weights = {f"model.{name}": t for name, t in unwrap(model).state_dict().items() if name not in skip}
    params = dict(_named_parameters(model))
    slots: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for key, (size, dtype) in sharded.shapes(path).items():
        if key.startswith("optim."):
            name, _, slot = key.removeprefix("optim.").rpartition("/")
            param = params[name]  # a slot is sharded like its parameter, or a small whole tensor (a step)
            target = torch.zeros_like(param) if size == param.shape else torch.zeros(size, dtype=dtype)
            slots.setdefault(param, {})[slot] = weights[key] = target
    sharded.load_into(weights, path)
    unwrap(model).load_state_dict({key.removeprefix("model."): t for key, t in weights.items()
                                   if key.startswith("model.")}, strict=False)
    for param, state in slots.items():
        optimizer.state[param] = state


def load_optimizer_state(model: nn.Module, optimizer: Optimiser,
                         state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put saved slots back, sharded like their parameter when it is sharded (none before step 1)."""
    if not state:
        return
    for name, param in _named_parameters(model):
        if name not in state:
            raise ValueError(f"the checkpoint's optimiser state has no entry for parameter {name}")
        slots: dict[str, torch.Tensor] = {}
        for slot, value in state[name].items():
            if is_sharded(param) and value.shape == param.shape:
                from torch.distributed.tensor import distribute_tensor

                slots[slot] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            else:
                slots[slot] = value.to(param.device)
        optimizer.state[param] = slots
