"""Worker programs the parallel tests start in spawned ranks (module level: they are pickled)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flare.parallel.group import ProcessGroups


def load_rank(rank: int, world_size: int) -> dict[str, int]:
    return {"rank": rank}


def load_failing_on_rank_1(rank: int, world_size: int) -> dict[str, int]:
    if rank == 1:
        raise FileNotFoundError("shard file model-rank1.safetensors is missing")
    return {"rank": rank}


def serve_all_reduce_then_wait(groups: ProcessGroups, state: dict[str, int]) -> None:
    """Add rank + 1 across the group (rank 0 does the same), then wait for rank 0's next
    command, as a serving worker does (the wait fails when rank 0's connection closes)."""
    value = torch.tensor([float(groups.rank + 1)])
    dist.all_reduce(value, group=groups.device)
    command = torch.zeros(1)
    while True:
        dist.broadcast(command, src=0, group=groups.control)


def serve_idle(groups: ProcessGroups, state: dict[str, int]) -> None:
    """Join the group and never take part in a collective (a stuck rank)."""
    while True:
        time.sleep(1)


def run_sampling_case(groups: ProcessGroups, index: int):
    """This rank's part of sampling case ``index`` (sampling_cases.py); rank 0 gets the result."""
    from tests.parallel.sampling_cases import sampling_cases

    from flare.parallel.vocab_round import ShardsAcrossRanks
    from flare.parallel.vocab_shard import VocabShard
    from flare.sampler.round import sample_round, score_tokens

    case = sampling_cases()[index]
    shard = VocabShard.of(case.logits.shape[1], groups.device)
    logits = case.logits[:, shard.start : shard.end].contiguous()
    if case.kind == "score":
        return score_tokens(logits, case.draft_tokens[:, 0], case.num_logprobs, ShardsAcrossRanks(shard))
    return sample_round(
        logits,
        case.num_drafts,
        case.draft_tokens,
        case.draft_probs[:, :, shard.start : shard.end].contiguous() if case.draft_probs is not None else None,
        case.batch,
        ShardsAcrossRanks(shard),
        token_mask=case.token_mask,
        num_logprobs=case.num_logprobs,
        raw_logprobs=case.raw_logprobs,
    )


RECEIVE_ROUND_COMMAND = -2


def _echo_round_command(groups: ProcessGroups) -> None:
    """Receive a round command and send rank 0 a digest of its re-encoding."""
    from flare.parallel.round_command import receive_command
    from flare.parallel.wire import gather_to_rank_0

    command = receive_command(groups.control)
    assert command is not None
    buffer = command.encode()
    gather_to_rank_0([torch.tensor([buffer.numel(), int(buffer.to(torch.int64).sum())])], groups.control)


def serve_sampling_cases(groups: ProcessGroups, state: dict[str, int]) -> None:
    """Run the case rank 0 names (a broadcast index; -1 ends), and the fallback's row gather."""
    from tests.parallel.sampling_cases import sampling_cases

    from flare.parallel.vocab_round import gather_rows
    from flare.parallel.vocab_shard import VocabShard

    while True:
        command = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(command, src=0, group=groups.control)
        index, gather = int(command[0]), int(command[1])
        if index == RECEIVE_ROUND_COMMAND:
            _echo_round_command(groups)
            continue
        if index < 0:
            return
        if gather:
            case = sampling_cases()[index]
            shard = VocabShard.of(case.logits.shape[1], groups.device)
            positions = torch.zeros(gather, dtype=torch.int64)
            dist.broadcast(positions, src=0, group=groups.control)
            gather_rows(shard, case.logits[:, shard.start : shard.end], positions)
        else:
            run_sampling_case(groups, index)


TP_BLOCK_SIZE = 4


def tiny_tensor_parallel(rank: int, world_size: int):
    """The tiny Llama's rank model (tests/engine/tiny_llama.py, seed 0) and its KV cache."""
    from tests.engine.tiny_llama import random_state_dict, tiny_config

    from flare.engine.kv_cache import KVCache
    from flare.parallel.group import all_reduce_sum
    from flare.parallel.tensor_split import rank_config, rank_model

    config = tiny_config()
    model = rank_model(config, random_state_dict(config), rank, world_size, all_reduce_sum)
    local = rank_config(config, world_size)
    cache = KVCache(
        num_layers=local.num_layers, num_blocks=32, block_size=TP_BLOCK_SIZE,
        num_kv_heads=local.num_kv_heads, head_dim=local.head_dim,
    )
    return model, cache


def load_tiny_tensor_parallel(rank: int, world_size: int):
    return tiny_tensor_parallel(rank, world_size)


def serve_tensor_parallel_rounds(groups: ProcessGroups, state) -> None:
    """A worker of the round protocol: each command's block copies, forward and sampling share
    (and, for the tests, a gather of its logits); None ends."""
    from flare.parallel.round_command import receive_command

    model, cache = state
    while True:
        command = receive_command(groups.control)
        if command is None:
            return
        tensor_parallel_round(groups, model, cache, command)


def tensor_parallel_round(groups: ProcessGroups, model, cache, command):
    """One round on this rank; rank 0 gets (full logits, sampling result)."""
    from flare.engine.batch import ForwardBatch
    from flare.parallel.vocab_round import ShardsAcrossRanks, gather_rows
    from flare.parallel.vocab_shard import VocabShard
    from flare.sampler.round import sample_round

    if command.copies:
        cache.copy_blocks(command.copies)
    logits = model.forward(ForwardBatch.build(list(command.rows), cache.block_size), cache)
    shard = VocabShard.of(model.config.vocab_size, groups.device)
    full = gather_rows(shard, logits, torch.arange(logits.shape[0]))
    result = None
    if command.sampling is not None:
        s = command.sampling
        result = sample_round(
            logits,
            s.num_drafts,
            s.draft_tokens,
            None,
            s.batch,
            ShardsAcrossRanks(shard),
            token_mask=s.token_mask,
            num_logprobs=s.num_logprobs,
            raw_logprobs=s.raw_logprobs,
        )
    return full, result


def load_package_rank(path: str, rank: int, world_size: int):
    """Rank ``rank``'s model of the package at ``path`` (its blocks kept, as `flare run` serves
    the default package) and a KV cache for one short conversation."""
    from pathlib import Path

    from flare.engine.kv_cache import KVCache
    from flare.engine.quantized import QuantizedWeight
    from flare.parallel.group import all_reduce_sum
    from flare.parallel.tensor_split import rank_config, rank_model
    from flare.package.directory import open_package

    package = open_package(Path(path))
    floats, blocks = package.load_weights()
    state = dict(floats)
    for name, tensor in blocks.items():
        state[name] = QuantizedWeight.from_blocks(tensor.ggml_type, tensor.data, *tensor.shape)
    config = package.manifest.model
    model = rank_model(config, state, rank, world_size, all_reduce_sum, context=1024)
    local = rank_config(config, world_size)
    cache = KVCache(
        num_layers=local.num_layers, num_blocks=64, block_size=TP_BLOCK_SIZE,
        num_kv_heads=local.num_kv_heads, head_dim=local.head_dim,
    )
    return model, cache


def serve_messages(groups: ProcessGroups, state: dict[str, int]) -> None:
    """A serving worker's wait: each message from rank 0 answered with an all-reduce of 1, until
    the stop command."""
    from flare.parallel.round_command import receive_message

    while receive_message(groups.control) is not None:
        dist.all_reduce(torch.tensor([1.0]), group=groups.device)


SLOW_READ_S = 1.0
"""How late `serve_messages_read_late` reads each message: long after rank 0 has sent it."""


def serve_messages_read_late(groups: ProcessGroups, state: dict[str, int]) -> None:
    """`serve_messages` on a worker slow to read: each message, the stop command included, is
    read SLOW_READ_S after it was sent (a busy host's worker)."""
    from flare.parallel.round_command import receive_message

    while True:
        time.sleep(SLOW_READ_S)
        if receive_message(groups.control) is None:
            return
        dist.all_reduce(torch.tensor([1.0]), group=groups.device)


def serve_failing(groups: ProcessGroups, state: dict[str, int]) -> None:
    """A worker whose serving fails (as a collective that raises does)."""
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
