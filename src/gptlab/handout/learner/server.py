"""The check server of `gptlab check` (Linux): one per process, a fresh interpreter that imports torch and
the checks once and forks a child per learner file (forking.py). This module imports no torch, so the
command can start the server before its own torch import and the two imports overlap. The server works in
an empty folder of its own, and a server that dies (a learner's code can kill it: it is the parent of
their process) is replaced by the next check."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

FORK_SERVER = sys.platform == "linux"  # fork children from the check server; else a fresh interpreter each
# (forking a process that imported torch is unsafe on macOS and impossible on Windows)
SERVE = """\
import sys
if sys.path[:1] == [""]:
    del sys.path[0]  # import nothing from the folder gptlab check was started in
from gptlab.handout.learner.forking import serve
serve(int(sys.argv[1]))
"""
HIDDEN = ("PWD", "OLDPWD")  # the shell's folders: where the submissions are, not the private copy
_SERVER: dict[str, Server] = {}  # this process's check server, under "server"
_SERVER_LOCK = threading.Lock()


@dataclass(frozen=True)
class Server:
    """A running check server: its process, `control` (the connection checks are sent on), its folder."""

    process: subprocess.Popen
    control: socket.socket
    folder: str

    def died(self) -> bool:
        """Whether this server, which closed a check's connection, died on its own (killed by a learner's
        code, say) rather than being stopped (stop_server); a dead one is forgotten, replaced on next use."""
        if self.process.wait() == 0:  # stop_server: it ended its checks and returned
            return False
        with _SERVER_LOCK:
            if _SERVER.get("server") is self:
                _forget(_SERVER.pop("server"))
        return True


def child_env() -> dict[str, str]:
    """The child's environment: CUDA hidden (before torch's import), matplotlib off-screen, no buffering,
    and no $PWD (the real folder of the learner's file, not the copy it runs on)."""
    kept = {name: value for name, value in os.environ.items() if name not in HIDDEN}
    return {**kept, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


def connection() -> Server:
    """This process's check server, started on first use (a server that died is replaced): a fresh
    interpreter with the children's environment, in an empty folder, that imports torch and the checks
    and forks."""
    with _SERVER_LOCK:
        running = _SERVER.get("server")
        if running is None or running.process.poll() is not None:
            if running is not None:
                _forget(running)
            folder = tempfile.mkdtemp(prefix="gptlab-check-server-")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-c", SERVE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                    cwd=folder, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    start_new_session=True)
            _SERVER["server"] = running = Server(process, ours, folder)
        return running


def stop_server() -> None:
    """End this process's check server, if it runs: a check still running is killed, its whole group."""
    with _SERVER_LOCK:
        if "server" in _SERVER:
            running = _SERVER.pop("server")
            running.control.close()  # the server reads end-of-file, kills every group and ends
            running.process.wait()
            shutil.rmtree(running.folder, ignore_errors=True)


def _forget(running: Server) -> None:
    """Let go of a server that died: kill what may be left of it, reap it, remove its folder."""
    running.process.kill()
    running.process.wait()
    running.control.close()
    shutil.rmtree(running.folder, ignore_errors=True)


atexit.register(stop_server)
