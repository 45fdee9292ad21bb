import pytest

from flare.scheduler.speculation.draft_length import (
    HEAD_STEP_MARGIN,
    AcceptanceEstimate,
    HeadCostModel,
    RoundCostModel,
    choose_draft_lengths,
    worthwhile_head_steps,
)


def timed_on_a_line(c0: float, c1: float, counts: range | list[int]) -> RoundCostModel:
    """A cost model that has timed rounds of `counts` tokens at c0 + c1 * tokens seconds, each
    twice (a count timed once is soon dropped: `RoundCostModel.single_age_rounds`)."""
    cost = RoundCostModel(c0=c0, c1=c1)
    for tokens in counts:
        for _ in range(2):
            cost.observe(tokens, c0 + c1 * tokens)
    return cost


def test_cost_model_recovers_a_linear_round_time():
    cost = RoundCostModel()
    for tokens in [1, 8, 32, 4, 16, 64, 2]:
        cost.observe(tokens, 0.017 + 0.0027 * tokens)
    assert abs(cost.c0 - 0.017) < 1e-6 and abs(cost.c1 - 0.0027) < 1e-7


def test_single_row_drafts_even_at_modest_acceptance_when_weight_reads_dominate():
    cost = timed_on_a_line(0.017, 0.0027, range(1, 7))
    assert choose_draft_lengths([5], [0.8], base_tokens=1, cost=cost, requests_waiting=True) == [5]
    # At 0.5 the third draft adds 1/8 token for c1 seconds: below the round's average rate.
    assert choose_draft_lengths([5], [0.5], base_tokens=1, cost=cost, requests_waiting=True) == [2]


def test_a_busy_batch_drafts_only_rows_that_are_nearly_always_accepted():
    cost = timed_on_a_line(0.017, 0.0027, range(32, 32 + 5 * 32 + 1))
    lengths = choose_draft_lengths([5] * 32, [0.3] * 24 + [0.99] * 8, base_tokens=32, cost=cost, requests_waiting=True)
    assert lengths[:24] == [0] * 24 and lengths[24:] == [5] * 8
    # One such row alone adds 2% to the round's rate: within DRAFT_MARGIN, so no bet.
    lengths = choose_draft_lengths([5] * 32, [0.3] * 31 + [0.99], base_tokens=32, cost=cost, requests_waiting=True)
    assert lengths == [0] * 32


def test_drafts_are_taken_only_when_they_beat_the_plain_round_by_the_margin():
    cost = timed_on_a_line(0.1, 0.0, [1, 2])  # a flat cost: every draft is free
    # 1 + 0.04 expected tokens for the same time: 4% better, not worth a bet.
    assert choose_draft_lengths([1], [0.04], base_tokens=1, cost=cost, requests_waiting=True) == [0]
    assert choose_draft_lengths([1], [0.06], base_tokens=1, cost=cost, requests_waiting=True) == [1]


def test_rows_without_proposals_or_acceptance_never_draft():
    cost = timed_on_a_line(0.017, 0.0027, range(2, 7))
    assert choose_draft_lengths([0, 4], [0.9, 0.0], base_tokens=2, cost=cost, requests_waiting=True) == [0, 0]


def test_acceptance_counts_each_tested_draft_and_none_after_the_rejected_one():
    estimate = AcceptanceEstimate(rate=0.5, weight=0.5)
    estimate.observe(proposed=5, accepted=2)  # 2 accepted, the third rejected, two untested
    assert estimate.rate == pytest.approx((1 - 0.5 * 0.5 * 0.5) * 0.5)
    tested_only = AcceptanceEstimate(rate=0.5, weight=0.5)
    tested_only.observe(proposed=3, accepted=2)
    assert tested_only.rate == estimate.rate


def test_a_copying_row_is_back_to_four_drafts_one_round_after_a_changed_word():
    # Four drafts accepted a round, then one rejected where the text changed a word, then four
    # accepted again: the estimate is back where four drafts pay (averaging rounds: 0.75).
    cost = timed_on_a_line(0.0106, 0.0025, range(1, 6))
    estimate = AcceptanceEstimate(rate=0.5)
    for _ in range(5):
        estimate.observe(proposed=4, accepted=4)
    estimate.observe(proposed=4, accepted=0)
    estimate.observe(proposed=4, accepted=4)
    assert estimate.rate > 0.9
    assert choose_draft_lengths([4], [estimate.rate], base_tokens=1, cost=cost, requests_waiting=True) == [4]
    assert choose_draft_lengths([4], [0.75], base_tokens=1, cost=cost, requests_waiting=True) < [4]


def test_one_token_rounds_are_timed_apart_from_the_line_of_larger_rounds():
    cost = RoundCostModel()
    for tokens, seconds in [(1, 0.046), (2, 0.075), (5, 0.078), (9, 0.086), (1, 0.046), (5, 0.078)]:
        cost.observe(tokens, seconds)
    assert abs(cost.seconds(1) - 0.046) < 1e-9
    assert 0.075 < cost.seconds(3) < 0.078  # unmeasured: the line of GEMM rounds, not through 46 ms


def test_a_lone_row_drafts_only_when_acceptance_covers_a_costlier_round():
    # As timed before the weights-first layout: 46 ms for one token, 75 ms + 1 ms a token beyond.
    cost = RoundCostModel()
    for tokens in range(1, 6):
        cost.observe(tokens, 0.046 if tokens == 1 else 0.073 + 0.001 * tokens)
    assert choose_draft_lengths([4], [0.3], base_tokens=1, cost=cost, requests_waiting=True) == [0]  # 1.43 tokens in 78 ms
    assert choose_draft_lengths([4], [0.9], base_tokens=1, cost=cost, requests_waiting=True) == [4]  # 4.1 tokens in 78 ms


def test_past_the_largest_timed_round_the_estimate_follows_the_steeper_measured_slope():
    cost = RoundCostModel(c0=0.06, c1=0.0014)  # a line pulled flat by long prefill rounds
    cost.observe(1, 0.042)
    cost.observe(8, 0.074)
    assert abs(cost.seconds(18) - (0.074 + 10 * (0.074 - 0.042) / 7)) < 1e-9
    assert abs(cost.seconds(4) - (0.042 + 3 * (0.074 - 0.042) / 7)) < 1e-9  # between two timed rounds


def cliff_at_nine_tokens() -> RoundCostModel:
    """Rounds as measured on this CPU at context 100: a GEMM cliff past 8 columns."""
    cost = RoundCostModel()
    measured = [(8, 0.072), (9, 0.085), (10, 0.100), (12, 0.126), (13, 0.126), (16, 0.130), (24, 0.132)]
    for tokens, seconds in measured * 3:
        cost.observe(tokens, seconds)
    return cost


def test_a_measured_cliff_stops_a_single_draft():
    cost = cliff_at_nine_tokens()
    # One draft at 0.9 adds 11% tokens for 18% more time (85 against 72 ms): no.
    assert choose_draft_lengths([1] * 8, [0.0] * 7 + [0.9], base_tokens=8, cost=cost, requests_waiting=True) == [0] * 8
    # Where the round was measured flat (12 and 13 tokens), a draft costs nothing and is taken
    # when it adds more than the margin (0.9 of a token on 12: 7.5%).
    assert choose_draft_lengths([1] * 12, [0.0] * 11 + [0.9], base_tokens=12, cost=cost, requests_waiting=True) == [0] * 11 + [1]


def test_drafts_that_fill_a_round_already_paid_for_are_taken_together():
    cost = cliff_at_nine_tokens()
    # Eight drafts at 0.9 take the round to 16 tokens: 15.2 tokens in 130 ms beats 8 in 72 ms,
    # though any one of them alone (9 tokens, 85 ms) would not pay.
    assert choose_draft_lengths([1] * 8, [0.9] * 8, base_tokens=8, cost=cost, requests_waiting=True) == [1] * 8
    assert choose_draft_lengths([1] * 8, [0.6] * 8, base_tokens=8, cost=cost, requests_waiting=True) == [0] * 8  # 12.8 in 130 ms


def test_past_a_single_timed_round_the_estimate_grows_from_it_not_from_the_line():
    cost = RoundCostModel()  # the default line: 20 ms + 3 ms a token
    for _ in range(3):
        cost.observe(8, 0.072)
    assert abs(cost.seconds(9) - 0.075) < 1e-9  # the line alone says 47 ms


def test_a_stale_measurement_is_dropped_and_the_count_measured_again():
    cost = RoundCostModel(max_age_rounds=10)
    cost.observe(9, 0.5)  # timed while something else held the cores
    assert cost.seconds(9) == 0.5
    for _ in range(11):
        cost.observe(8, 0.072)
    assert cost.seconds(9) < 0.1


def test_a_count_timed_in_a_slow_stretch_is_estimated_at_the_machines_speed_once_it_recovers():
    # A copying row (drafts nearly always accepted) on a machine that ran at half speed for a
    # while: 1-, 3- and 5-token rounds at 10, 13 and 16.5 ms, then all at twice that, then the
    # machine is back and only 3-token rounds are timed (what the row ran in the slow stretch's
    # last rounds).
    cost = RoundCostModel()
    for _ in range(7):
        for tokens, seconds in [(1, 0.010), (3, 0.013), (5, 0.0165)]:
            cost.observe(tokens, seconds)
    assert choose_draft_lengths([4], [0.95], base_tokens=1, cost=cost, requests_waiting=True) == [4]
    for _ in range(7):
        for tokens, seconds in [(1, 0.020), (3, 0.026), (5, 0.033)]:
            cost.observe(tokens, seconds)
    assert cost.seconds(5) == pytest.approx(0.033)
    for _ in range(10):
        cost.observe(3, 0.013)
    # Each count at today's speed, though 1- and 5-token rounds were last timed at half of it.
    assert cost.seconds(5) == pytest.approx(0.0165)
    assert cost.seconds(1) == pytest.approx(0.010)
    assert choose_draft_lengths([4], [0.95], base_tokens=1, cost=cost, requests_waiting=True) == [4]


def test_a_count_timed_once_as_the_machine_slowed_is_tried_again_soon():
    cost = RoundCostModel(single_age_rounds=50)
    for _ in range(7):
        cost.observe(1, 0.010)
    # The machine slows: the first drafted round is timed at 24 ms before the pace has seen it.
    cost.observe(2, 0.024)
    for _ in range(3):
        cost.observe(1, 0.020)
    for _ in range(10):
        cost.observe(1, 0.010)
    assert choose_draft_lengths([4], [0.9], base_tokens=1, cost=cost, requests_waiting=True) == [0]
    for _ in range(40):
        cost.observe(1, 0.010)
    # Dropped, so the count is estimated from the others again and tried.
    assert not cost.is_measured(2)
    assert choose_draft_lengths([4], [0.9], base_tokens=1, cost=cost, requests_waiting=True) == [4]


def test_a_round_timed_at_zero_seconds_leaves_the_pace_as_it_was():
    cost = RoundCostModel()
    cost.observe(2, 0.0)  # a clock too coarse for the round
    cost.observe(2, 0.010)
    cost.observe(3, 0.012)
    cost.observe(3, 0.012)
    assert cost.seconds(3) == pytest.approx(0.012)


def test_the_plain_round_is_timed_before_any_draft():
    cost = RoundCostModel()
    assert choose_draft_lengths([4], [1.0], base_tokens=1, cost=cost, requests_waiting=True) == [0]
    cost.observe(1, 0.046)
    assert choose_draft_lengths([4], [1.0], base_tokens=1, cost=cost, requests_waiting=True) == [4]


def test_an_untimed_round_is_tried_only_when_its_estimate_is_clearly_better():
    cost = timed_on_a_line(0.064, 0.001, [8])  # 72 ms for 8 rows; 10 tokens estimated at 74 ms
    # 8.9 tokens in 74 ms is 8% better than 8 in 72: past DRAFT_MARGIN, short of it times
    # EXPLORATION_MARGIN, so not worth an untimed round.
    assert choose_draft_lengths([1] * 8, [0.45, 0.45] + [0.0] * 6, base_tokens=8, cost=cost, requests_waiting=True) == [0] * 8
    # 9.9 tokens is 20% better: tried.
    assert choose_draft_lengths([1] * 8, [0.95, 0.95] + [0.0] * 6, base_tokens=8, cost=cost, requests_waiting=True) == [1, 1] + [0] * 6


def test_untimed_rounds_stop_being_tried_once_their_surprises_pass_the_budget():
    # 32 decode rows measured at 113 ms and 256-token prefill chunks at 490: the rounds between
    # are interpolated at 1.7 ms a token, but past 32 rows this CPU's GEMM jumps (41 tokens: 205).
    cost = RoundCostModel()
    cost.observe(256, 0.490)
    cost.observe(32, 0.113)
    rows, rates = [5] * 32, [0.9] * 32
    tried: list[float] = []
    for _ in range(20):
        lengths = choose_draft_lengths(rows, rates, base_tokens=32, cost=cost, requests_waiting=True)
        tokens = 32 + sum(lengths)
        if cost.is_measured(tokens):
            break
        tried.append(0.113 + 0.010 * (tokens - 32))  # 10 ms a token, not 1.7
        cost.observe(tokens, tried[-1])
    # A try lost more than the 0.1 s allowance against its estimate: no more tries.
    assert 1 <= len(tried) <= 4
    assert not cost.may_try()
    assert choose_draft_lengths(rows, [0.3] * 32, base_tokens=32, cost=cost, requests_waiting=True) == [0] * 32
    # Time spent in ordinary rounds earns the budget back, at 1% of it.
    plain_rounds = 0
    while not cost.may_try():
        cost.observe(32, 0.113)
        plain_rounds += 1
    assert 0 < plain_rounds <= (sum(tried) - 0.1) / (0.01 * 0.113) + 1


def test_a_round_that_matches_its_estimate_costs_no_budget():
    cost = timed_on_a_line(0.017, 0.0027, [1])
    for tokens in range(2, 40):
        assert cost.may_try()
        cost.trying(tokens, 0.017 + 0.0027 * tokens)
        cost.observe(tokens, 0.017 + 0.0027 * tokens)
    assert cost.may_try()


def flat_rounds() -> RoundCostModel:
    """Rounds of 8 to 24 tokens timed at 40 ms + 2 ms a token past 8: drafts are cheap."""
    return timed_on_a_line(0.024, 0.002, range(8, 25))


def test_drafts_that_speed_up_a_few_rows_are_taken_only_while_requests_wait():
    # Two rows accept 0.9 of their drafts, six have none. All eight drafts: 14.2 tokens in 56 ms
    # against 8 in 40, better throughput (253 against 200 tok/s). But the six rows' own rounds
    # get 40% slower for the two rows' 4.1x: their summed time per token gets worse (rows x
    # harmonic mean of expected tokens: 9.9 in 56 ms, 176 tok/s), and with no request waiting
    # for a row that is what counts.
    rows, rates = [4, 4] + [0] * 6, [0.9, 0.9] + [0.0] * 6
    assert choose_draft_lengths(rows, rates, base_tokens=8, cost=flat_rounds(), requests_waiting=True) == rows
    assert choose_draft_lengths(rows, rates, base_tokens=8, cost=flat_rounds(), requests_waiting=False) == [0] * 8


def test_drafts_that_speed_up_every_row_alike_are_taken_whether_or_not_requests_wait():
    rows, rates = [2] * 8, [0.9] * 8
    for waiting in (True, False):
        assert choose_draft_lengths(rows, rates, base_tokens=8, cost=flat_rounds(), requests_waiting=waiting) == rows


def test_a_lone_row_drafts_the_same_whether_or_not_requests_wait():
    for rate in (0.05, 0.3, 0.5, 0.8, 1.0):
        cost = timed_on_a_line(0.017, 0.0027, range(1, 7))
        waiting = choose_draft_lengths([5], [rate], base_tokens=1, cost=cost, requests_waiting=True)
        assert choose_draft_lengths([5], [rate], base_tokens=1, cost=cost, requests_waiting=False) == waiting


def test_a_round_without_decode_rows_drafts_nothing():
    cost = timed_on_a_line(0.017, 0.0027, range(1, 7))
    for waiting in (True, False):
        assert choose_draft_lengths([], [], base_tokens=5, cost=cost, requests_waiting=waiting) == []


def test_a_lone_slow_round_does_not_change_a_counts_time_and_a_run_of_them_does():
    cost = RoundCostModel()
    for seconds in [0.0090, 0.0095, 0.0093, 0.031]:  # the last one: a collection, a neighbour's burst
        cost.observe(2, seconds)
    assert 0.0093 <= cost.seconds(2) <= 0.0095
    for _ in range(4):
        cost.observe(2, 0.031)  # the machine really is slower now: most of the window says so
    assert cost.seconds(2) == 0.031


def test_a_row_that_stopped_drafting_after_rejections_drafts_again_once_its_estimate_recovers():
    cost = RoundCostModel()
    for _ in range(3):
        cost.observe(1, 0.0090)
        cost.observe(2, 0.0095)
    estimate = AcceptanceEstimate()
    for _ in range(6):
        estimate.observe(proposed=1, accepted=0)
    assert choose_draft_lengths([1], [estimate.rate], base_tokens=1, cost=cost, requests_waiting=False) == [0]
    rounds = 0
    while choose_draft_lengths([1], [estimate.rate], base_tokens=1, cost=cost, requests_waiting=False) == [0]:
        estimate.unobserved()  # a round without verified drafts
        rounds += 1
        assert rounds < 50
    assert rounds > 1 and estimate.rate < estimate.prior
    for _ in range(300):
        estimate.unobserved()
    assert estimate.prior - 1e-3 < estimate.rate <= estimate.prior  # toward the prior, never past it
    high = AcceptanceEstimate(rate=0.9)
    high.unobserved()
    assert high.rate == 0.9  # a row accepted well keeps its estimate between verified rounds


def test_the_head_drafts_the_steps_whose_expected_saving_covers_a_step_by_the_margin():
    # a = 0.5 and a token worth 10 ms: the j-th draft saves 5, 2.5, 1.25, 0.625 ms on average,
    # against twice the step's 1 ms.
    assert HEAD_STEP_MARGIN == 2.0
    assert worthwhile_head_steps(4, acceptance=0.5, token_seconds=0.010, step_seconds=0.001) == 2
    assert worthwhile_head_steps(4, acceptance=0.5, token_seconds=0.010, step_seconds=0.0006) == 3
    assert worthwhile_head_steps(1, acceptance=0.5, token_seconds=0.010, step_seconds=0.001) == 1  # never past the cap
    assert worthwhile_head_steps(4, acceptance=0.5, token_seconds=0.010, step_seconds=0.003) == 0
    # At 32 rows a token is worth a thirty-second of the round: a third-accepted head does not pay.
    assert worthwhile_head_steps(4, acceptance=0.35, token_seconds=0.113 / 32, step_seconds=0.0015) == 0
    # Until the head has been timed, it drafts what it is asked to.
    assert worthwhile_head_steps(4, acceptance=0.1, token_seconds=0.010, step_seconds=None) == 4


def test_the_head_cost_is_the_median_seconds_per_row_step_of_recent_passes():
    cost = HeadCostModel()
    assert cost.seconds_per_step() is None
    cost.observe(0, 0.5)  # a round without a head pass says nothing
    assert cost.seconds_per_step() is None
    for row_steps, seconds in [(4, 0.004), (1, 0.0012), (8, 0.0080), (2, 0.050)]:  # the last: a stall
        cost.observe(row_steps, seconds)
    assert cost.seconds_per_step() == pytest.approx(0.0011)  # the median of 1.0, 1.2, 1.0 and 25 ms
