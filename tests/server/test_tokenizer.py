from __future__ import annotations

import pytest

from kvcanary.server.tokenizer import ByteTokenizer


def test_round_trip_of_utf8_text():
    tok = ByteTokenizer(256)
    text = "KV canary: ünïcode ✓ 漢字"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_ids_beyond_bytes_and_broken_sequences_decode_to_replacement():
    tok = ByteTokenizer(512)
    assert tok.decode([104, 300, 105]) == "h\ufffdi"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"


def test_small_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256"):
        ByteTokenizer(128)
