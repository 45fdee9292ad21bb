"""A mixture-of-experts model (the tiny Qwen2-MoE: routed experts, a gated shared expert, a dense
layer; the tiny Qwen3-MoE and Mixtral) at tensor-parallel 2 answers as at 1: every rank holds half of every expert's intermediate
columns (flare/parallel/tensor_split.py) and the ranks' partial MLP outputs are summed. The two
ranks run in two threads here, their all-reduce an exchange through a barrier."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import torch
from tests.family_checkpoints import write_checkpoint

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel
from flare.package.directory import open_package
from flare.parallel.tensor_split import TensorParallelError, check_tensor_parallel, rank_config, rank_model, rank_state_dict
from flare.preparation.export import ExportOptions, export_package
from flare.preparation.source import ModelSource

pytest.importorskip("transformers")

BLOCK_SIZE = 4


class PairSum:
    """all_reduce of two threads: each gives its tensor, both get the same sum (rank 0's + rank 1's)."""

    def __init__(self) -> None:
        # A rank that fails breaks the barrier for the other instead of leaving it waiting.
        self.barrier = threading.Barrier(2, timeout=300)
        self.slots: list[torch.Tensor | None] = [None, None]

    def of(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]  # type: ignore[operator]
            self.barrier.wait()
            tensor.copy_(total)

        return all_reduce


def logits(model: DecoderModel, prompts: list[list[int]], pieces: list[list[int]]) -> list[torch.Tensor]:
    cache = KVCache.for_budget(model.config, 8 * 1024**2, BLOCK_SIZE)
    allocator = BlockAllocator(cache.num_blocks)
    tables = [allocator.allocate(-(-len(p) // BLOCK_SIZE)) for p in prompts]
    done, out = [0] * len(prompts), []
    for sizes in pieces:
        rows = [ForwardRow(p[d : d + n], d, t, num_logits=n) for p, d, n, t in zip(prompts, done, sizes, tables)]
        out.append(model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache))
        done = [d + n for d, n in zip(done, sizes)]
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_moe_model_at_tensor_parallel_2_answers_as_at_1(family: str, smollm2_source: ModelSource, tmp_path: Path) -> None:
    checkpoint = write_checkpoint(family, tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    config, state = package.manifest.model, package.load_state_dict()
    width = config.moe_intermediate_size
    half = rank_config(config, 2)
    assert (half.moe_intermediate_size, half.shared_expert_intermediate_size) == (width // 2, config.shared_expert_intermediate_size // 2)
    shares = [rank_state_dict(config, state, rank, 2) for rank in range(2)]
    layer = config.moe_layers[0]
    gate_up = f"model.layers.{layer}.mlp.experts.gate_up_proj.weight"
    # Rank 1's expert 3: the second half of its gate rows, then of its up rows.
    expert = state[gate_up][3]
    assert torch.equal(shares[1][gate_up][3], torch.cat((expert[width // 2 : width], expert[width + width // 2 :])))

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (21, 15)]
    pieces = [[13, 9], [1, 1], [3, 4], [4, 1]]
    whole = logits(DecoderModel(config, state), prompts, pieces)
    exchange = PairSum()
    results: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        model = rank_model(config, state, rank, 2, exchange.of(rank))
        results[rank] = logits(model, prompts, pieces)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for expected, shard0, shard1 in zip(whole, *results):
        torch.testing.assert_close(torch.cat((shard0, shard1), dim=1), expected, atol=1e-4, rtol=1e-4)


def test_a_size_that_does_not_divide_the_experts_width_is_refused_naming_it() -> None:
    from flare.preparation.families.hf_config import model_config_from_hf
    from tests.family_checkpoints import family_config

    config = model_config_from_hf({**family_config("qwen2_moe").to_dict(), "moe_intermediate_size": 33}, None)
    with pytest.raises(TensorParallelError, match="moe_intermediate_size of 33"):
        check_tensor_parallel(config, 2)
