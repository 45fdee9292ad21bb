import pytest

from flare.parallel.threads import RankThreads, parse_cpu_list, split_cpus


def test_cpus_are_cut_into_equal_contiguous_runs_one_per_rank() -> None:
    assert split_cpus(range(2), (0, 1, 2, 3, 4)) == [RankThreads(0, (0, 1, 2)), RankThreads(1, (3, 4))]


def test_more_ranks_than_cpus_share_cpus_round_robin() -> None:
    assert split_cpus(range(3), (0, 1)) == [RankThreads(0, (0,)), RankThreads(1, (1,)), RankThreads(2, (0,))]


def test_a_binding_gives_each_rank_its_list_like_vllm_threads_bind() -> None:
    plan = split_cpus(range(2, 4), (0, 1), "0-3,8|4-7")
    assert plan == [RankThreads(2, (0, 1, 2, 3, 8)), RankThreads(3, (4, 5, 6, 7))]
    assert plan[0].num_threads == 5


def test_a_binding_with_the_wrong_number_of_lists_is_refused_naming_both_counts() -> None:
    with pytest.raises(ValueError, match="gives 1 CPU lists for 2 ranks"):
        split_cpus(range(2), (0, 1), "0-3")


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-2"])
def test_a_malformed_cpu_list_is_refused_naming_the_part(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)
