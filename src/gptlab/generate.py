"""Generation (§7.1): predict from the last position, choose a token, append it, repeat.

The handout's loop recomputes the growing prefix at every step. In a causal model appending a token
leaves every earlier position unchanged (§7.1, the sequel's KV cache), so with `use_cache=True` the
prompt runs once (the prefill) into a `KVCache` allocated once per run, and every later step runs
one position per row. `use_cache=False` is the naive loop, kept as the reference: every step starts
from an empty cache and recomputes everything the newest token can depend on. Both loops take the
context window from `window_start`, so they compute the same function; the tests hold their tokens
equal for 200 steps and their logits to 1e-5.

The context window (W = block_size) once a generation outgrows it:
- Prompts longer than W keep their last W tokens.
- `rope`, `none`, `sinusoidal`: a sliding window. Every query attends to the keys of the last W
  positions (a band mask) at absolute positions, and the cache is a ring of W slots. This is not
  the same as recomputing the last W tokens alone: in a deeper layer the kept keys were computed when
  older tokens were still visible, so a token's influence reaches L (W - 1) positions back. The
  naive loop therefore recomputes, under the same band mask, the last L (W - 1) + 1 tokens.
- `learned`: there is no row for position W, so when a row's window is full it restarts from the
  row's last W // 2 tokens, renumbered from position 0, which are run again (a re-prefill); the
  amortised cost is one W/2-token prefill per W/2 steps. The naive loop starts at the same token.

Batches of prompts of different lengths are left-padded; padding is masked out and every row's
positions count from its own first token (n-gram embeddings read the start id before it, never
padding), so each row gets the tokens it would get alone. Tokens are
chosen as a `SamplingConfig` says (gptlab.sampling), never among the ids a padded model vocabulary
has beyond its tokenizer's. Generation stops at any of the tokenizer's end-of-sequence ids
(`Tokenizer.stop_ids`), at a stop string (which is never shown, not even its start while streaming),
or after max_new_tokens.

With a `SpeculationConfig` (one prompt, with the cache) each step drafts tokens by prompt lookup and
verifies them with the newest one in a single forward pass (`gptlab.speculative`): the accepted ones
and the model's own next token are kept, and the rejected ones' keys are rewound out of the cache.
Its ring has draft_tokens slots beyond the window, so a chunk's keys only ever overwrite keys out of
every later query's window; a chunk never crosses the ring's end nor, with learned positions, the
window's, and where no draft fits (a prefill, a moved window) the step is a plain one. Greedy tokens
are plain greedy's; sampled ones have the model's distribution but not plain sampling's draws.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gptlab.config import ModelConfig, SamplingConfig
from gptlab.kv_cache import KVCache
from gptlab.model import GPT
from gptlab.sampling import next_token, sampler, within_vocabulary
from gptlab.speculative import SpeculationConfig, SpeculationStats, accept_draft, ngram_draft
from gptlab.text.tokenizer import Tokenizer


def window_start(config: ModelConfig, start: int, length: int) -> int:
    """Where a row of `length` tokens, whose window began at `start`, has its window now (both loops).

    Only learned positions move it: to the last block_size // 2 tokens once the window overflows.
    The other schemes keep absolute positions and slide with a band mask instead (module docstring).
    """
    if config.positions == "learned" and length - start > config.block_size:
        return length - max(1, config.block_size // 2)
    return start


def prompt_rows(prompts: torch.Tensor | Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Token ids of each prompt, (B, T) or lists of any lengths, keeping each one's last block_size."""
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [[int(t) for t in p] for p in prompts]
    if not rows or not all(rows):
        raise ValueError("every prompt needs at least one token: give a non-empty prompt")
    return [row[-block_size:] for row in rows]


class Decoder:
    """Rows of token ids that grow by one token per step, and the model's next-token logits for them.

    With a cache the model sees each token once: a prefill of every row's window (repeated when a
    window moves), then the newest token of each row. Without one every step starts from scratch.
    """

    def __init__(self, model: GPT, rows: Sequence[Sequence[int]], use_cache: bool = True,
                 max_new_tokens: int | None = None, spare: int = 0) -> None:
        """`max_new_tokens`, when known, sizes the cache to what the run can hold: at most block_size
        slots (a ring), fewer when every row ends before then, so a large batch allocates only that.
        `spare` slots more let chunks of up to spare + 1 tokens be verified once the ring wraps."""
        if not model.config.causal:
            raise ValueError("generation needs a causal model: causal=False is only for demonstrations")
        self.model, self.config = model, model.config
        self.rows = [list(row) for row in rows]
        self.starts = [0] * len(self.rows)  # the first token of each row's window
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        window = self.config.block_size
        longest = max(map(len, self.rows)) + (window if max_new_tokens is None else max_new_tokens)
        self.cache = self._new_cache(min(window + spare, longest)) if use_cache else None
        self.prefilled = False  # whether the cache holds every token but the newest of each row
        self.newest: torch.Tensor | None = None  # the token last appended to each row, (B, 1)
        self.latest: torch.Tensor | None = None  # the logits for the rows as they are, once computed

    def append(self, tokens: torch.Tensor) -> None:
        """Add one token (B, 1) to every row (after `logits`: the cache takes one new token per step)."""
        assert self.latest is not None or not self.prefilled, "call logits() before appending another token"
        for row, token in zip(self.rows, tokens.flatten().tolist(), strict=True):
            row.append(token)
        self.newest = tokens.reshape(-1, 1).to(self.device)
        self.latest = None

    @torch.inference_mode()  # cheaper per operation than no_grad; the logits never enter autograd
    def logits(self) -> torch.Tensor:
        """The logits (B, V) of the token after each row's newest one (computed once per step)."""
        if self.latest is None:
            windows = zip(self.starts, self.rows, strict=True)
            starts = [window_start(self.config, start, len(row)) for start, row in windows]
            self.latest = self._recompute(starts) if self.cache is None else self._step(self.cache, starts)
        return self.latest

    def draft_room(self) -> int:
        """How many drafted tokens the next step may verify beside the newest one (0: a plain step is due).

        Only a lone row with a cache speculates, and not when its window needs a prefill first. The
        chunk may not cross the ring's end, nor hold a position past the window of learned positions.
        """
        cache, row, start = self.cache, self.rows[0], self.starts[0]
        if cache is None or len(self.rows) > 1 or not self.prefilled or self.latest is not None:
            return 0
        if window_start(self.config, start, len(row)) != start:
            return 0  # the window moves: the next step prefills it again
        room = cache.capacity - cache.fed[0] % cache.capacity - 1
        if self.config.positions == "learned":  # the newest token is at position len(row) - 1 - start
            room = min(room, self.config.block_size + start - len(row))
        return max(room, 0)

    @torch.inference_mode()
    def verify(self, draft: Sequence[int]) -> torch.Tensor:
        """The logits (d + 1, V) after the newest token and after each of the d drafted ones, in one pass.

        The drafted tokens enter the cache too; `keep` then says which of them stay.
        """
        assert self.cache is not None and self.newest is not None, "verify follows a step of the lone row"
        assert 0 < len(draft) <= self.draft_room(), "the draft does not fit: ask draft_room() first"
        drafted = torch.tensor([list(draft)], device=self.device)  # (1, d)
        return self.model(torch.cat([self.newest, drafted], dim=1), cache=self.cache)[0][0]  # (d + 1, V)

    def keep(self, tokens: Sequence[int], drafted: int) -> None:
        """After `verify` of `drafted` tokens: append `tokens` (the accepted start of the draft, then the
        model's own token) to the row, and forget the rejected drafted tokens' keys."""
        assert self.cache is not None and 0 < len(tokens) <= drafted + 1, "keep follows verify"
        self.cache.rewind(0, drafted + 1 - len(tokens))
        self.rows[0].extend(tokens)
        self.newest = torch.tensor([[tokens[-1]]], device=self.device)  # (1, 1), not yet in the cache
        self.latest = None

    def _step(self, cache: KVCache, starts: list[int]) -> torch.Tensor:
        """The cached step: the newest token of every row, or a prefill of every window when one moved."""
        if starts != self.starts or not self.prefilled:
            self.starts, self.prefilled = starts, True
            idx, pad = self._left_padded([row[s:] for row, s in zip(self.rows, starts, strict=True)])
            cache.reset(pad)
        else:
            assert self.newest is not None, "every step after the prefill follows an append"
            idx = self.newest  # (B, 1)
        return self.model(idx, cache=cache, last_only=True)[0][:, -1]

    def _recompute(self, starts: list[int]) -> torch.Tensor:
        """The naive step: a new, empty cache and every token the newest one can depend on, run at once."""
        self.starts = starts
        reach = self.config.n_layer * (self.config.block_size - 1) + 1  # the band's reach through L layers
        firsts = [max(s, len(row) - reach) for row, s in zip(self.rows, starts, strict=True)]
        idx, pad = self._left_padded([row[f:] for row, f in zip(self.rows, firsts, strict=True)])
        cache = self._new_cache(idx.size(1))
        positions = [f - s for f, s in zip(firsts, starts, strict=True)]  # of each row's first token
        K = cache.before.size(1)  # n-gram embeddings read the K ids before each first token, in its window
        before = [([cache.start] * K + row[max(s, f - K):f])[-K:] if K else []
                  for row, f, s in zip(self.rows, firsts, starts, strict=True)]
        cache.reset(pad, torch.tensor(positions, device=self.device),
                    torch.tensor(before, dtype=torch.long, device=self.device))  # (B, K)
        return self.model(idx, cache=cache, last_only=True)[0][:, -1]

    def _new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, len(self.rows), capacity, device=self.device, dtype=self.dtype)

    def _left_padded(self, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (B, T) with each window at the right end, and the padding of each row (B,)."""
        width = max(len(w) for w in windows)
        idx = torch.tensor([[0] * (width - len(w)) + w for w in windows], device=self.device)  # (B, T)
        pad = torch.tensor([width - len(w) for w in windows], device=self.device)  # (B,)
        return idx, pad


def generate(model: GPT, prompts: torch.Tensor | Sequence[Sequence[int]], sampling: SamplingConfig, *,
             generator: torch.Generator | None = None, eot_id: int | Sequence[int] | None = None,
             vocab_size: int | None = None, use_cache: bool = True,
             speculation: SpeculationConfig | None = None,
             stats: SpeculationStats | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every prompt, (B, 1), one step at a time, as soon as it is chosen.

    `prompts` is a (B, T) tensor or a list of token lists of any lengths. A row that has produced
    `eot_id` (or any of several) keeps yielding that id; the generation ends when every row has, or
    after max_new_tokens. Ids >= `vocab_size` (a tokenizer's, below a padded model's) are never chosen.
    `generator` (default: one seeded with `sampling.seed`) draws the samples. `speculation` drafts
    and verifies several tokens per forward pass (one prompt, with the cache), counted in `stats`.
    """
    model.eval()
    rows = prompt_rows(prompts, model.config.block_size)
    if speculation is not None and (len(rows) > 1 or not use_cache):
        raise ValueError("speculative decoding verifies drafts of one prompt through the KV cache: give one "
                         "prompt, and use_cache=True")
    spare = 0 if speculation is None else speculation.draft_tokens
    decoder = Decoder(model, rows, use_cache, sampling.max_new_tokens, spare)
    generator = generator or sampler(sampling, decoder.device)
    stop_ids = [eot_id] if isinstance(eot_id, int) else list(eot_id or ())
    if speculation is not None:
        counts = SpeculationStats() if stats is None else stats
        for one in speculated(decoder, sampling, speculation, generator, stop_ids, vocab_size, counts):
            yield torch.tensor([[one]], device=decoder.device)  # (1, 1)
        return
    stops = torch.tensor(stop_ids, dtype=torch.long, device=decoder.device)  # (E,)
    finished = torch.zeros(len(decoder.rows), 1, dtype=torch.bool, device=decoder.device)
    last = torch.zeros_like(finished, dtype=torch.long)  # each row's latest token, (B, 1)
    for _ in range(sampling.max_new_tokens):
        token = next_token(within_vocabulary(decoder.logits(), vocab_size), sampling, generator)  # (B, 1)
        if len(stops):
            last = token = torch.where(finished, last, token)  # an ended row repeats its stop id
            finished |= torch.isin(token, stops)
        decoder.append(token)
        yield token
        if len(stops) and bool(finished.all()):
            return


def speculated(decoder: Decoder, sampling: SamplingConfig, speculation: SpeculationConfig,
               generator: torch.Generator | None, stop_ids: Sequence[int], vocab_size: int | None,
               stats: SpeculationStats) -> Iterator[int]:
    """The tokens of the decoder's lone row, a verified draft at a time (a plain step where none fits)."""
    left = sampling.max_new_tokens
    while left > 0:
        room = min(decoder.draft_room(), speculation.draft_tokens, left - 1)  # the model's own token fits too
        draft = ngram_draft(decoder.rows[0], room, speculation.ngram)
        if draft:
            logits = within_vocabulary(decoder.verify(draft), vocab_size)  # (d + 1, V)
            tokens = accept_draft(logits, draft, sampling, generator)
            decoder.keep(tokens, len(draft))
            stats.record(len(draft), len(tokens) - 1)
        else:
            token = next_token(within_vocabulary(decoder.logits(), vocab_size), sampling, generator)  # (1, 1)
            decoder.append(token)
            tokens = [int(token)]
        for one in tokens:
            yield one
            left -= 1
            if one in stop_ids:  # a draft that crosses the end of the text stops there
                return


@dataclass(frozen=True)
class Chunk:
    """One step of a text stream: the token chosen and the text that became safe to show.

    The stream ends with one chunk whose token is None: it carries the text held back until then and
    the stop reason: "eot" (end-of-text token), "stop" (a stop string) or "length" (max_new_tokens).
    """

    text: str
    token: int | None = None
    stop_reason: str | None = None


def stream_text(model: GPT, tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig, *,
                generator: torch.Generator | None = None, use_cache: bool = True,
                speculation: SpeculationConfig | None = None,
                stats: SpeculationStats | None = None) -> Iterator[Chunk]:
    """Continue `prompt`, yielding each token with the text that can no longer become a stop string.

    The prompt is checked at once, before the first chunk is asked for. `speculation` and `stats`: as
    in `generate`.
    """
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
    tokens = generate(model, [prompt_ids], sampling, generator=generator, eot_id=tokenizer.stop_ids,
                      vocab_size=tokenizer.vocab_size, use_cache=use_cache, speculation=speculation,
                      stats=stats)
    return text_chunks(tokens, tokenizer, sampling.stop)


def text_chunks(
    tokens: Iterator[torch.Tensor | int], tokenizer: Tokenizer, stop: Sequence[str]
) -> Iterator[Chunk]:
    """The chunks of stream_text: decode, find stop strings, hold back what may still change."""
    ids: list[int] = []
    text, shown, reason = "", 0, "length"
    for token in tokens:
        ids.append(int(token))
        if ids[-1] in tokenizer.stop_ids:
            reason = "eot"
        else:
            text = tokenizer.decode(ids)
            # Shown text is final, so a stop string can only begin at or after `shown`.
            found = [i for i in (text.find(s, shown) for s in stop) if i >= 0]
            if found:
                text, reason = text[: min(found)], "stop"
        if reason != "length":
            yield Chunk("", ids[-1])
            break
        safe = len(text) - held_back(text, stop)
        yield Chunk(text[shown:safe], ids[-1])
        shown = safe
    yield Chunk(text[shown:], None, reason)


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many final characters of `text` may still change: a cut character, or a stop string's start."""
    held = len(text) - len(text.rstrip("\ufffd"))  # byte-level tokenizers decode a cut character as U+FFFD
    for s in stop:
        starts = (k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k]))
        held = max(held, next(starts, 0))
    return held
