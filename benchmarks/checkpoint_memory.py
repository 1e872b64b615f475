"""What saving a checkpoint costs each process under FSDP: one gathered file against sharded folders.

Each cell starts `torchrun --nproc_per_node=N` workers that build the same model (GPT-2 124M's shape by
default: 12 x 768, vocabulary 50,304), shard it with FSDP2, take one AdamW step (so the optimiser holds
its two slots) and then save a checkpoint the way `gptlab train` does: gathered to whole tensors and
written by rank 0 as one safetensors file (`--checkpoint-format file`), or each rank writing its own
shards with torch.distributed.checkpoint (`sharded`, the default under FSDP). A thread samples each
worker's resident memory every 10 ms while it saves; the table gives the largest rise over the memory
held just before the save, and the save's wall time.

    python benchmarks/checkpoint_memory.py                       # 2 and 4 processes, a minute or two
    python benchmarks/checkpoint_memory.py --processes 2 --n-layer 6 --n-embd 384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil


def worker(args: argparse.Namespace) -> None:
    """One torchrun worker: build, shard, step once, save; rank 0 prints the ranks' figures as JSON."""
    import torch
    import torch.distributed as dist

    from gptlab.checkpoint import LAST, Checkpoint, save_to_run
    from gptlab.config import ModelConfig, TrainConfig
    from gptlab.model import GPT
    from gptlab.training import distributed
    from gptlab.training.optim import make_optimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shard = args.format == "sharded"
    if shard:
        import torch.distributed.checkpoint  # noqa: F401 (imported before the baseline, as training has)
    config = ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=12, block_size=64,
                         vocab_size=args.vocab_size, tied=True)
    train_config = TrainConfig(parallel="fsdp", checkpoint_format=args.format)
    model = distributed.wrap(GPT(config), "fsdp", distributed.this_process(), torch.device("cpu"))
    optimizer = make_optimizer(model, train_config)
    tokens = torch.randint(0, args.vocab_size, (2, 64))  # (B, T)
    model(tokens, tokens)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    process, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    dist.barrier()
    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    weights = distributed.model_state(model, gather=not shard)
    weights.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    slots = distributed.optimizer_state(model, optimizer, gather=not shard)
    checkpoint = Checkpoint(config, {}, weights, train_config, {"step": 1}, slots,
                            {"torch": torch.get_rng_state()})
    if shard or rank == 0:
        save_to_run(Path(args.out), [LAST], checkpoint, shard)
    dist.barrier()
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, {"rise": (peak[0] - before) / 2**20, "before": before / 2**20,
                                     "seconds": seconds})
    if rank == 0:
        print("FIGURES " + json.dumps(figures), flush=True)
    dist.destroy_process_group()


def cell(processes: int, checkpoint_format: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """Run one configuration under torchrun; every rank's figures."""
    out = work / f"{checkpoint_format}-{processes}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               __file__, "--worker", "--format", checkpoint_format, "--out", str(out), "--n-layer",
               str(args.n_layer), "--n-embd", str(args.n_embd), "--vocab-size", str(args.vocab_size)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    line = next((s for s in result.stdout.splitlines() if s.startswith("FIGURES ")), None)
    if result.returncode != 0 or line is None:
        sys.exit(f"{checkpoint_format} x {processes} failed:\n{result.stderr[-3000:]}")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return [{**figure, "bytes": size} for figure in json.loads(line.removeprefix("FIGURES "))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gptlab.common import cpu_name
    from gptlab.config import ModelConfig, parameter_count

    config = ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=12, vocab_size=args.vocab_size)
    params = parameter_count(config)["total"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gptlab-checkpoint-memory-") as tmp:
        for processes in args.processes:
            for checkpoint_format in ("file", "sharded"):
                figures = cell(processes, checkpoint_format, args, Path(tmp))
                rows.append((checkpoint_format, processes, figures))
                ranks = [f"rank {r}: +{f['rise']:,.0f} MiB in {f['seconds']:.1f} s"
                         for r, f in enumerate(figures)]
                print(f"{checkpoint_format} x {processes}: {', '.join(ranks)}", flush=True)
    print(f"\n{cpu_name()}, {os.cpu_count()} cores; {args.n_layer} x {args.n_embd}, vocabulary "
          f"{args.vocab_size:,} ({params / 1e6:.0f} M parameters), FSDP2, AdamW state after one step\n")
    print("| checkpoint | processes | save, s | memory rise while saving, rank 0 / largest other, MiB | "
          "written, MiB |")
    print("|---|---|---|---|---|")
    for checkpoint_format, processes, figures in rows:
        others = max(f["rise"] for f in figures[1:])
        print(f"| {'one gathered file' if checkpoint_format == 'file' else 'sharded'} | {processes} | "
              f"{figures[0]['seconds']:.1f} | {figures[0]['rise']:,.0f} / {others:,.0f} | "
              f"{figures[0]['bytes'] / 2**20:,.0f} |")


if __name__ == "__main__":
    main()
