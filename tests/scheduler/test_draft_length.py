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
