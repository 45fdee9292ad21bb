import pytest

from flare.scheduler.stop_strings import StopStringMatcher


def stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped is not None:
            return "".join(out), stopped
    out.append(matcher.flush())
    return "".join(out), None


@pytest.mark.parametrize(
    "pieces",
    [["Hello wor", "ld END and more"], ["Hello world E", "N", "D"], ["Hello world ", "END"], ["Hello world END"]],
)
def test_stop_string_split_across_pieces_is_never_emitted(pieces):
    assert stream(StopStringMatcher(("END",)), pieces) == ("Hello world ", "END")


def test_text_that_only_looked_like_a_stop_prefix_is_released():
    assert stream(StopStringMatcher(("END",)), ["a E", "N", "x"]) == ("a ENx", None)
    assert stream(StopStringMatcher(("END",)), ["tail E"]) == ("tail E", None)


def test_earliest_of_several_stop_strings_wins():
    assert stream(StopStringMatcher(("world", "lo")), ["hello world"]) == ("hel", "lo")
    assert stream(StopStringMatcher(("lo w", "lo")), ["hello world"]) == ("hel", "lo w")  # one start: the first given


def test_without_stop_strings_text_passes_through_at_once():
    matcher = StopStringMatcher(())
    assert matcher.push("abc") == ("abc", None)
