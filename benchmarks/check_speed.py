"""How long `gptlab check` takes a file: each file in a fresh interpreter (`spawn`, how check ran before
issue 39) against children forked from one server that imported torch once (`fork`, the default on Linux).

30 small learner files (the gallery's reference and bugs, `gptlab break ... --write`) go into a temporary
folder; each configuration runs `gptlab check` in a fresh interpreter on 1 file and on all 30, with
--jobs 1 and 2, and the wall time of the whole command (its own start included) is shown, total and per
file. Every run on the same files must report the same checks, or the benchmark says where not.

    python benchmarks/check_speed.py
    python benchmarks/check_speed.py --files 10 --modes fork
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from itertools import zip_longest
from pathlib import Path

from gptlab.handout.learner.bugs import BUGS, write_bug, write_reference

# Runs `gptlab check` with the way of running files chosen by argv[1] (server.FORK_SERVER).
RUNNER = """\
import sys
from gptlab.handout.learner import server
server.FORK_SERVER = sys.argv[1] == "fork"
from gptlab.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cpu_model() -> str:
    """The processor's model name, from /proc/cpuinfo (or the platform's word for it elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"


def learner_files(folder: Path, count: int) -> list[Path]:
    """`count` learner files in `folder`: the reference, then the gallery's bugs, round and round."""
    folder.mkdir(parents=True)
    names = ["reference", *BUGS]
    files = []
    for i in range(count):
        name = names[i % len(names)]
        path = folder / f"f{i:02d}_{name.replace('-', '_')}.py"
        files.append(write_reference(path) if name == "reference" else write_bug(name, path))
    return files


def run_check(mode: str, files: list[Path], jobs: int, learning: bool) -> tuple[float, str]:
    """Wall seconds of one `gptlab check --json` on `files` in a fresh interpreter, and what it printed."""
    command = [sys.executable, "-c", RUNNER, mode, "check", *map(str, files), "--json"]
    if not learning:
        command.append("--no-learning")
    if jobs > 1:
        command += ["--jobs", str(jobs)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"gptlab check failed ({done.returncode}):\n{done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=30, help="files in the batch (default 30)")
    parser.add_argument("--modes", default="spawn,fork", help="ways to run the files (default spawn,fork)")
    parser.add_argument("--jobs", default="1,2", help="--jobs values for the batch (default 1,2)")
    parser.add_argument("--learning", default="off,on", help="without and with the §7.2 learning checks "
                        "(default off,on)")
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"gptlab check, {cpu_model()}, {os.cpu_count()} cores, load average {load:.2f} at the start\n")
    print("| way | learning checks | --jobs | files | total | per file |")
    print("|---|---|---|---|---|---|")
    outputs: dict[tuple[str, int, int], str] = {}
    with tempfile.TemporaryDirectory(prefix="check-speed-") as folder:
        single = learner_files(Path(folder) / "one", 1)
        batch = learner_files(Path(folder) / "batch", args.files)
        for learning in args.learning.split(","):
            for mode in args.modes.split(","):
                runs = [(single, 1)] + [(batch, int(jobs)) for jobs in args.jobs.split(",")]
                for files, jobs in runs:
                    seconds, out = run_check(mode, files, jobs, learning == "on")
                    outputs[mode, jobs, len(files) if learning == "on" else -len(files)] = out
                    print(f"| {mode} | {learning} | {jobs} | {len(files)} | {seconds:.1f} s | "
                          f"{seconds / len(files):.2f} s |", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average {load:.2f} at the end; {first_difference(outputs)}")


def first_difference(outputs: dict[tuple[str, int, int], str]) -> str:
    """Whether every run on the same files printed the same checks, or the first line where two differ."""
    first: dict[int, tuple[tuple[str, int, int], str]] = {}
    for key, out in outputs.items():
        seen, earlier = first.setdefault(key[2], (key, out))
        for line, other in zip_longest(out.splitlines(), earlier.splitlines(), fillvalue="(nothing)"):
            if line != other:
                return f"{key} and {seen} differ (a source file edited during the run?):\n{other}\n{line}"
    return "every run on the same files reported the same checks"


if __name__ == "__main__":
    main()
