"""A DeepSeek-V3 checkpoint's own multi-token-prediction layer becomes the package's draft head
(issue 39): a head of the target's own layer kind (latent attention with a latent KV pool of its
own, and experts routed as the target's), which drafts what DeepSeek's MTP module computes from
the checkpoint's tensors (tests/deepseek_mtp.py's reference), and through the scheduler keeps
greedy output while its drafts are accepted."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tests.deepseek_mtp import MtpCheckpoint, reference_drafts, write_mtp_checkpoint
from tests.family_checkpoints import write_checkpoint
from tests.gguf_writer import write_family_gguf
from tests.greedy_answers import greedy_answers
from tests.package_commands import flare

from flare.distill import export as distill_export
from flare.distill.distill import DistillOptions
from flare.distill.head_model import DraftHeadModule
from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.drafters.mtp import HeadRow, load_draft_head
from flare.engine.kv_cache import KVCache
from flare.engine.model import load_model
from flare.package.directory import Package, open_package
from flare.preparation.export import ExportError, ExportOptions
from flare.preparation.source import ModelSource
from flare.scheduler.scheduler import SchedulerOptions

DRAFT_TOKENS = 7
# The held-out acceptance export measures, on the first prompts' held-out ones and short answers:
# what the tests read of it is that it was measured, not its figure.
MEASURED_BRIEFLY = {"prompt_limit": 20, "answer_tokens": 32}
# Copy-friendly text: the peaked target repeats its last token, and the head proposes it again.
PROMPTS = ("one two three four one two three four", "hello hello hello world")


def export_head_package(checkpoint: MtpCheckpoint, out: Path, *, vocabulary_parallel: bool = False) -> Package:
    options = ExportOptions(dtype="float32", vocabulary_parallel_sampling=vocabulary_parallel)
    distill_export.export_with_draft_head(
        str(checkpoint.path), out, options, DistillOptions(draft_tokens=DRAFT_TOKENS, dtype="float32", **MEASURED_BRIEFLY),
        stderr=io.StringIO(),
    )
    return open_package(out)


@pytest.fixture(
    scope="module",
    params=[("deepseek_v3_moe", True), ("deepseek_v3_moe", False), ("deepseek_v2_moe", True)],
    ids=["v3-moe-layer", "v3-dense-layer", "v2-moe-layer"],
)
def mtp_checkpoint(request: pytest.FixtureRequest, smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> MtpCheckpoint:
    """DeepSeek-V3's layer (q_lora_rank, sigmoid group routing with a correction bias), dense or
    MoE, and DeepSeek-V2's (q_proj, group-limited softmax routing): V2 releases ship no MTP layer,
    but one in its layout is read the same way."""
    family, moe = request.param
    root = tmp_path_factory.mktemp("deepseek-mtp")
    return write_mtp_checkpoint(
        root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, moe=moe, family=family
    )


@pytest.fixture(scope="module")
def head_package(mtp_checkpoint: MtpCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Package:
    return export_head_package(mtp_checkpoint, tmp_path_factory.mktemp("deepseek-mtp-package") / "pkg")


def test_the_mtp_layer_is_imported_as_a_head_of_the_targets_own_layer_kind(
    mtp_checkpoint: MtpCheckpoint, head_package: Package, capsys: pytest.CaptureFixture[str]
) -> None:
    info = head_package.manifest.draft_head
    config = head_package.manifest.model
    assert info is not None and info.layer == "target" and info.target_hidden == "final_norm"
    assert info.draft_tokens == DRAFT_TOKENS
    assert info.held_out is not None and info.held_out.positions > 0 and len(info.held_out.per_step) == DRAFT_TOKENS
    assert info.imported_from == (
        f"model.layers.{config.num_layers} of {mtp_checkpoint.path} (DeepSeek-V3-style MTP layer, the first of 1)"
    )
    head = head_package.load_draft_head()
    moe = config.num_experts > 0
    p = f"model.layers.{config.num_layers}."
    with safe_open(str(next(mtp_checkpoint.path.glob("*.safetensors"))), framework="pt") as f:
        source = {n: f.get_tensor(n) for n in f.keys() if n.startswith(p)}
    # Latent attention's projections, and the experts stacked as the target's are.
    assert head["mtp.layer.self_attn.kv_b_proj.weight"].shape == source[p + "self_attn.kv_b_proj.weight"].shape
    low_rank = config.latent_attention is not None and config.latent_attention.q_lora_rank is not None
    assert ("mtp.layer.self_attn.q_a_proj.weight" in head) == low_rank
    assert ("mtp.layer.self_attn.q_proj.weight" in head) != low_rank
    if moe:
        e, width = config.num_experts, config.moe_intermediate_size
        assert head["mtp.layer.mlp.experts.gate_up_proj.weight"].shape == (e, 2 * width, config.hidden_size)
        assert torch.equal(head["mtp.layer.mlp.experts.down_proj.weight"][3], source[p + "mlp.experts.3.down_proj.weight"])
        if config.routing == "sigmoid_group":  # V3's correction bias
            bias = source[p + "mlp.gate.e_score_correction_bias"]
            assert torch.equal(head["mtp.layer.mlp.router.score_correction_bias"], bias)
        assert "mtp.layer.mlp.shared_expert.down_proj.weight" in head
    else:
        assert torch.equal(head["mtp.layer.mlp.down_proj.weight"], source[p + "mlp.down_proj.weight"])
        assert not any(".experts." in name for name in head)
    assert flare("inspect", str(head_package.path)) == 0
    text = capsys.readouterr().out
    assert "decoder layer       the target's own kind (its attention and MLP)" in text
    assert "held-out acceptance" in text


def test_the_heads_drafts_are_deepseeks_mtp_module(mtp_checkpoint: MtpCheckpoint, head_package: Package) -> None:
    """After a prompt chunk and a decode step, the head's q at each of 3 draft steps (temperature
    0.7) is the reference MTP module's, computed by transformers' DeepSeek-V3 decoder layer from
    the checkpoint's tensors, the later steps fed the head's own output; and so is the q of the
    dense module that measures the head's held-out acceptance at export, unrolled on the same
    tokens."""
    target = load_model(head_package)
    config = head_package.manifest.model
    kv = KVCache.for_config(config, 8, 16, torch.float32, "cpu")
    head = load_draft_head(head_package, target, num_blocks=8, block_size=16)
    # The head's own latent pool: one [latent | rope key] row a token, no values.
    latent = config.latent_attention
    assert latent is not None and len(head.kv_cache.keys) == 1
    assert head.kv_cache.keys[0].shape[-1] == latent.kv_lora_rank + latent.qk_rope_head_dim
    assert head.kv_cache.values[0].shape[-1] == 0
    tokens = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    table, chunk = tuple(range(8)), 28
    with torch.inference_mode():
        batch = ForwardBatch.build([ForwardRow(tokens[:chunk], 0, table, 1)], 16)
        head.write_hidden(batch.slot_mapping, target.forward_hidden(batch, kv)[1])
        batch = ForwardBatch.build([ForwardRow([tokens[chunk]], chunk, table, 1)], 16)
        head.write_hidden(batch.slot_mapping, target.forward_hidden(batch, kv)[1])
        row = HeadRow(0, table, tuple(tokens[: chunk + 1]), device_tokens=1, sample_index=0, steps=3, temperature=0.7, seed=9)
        drafts = head.run([row], torch.tensor([[tokens[chunk + 1]]]), torch.tensor([1]))
    assert drafts is not None
    proposed = [int(t) for t in drafts.tokens[0]]
    sequence = tokens[: chunk + 2] + proposed[:2]
    state = head_package.load_state_dict()
    head_state = head_package.load_draft_head()
    module = DraftHeadModule(
        config, head_state["mtp.draft_vocab"], state["model.embed_tokens.weight"], state["lm_head.weight"],
        head_state["mtp.final_norm.weight"], seed=0, target_norm=state["model.norm.weight"], layer="target",
    )
    module.load_package_state(head_state)
    with torch.no_grad():
        kv_dense = KVCache.for_config(config, 8, 16, torch.float32, "cpu")
        _, dense_hidden = target.forward_hidden(ForwardBatch.build([ForwardRow(sequence, 0, table, 1)], 16), kv_dense)
        outputs = module.unrolled(dense_hidden.unsqueeze(0), torch.tensor(sequence).unsqueeze(0), 3)
    for j, q in enumerate(reference_drafts(mtp_checkpoint, tokens[: chunk + 2], 3, 0.7, proposed)):
        torch.testing.assert_close(drafts.probs[0, j], q, atol=2e-5, rtol=1e-3)
        assert q[proposed[j]].item() > 0
        dense = torch.softmax(module.logits(outputs[j][0, chunk + 1 + j]) / 0.7, -1)
        torch.testing.assert_close(dense, q, atol=2e-5, rtol=1e-3)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
async def test_greedy_output_with_seven_drafts_is_the_output_without_and_drafts_are_accepted(
    head_package: Package, tensor_parallel: int
) -> None:
    """At tensor parallel 2 the head runs whole on rank 0 beside the ranks' target."""
    plain = await greedy_answers(
        head_package, PROMPTS, SchedulerOptions(draft_tokens=0, tensor_parallel=tensor_parallel), max_tokens=32
    )
    speculative = await greedy_answers(
        head_package,
        PROMPTS,
        SchedulerOptions(
            drafter="mtp", draft_tokens=DRAFT_TOKENS, draft_length="fixed", tensor_parallel=tensor_parallel
        ),
        max_tokens=32,
    )
    assert speculative.outputs == plain.outputs
    emitted, rounds = speculative.drafting_emitted, speculative.drafting_rounds
    print(f"TP {tensor_parallel}: {emitted / max(rounds, 1):.2f} tokens per drafting round ({emitted} in {rounds})")
    assert rounds > 0 and emitted / rounds > 1.0, (emitted, rounds)  # more than one token per drafting round


def test_a_layer_that_is_not_the_models_kind_is_refused_by_name(smollm2_source: ModelSource, tmp_path: Path) -> None:
    checkpoint = write_mtp_checkpoint(tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    shard = next(checkpoint.path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    p = f"model.layers.{checkpoint.layer_index}."
    del tensors[p + "self_attn.kv_b_proj.weight"]
    tensors[p + "self_attn.k_proj.weight"] = torch.zeros(8, 64)
    tensors[p + "eh_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ExportError) as error:
        export_head_package(checkpoint, tmp_path / "pkg")
    message = str(error.value)
    assert "declares 1 multi-token-prediction layer(s)" in message
    assert "DeepSeek-V3's layout on a decoder layer of the model's own kind" in message
    assert f"{p}self_attn.kv_b_proj.weight is missing" in message
    assert f"{p}self_attn.k_proj.weight is not part of a DeepSeek-V3-style MTP layer of this deepseek2 model" in message
    assert f"{p}eh_proj.weight has shape [64, 64], expected [64, 128]" in message
    assert not (tmp_path / "pkg").exists()


def test_a_deepseek_gguf_has_no_mtp_layer_and_the_refusal_says_so(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """llama.cpp's converter drops DeepSeek's MTP layers from a deepseek2 GGUF, and flare distills
    no head for latent attention: --drafter mtp is refused naming both."""
    checkpoint = write_checkpoint("deepseek_v3", tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    gguf_path = tmp_path / "model.gguf"
    write_family_gguf(gguf_path, checkpoint.model.config, checkpoint.model.state_dict(), chat_template=smollm2_source.chat_template)
    with pytest.raises(ExportError) as error:
        distill_export.export_with_draft_head(str(gguf_path), tmp_path / "pkg", ExportOptions(), DistillOptions())
    message = str(error.value)
    assert "latent-attention (deepseek2) model without a multi-token-prediction layer" in message
    assert "llama.cpp's deepseek2 GGUF files carry no MTP layer" in message
    assert "--drafter ngram" in message and error.value.option == "--drafter"
    assert not (tmp_path / "pkg").exists()
