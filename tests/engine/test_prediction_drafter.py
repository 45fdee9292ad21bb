"""A request's predicted output as a draft source: it proposes the prediction's continuation from
where the output stands in it, and finds its place again after the output departs from it."""

from __future__ import annotations

from flare.engine.drafters.prediction import PredictionState


def test_an_output_that_follows_the_prediction_is_offered_its_continuation() -> None:
    state = PredictionState((10, 11, 12, 13, 14))
    assert state.propose(3).token_ids == (10, 11, 12)
    state.extend([10, 11])
    assert state.propose(2).token_ids == (12, 13)
    state.extend([12, 13, 14])
    assert state.propose(4).token_ids == ()


def test_after_an_inserted_stretch_the_prediction_is_picked_up_where_the_output_rejoins_it() -> None:
    state = PredictionState((1, 2, 3, 4, 5, 6, 7))
    state.extend([1, 2, 90, 91])  # the output inserts text the prediction does not hold
    assert state.propose(3).token_ids == ()
    state.extend([3])  # and rejoins it
    assert state.propose(3).token_ids == (4, 5, 6)


def test_a_skipped_stretch_realigns_on_the_outputs_last_tokens() -> None:
    state = PredictionState((1, 2, 3, 4, 5, 6, 7, 8))
    state.extend([1, 2, 5, 6])
    assert state.propose(2).token_ids == (7, 8)


def test_a_repeated_phrase_realigns_at_its_next_occurrence_not_its_first() -> None:
    state = PredictionState((7, 8, 1, 7, 8, 2))
    state.extend([7, 8, 1, 9, 7, 8])
    assert state.propose(1).token_ids == (2,)
