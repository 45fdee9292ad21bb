"""The manifest: JSON round trip and strict reading."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flare.package.manifest import FORMAT_VERSION, INTEGER_FROM_BYTES, Manifest, Provenance, ServingConfig, auto_activations
from flare.package.model_config import ManifestError, ModelConfig, RopeScaling
from flare.policy.policy import SamplingPolicy

DEFAULTS = {
    "temperature": 0.2, "top_k": -1, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 256,
}


def make_manifest(**serving: object) -> Manifest:
    config = ModelConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    return Manifest(
        model=config,
        serving=ServingConfig(max_context=512, **serving),
        sampling=SamplingPolicy(DEFAULTS, {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0)}),
        provenance=Provenance("SmolLM2-135M-Instruct", "default", "gguf", "ab" * 32, "smollm2-135m-instruct", "0.1.0", "2026-11-29T17:00:00Z"),
        files={"model.safetensors": "00" * 32},
    )


def test_manifest_survives_a_json_round_trip() -> None:
    manifest = make_manifest(vocabulary_parallel_sampling=True, draft_tokens=0)
    again = Manifest.loads(manifest.dumps())
    assert again == manifest
    assert again.to_json() == manifest.to_json()


def test_manifest_json_has_the_documented_layout() -> None:
    data = json.loads(make_manifest().dumps())
    assert data["format"] == FORMAT_VERSION
    assert set(data) == {"format", "model", "serving", "sampling", "files"}
    assert set(data["model"]) == {"config", "provenance"}
    assert data["serving"] == {
        "max_context": 512, "max_concurrency": 32, "dtype": "float32",
        "vocabulary_parallel_sampling": False, "draft_tokens": 4, "drafter": "ngram",
    }
    assert data["sampling"]["ranges"] == {"temperature": [0.0, 2.0], "top_p": [0.05, 1.0]}


def test_unknown_key_is_refused_by_name() -> None:
    data = make_manifest().to_json()
    data["serving"]["turbo"] = True
    with pytest.raises(ManifestError, match="serving: unknown key.*turbo"):
        Manifest.from_json(data)


def test_missing_key_is_refused_by_name() -> None:
    data = make_manifest().to_json()
    del data["model"]["config"]["rope_theta"]
    with pytest.raises(ManifestError, match="model.config: missing key.*rope_theta"):
        Manifest.from_json(data)
    data = make_manifest().to_json()
    del data["files"]
    with pytest.raises(ManifestError, match="manifest: missing key.*files"):
        Manifest.from_json(data)


def test_other_format_version_is_refused_with_the_fix() -> None:
    data = make_manifest().to_json()
    data["format"] = FORMAT_VERSION + 1
    with pytest.raises(ManifestError, match=f"format {FORMAT_VERSION + 1} is not supported.*re-export"):
        Manifest.from_json(data)


def test_invalid_json_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.loads("{")


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        ({"max_concurrency": 0}, "max_concurrency must be a positive integer"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"draft_tokens": -1}, "draft_tokens must be an integer from 0"),
        ({"draft_tokens": 17}, "draft_tokens must be an integer from 0"),
        ({"drafter": "eagle"}, "drafter must be one of ngram"),
    ],
)
def test_invalid_serving_settings_are_named(serving: dict, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        make_manifest(**serving)


def test_max_context_beyond_the_model_is_refused() -> None:
    manifest = make_manifest()
    with pytest.raises(ManifestError, match="max_context 1024 exceeds the model's max_position_embeddings 512"):
        Manifest(
            model=manifest.model, serving=ServingConfig(max_context=1024), sampling=manifest.sampling,
            provenance=manifest.provenance,
        )


def test_model_config_checks_head_layout() -> None:
    with pytest.raises(ManifestError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
        ModelConfig(
            vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=3, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        )
    with pytest.raises(ManifestError, match=r"architecture 'falcon' is not one flare serves \(llama, mistral"):
        ModelConfig(
            vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(200,),
            architecture="falcon",
        )


def _head_json(**changes: object) -> dict:
    return {
        "draft_tokens": 4, "draft_vocab_size": 100, "parameters": 10, "dtype": "bfloat16", "prompt_set": "tests",
        "budget": {}, "trained": {}, "held_out": None, **changes,
    }


def test_a_draft_head_from_before_imported_heads_reads_as_a_distilled_one() -> None:
    from flare.package.manifest import DraftHeadInfo

    info = DraftHeadInfo.from_json(_head_json())
    assert info.target_hidden == "residual" and info.imported_from is None and info.layer == "llama"
    imported = DraftHeadInfo.from_json(_head_json(target_hidden="final_norm", imported_from="model.layers.2 of DIR"))
    assert DraftHeadInfo.from_json(imported.to_json()) == imported
    own_layer = DraftHeadInfo.from_json(_head_json(target_hidden="final_norm", layer="target"))
    assert own_layer.layer == "target" and DraftHeadInfo.from_json(own_layer.to_json()) == own_layer


def test_a_draft_head_reading_an_unknown_hidden_state_is_refused() -> None:
    from flare.package.manifest import DraftHeadInfo

    with pytest.raises(ManifestError, match="target_hidden must be one of residual, final_norm, got 'middle'"):
        DraftHeadInfo.from_json(_head_json(target_hidden="middle"))
    with pytest.raises(ManifestError, match="layer must be one of llama, target, got 'mamba'"):
        DraftHeadInfo.from_json(_head_json(layer="mamba"))
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['origin'\]"):
        DraftHeadInfo.from_json(_head_json(origin="x"))


def test_blocks_and_dequantized_survive_a_json_round_trip_and_a_format_2_manifest_still_reads() -> None:
    from dataclasses import replace

    from flare.package.manifest import BlockEntry

    manifest = replace(
        make_manifest(),
        blocks={"model.layers.0.mlp.up_proj.weight": BlockEntry("Q4_1", 0, 5120)},
        dequantized={"model.layers.1.mlp.down_proj.weight": "Q2_K"},
    )
    data = json.loads(manifest.dumps())
    assert data["blocks"] == {"model.layers.0.mlp.up_proj.weight": {"type": "Q4_1", "offset": 0, "nbytes": 5120}}
    assert Manifest.loads(manifest.dumps()) == manifest
    older = make_manifest().to_json()
    older["format"] = 2  # written before blocks: read as it was
    assert Manifest.from_json(older).blocks == {}
    with pytest.raises(ManifestError, match="format 2 cannot have blocks"):
        Manifest.from_json({**data, "format": 2})


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"type": "Q4_1", "offset": -1, "nbytes": 5120}, "offset must be a non-negative integer"),
        ({"type": "Q4_1", "offset": 0}, "missing key\\(s\\) nbytes"),
        ({"type": "", "offset": 0, "nbytes": 1}, "type must be a ggml type name"),
    ],
)
def test_a_malformed_blocks_entry_is_refused_naming_the_tensor(entry: dict, message: str) -> None:
    data = make_manifest().to_json()
    data["blocks"] = {"model.layers.0.mlp.up_proj.weight": entry}
    with pytest.raises(ManifestError, match=f"blocks.model.layers.0.mlp.up_proj.weight: .*{message}"):
        Manifest.from_json(data)


def test_a_family_config_survives_a_json_round_trip() -> None:
    manifest = make_manifest()
    config = dataclasses.replace(
        manifest.model, architecture="gemma3", qk_norm=True, rotary_dim=8, sliding_window=64, sliding_layers=(0,),
        local_rope_theta=1e4, attention_scale=0.25, attention_softcap=50.0, final_logit_softcap=30.0,
        sandwich_norms=True, embedding_scale=8.0, hidden_activation="gelu_tanh",
        rope_scaling=RopeScaling("longrope", factor=4.0, original_max_position_embeddings=128,
                                 short_factor=(1.0,) * 4, long_factor=(2.0,) * 4),
    )
    family = dataclasses.replace(manifest, model=config)
    assert Manifest.loads(family.dumps()) == family


def test_a_format_3_manifest_reads_as_a_llama_model() -> None:
    data = make_manifest().to_json()
    data["format"] = 3
    for name in ("attention_bias", "qk_norm", "rotary_dim", "rope_scaling", "sliding_window", "sliding_layers",
                 "local_rope_theta", "attention_scale", "attention_softcap", "final_logit_softcap",
                 "sandwich_norms", "embedding_scale", "hidden_activation"):
        del data["model"]["config"][name]
    assert Manifest.from_json(data).model == make_manifest().model


def test_a_sliding_layer_without_a_window_is_refused() -> None:
    with pytest.raises(ManifestError, match="sliding_layers are named but sliding_window is not set"):
        dataclasses.replace(make_manifest().model, sliding_layers=(1,))
    with pytest.raises(ManifestError, match="sliding_layers must be layer indices below num_layers 2"):
        dataclasses.replace(make_manifest().model, sliding_window=8, sliding_layers=(2,))


def test_auto_activations_are_int8x2_for_k_quants_and_large_32_value_files_and_float32_for_small_ones() -> None:
    def types(**sizes: int) -> dict[str, dict[str, int]]:
        return {kind: {"tensors": 1, "bytes": size} for kind, size in sizes.items()}

    # the default package: 66 MB of Q4_1 layers and a 30 MB Q8_0 head
    assert auto_activations(types(Q4_1=66_400_000, Q8_0=30_100_000, F32=100_000)) == "float32"
    # a 1B model's Q8_0 file, and a Q4_0 file whose head llama-quantize stores as Q6_K
    assert auto_activations(types(Q8_0=1_300_000_000, F32=200_000)) == "int8x2"
    assert auto_activations(types(Q4_0=600_000_000, Q6_K=200_000_000)) == "int8x2"
    assert auto_activations(types(Q4_K=1_000, F32=1_000)) == "int8x2"  # a K type, whatever the size
    # the threshold counts only the blocks the integer kernels take
    assert auto_activations(types(Q8_0=INTEGER_FROM_BYTES - 1, F16=10 * INTEGER_FROM_BYTES)) == "float32"
    assert auto_activations(types(Q8_0=INTEGER_FROM_BYTES // 2, Q5_1=INTEGER_FROM_BYTES // 2)) == "int8x2"
    assert auto_activations(types(F16=10 * INTEGER_FROM_BYTES)) == "float32"
