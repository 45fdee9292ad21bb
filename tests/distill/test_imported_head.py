"""A checkpoint's own multi-token-prediction layer (DeepSeek-V3's layout on a Llama decoder layer,
`hf_source.read_mtp_head`) becomes the package's draft head instead of a distilled one; other
layouts are refused by name, and an export without the head leaves the layer out."""

from __future__ import annotations

import asyncio

import pytest
from tests.greedy_answers import greedy_answers
from tests.package_commands import flare
import torch
from safetensors import safe_open

from flare.distill import export as distill_export
from flare.distill.distill import DistillOptions
from flare.preparation.export import ExportError, ExportOptions, export_package
from flare.package.directory import open_package
from flare.scheduler.scheduler import SchedulerOptions

# The first 20 prompts hold two held-out ones: what the imported head is measured on.
TINY = DistillOptions(draft_tokens=3, seconds=120, prompt_limit=20, answer_tokens=16)
LOGIT_SCALE = 5.0  # a peaked tiny model repeats itself, so a head that proposes the last token is accepted


def mtp_layer(config, state, *, own_norm: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Layer num_layers in DeepSeek-V3's layout: a head that mostly proposes the token it is fed
    (eh_proj passes the embedding half through), with random attention and MLP mixed in."""
    g = torch.Generator().manual_seed(seed)
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    p = f"model.layers.{config.num_layers}."
    eh = torch.zeros(h, 2 * h)
    eh[:, :h] = torch.eye(h) * 3.0  # [enorm(embedding); hnorm(hidden)]: the embedding comes first
    eh[:, h:] = 0.1 * torch.randn(h, h, generator=g)
    layer = {
        "enorm.weight": torch.ones(h),
        "hnorm.weight": 1.0 + 0.1 * torch.rand(h, generator=g),
        "eh_proj.weight": eh,
        "input_layernorm.weight": torch.ones(h),
        "self_attn.q_proj.weight": torch.randn(q, h, generator=g) / h**0.5,
        "self_attn.k_proj.weight": torch.randn(kv, h, generator=g) / h**0.5,
        "self_attn.v_proj.weight": torch.randn(kv, h, generator=g) / h**0.5,
        "self_attn.o_proj.weight": 0.3 * torch.randn(h, q, generator=g) / q**0.5,
        "post_attention_layernorm.weight": torch.ones(h),
        "mlp.gate_proj.weight": torch.randn(f, h, generator=g) / h**0.5,
        "mlp.up_proj.weight": torch.randn(f, h, generator=g) / h**0.5,
        "mlp.down_proj.weight": 0.3 * torch.randn(h, f, generator=g) / f**0.5,
        "shared_head.head.weight": state["model.embed_tokens.weight"].clone(),  # tied: the LM head is the embedding
        "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        "shared_head.norm.weight": state["model.norm.weight"] * 1.5 if own_norm else state["model.norm.weight"].clone(),
    }
    return {p + name: t for name, t in layer.items()}


@pytest.fixture(scope="module")
def peaked_parts(package_parts):
    state = dict(package_parts["state_dict"])
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * LOGIT_SCALE
    return {**package_parts, "state_dict": state}


@pytest.fixture(scope="module")
def mtp_checkpoint(make_hf_directory, peaked_parts, tmp_path_factory):
    config, state = peaked_parts["config"], peaked_parts["state_dict"]
    parts = {**peaked_parts, "state_dict": {**state, **mtp_layer(config, state)}}
    return make_hf_directory(
        tmp_path_factory.mktemp("hf") / "tiny-mtp", parts, config_changes={"num_nextn_predict_layers": 1}
    )


def test_a_checkpoints_mtp_layer_becomes_the_packages_head(mtp_checkpoint, peaked_parts, tmp_path, capsys):
    config = peaked_parts["config"]
    out = tmp_path / "pkg"
    manifest = distill_export.export_with_draft_head(str(mtp_checkpoint), out, ExportOptions(), TINY)
    package = open_package(out)
    info = package.manifest.draft_head
    assert info == manifest.draft_head and info is not None
    assert info.imported_from == f"model.layers.{config.num_layers} of {mtp_checkpoint} (DeepSeek-V3-style MTP layer, the first of 1)"
    assert info.target_hidden == "final_norm" and info.draft_tokens == 3
    assert info.draft_vocab_size == config.vocab_size and info.held_out is not None and info.held_out.positions > 0
    # The tensors as the checkpoint holds them (bfloat16 there, bfloat16 here), renamed; eh_proj's
    # halves swapped into flare's [hidden; embedding] order; the layer's own final norm kept.
    head = package.load_draft_head()
    source = {}
    for file in mtp_checkpoint.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            source.update({n: f.get_tensor(n) for n in f.keys()})
    p, h = f"model.layers.{config.num_layers}.", config.hidden_size
    assert torch.equal(head["mtp.fc.weight"][:, :h], source[p + "eh_proj.weight"][:, h:])
    assert torch.equal(head["mtp.fc.weight"][:, h:], source[p + "eh_proj.weight"][:, :h])
    assert torch.equal(head["mtp.embed_norm.weight"], source[p + "enorm.weight"])
    assert torch.equal(head["mtp.layer.mlp.down_proj.weight"], source[p + "mlp.down_proj.weight"])
    assert torch.equal(head["mtp.final_norm.weight"], source[p + "shared_head.norm.weight"])
    assert torch.equal(head["mtp.draft_vocab"], torch.arange(config.vocab_size))
    assert not any(name.startswith(p) for name in package.load_state_dict())  # the target has no layer L
    assert flare("inspect", str(out)) == 0
    text = capsys.readouterr().out
    assert f"imported from       model.layers.{config.num_layers} of {mtp_checkpoint}" in text
    assert "reads the target    after its final norm" in text
    assert "held-out acceptance" in text
    # It serves: greedy output is the output without speculation, with drafts accepted.
    prompts = ("one two three four one two three four", "hello hello hello world")
    plain = asyncio.run(greedy_answers(package, prompts, SchedulerOptions(draft_tokens=0), max_tokens=24))
    assert package.manifest.serving.drafter == "auto"
    speculative = asyncio.run(
        greedy_answers(package, prompts, SchedulerOptions(drafter="mtp", draft_length="fixed"), max_tokens=24)
    )
    assert speculative.drafter == "mtp"
    assert speculative.outputs == plain.outputs
    assert speculative.accepted > 0


def test_a_head_identical_to_the_target_norm_shares_it(make_hf_directory, peaked_parts, tmp_path):
    config, state = peaked_parts["config"], peaked_parts["state_dict"]
    parts = {**peaked_parts, "state_dict": {**state, **mtp_layer(config, state, own_norm=False)}}
    source = make_hf_directory(tmp_path / "hf", parts, config_changes={"num_nextn_predict_layers": 1})
    distill_export.export_with_draft_head(str(source), tmp_path / "pkg", ExportOptions(), TINY)
    assert "mtp.final_norm.weight" not in open_package(tmp_path / "pkg").load_draft_head()


def test_without_the_mtp_drafter_the_layer_is_left_out(mtp_checkpoint, tmp_path):
    export_package(str(mtp_checkpoint), tmp_path / "pkg", ExportOptions())
    package = open_package(tmp_path / "pkg")
    assert package.manifest.draft_head is None and package.manifest.serving.drafter == "ngram"


def test_an_mtp_layer_in_another_layout_is_refused_by_name(make_hf_directory, peaked_parts, tmp_path):
    config, state = peaked_parts["config"], peaked_parts["state_dict"]
    layer = mtp_layer(config, state)
    p = f"model.layers.{config.num_layers}."
    del layer[p + "eh_proj.weight"]
    layer[p + "mlp.experts.0.gate_proj.weight"] = torch.zeros(4, config.hidden_size)
    layer[p + "enorm.weight"] = torch.ones(config.hidden_size + 1)
    parts = {**peaked_parts, "state_dict": {**state, **layer}}
    source = make_hf_directory(tmp_path / "hf", parts, config_changes={"num_nextn_predict_layers": 1})
    with pytest.raises(ExportError) as error:
        distill_export.export_with_draft_head(str(source), tmp_path / "pkg", ExportOptions(), TINY)
    message = str(error.value)
    assert "declares 1 multi-token-prediction layer(s)" in message
    assert f"{p}eh_proj.weight is missing" in message
    assert f"{p}mlp.experts.0.gate_proj.weight is not part of a DeepSeek-V3-style MTP layer" in message
    assert f"{p}enorm.weight has shape [{config.hidden_size + 1}], expected [{config.hidden_size}]" in message
    assert "--drafter ngram" in message
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing written


def test_an_mtp_layer_with_an_lm_head_of_its_own_is_refused(make_hf_directory, peaked_parts, tmp_path):
    config, state = peaked_parts["config"], peaked_parts["state_dict"]
    layer = mtp_layer(config, state)
    layer[f"model.layers.{config.num_layers}.shared_head.head.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    parts = {**peaked_parts, "state_dict": {**state, **layer}}
    source = make_hf_directory(tmp_path / "hf", parts, config_changes={"num_nextn_predict_layers": 1})
    with pytest.raises(ExportError, match=r"shared_head.head.weight differs from the model's LM head; flare's draft head shares"):
        distill_export.export_with_draft_head(str(source), tmp_path / "pkg", ExportOptions(), TINY)


def test_a_malformed_layer_count_is_a_source_error(make_hf_directory, peaked_parts, tmp_path, capsys):
    source = make_hf_directory(tmp_path / "hf", peaked_parts, config_changes={"num_nextn_predict_layers": "one"})
    assert flare("export", str(source), "-o", str(tmp_path / "pkg")) == 1
    assert capsys.readouterr().err == (
        "flare export: error: config.json: num_nextn_predict_layers must be a non-negative integer, got 'one'\n"
    )
