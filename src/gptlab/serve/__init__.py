"""`gptlab serve`: an OpenAI-compatible HTTP server and a browser playground for a trained run.

- `batching`: the continuous-batching scheduler. One decode thread owns the model; a request joins
  the running batch at the next step, and each row samples with its own generator, so it gets the
  tokens `generate` gives for its prompt alone with the same `SamplingConfig`.
  Its rows and what they report are in `rows`; `prefix_cache` keeps finished rows' keys and values for
  later prompts that start alike, and `speculation` drafts and verifies tokens per row (prompt lookup).
- `schemas`: the OpenAI request bodies, validated into `SamplingConfig`, and OpenAI-style errors.
- `app`: the ASGI application (FastAPI): `/v1/models`, `/v1/completions` (streamed or not),
  `/v1/attention` for the playground, and the playground page at `/` (`page`).
- `prometheus`: `GET /metrics`, the server's counters, gauges and histograms in Prometheus' format.
- `server`: a run folder served as the serve command serves it (`app_for_run`: the model loaded, the
  batch sized to the free memory by `sizing`), and uvicorn running the app on a bound socket.

FastAPI, uvicorn and prometheus-client come with the optional extra `gptlab[serve]`; nothing here imports them
at the package level, so `gptlab` works without them.
"""
