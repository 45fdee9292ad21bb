"""A round of greedy rows takes sample_round's short paths, with the general path's results: plain,
with penalties, with a logit bias and, in the C kernel, with drafts to verify."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flare.sampler.round as round_module
from flare.sampler import native_sampler as native
from flare.sampler.round import SampledRound, sample_round
from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams

from .helpers import make_batch

VOCAB = 1000


def _greedy_logits(rows: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    if rows > 1:
        logits[1, 10] = logits[1, 500] = logits[1].max() + 1  # a tie: the lower index wins
    if rows > 2:
        logits[2, 7] = float("nan")
    if rows > 3:
        logits[3] = float("-inf")  # no finite logit at all
    if rows > 4:
        logits[4, 3] = float("inf")
    return logits


def _round(logits: torch.Tensor, batch, width: int, mask: torch.Tensor | None = None) -> SampledRound:
    rows = logits.shape[0]
    return sample_round(
        logits,
        num_drafts=torch.zeros(rows, dtype=torch.int64),
        draft_tokens=torch.full((rows, width), -1, dtype=torch.int64),
        draft_probs=None,
        batch=batch,
        token_mask=mask,
    )


GREEDY = SamplingParams(temperature=0.0)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4)
BIASED = SamplingParams(temperature=0.0, logit_bias=((5, 2.0), (11, -100.0)))


def _history(rows: int, logits: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and outputs that hold each row's top tokens, repeated, so penalties move the argmax."""
    top = logits.nan_to_num(0.0, 0.0, 0.0).topk(4, dim=1).indices.tolist()
    prompts = [[top[r][0], 1, 2, top[r][2]] for r in range(rows)]
    outputs = [[top[r][1], top[r][1], 3, top[r][3]] for r in range(rows)]
    return prompts, outputs


needs_kernels = pytest.mark.skipif(not native.available(), reason="the sampler's C kernels were not built")
SHORT_PATHS = [pytest.param(True, id="kernel", marks=needs_kernels), pytest.param(False, id="twin")]
ALL_ALLOWED = -1  # a grammar mask word that allows its 32 tokens: changes nothing, takes the general path


def _assert_same_results(result: SampledRound, expected: SampledRound) -> None:
    assert result.status.tolist() == expected.status.tolist()
    assert result.tokens.tolist() == expected.tokens.tolist()
    assert result.num_emitted.tolist() == expected.num_emitted.tolist()


def _count_short_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which short path each sample_round call took: "kernel" or "twin"."""
    calls: list[str] = []
    greedy_round, greedy_tokens = round_module.greedy_round, native.greedy_tokens
    monkeypatch.setattr(round_module, "greedy_round", lambda *a: calls.append("twin") or greedy_round(*a))
    monkeypatch.setattr(native, "greedy_tokens", lambda *a: calls.append("kernel") or greedy_tokens(*a))
    return calls


@pytest.mark.parametrize("rows", [1, 2, 5, 7])
@pytest.mark.parametrize("width", [0, 1, 4])
@pytest.mark.parametrize("invalid_row", [None, 0])
@pytest.mark.parametrize("params", [GREEDY, PENALISED, BIASED], ids=["plain", "penalised", "biased"])
@pytest.mark.parametrize("kernel", SHORT_PATHS)
def test_greedy_rows_take_the_short_path_and_get_the_general_paths_tokens_and_statuses(
    rows: int, width: int, invalid_row: int | None, params: SamplingParams, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "available", lambda: kernel)
    logits = _greedy_logits(rows, seed=rows + width)
    prompts, outputs = _history(rows, logits)
    # Row 0 keeps the plain parameters, so the round mixes them with the others.
    batch = make_batch([GREEDY] + [params] * (rows - 1), prompt_ids=prompts, output_ids=outputs)
    if invalid_row is not None:  # as the INVALID_SAMPLING_PARAMETERS fault does: facts unchanged
        temperature = batch.temperature.clone()
        temperature[invalid_row] = -1.0
        batch = dataclasses.replace(batch, temperature=temperature)
    short_calls = _count_short_paths(monkeypatch)

    short = _round(logits, batch, width)
    # A grammar mask that allows every token changes nothing but takes the general path.
    general = _round(logits, batch, width, mask=torch.full((rows, -(-VOCAB // 32)), -1, dtype=torch.int32))

    assert short_calls == ["kernel" if kernel else "twin"]
    _assert_same_results(short, general)
    assert short.tokens.shape == (rows, width + 1) and short.tokens.dtype == general.tokens.dtype
    assert short.status.dtype == general.status.dtype == torch.int32
    statuses = short.status.tolist()
    if invalid_row is not None:
        assert statuses[invalid_row] == DeviceStatus.INVALID_SAMPLING_PARAMETERS
    if rows > 1 and params is GREEDY:
        assert short.tokens[1, 0] == 10
    for bad in (2, 3, 4):
        if rows > bad:
            assert statuses[bad] == DeviceStatus.NONFINITE_LOGITS and short.tokens[bad].tolist() == [-1] * (width + 1)
    if rows == 1 and invalid_row is None:
        assert short.tokens[0, 0] == logits[0].argmax() and short.num_emitted.tolist() == [1]


@pytest.mark.parametrize(
    "change",
    [
        {"params": SamplingParams(temperature=0.7)},
        {"num_logprobs": 2},
        {"drafts": 1, "draft_probs": True},
        {"drafts": 1, "kernel": False},
    ],
    ids=["sampled", "logprobs", "learned-drafts", "drafts-without-the-kernel"],
)
def test_sampling_log_probabilities_or_draft_probabilities_keep_the_general_path(
    change: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = change.get("kernel", native.available())
    monkeypatch.setattr(native, "available", lambda: built)
    calls = _count_short_paths(monkeypatch)
    params = change.get("params", SamplingParams(temperature=0.0))
    drafts = change.get("drafts", 0)
    batch = make_batch([params], prompt_ids=[[1, 2]], output_ids=[[3]])
    logits = torch.randn(1 + drafts, VOCAB, generator=torch.Generator().manual_seed(3))
    result = sample_round(
        logits,
        num_drafts=torch.tensor([drafts]),
        draft_tokens=torch.full((1, max(drafts, 1)), 4, dtype=torch.int64),
        draft_probs=torch.full((1, max(drafts, 1), VOCAB), 1.0 / VOCAB) if change.get("draft_probs") else None,
        batch=batch,
        num_logprobs=change.get("num_logprobs"),
    )
    assert calls == []
    assert result.status.tolist() == [DeviceStatus.OK]


@pytest.mark.parametrize("kernel", SHORT_PATHS)
def test_penalties_move_the_short_paths_choice_off_a_repeated_token(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "available", lambda: kernel)
    logits = torch.zeros(1, VOCAB)
    logits[0, 40], logits[0, 41] = 3.0, 2.9  # 40 leads by 0.1 until the penalties apply
    batch = make_batch([PENALISED], prompt_ids=[[7]], output_ids=[[40, 40]])
    result = _round(logits, batch, width=0)
    # 3.0 / 1.3 - 2 * 0.5 - 0.4 = 0.91 < 2.9
    assert result.tokens.tolist() == [[41]] and result.status.tolist() == [DeviceStatus.OK]
    # Once in the output, and presence alone decides: 3.0 - 0.4 = 2.6 < 2.9; as a bonus, 3.4 > 3.3.
    presence = SamplingParams(temperature=0.0, presence_penalty=0.4)
    result = _round(logits, make_batch([presence], prompt_ids=[[]], output_ids=[[40]]), width=0)
    assert result.tokens.tolist() == [[41]]
    logits[0, 41] = 3.3
    bonus = SamplingParams(temperature=0.0, presence_penalty=-0.4)
    result = _round(logits, make_batch([bonus], prompt_ids=[[]], output_ids=[[40]]), width=0)
    assert result.tokens.tolist() == [[40]]


@pytest.mark.parametrize("kernel", SHORT_PATHS)
def test_a_penalty_that_overflows_every_logit_is_an_empty_distribution_on_the_short_path(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid but extreme repetition penalty (a denormal divisor) turns a seen positive logit
    into +inf: the general path reports EMPTY_DISTRIBUTION (no finite maximum), and so must the
    short one."""
    monkeypatch.setattr(native, "available", lambda: kernel)
    logits = torch.full((2, VOCAB), -1.0)
    logits[:, 9] = 1.0
    params = SamplingParams(temperature=0.0, repetition_penalty=1e-40)
    batch = make_batch([params, params], prompt_ids=[[9], [8]], output_ids=[[], []])
    short = _round(logits, batch, width=0)
    general = _round(logits, batch, width=0, mask=torch.full((2, -(-VOCAB // 32)), -1, dtype=torch.int32))
    assert short.status.tolist() == general.status.tolist() == [DeviceStatus.EMPTY_DISTRIBUTION, DeviceStatus.OK]
    assert short.tokens.tolist() == general.tokens.tolist() == [[-1], [9]]


values = st.one_of(
    st.floats(-30, 30, width=32),
    st.sampled_from([0.5, 1.0, 1.5, 2.0, -1.0]),  # ties and near-ties that the penalties break
    st.sampled_from([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]),
)


@needs_kernels
@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    vocab=st.one_of(st.integers(1, 8), st.integers(9, 70)),
    repetition=st.sampled_from([1.0, 1.1, 1.5, 0.5, 1e-40, 0.0, float("inf")]),
    frequency=st.sampled_from([0.0, 0.3, -2.0, 1e38, float("nan")]),
    presence=st.sampled_from([0.0, 0.7, -1.5]),
    temperature=st.sampled_from([0.0, 0.0, -1.0]),
)
def test_the_kernel_gives_the_twins_tokens_and_statuses_on_any_logits_and_history(
    data: st.DataObject, rows: int, vocab: int, repetition: float, frequency: float, presence: float, temperature: float
) -> None:
    """Ties, zeros of both signs, overflowing penalties, NaN and infinite logits, ids outside the
    vocabulary, duplicated bias entries and invalid parameters: the C kernel and its torch twin
    agree on every row."""
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows)))
    ids = st.lists(st.integers(-2, vocab + 1), max_size=12)
    bias = st.lists(st.tuples(st.integers(0, vocab - 1), st.sampled_from([1.0, -100.0, 0.25, 3e38])), max_size=4)
    params = [
        SamplingParams(
            temperature=temperature if r == 0 else 0.0,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
            logit_bias=tuple(data.draw(bias)),
        )
        for r in range(rows)
    ]
    batch = make_batch(params, prompt_ids=[data.draw(ids) for _ in range(rows)], output_ids=[data.draw(ids) for _ in range(rows)])
    with mock.patch.object(native, "available", lambda: False):
        twin = _round(logits, batch, 2)
    kernel = _round(logits, batch, 2)
    _assert_same_results(kernel, twin)


@needs_kernels
def test_the_kernel_refuses_tensors_it_cannot_read() -> None:
    batch = make_batch([GREEDY])
    no_drafts = (torch.zeros(1, dtype=torch.int64), torch.full((1, 0), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits must be a contiguous CPU torch.float32"):
        native.greedy_tokens(torch.zeros(1, 8, dtype=torch.float64), *no_drafts, batch)
    with pytest.raises(ValueError, match="temperature must be a contiguous CPU"):
        native.greedy_tokens(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), torch.full((2, 0), -1), batch)
    with pytest.raises(ValueError, match="do not add up to the logits' rows"):
        native.greedy_tokens(torch.zeros(3, 8), torch.tensor([1]), torch.tensor([[4]]), batch)

def _verify_round(logits: torch.Tensor, num_drafts: list[int], drafts: torch.Tensor, batch, mask: bool) -> SampledRound:
    return sample_round(
        logits,
        num_drafts=torch.tensor(num_drafts),
        draft_tokens=drafts,
        draft_probs=None,
        batch=batch,
        token_mask=torch.full((logits.shape[0], -(-logits.shape[1] // 32)), ALL_ALLOWED, dtype=torch.int32) if mask else None,
    )


@needs_kernels
def test_the_kernel_accepts_greedy_drafts_up_to_the_first_that_is_not_the_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_short_paths(monkeypatch)
    logits = torch.zeros(4, VOCAB)
    for position, top in enumerate([7, 8, 5, 9]):
        logits[position, top] = 1.0
    drafts = torch.tensor([[7, 8, 9]])  # the third draft (9) is not the argmax (5) at its position
    batch = make_batch([GREEDY], prompt_ids=[[1]], output_ids=[[2]])
    result = _verify_round(logits, [3], drafts, batch, mask=False)
    assert calls == ["kernel"]
    assert result.tokens.tolist() == [[7, 8, 5, -1]]
    assert result.num_emitted.tolist() == [3] and result.status.tolist() == [DeviceStatus.OK]
    general = _verify_round(logits, [3], drafts, batch, mask=True)
    assert general.tokens.tolist() == result.tokens.tolist()


@needs_kernels
def test_a_draft_counts_as_output_for_the_penalties_at_the_positions_after_it() -> None:
    """Token 7 leads at both positions. Once the draft 7 is accepted it is output at the next
    position, where a frequency penalty of 0.5 takes it below token 8 (1.0 - 0.5 < 0.8): the
    kernel emits 7 then 8, as the general path does."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 7], logits[:, 8] = 1.0, 0.8
    batch = make_batch([SamplingParams(temperature=0.0, frequency_penalty=0.5)], prompt_ids=[[1]], output_ids=[[2]])
    drafts = torch.tensor([[7]])
    assert _verify_round(logits, [1], drafts, batch, mask=False).tokens.tolist() == [[7, 8]]
    assert _verify_round(logits, [1], drafts, batch, mask=True).tokens.tolist() == [[7, 8]]


@needs_kernels
@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 5),
    vocab=st.one_of(st.integers(1, 8), st.integers(9, 70)),
    max_drafts=st.integers(0, 4),
    repetition=st.sampled_from([1.0, 1.3, 1e-40]),
    frequency=st.sampled_from([0.0, 0.4, -2.0]),
    presence=st.sampled_from([0.0, 0.7]),
    temperature=st.sampled_from([0.0, 0.0, -1.0]),
)
def test_the_kernel_verifies_drafts_as_the_general_path_does(
    data: st.DataObject, rows: int, vocab: int, max_drafts: int, repetition: float, frequency: float,
    presence: float, temperature: float,
) -> None:
    """Drafts that match the argmax or not, drafts outside the vocabulary, penalties that count
    the drafts before each position, NaN and infinite logits at later positions, and invalid
    parameters: tokens, emitted counts and statuses equal the general path's."""
    num_drafts = data.draw(st.lists(st.integers(0, max_drafts), min_size=rows, max_size=rows))
    positions = sum(num_drafts) + rows
    logits = torch.tensor(
        data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=positions, max_size=positions))
    )
    # Drafts mostly from the positions' argmaxes, so that some are accepted, some rejected.
    top = logits.nan_to_num(0.0, 1e30, -1e30).argmax(1).tolist()
    drafts = torch.full((rows, max(max_drafts, 1) if max_drafts else 0), -1, dtype=torch.int64)
    start = 0
    for r, k in enumerate(num_drafts):
        for j in range(k):
            drafts[r, j] = data.draw(st.one_of(st.just(top[start + j]), st.integers(-1, vocab)))
        start += k + 1
    ids = st.lists(st.integers(-1, vocab), max_size=6)
    params = [
        SamplingParams(
            temperature=temperature if r == 0 else 0.0,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
            logit_bias=tuple(data.draw(st.lists(st.tuples(st.integers(0, vocab - 1), st.sampled_from([1.0, -3.0])), max_size=2))),
        )
        for r in range(rows)
    ]
    batch = make_batch(params, prompt_ids=[data.draw(ids) for _ in range(rows)], output_ids=[data.draw(ids) for _ in range(rows)])
    kernel = _verify_round(logits, num_drafts, drafts, batch, mask=False)
    general = _verify_round(logits, num_drafts, drafts, batch, mask=True)
    _assert_same_results(kernel, general)
