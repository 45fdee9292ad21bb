from flare.engine.drafters import NgramDrafter, make_drafter

import pytest


def test_proposes_the_tokens_that_followed_the_latest_match_of_the_suffix():
    state = NgramDrafter().new_state([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    # Suffix (5, 6, 7) occurred at the start, followed by 8, 9, 1.
    assert state.propose(3).token_ids == (8, 9, 1)


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
