"""A byte-level tokenizer for the reference model, which has none: token id = UTF-8 byte."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

NUM_BYTES = 256
_REPLACEMENT = "\ufffd".encode()


class ByteTokenizer:
    """Text <-> token ids for a model of ``vocab_size`` >= 256: each UTF-8 byte is one token.
    Ids the model may produce beyond 255 decode to U+FFFD, as do broken UTF-8 sequences."""

    def __init__(self, vocab_size: int):
        if type(vocab_size) is not int or vocab_size < NUM_BYTES:
            raise ValueError(f"vocab_size must be an int >= {NUM_BYTES} for byte-level text, got {vocab_size!r}; "
                             "send prompts as token-id lists instead")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out = b"".join(bytes([i]) if 0 <= i < NUM_BYTES else _REPLACEMENT for i in ids)
        return out.decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()


class StreamDecoder:
    """Decodes ids chunk by chunk: a UTF-8 sequence split across chunks comes out whole, once
    complete; the concatenation of every chunk (and ``flush()``) equals ``ByteTokenizer.decode``."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._utf8.decode(b"".join(bytes([i]) if 0 <= i < NUM_BYTES else _REPLACEMENT for i in ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The reference model's chat template over (role, content) pairs: each turn as
    ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` for the reply to come."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


class TextOutput:
    """A generation's text as its tokens arrive, cut at the first of ``stops`` to appear (the one
    whose match completes first; OpenAI's ``stop``: the text ends before it and leaves it out).

    ``view``: (text so far, how much of it may be streamed now). Once stopped the text ends before
    the stop string and all of it may go; before, a tail that could still begin a stop string is
    held back. Fed on the engine thread, read on the event loop: ``view`` is replaced whole."""

    def __init__(self, tokenizer: ByteTokenizer, stops: Sequence[str] = ()):
        self._decoder = tokenizer.stream_decoder()
        self.stops = tuple(stops)
        self._hold = max(map(len, self.stops), default=1) - 1
        self.view: tuple[str, int] = ("", 0)
        self.is_stopped = False

    @property
    def text(self) -> str:
        return self.view[0]

    def feed(self, ids: Sequence[int]) -> bool:
        """Append ``ids``' text; True once a stop string appeared (the text is cut there)."""
        if not self.is_stopped:
            self._append(self._decoder.feed(ids), final=False)
        return self.is_stopped

    def finish(self) -> None:
        """The generation ended: flush a broken UTF-8 tail; every character may go out."""
        if not self.is_stopped:
            self._append(self._decoder.flush(), final=True)

    def _append(self, new: str, final: bool) -> None:
        old = self.view[0]
        start = max(len(old) - self._hold, 0)  # a match ending in ``new`` starts here or later
        text = old + new
        # the match that completes first (as if fed a character at a time), then the longer one
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s, start)) >= 0]
        if hits:
            text, self.is_stopped = text[: min(hits)[1]], True
        done = final or self.is_stopped
        self.view = (text, len(text) if done else max(len(text) - self._hold, 0))
