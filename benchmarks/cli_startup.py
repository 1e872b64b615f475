"""How long `gptlab --help` and `gptlab train --help` take to answer, beside `import torch` alone (what
any command that imports torch before parsing its arguments pays first).

Each command runs in a fresh interpreter, `--repeats` times (default 5), and the median wall time is
printed. With `--compare SRC` the same commands also run against another gptlab source tree (for
example a checkout of an older commit: `git worktree add /tmp/old COMMIT`, then `--compare
/tmp/old/src`), in the same run, alternating, so a before/after table comes from one machine state.

    python benchmarks/cli_startup.py
    python benchmarks/cli_startup.py --compare /tmp/old/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gptlab.common import cpu_name

SRC = Path(__file__).resolve().parents[1] / "src"
COMMANDS = {
    "gptlab --help": ["-m", "gptlab", "--help"],
    "gptlab train --help": ["-m", "gptlab", "train", "--help"],
    "gptlab sample --help": ["-m", "gptlab", "sample", "--help"],
    "python -c 'import torch'": ["-c", "import torch"],
}


def wall_time(args: list[str], src: Path) -> float:
    """Seconds for one fresh interpreter to run `args` with gptlab imported from `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (the median is shown)")
    parser.add_argument("--compare", type=Path, metavar="SRC", help="another gptlab source tree to time too")
    args = parser.parse_args()
    trees = {"this tree": SRC} | ({"compared": args.compare} if args.compare else {})
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for label, command in COMMANDS.items():
            for tree, src in trees.items():
                if command[0] == "-c" and tree != "this tree":
                    continue  # `import torch` does not depend on the tree
                times.setdefault((label, tree), []).append(wall_time(command, src))
    print(f"median wall time of {args.repeats} fresh interpreters, {cpu_name()}, {os.cpu_count()} cores\n")
    print(f"| command | {' | '.join(trees)} |")
    print(f"|---|{'---|' * len(trees)}")
    for label in COMMANDS:
        cells = [f"{statistics.median(times[label, t]):.2f} s" if (label, t) in times else "" for t in trees]
        print(f"| `{label}` | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
