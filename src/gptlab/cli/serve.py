"""The serve command: an OpenAI-compatible HTTP server and a browser playground for a run (gptlab.serve)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import (
    COUNT,
    Bounded,
    InputFile,
    RunPath,
    add_device_option,
    add_weight_options,
    speculation_of,
)

if TYPE_CHECKING:  # fastapi and torch are imported when the command runs, not when the parser is built
    from gptlab.serve.server import ServedRun


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the run, size the batch to the memory, bind the address, print it and serve until Ctrl-C."""
    try:
        from gptlab.serve.server import app_for_run, listen, run_app
    except ImportError as err:
        raise ValueError(f"gptlab serve needs the serve extra ({err.name} is missing): "
                         "pip install -e '.[serve]'") from None
    from gptlab.serve.guard import default_allowed_hosts, parse_allowed_hosts, read_api_key
    from gptlab.serve.schemas import Limits

    if args.api_key is not None:
        raise ValueError("--api-key would show the key to every user of this machine (in `ps`): put it in "
                         "the GPTLAB_API_KEY environment variable or in a file given with --api-key-file")
    if min(args.max_batch or 1, args.max_tokens, args.threads) < 1:
        raise ValueError("--max-batch, --max-tokens and --threads must be at least 1")
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb {args.prefix_cache_mb} must be at least 0 (0 turns it off)")
    speculation = speculation_of(args)
    api_key = read_api_key(args.api_key_file, os.environ)
    allowed = (parse_allowed_hosts(args.allowed_hosts) if args.allowed_hosts is not None
               else default_allowed_hosts(args.host))
    limits = Limits(max_tokens=args.max_tokens, max_stops=args.max_stops, max_stop_chars=args.max_stop_chars,
                    max_context=args.max_context, max_waiting=args.max_waiting,
                    request_timeout=args.request_timeout, prefill_chunk=args.prefill_chunk)
    import torch

    sock = bind(listen, args.host, args.port)  # a busy port is refused before the model is loaded
    try:
        served = app_for_run(args.run, args.device, args.dtype, args.quantize, api_key=api_key,
                             max_batch=args.max_batch, limits=limits, allowed_hosts=allowed,
                             metrics=not args.no_metrics, speculation=speculation,
                             prefix_cache_bytes=int(args.prefix_cache_mb * 2**20))
    except BaseException:
        sock.close()
        raise
    torch.set_num_threads(args.threads)  # once serving is sure: a refusal leaves the caller's count as it was
    announce(args.run, served, sock, api_key is not None, allowed)
    run_app(served.app, sock)
    print("stopped", flush=True)
    return 0


def bind(listen: Callable[[str, int], socket.socket], host: str, port: int) -> socket.socket:
    """`listen(host, port)`, a busy or forbidden port being one line that says what to do."""
    try:
        return listen(host, port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} is in use: pick another with --port (or 0 for a free "
                             "one)") from None
        if err.errno == errno.EACCES:
            raise ValueError(f"port {port} needs privileges on this machine: pick one above 1023 with "
                             "--port") from None
        raise ValueError(f"cannot listen on {host} port {port}: {err.strerror or err} (check --host and "
                         "--port)") from None


def announce(run: str, served: ServedRun, sock: socket.socket, keyed: bool,
             allowed: Collection[str] | None) -> None:
    """Where the server answers and what to, and the notes on what it refuses or chose."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    hosts = ("any Host name (--allowed-hosts to restrict)" if allowed is None
             else "Host " + ", ".join(sorted(allowed)))
    metrics = ", metrics at /metrics" if served.app.state.metrics is not None else ""
    print(f"serving {run} as model {served.name!r} at http://{shown}:{port} (playground at /, OpenAI API "
          f"at /v1{metrics}{', API key required' if keyed else ''}; answering {hosts}); Ctrl-C stops",
          flush=True)
    refusal = served.app.state.chat.refusal()
    if refusal is not None:
        print(f"note: /v1/chat/completions answers 400: {refusal}", flush=True)
    plan = served.plan
    if plan.chosen:
        print(f"--max-batch {plan.max_batch}: the most rows of {plan.max_context} tokens that fit in the "
              f"free memory ({plan.cache_bytes / 1e9:.2f} GB of KV cache at most)", flush=True)


def add_serve_command(sub: Any) -> None:
    """The serve command."""
    serve = sub.add_parser(
        "serve", help="serve a run over HTTP: OpenAI-compatible API and a browser playground",
        description="Serve a decoder run folder (trained or imported from Hugging Face) with OpenAI's "
        "completions and chat APIs (GET /v1/models, POST /v1/completions, POST /v1/chat/completions with "
        "the run's chat template, streaming included) and a playground page at / (completion and chat "
        "modes). Concurrent requests are decoded together in one batch that requests join at "
        "any step. Needs the serve extra: pip install -e '.[serve]'.",
        epilog="example: gptlab serve runs/demo --port 8000; with a key: GPTLAB_API_KEY=... gptlab serve "
        "runs/demo, or --api-key-file key.txt",
    )
    serve.add_argument("run", type=RunPath(), help="a run folder or checkpoint file")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                       "machine only; 0.0.0.0 serves every network the machine is on)")
    serve.add_argument("--port", type=Bounded(int, 0, 65535), default=8000,
                       help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument("--allowed-hosts", metavar="A,B", help="the Host names requests may be addressed to, "
                       "against DNS rebinding (default: localhost, 127.0.0.1 and [::1] on a loopback "
                       "address, any name on 0.0.0.0 or ::; * for any)")
    serve.add_argument("--api-key-file", type=InputFile(), metavar="PATH",
                       help="require `Authorization: Bearer KEY` on the "
                       "API, KEY being this file's first line (default: $GPTLAB_API_KEY if set, else no key)")
    serve.add_argument("--api-key", help=argparse.SUPPRESS)  # refused with a pointer to the safe ways
    serve.add_argument("--max-batch", type=COUNT, default=None, help="rows decoded together at most; later "
                       "requests wait for a free row (default 64, or fewer when 64 do not fit in memory)")
    serve.add_argument("--max-context", type=COUNT, default=None, help="tokens of prompt and completion one "
                       "row may hold, which sizes the KV cache (default: the model's context window, past "
                       "which a completion slides on)")
    serve.add_argument("--max-tokens", type=COUNT, default=1024,
                       help="the largest max_tokens a request may ask for (default 1024)")
    serve.add_argument("--max-waiting", type=COUNT, default=256,
                       help="rows waiting for a free row at most; a "
                       "request beyond is refused with 429 and Retry-After (default 256)")
    serve.add_argument("--request-timeout", type=Bounded(float, 1e-3), default=600.0,
                       help="seconds a request may take from "
                       "its arrival: a running one ends with finish_reason length, a queued one gets a 503 "
                       "(default 600)")
    serve.add_argument("--prefill-chunk", type=COUNT, default=256,
                       help="prompt tokens prefilled per step, so "
                       "a long prompt does not stall the other streams (default 256)")
    serve.add_argument("--max-stops", type=COUNT, default=4, help="stop strings per request (default 4, as "
                       "OpenAI)")
    serve.add_argument("--max-stop-chars", type=COUNT, default=64,
                       help="characters per stop string (default 64)")
    serve.add_argument("--prefix-cache-mb", type=Bounded(float, 0), default=256, metavar="MB",
                       help="memory for the keys "
                       "and values of finished requests, reused by later prompts that start with the same "
                       "tokens (a chat's history); least recently used first out; 0 turns it off (default "
                       "256)")
    serve.add_argument("--no-metrics", action="store_true", help="answer GET /metrics (Prometheus' text "
                       "format, behind the API key when there is one) with 404, and count nothing")
    serve.add_argument("--threads", type=COUNT, default=max(1, (os.cpu_count() or 2) - 1),
                       help="CPU threads of the decode thread's tensor operations (default: all cores "
                       "but one, which is left to the HTTP event loop)")
    add_speculation_options(serve)
    add_device_option(serve)
    add_weight_options(serve)
    serve.set_defaults(func=cmd_serve)


def add_speculation_options(serve: argparse.ArgumentParser) -> None:
    """--speculative, --draft-tokens and --ngram, in a group of their own."""
    speculative = serve.add_argument_group(
        "speculative decoding", "draft tokens by finding the last n tokens earlier in the prompt and output, "
        "and verify them in one forward pass per row: greedy output is unchanged, sampled output keeps the "
        "model's distribution (but a seed gives other samples than without it); a request's "
        "\"speculative\": false turns it off")
    speculative.add_argument("--speculative", choices=["ngram"], help="prompt lookup for every request")
    speculative.add_argument("--draft-tokens", type=COUNT, metavar="K",
                             help="tokens drafted and verified per "
                             "step (default 4)")
    speculative.add_argument("--ngram", type=COUNT, metavar="N",
                             help="longest n-gram looked up, falling back "
                             "to shorter ones (default 3)")
