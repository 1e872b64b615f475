"""The check server of `gptlab check` (Linux): one per process, a fresh interpreter that imports torch and
the checks once and forks a child per learner file (isolate._serve). This module imports no torch, so the
command can start the server before its own torch import and the two imports overlap."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
from typing import Any

FORK_SERVER = sys.platform == "linux"  # fork children from the check server; else a fresh interpreter each
# (forking a process that imported torch is unsafe on macOS and impossible on Windows)
SERVE = """\
import sys
if sys.path[:1] == [""]:
    del sys.path[0]  # import nothing from the folder gptlab check was started in
from gptlab.handout.learner.isolate import _serve
_serve(int(sys.argv[1]))
"""
_SERVER: dict[str, Any] = {}  # this process's check server: "process" and "control", its connection
_SERVER_LOCK = threading.Lock()


def child_env() -> dict[str, str]:
    """The child's environment: CUDA hidden (before torch's import), matplotlib off-screen, no buffering."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


def connection() -> socket.socket:
    """The connection to this process's check server, started on first use (a server that died is replaced):
    a fresh interpreter with the children's environment that imports torch and the checks, and forks."""
    with _SERVER_LOCK:
        if "process" not in _SERVER or _SERVER["process"].poll() is not None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-c", SERVE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                    env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    start_new_session=True)
            _SERVER.update(process=process, control=ours)
        return _SERVER["control"]


def stop_server() -> None:
    """End this process's check server, if it runs: a check still running is killed, its whole group."""
    with _SERVER_LOCK:
        if "process" in _SERVER:
            _SERVER.pop("control").close()  # the server reads end-of-file, kills every group and ends
            _SERVER.pop("process").wait()


atexit.register(stop_server)
