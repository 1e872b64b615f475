"""A run served as `gptlab serve` serves it, for Python callers too: the app for a run folder
(`app_for_run`: its model loaded and held as asked, the batch sized to the free memory, its sampling
defaults and chat template), a socket bound to an address (`listen`) and uvicorn serving the app on it
(`run_app`). `app.create_app` is the app for a model already in memory."""

from __future__ import annotations

import os
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from gptlab.common import resolve_device
from gptlab.inference.loading import load
from gptlab.serve.app import create_app
from gptlab.serve.guard import LOOPBACK_NAMES
from gptlab.serve.prefix_cache import DEFAULT_BUDGET
from gptlab.serve.schemas import Limits
from gptlab.serve.sizing import Plan, available_memory, plan_memory, weights_bytes
from gptlab.speculative import SpeculationConfig

if TYPE_CHECKING:
    from fastapi import FastAPI


@dataclass(frozen=True)
class ServedRun:
    """A run's app, the name it serves the model under, and the batch and context it holds (`plan`)."""

    app: FastAPI
    name: str
    plan: Plan


def app_for_run(run: str | Path, device: str = "cpu", dtype: str = "float32", quantize: str = "none", *,
                api_key: str | None = None, max_batch: int | None = None, limits: Limits | None = None,
                allowed_hosts: Collection[str] | None = LOOPBACK_NAMES, metrics: bool = True,
                speculation: SpeculationConfig | None = None, prefix_cache_bytes: int = DEFAULT_BUDGET
                ) -> ServedRun:
    """The app serving a run folder or checkpoint, named as given (a link by its own name), its weights held
    in `dtype` or quantised (`gptlab.load`). `max_batch` None: the largest batch up to 64
    that fits in the memory free before loading (`sizing.plan_memory`); the run's sampling defaults (an
    imported model's generation_config.json) fill what a request leaves out; its chat template, chats;
    `metrics` False: no GET /metrics; `speculation` and `prefix_cache_bytes`: as `create_app` takes them."""
    limits = limits or Limits()
    torch_device = resolve_device(device)
    free = available_memory(torch_device)  # before the weights take their share
    lm = load(run, device=torch_device, dtype=dtype, quantize=quantize)
    plan = plan_memory(lm.model.config, next(lm.model.parameters()).dtype, weights_bytes(lm.model), free,
                       max_batch, limits.max_context)
    name = Path(os.path.abspath(run)).name  # as given, links unresolved: runs/demo (a link) serves "demo"
    app = create_app(lm, name, api_key=api_key, max_batch=plan.max_batch, limits=limits,
                     allowed_hosts=allowed_hosts, metrics=metrics, speculation=speculation,
                     prefix_cache_bytes=prefix_cache_bytes)
    return ServedRun(app, name, plan)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host` (IPv4 or IPv6) and `port` now, so that port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def run_app(app: FastAPI, sock: socket.socket) -> None:
    """Serve `app` on `sock` until Ctrl-C or SIGTERM (uvicorn logging warnings only), then return."""
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
