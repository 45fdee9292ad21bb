import pytest

from flare.scheduler.stop_strings import StopStringMatcher


def stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


@pytest.mark.parametrize(
    "pieces",
    [["Hello wor", "ld END and more"], ["Hello world E", "N", "D"], ["Hello world ", "END"], ["Hello world END"]],
)
def test_stop_string_split_across_pieces_is_never_emitted(pieces):
    assert stream(StopStringMatcher(("END",)), pieces) == ("Hello world ", True)


def test_text_that_only_looked_like_a_stop_prefix_is_released():
    assert stream(StopStringMatcher(("END",)), ["a E", "N", "x"]) == ("a ENx", False)
    assert stream(StopStringMatcher(("END",)), ["tail E"]) == ("tail E", False)


def test_earliest_of_several_stop_strings_wins():
    assert stream(StopStringMatcher(("world", "lo")), ["hello world"]) == ("hel", True)


def test_without_stop_strings_text_passes_through_at_once():
    matcher = StopStringMatcher(())
    assert matcher.push("abc") == ("abc", False)
