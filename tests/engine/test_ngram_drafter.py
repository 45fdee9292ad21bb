from flare.engine.drafters import NgramDrafter, make_drafter

import pytest


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
