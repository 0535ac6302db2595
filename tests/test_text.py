"""Detokenization and stop strings: pure, with property tests over arbitrary splits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from butter.chat.detokenize import IncrementalDetokenizer
from butter.chat.stops import StopMatcher


def test_multibyte_character_split_across_tokens() -> None:
    detok = IncrementalDetokenizer()
    euro = "€".encode()  # 3 bytes
    assert detok.feed(b"price " + euro[:1]) == "price "
    assert detok.feed(euro[1:2]) == ""
    assert detok.feed(euro[2:] + b"5") == "€5"
    assert detok.flush() == ""


def test_invalid_bytes_never_reach_the_client() -> None:
    detok = IncrementalDetokenizer()
    text = detok.feed(b"a\xff\xfeb") + detok.feed(b"\xe2\x82") + detok.flush()
    text.encode("utf-8")  # always valid
    assert text == "a\ufffd\ufffdb\ufffd"


@given(st.text(), st.lists(st.integers(min_value=0, max_value=64), max_size=12))
def test_any_split_decodes_to_the_original(text: str, cuts: list[int]) -> None:
    data = text.encode()
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    detok = IncrementalDetokenizer()
    assert "".join(detok.feed(p) for p in pieces) + detok.flush() == text


def _run_stops(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        out.append(matcher.feed(delta))
        if matcher.matched:
            break
    out.append(matcher.flush())
    return "".join(out), matcher.matched


def test_stop_split_across_deltas_is_never_emitted() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.feed("abc E") == "abc "
    assert matcher.feed("N") == ""
    assert matcher.feed("D tail") == ""
    assert matcher.matched == "END"


def test_held_text_is_released_when_it_was_not_a_stop() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.feed("the E") == "the "
    assert matcher.feed("ND?") == ""  # "END" completed
    matcher = StopMatcher(("END",))
    assert matcher.feed("the E") == "the "
    assert matcher.feed("xit") == "Exit"
    assert matcher.feed("E") == ""
    assert matcher.flush() == "E"


def test_earliest_of_several_stops_wins() -> None:
    assert _run_stops(("bb", "a"), ["xxbba"]) == ("xx", "bb")


@given(
    st.text(alphabet="abc", max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_stops_match_the_unsplit_result(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    emitted, matched = _run_stops(tuple(stops), deltas)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        index = min(i for i, _ in hits)
        assert emitted == text[:index]
        assert matched is not None and text.find(matched) == index
    else:
        assert emitted == text and matched is None
