"""The default model (9 heads, 3 KV heads, Q4_1/Q8_0 blocks) at tensor-parallel 3, three
processes oversubscribed on this 2-core machine: correct, not fast."""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from tests.parallel.rank_programs import (
    TP_BLOCK_SIZE,
    load_package_rank,
    serve_tensor_parallel_rounds,
    tensor_parallel_round,
)

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import load_model
from flare.engine.tokenizer import Tokenizer
from flare.sampler.batch import SamplingBatch
from flare.parallel.launch import RankGroup, WorkerSpec
from flare.parallel.layout import ParallelLayout
from flare.parallel.round_command import RoundCommand, RoundSampling, send_command
from flare.package.directory import open_package
from flare.policy.params import SamplingParams

pytestmark = pytest.mark.real_model

STEPS = 8


def _greedy() -> RoundSampling:
    batch = SamplingBatch.from_rows([SamplingParams(temperature=0.0)], [0], [0], [[]], [[]], "cpu")
    return RoundSampling(torch.zeros(1, dtype=torch.int64), torch.full((1, 0), -1), batch)


def test_the_default_model_at_tp3_answers_the_capital_question_as_tp1_does(default_package: Path) -> None:
    package = open_package(default_package)
    tokenizer = Tokenizer.from_package(package)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    table = tuple(range(-(-(len(prompt) + STEPS) // TP_BLOCK_SIZE)))

    whole = load_model(package)
    config = package.manifest.model
    whole_cache = KVCache(
        num_layers=config.num_layers, num_blocks=64, block_size=TP_BLOCK_SIZE,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
    )
    expected = []
    row = ForwardRow(tuple(prompt), 0, table, 1)
    for step in range(STEPS):
        logits = whole.forward(ForwardBatch.build([row], TP_BLOCK_SIZE), whole_cache)
        expected.append(int(logits[0].argmax()))
        row = ForwardRow((expected[-1],), len(prompt) + step, table, 1)
    del whole, whole_cache

    group = RankGroup(
        ParallelLayout(tensor_parallel=3),
        WorkerSpec(functools.partial(load_package_rank, str(default_package)), serve_tensor_parallel_rounds),
        torch.device("cpu"),
        timedelta(seconds=300),
        timedelta(seconds=120),
    )
    try:
        model, cache = load_package_rank(str(default_package), 0, 3)
        groups = group.connect()
        assert groups is not None
        generated = []
        row = ForwardRow(tuple(prompt), 0, table, 1)
        for step in range(STEPS):
            command = RoundCommand(step, (row,), (), _greedy())
            send_command(command, groups.control)
            _, result = tensor_parallel_round(groups, model, cache, command)
            generated.append(int(result.tokens[0, 0]))
            row = ForwardRow((generated[-1],), len(prompt) + step, table, 1)
        send_command(None, groups.control)
    finally:
        group.stop()
    assert generated == expected
    assert "Paris" in tokenizer.decode(generated)
