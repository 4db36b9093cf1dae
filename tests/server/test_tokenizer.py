from __future__ import annotations

import pytest

from kvcanary.server.tokenizer import ByteTokenizer, TextOutput


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


def _fed(stops, chunks):
    out = TextOutput(ByteTokenizer(256), stops)
    views = []
    for chunk in chunks:
        out.feed(list(chunk.encode()))
        views.append(out.view)
    return out, views


def test_text_output_cuts_at_the_first_stop_string_across_chunks():
    out, views = _fed(["END", "xyz"], ["abcE", "N", "Dtail"])
    assert out.is_stopped and out.text == "abc"
    assert views == [("abcE", 2), ("abcEN", 3), ("abc", 3)]  # "E", "EN" held back: they may begin "END"
    out, _ = _fed(["lo w", "o"], ["hello world"])
    assert out.text == "hell"  # the match that completes first wins, however the text was chunked
    out, _ = _fed(["lo", "llo"], ["hello"])
    assert out.text == "he"  # two completing at once: the longer one
    out, _ = _fed(["zz"], ["no stop here"])
    assert not out.is_stopped and out.view == ("no stop here", 11)
    out.finish()
    assert out.view == ("no stop here", 12)


def test_text_output_decodes_utf8_split_across_tokens():
    out = TextOutput(ByteTokenizer(256), ["é!"])
    data = "café! more".encode()
    for b in data:
        out.feed([b])
    assert out.text == "caf" and out.is_stopped
    free = TextOutput(ByteTokenizer(256))
    free.feed(list("ü".encode())[:1])
    assert free.view == ("", 0)
    free.finish()
    assert free.view == ("\ufffd", 1)
