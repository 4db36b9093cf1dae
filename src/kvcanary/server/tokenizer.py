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
