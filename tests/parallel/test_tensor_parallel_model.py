"""The tiny Llama at tensor-parallel 2 (two gloo processes) against the same model at 1."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from tests.parallel.rank_programs import (
    TP_BLOCK_SIZE,
    load_tiny_tensor_parallel,
    serve_tensor_parallel_rounds,
    tensor_parallel_round,
    tiny_tensor_parallel,
)

from tests.engine.tiny_llama import random_state_dict, tiny_config

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel
from flare.sampler.batch import SamplingBatch
from flare.parallel.launch import RankGroup, WorkerSpec
from flare.parallel.layout import ParallelLayout
from flare.parallel.round_command import RoundCommand, RoundSampling, send_command
from flare.policy.params import SamplingParams


@pytest.fixture(scope="module")
def tensor_parallel() -> Iterator[tuple]:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_tiny_tensor_parallel, serve_tensor_parallel_rounds),
        torch.device("cpu"),
        timedelta(seconds=120),
        timedelta(seconds=60),
    )
    model, cache = tiny_tensor_parallel(0, 2)  # rank 0 loads while the worker does
    groups = group.connect()
    assert groups is not None
    yield groups, model, cache
    send_command(None, groups.control)
    group.stop()


def _greedy(rows: int) -> RoundSampling:
    batch = SamplingBatch.from_rows([SamplingParams(temperature=0.0)] * rows, [0] * rows, [0] * rows, [[]] * rows, [[]] * rows, "cpu")
    return RoundSampling(torch.zeros(rows, dtype=torch.int64), torch.full((rows, 0), -1), batch)


def test_tp2_logits_greedy_tokens_and_kv_heads_equal_tp1(tensor_parallel) -> None:
    groups, model, cache = tensor_parallel
    config = tiny_config()
    whole = DecoderModel(config, random_state_dict(config))
    whole_cache = KVCache(
        num_layers=config.num_layers, num_blocks=32, block_size=TP_BLOCK_SIZE,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
    )
    prompts = [[5, 17, 33, 2, 90, 41, 7], [60, 3, 3, 8]]
    tables = [tuple(range(8)), tuple(range(8, 16))]
    rows = [ForwardRow(tuple(p), 0, tables[i], 1) for i, p in enumerate(prompts)]
    generated: list[list[int]] = [[], []]
    expected: list[list[int]] = [[], []]
    positions = [len(p) for p in prompts]
    for step in range(8):
        command = RoundCommand(index=step, rows=tuple(rows), copies=(), sampling=_greedy(len(rows)))
        send_command(command, groups.control)
        full, result = tensor_parallel_round(groups, model, cache, command)
        reference = whole.forward(ForwardBatch.build(rows, TP_BLOCK_SIZE), whole_cache)
        torch.testing.assert_close(full, reference, rtol=1e-4, atol=1e-4)
        assert result is not None and (result.status == 0).all()
        tokens = result.tokens[:, 0].tolist()
        for r in range(2):
            generated[r].append(tokens[r])
            expected[r].append(int(reference[r].argmax()))
        rows = [ForwardRow((tokens[r],), positions[r], tables[r], 1) for r in range(2)]
        positions = [p + 1 for p in positions]
    assert generated == expected
    # Rank 0's pool holds the first half of the KV heads, under the same block ids.
    kv_heads = cache.keys[0].shape[0]
    assert kv_heads == config.num_kv_heads // 2
    for layer in range(config.num_layers):
        torch.testing.assert_close(cache.keys[layer], whole_cache.keys[layer][:kv_heads], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.values[layer], whole_cache.values[layer][:kv_heads], rtol=1e-4, atol=1e-5)
