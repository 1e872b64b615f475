"""Special tokens of the char and byte tokenizers: multi-character strings, such as the native chat
template's "<|user|>", that each encode as one id of their own, numbered after the kind's ordinary ids.

They are matched in the text before it is read as characters or bytes, leftmost first and, where two
start at the same place, longest first: the same rule as Hugging Face's added tokens, so that the
tokenizer.json `export-hf` writes (`gptlab.interop.hf_tokenizer`) encodes alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Piece = tuple[int, str | int]  # (where it starts in the text, plain text or a special token's id)


class SpecialTokens:
    """Special tokens with ids `first_id`, `first_id` + 1, ... in the order given."""

    def __init__(self, tokens: Sequence[str], first_id: int) -> None:
        tokens = list(tokens)
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"special tokens must be distinct: {tokens!r}")
        short = next((t for t in tokens if not isinstance(t, str) or len(t) < 2), None)
        if short is not None:
            raise ValueError(f"special token {short!r} must be a string of at least two characters (a single "
                             "character is an ordinary token)")
        self.tokens, self.first_id = tuple(tokens), first_id
        self.ids = {token: first_id + i for i, token in enumerate(tokens)}
        # Python's regex tries alternatives in order at each position: longest first gives longest match.
        longest_first = sorted(tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if tokens else None

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, text: str) -> list[Piece]:
        """The text as pieces in order: plain stretches (never empty) and the ids of special tokens."""
        if self._pattern is None:
            return [(0, text)] if text else []
        pieces: list[Piece] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                pieces.append((start, text[start:match.start()]))
            pieces.append((match.start(), self.ids[match.group()]))
            start = match.end()
        if start < len(text):
            pieces.append((start, text[start:]))
        return pieces
