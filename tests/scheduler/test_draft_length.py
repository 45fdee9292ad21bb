from flare.scheduler.draft_length import AcceptanceEstimate, RoundCostModel, choose_draft_lengths


def test_cost_model_recovers_a_linear_round_time():
    cost = RoundCostModel()
    for tokens in [1, 8, 32, 4, 16, 64, 2]:
        cost.observe(tokens, 0.017 + 0.0027 * tokens)
    assert abs(cost.c0 - 0.017) < 1e-6 and abs(cost.c1 - 0.0027) < 1e-7


def test_single_row_drafts_even_at_modest_acceptance_when_weight_reads_dominate():
    cost = RoundCostModel(c0=0.017, c1=0.0027)
    assert choose_draft_lengths([5], [0.8], base_tokens=1, cost=cost) == [5]
    # At 0.5 the third draft adds 1/8 token for c1 seconds: below the round's average rate.
    assert choose_draft_lengths([5], [0.5], base_tokens=1, cost=cost) == [2]


def test_a_busy_batch_drafts_only_rows_that_are_nearly_always_accepted():
    cost = RoundCostModel(c0=0.017, c1=0.0027)
    lengths = choose_draft_lengths([5] * 32, [0.3] * 31 + [0.99], base_tokens=32, cost=cost)
    assert lengths[:31] == [0] * 31 and lengths[31] == 5


def test_rows_without_proposals_or_acceptance_never_draft():
    cost = RoundCostModel(c0=0.017, c1=0.0027)
    assert choose_draft_lengths([0, 4], [0.9, 0.0], base_tokens=2, cost=cost) == [0, 0]


def test_acceptance_counts_only_the_drafts_that_were_tested():
    estimate = AcceptanceEstimate(rate=0.5, weight=1.0)
    estimate.observe(proposed=5, accepted=2)  # 2 accepted, the third rejected, two untested
    assert abs(estimate.rate - 2 / 3) < 1e-9
    estimate.observe(proposed=3, accepted=3)
    assert estimate.rate == 1.0


def test_one_token_rounds_are_timed_apart_from_the_line_of_larger_rounds():
    cost = RoundCostModel()
    for tokens, seconds in [(1, 0.046), (2, 0.075), (5, 0.078), (9, 0.086), (1, 0.046), (5, 0.078)]:
        cost.observe(tokens, seconds)
    assert abs(cost.seconds(1) - 0.046) < 1e-9
    assert cost.seconds(2) > 0.07  # the line of GEMM rounds, not through the one-token point


def test_a_lone_row_drafts_only_when_acceptance_covers_the_step_to_a_matrix_product():
    # 46 ms for one token, 75 ms + 1 ms a token beyond: the first draft costs 29 ms.
    cost = RoundCostModel(c0=0.073, c1=0.001, single_token_s=0.046)
    assert choose_draft_lengths([4], [0.3], base_tokens=1, cost=cost) == [0]  # 1.43 tokens in 78 ms
    assert choose_draft_lengths([4], [0.9], base_tokens=1, cost=cost) == [4]  # 4.1 tokens in 78 ms

