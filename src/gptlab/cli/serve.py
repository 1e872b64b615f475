"""The serve command: an OpenAI-compatible HTTP server and a browser playground for a run (gptlab.serve)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from gptlab.cli.common import add_device_option, add_weight_options


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the run, bind the address, print it and serve until Ctrl-C (or SIGTERM)."""
    try:
        import uvicorn

        from gptlab.serve.app import create_app
    except ImportError as err:
        raise ValueError(f"gptlab serve needs the serve extra ({err.name} is missing): "
                         "pip install -e '.[serve]'") from None
    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.quantize import inference_weights

    if min(args.max_batch, args.max_tokens, args.threads) < 1:
        raise ValueError("--max-batch, --max-tokens and --threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_run(args.run, resolve_device(args.device))
    model = inference_weights(model, args.dtype, args.quantize)
    name = Path(args.run).resolve().name
    app = create_app(model, tokenizer, name, api_key=args.api_key, max_batch=args.max_batch,
                     max_tokens=args.max_tokens)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.create_server((args.host, args.port), family=family)  # bound now: --port 0 picks one
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {args.run} as model {name!r} at http://{shown}:{port} (playground at /, OpenAI API "
          f"at /v1{', API key required' if args.api_key else ''}); Ctrl-C stops", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
    print("stopped", flush=True)
    return 0


def add_serve_command(sub: Any) -> None:
    """The serve command."""
    serve = sub.add_parser(
        "serve", help="serve a run over HTTP: OpenAI-compatible API and a browser playground",
        description="Serve a decoder run folder (trained or imported from Hugging Face) with OpenAI's "
        "completions API (GET /v1/models, POST /v1/completions, streaming included) and a playground "
        "page at /. Concurrent requests are decoded together in one batch that requests join at "
        "any step. Needs the serve extra: pip install -e '.[serve]'.",
        epilog="example: gptlab serve runs/demo --port 8000",
    )
    serve.add_argument("run", help="a run folder or checkpoint file")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                       "machine only; 0.0.0.0 serves every network the machine is on)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on the API")
    serve.add_argument("--max-batch", type=int, default=64, help="rows decoded together at most; later "
                       "requests wait for a free row (default 64)")
    serve.add_argument("--max-tokens", type=int, default=1024,
                       help="the largest max_tokens a request may ask for (default 1024)")
    serve.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                       help="CPU threads of the decode thread's tensor operations (default: all cores "
                       "but one, which is left to the HTTP event loop)")
    add_device_option(serve)
    add_weight_options(serve)
    serve.set_defaults(func=cmd_serve)
