"""The check server's own side (Linux), run in its process (server.py starts it): the loop that forks a
child per learner file, sends back how each ended, and kills each child's process group when its check
ends; and the forked child, which runs isolate's child job as a fresh interpreter would. The server has
imported torch and the checks once and runs no tensor operation, so forking is safe."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

from gptlab.handout.learner import isolate


def serve(fd: int) -> None:
    """The check server's loop, on the connection `fd` from its parent: a child forked per request (which
    sends its own id first, _forked) and its exit status sent back; when the parent ends that check (or is
    gone) its group is killed, then the child reaped: only then, so that its id, which is its group's, is
    not reused before the kill."""
    control = socket.socket(fileno=fd)
    children: dict[socket.socket, int] = {}  # each check's connection -> its child's pid, until reaped
    running: set[socket.socket] = set()  # the checks whose child has not exited yet
    while True:
        for conn in select.select([control, *children], [], [], 0.02 if running else None)[0]:
            if conn is not control:
                conn.recv(16)  # "end", or nothing where the parent is gone
                running.discard(conn)
                _end(conn, children.pop(conn))
                continue
            message, fds, _, _ = socket.recv_fds(control, 1 << 16, 2)
            if not message:  # the parent is gone, or stopped the server
                for conn, pid in children.items():
                    _end(conn, pid)
                return
            conn = socket.socket(fileno=fds[0])
            children[conn] = _fork(json.loads(message), fds[1], conn, [control, *children])
            running.add(conn)
        for conn in list(running):
            info = os.waitid(os.P_PID, children[conn], os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:  # exited, and left unreaped: a zombie holding its id
                running.discard(conn)
                status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                with contextlib.suppress(OSError):
                    conn.send(str(status).encode())


def _end(conn: socket.socket, pid: int) -> None:
    """SIGKILL the process group of the unreaped child `pid`, reap the child, and close its check's `conn`."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    conn.close()


def _fork(message: dict[str, Any], output: int, conn: socket.socket, inherited: list[socket.socket]) -> int:
    """Fork the child for `message`, `output` its stdout and stderr, `conn` its check's connection; its pid,
    once it leads a session."""
    ready, started = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        os.setsid()
        os.close(started)  # end-of-file for the server: the child leads its own session and group
        _forked(message, output, conn, inherited)
    os.close(started)
    os.close(output)
    os.read(ready, 1)
    os.close(ready)
    return pid


def _forked(message: dict[str, Any], output: int, conn: socket.socket,
            inherited: list[socket.socket]) -> NoReturn:
    """The forked child: its id sent on `conn` (to the check's parent, before any of the learner's code runs,
    so that it is known whatever that code does to the server), none of the server's connections, its output
    to the parent's pipe, the private folder as its working directory, then the child's job, as in a child
    started with `python -m gptlab.handout.learner.isolate`."""
    status = 1
    try:
        with contextlib.suppress(OSError):
            conn.send(f"pid {os.getpid()}".encode())
        for other in [*inherited, conn]:
            other.close()
        for fd in (1, 2):
            os.dup2(output, fd)
        os.close(output)
        os.chdir(message["cwd"])
        sys.argv = [isolate.__file__, json.dumps(message["request"])]
        sys.modules["__main__"] = isolate
        isolate.child_job(message["request"])
        status = 0
    except BaseException:  # as an interpreter would: the traceback in the output, and status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
