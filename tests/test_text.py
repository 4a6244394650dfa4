"""Streaming text: stop strings split across tokens, and no partial UTF-8 ever emitted."""

from __future__ import annotations

import random

import pytest

from mlx_trio.engine.vocabulary.stops import StopStringMatcher
from mlx_trio.engine.vocabulary.text import TextStream, byte_level_table
from tests.tiny import make_tokenizer


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, matched = matcher.push(piece)
        out.append(text)
        if matched:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hel", "lo W", "orld"], ("o Wo",), ("Hell", True)),
        (["a", "b", "c", "d"], ("bc",), ("a", True)),
        (["ab", "x", "abc"], ("abc",), ("abx", True)),
        (["END"], ("END",), ("", True)),
        (["one", " tw", "o three"], ("two", "three"), ("one ", True)),
        (["one", " tw", "in three"], ("two", "thee"), ("one twin three", False)),
        (["x", "y"], (), ("xy", False)),
        (["foo", "ba", "r baz"], ("baz", "bar"), ("foo", True)),
    ],
)
def test_stop_strings_match_across_pieces(pieces, stops, expected):
    assert feed(StopStringMatcher(stops), pieces) == expected


def test_partial_stop_match_is_held_back_then_released():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("RM") == ("STORM", False)


def byte_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", ["é", "naïve café", "日本語", "emoji 😀 ok", "a\u0301b"])
def test_stream_never_emits_a_partial_code_point(text):
    tokenizer = make_tokenizer()
    tokens = byte_tokens(tokenizer, text)
    assert len(tokens) > len(text.split()), "test needs multi-byte characters split over tokens"
    stream = TextStream(tokenizer)
    pieces = [stream.push(t)[0] for t in tokens]
    pieces.append(stream.finish()[0])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stream_cuts_at_stop_string_split_over_byte_tokens():
    tokenizer = make_tokenizer()
    stream = TextStream(tokenizer, stop=("é!",))
    emitted = []
    matched = False
    for token in byte_tokens(tokenizer, "café! more"):
        text, matched = stream.push(token)
        emitted.append(text)
        if matched:
            break
    assert matched
    assert "".join(emitted) == "caf"


@pytest.mark.parametrize("seed", range(5))
def test_byte_level_text_matches_mlx_lm_in_any_chunking(seed):
    # Random ids (bytes that make broken UTF-8 too, merges, special tokens), cut into calls
    # of random sizes: the same text as mlx-lm's BPEStreamingDetokenizer, one space dropped
    # at the start included.
    tokenizer = make_tokenizer()
    assert byte_level_table(tokenizer) is not None
    rng = random.Random(seed)
    space = byte_tokens(tokenizer, " ")
    ids = space * 2 + [rng.randrange(len(tokenizer)) for _ in range(300)]
    reference = tokenizer.detokenizer
    for token in ids:
        reference.add_token(token)
    reference.finalize()
    stream = TextStream(tokenizer)
    pieces, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 9)
        pieces.append(stream.extend(ids[start : start + size]))
        start += size
    pieces.append(stream.finish()[0])
    assert "".join(pieces) == reference.text
    assert reference.text.startswith(" ")  # of the two spaces, one was dropped
