"""A conversation with a chat-tuned model: the messages so far, each reply streamed as it is chosen.

`gptlab chat` is this loop on a terminal; in Python, `Conversation(gptlab.load(run))` keeps the history
that `LM.chat` leaves to its caller. One random stream serves the whole conversation, as `gptlab sample`
has one for all its samples.
"""

from __future__ import annotations

from collections.abc import Iterator

from gptlab.config import SamplingConfig
from gptlab.generate import Chunk
from gptlab.inference.lm import LM
from gptlab.sampling import sampler


class Conversation:
    """The messages of one conversation with `lm`, and each reply streamed as `generate` chunks."""

    def __init__(self, lm: LM, sampling: SamplingConfig | None = None, system: str | None = None) -> None:
        """`sampling`: default `lm.sampling()` (the run's defaults); `system`: a message that opens it.
        A run not fine-tuned for chat is refused here, before any turn."""
        lm.check_chat()
        self.lm, self.system = lm, system
        self.sampling = lm.sampling() if sampling is None else sampling
        self.generator = sampler(self.sampling, lm.device)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Start again: only the system message, if any."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def reply(self, message: str) -> Iterator[Chunk]:
        """Stream the reply to a user message; the conversation keeps both once the reply has ended
        (a reply cut short, by Ctrl-C or an error, leaves the conversation as it was)."""
        asked = [*self.messages, {"role": "user", "content": message}]
        said = ""
        for chunk in self.lm.reply_chunks(asked, self.sampling, self.generator):
            said += chunk.text
            yield chunk
        self.messages = [*asked, {"role": "assistant", "content": said}]
