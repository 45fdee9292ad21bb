from flare.engine.drafters import NgramDrafter, make_drafter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def test_proposes_the_tokens_that_followed_the_latest_match_of_the_suffix():
    state = NgramDrafter().new_state([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    # Suffix (5, 6, 7) occurred at the start, followed by 8, 9, 1.
    assert state.propose(3).token_ids == (8, 9, 1)


def test_after_an_inserted_token_lookup_goes_on_with_the_copied_text_not_the_latest_match():
    # The prompt's text 1 9 2 3 9 4 9 6 7 (9 is frequent, as ", " is), then the answer copies it.
    state = NgramDrafter().new_state([1, 9, 2, 3, 9, 4, 9, 6, 7, 100])
    state.extend([1])
    assert state.propose(4).token_ids == (9, 2, 3, 9)
    state.extend([9, 2, 3, 9, 4])  # the drafts accepted, and the round's own token
    state.extend([8, 9])  # the answer inserts 8, then copies on
    # The latest 9 (the answer's own, at 4 8) would propose 4 8; the copy goes on with 6 7.
    assert state.propose(2).token_ids == (6, 7)


def test_an_ngram_seen_only_before_the_copy_takes_its_latest_occurrence():
    state = NgramDrafter().new_state([5, 6, 1, 2, 3, 4, 100])
    state.extend([1])
    assert state.propose(4).token_ids == (2, 3, 4, 100)
    state.extend([2, 3, 4, 5])  # the answer leaves the copy for 5, seen only before it
    assert state.propose(2).token_ids == (6, 1)


def test_prefers_the_longest_matching_ngram():
    # Unigram 3 last followed by 4 at index 6, but the trigram (1, 2, 3) was followed by 9.
    state = NgramDrafter(max_n=3).new_state([1, 2, 3, 9, 7, 3, 4, 1, 2, 3])
    assert state.propose(1).token_ids == (9,)


def test_never_matches_the_suffix_itself_and_proposes_nothing_without_history():
    state = NgramDrafter().new_state([1, 2, 3])
    assert state.propose(4).token_ids == ()


def test_proposal_is_cut_at_the_end_of_the_context_and_at_k():
    state = NgramDrafter().new_state([4, 5, 4])
    assert state.propose(5).token_ids == (5, 4)
    assert state.propose(1).token_ids == (5,)
    assert state.propose(0).token_ids == ()


def test_extension_with_generated_tokens_updates_the_index():
    state = NgramDrafter().new_state([10, 11, 12, 13])
    state.extend([10, 11])
    assert state.propose(2).token_ids == (12, 13)
    assert state.propose(2).probs is None  # one-hot q


def test_unknown_drafter_name_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="known drafters: ngram"):
        make_drafter("medusa")


def scanned_proposal(tokens: list[int], cursor: int | None, k: int) -> tuple[int | None, tuple[int, ...]]:
    """(the proposal's start, the proposal) by a scan of the whole context: the longest of the
    last 3, 2, 1 tokens that occurred before (not as the suffix itself), at its first occurrence
    at or past the cursor, else its latest."""
    for n in range(min(3, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n :]
        ends = [end for end in range(n, len(tokens)) if tokens[end - n : end] == suffix]
        if ends:
            later = [end for end in ends if cursor is not None and end >= cursor]
            start = later[0] if later else ends[-1]
            return start, tuple(tokens[start : start + k])
    return None, ()


@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=80),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    k=st.integers(1, 6),
)
@settings(max_examples=200, deadline=None)
def test_proposals_follow_the_scanned_rule_however_the_tokens_arrive(tokens: list[int], cuts: list[int], k: int) -> None:
    prompt, rest = tokens[: cuts[0]], tokens[cuts[0] :]
    state = NgramDrafter().new_state(prompt)
    seen, cursor = list(prompt), None  # the copy cursor, kept here by the rule's own words
    for size in [*cuts[1:], len(rest)]:
        start, proposal = scanned_proposal(seen, cursor, k)
        assert state.propose(k).token_ids == proposal
        if proposal:
            cursor = start
        chunk, rest = rest[:size], rest[size:]
        for token in chunk:  # each token that continues the copied text moves the cursor on
            if cursor is not None and cursor < len(seen) and seen[cursor] == token:
                cursor += 1
            seen.append(token)
        state.extend(chunk)
        if not rest:
            break
