"""Daemon settings: precedence of flags > environment > TOML file > defaults, and precise errors."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from flare.daemon.config import ConfigError, DaemonConfig, load_config, parse_bytes


def flags(**given: object) -> argparse.Namespace:
    """A namespace as the `flare run` parser makes it: None for every flag not given."""
    return argparse.Namespace(**given)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flare.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    config = load_config(flags(), {})
    assert config == DaemonConfig()
    assert (config.host, config.port, config.max_waiting, config.api_keys) == ("127.0.0.1", 8000, 256, ())
    assert config.max_body_bytes == 1 << 20


def test_toml_file_sets_values_in_their_native_types(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'port = 9000\nkv_cache_memory = "512MiB"\nfault_injection = true\ndrain_grace_s = 2.5\n'
        'package = "/srv/pkg"\napi_keys = ["sk-a", "sk-b"]\nsampling_policy = "unfiltered"\n',
    )
    config = load_config(flags(), {}, path)
    assert config.port == 9000
    assert config.kv_cache_memory == 512 * 1024**2
    assert config.fault_injection is True
    assert config.drain_grace_s == 2.5
    assert config.package == Path("/srv/pkg")
    assert config.api_keys == ("sk-a", "sk-b")
    assert config.sampling_policy == "unfiltered"


def test_the_weight_format_is_auto_unless_a_source_names_one(tmp_path: Path) -> None:
    assert load_config(flags(), {}).weight_format == "auto"
    path = write_toml(tmp_path, 'weight_format = "float32"\n')
    assert load_config(flags(), {}, path).weight_format == "float32"
    assert load_config(flags(), {"FLARE_WEIGHT_FORMAT": "float16"}, path).weight_format == "float16"
    assert load_config(flags(weight_format="bfloat16"), {"FLARE_WEIGHT_FORMAT": "float16"}).weight_format == "bfloat16"


def test_the_activations_are_auto_unless_a_source_names_others_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    assert load_config(flags(), {}).activations == "auto"
    path = write_toml(tmp_path, 'activations = "int8x2"\n')
    assert load_config(flags(), {}, path).activations == "int8x2"
    assert load_config(flags(), {"FLARE_ACTIVATIONS": "int8"}, path).activations == "int8"
    assert load_config(flags(activations="float32"), {"FLARE_ACTIVATIONS": "int8"}).activations == "float32"
    with pytest.raises(ConfigError, match="FLARE_ACTIVATIONS: expected one of auto, float32, int8x2, int8, got .int4."):
        load_config(flags(), {"FLARE_ACTIVATIONS": "int4"})


def test_the_kv_cache_dtype_is_float32_unless_a_source_names_one_and_others_are_refused(tmp_path: Path) -> None:
    assert load_config(flags(), {}).kv_cache_dtype == "float32"
    path = write_toml(tmp_path, 'kv_cache_dtype = "bfloat16"\n')
    assert load_config(flags(), {}, path).kv_cache_dtype == "bfloat16"
    assert load_config(flags(), {"FLARE_KV_CACHE_DTYPE": "float16"}, path).kv_cache_dtype == "float16"
    assert load_config(flags(kv_cache_dtype="float32"), {"FLARE_KV_CACHE_DTYPE": "float16"}).kv_cache_dtype == "float32"
    with pytest.raises(ConfigError, match="FLARE_KV_CACHE_DTYPE: expected one of float32, bfloat16, float16, got 'int8'"):
        load_config(flags(), {"FLARE_KV_CACHE_DTYPE": "int8"})


def test_the_drafter_is_the_packages_unless_a_source_names_one(tmp_path: Path) -> None:
    assert load_config(flags(), {}).drafter is None
    path = write_toml(tmp_path, 'drafter = "mtp"\n')
    assert load_config(flags(), {}, path).drafter == "mtp"
    assert load_config(flags(), {"FLARE_DRAFTER": "ngram"}, path).drafter == "ngram"
    assert load_config(flags(drafter="auto"), {"FLARE_DRAFTER": "ngram"}).drafter == "auto"
    with pytest.raises(ConfigError, match="FLARE_DRAFTER: expected one of ngram, mtp, auto"):
        load_config(flags(), {"FLARE_DRAFTER": "medusa"})


def test_the_draft_length_is_adaptive_unless_a_source_holds_it_fixed(tmp_path: Path) -> None:
    assert load_config(flags(), {}).draft_length == "adaptive"
    path = write_toml(tmp_path, 'draft_length = "fixed"\n')
    assert load_config(flags(), {}, path).draft_length == "fixed"
    assert load_config(flags(), {"FLARE_DRAFT_LENGTH": "adaptive"}, path).draft_length == "adaptive"
    assert load_config(flags(draft_length="fixed"), {"FLARE_DRAFT_LENGTH": "adaptive"}).draft_length == "fixed"
    with pytest.raises(ConfigError, match="FLARE_DRAFT_LENGTH: expected one of adaptive, fixed, got 'short'"):
        load_config(flags(), {"FLARE_DRAFT_LENGTH": "short"})
    with pytest.raises(ConfigError, match=re.escape(f"{path}: draft_length: expected one of adaptive, fixed, got 7")):
        load_config(flags(), {}, write_toml(tmp_path, "draft_length = 7\n"))


def test_environment_overrides_file_and_flags_override_environment(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'port = 9000\nhost = "0.0.0.0"\nmax_waiting = 3\n')
    environ = {"FLARE_PORT": "9100", "FLARE_HOST": "::1", "FLARE_CONFIG": str(path)}
    config = load_config(flags(port="9200"), environ)
    assert config.port == 9200  # flag
    assert config.host == "::1"  # environment
    assert config.max_waiting == 3  # file named by FLARE_CONFIG


def test_config_flag_wins_over_flare_config(tmp_path: Path) -> None:
    chosen = write_toml(tmp_path, "port = 1\n")
    config = load_config(flags(config=str(chosen)), {"FLARE_CONFIG": str(tmp_path / "missing.toml")})
    assert config.port == 1


def test_api_keys_come_from_the_highest_source_that_names_any(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nsk-file-1\n\n  sk-file-2  \n")
    path = write_toml(tmp_path, 'api_keys = ["sk-toml"]\n')
    assert load_config(flags(), {}, path).api_keys == ("sk-toml",)
    assert load_config(flags(), {"FLARE_API_KEYS": "sk-e1, sk-e2"}, path).api_keys == ("sk-e1", "sk-e2")
    from_flags = load_config(flags(api_key=["sk-flag"], api_key_file=str(key_file)), {"FLARE_API_KEYS": "sk-e"}, path)
    assert from_flags.api_keys == ("sk-flag", "sk-file-1", "sk-file-2")
    assert load_config(flags(), {"FLARE_API_KEY_FILE": str(key_file)}).api_keys == ("sk-file-1", "sk-file-2")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * 1024**2), ("2GiB", 2 * 1024**3), ("1.5GB", 1_500_000_000), ("4096", 4096), ("64 kib", 65536)],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "2XB", "-1GiB", "0", ""])
def test_bad_byte_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("args", "environ", "names"),
    [
        (flags(port="http"), {}, ("--port", "integer")),
        (flags(port="70000"), {}, ("--port", "0..65535")),
        (flags(), {"FLARE_KV_CACHE_MEMORY": "lots"}, ("FLARE_KV_CACHE_MEMORY", "512MiB")),
        (flags(), {"FLARE_FAULT_INJECTION": "maybe"}, ("FLARE_FAULT_INJECTION", "true or false")),
        (flags(max_concurrency="0"), {}, ("--max-concurrency", ">= 1")),
        (flags(sampling_policy="loose"), {}, ("--sampling-policy", "package, unfiltered")),
        (flags(), {"FLARE_REQUEST_TIMEOUT_S": "soon"}, ("FLARE_REQUEST_TIMEOUT_S", "seconds")),
        (flags(device="tpu"), {}, ("--device", "cuda:N")),
        (flags(), {"FLARE_WEIGHT_FORMAT": "int4"}, ("FLARE_WEIGHT_FORMAT", "auto, float32, bfloat16, float16")),
        (flags(api_key=["has space"]), {}, ("--api-key", "whitespace")),
    ],
)
def test_bad_values_name_their_source_and_the_expected_form(
    args: argparse.Namespace, environ: dict[str, str], names: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(args, environ)
    assert all(name in str(raised.value) for name in names), str(raised.value)


def test_bad_toml_value_names_the_file_and_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'port = "eighty"\n')
    with pytest.raises(ConfigError, match=r"flare.toml: port: expected an integer"):
        load_config(flags(), {}, path)


def test_unknown_toml_key_is_refused_with_the_known_keys(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "prot = 80\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) prot; the keys are .*port"):
        load_config(flags(), {}, path)


def test_unreadable_or_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(flags(), {}, tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(flags(), {}, write_toml(tmp_path, "port = = 3"))


def test_empty_or_missing_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no API key"):
        load_config(flags(api_key_file=str(empty)), {})
    with pytest.raises(ConfigError, match="--api-key-file: cannot read"):
        load_config(flags(api_key_file=str(tmp_path / "absent")), {})


def test_request_timeout_none_disables_it() -> None:
    assert load_config(flags(request_timeout_s="none"), {}).request_timeout_s is None


def test_connection_limits_and_origins_come_from_every_source(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'max_connections = 64\nheader_timeout_s = 5\nmax_header_bytes = "16KiB"\n'
        'allowed_origins = ["https://a.example", "http://localhost:*"]\nallowed_hosts = ["flare.internal"]\n',
    )
    config = load_config(flags(keepalive_timeout_s="12"), {"FLARE_WRITE_TIMEOUT_S": "7.5"}, path)
    assert (config.max_connections, config.header_timeout_s, config.keepalive_timeout_s) == (64, 5.0, 12.0)
    assert (config.write_timeout_s, config.max_header_bytes) == (7.5, 16384)
    assert config.allowed_origins == ("https://a.example", "http://localhost:*")
    assert config.allowed_hosts == ("flare.internal",)
    env = load_config(flags(), {"FLARE_ALLOWED_ORIGINS": "https://a.example, https://b.example"})
    assert env.allowed_origins == ("https://a.example", "https://b.example")
    assert load_config(flags(allow_special_tokens_in_messages=True), {}).allow_special_tokens_in_messages


@pytest.mark.parametrize(
    ("setting", "value"),
    [("header_timeout_s", "0"), ("write_timeout_s", "none"), ("max_connections", "0"), ("allowed_origins", "a b")],
)
def test_bad_connection_settings_are_refused_naming_the_flag(setting: str, value: str) -> None:
    with pytest.raises(ConfigError, match="--" + setting.replace("_", "-")):
        load_config(flags(**{setting: value}), {})


def test_the_prefix_cache_is_on_by_default_and_each_source_can_turn_it_off(tmp_path: Path) -> None:
    assert load_config(flags(), {}).prefix_cache is True
    assert load_config(flags(), {}, write_toml(tmp_path, "prefix_cache = false\n")).prefix_cache is False
    assert load_config(flags(), {"FLARE_PREFIX_CACHE": "off"}).prefix_cache is False
    assert load_config(flags(prefix_cache="off"), {"FLARE_PREFIX_CACHE": "on"}).prefix_cache is False
    with pytest.raises(ConfigError, match="--prefix-cache: expected true or false"):
        load_config(flags(prefix_cache="sometimes"), {})


def test_several_served_model_names_come_from_every_source(tmp_path: Path) -> None:
    assert load_config(flags(), {}).served_model_name == ()
    path = write_toml(tmp_path, 'served_model_name = ["smollm2", "gpt-4o"]\naccept_any_model_name = true\n')
    from_file = load_config(flags(), {}, path)
    assert from_file.served_model_name == ("smollm2", "gpt-4o") and from_file.accept_any_model_name is True
    one = write_toml(tmp_path, 'served_model_name = "smollm2"\n')
    assert load_config(flags(), {}, one).served_model_name == ("smollm2",)
    assert load_config(flags(), {"FLARE_SERVED_MODEL_NAME": "a, b"}, path).served_model_name == ("a", "b")
    assert load_config(flags(served_model_name=["x", "y"]), {"FLARE_SERVED_MODEL_NAME": "a"}).served_model_name == (
        "x",
        "y",
    )
    with pytest.raises(ConfigError, match="--accept-any-model-name"):
        load_config(flags(accept_any_model_name="maybe"), {})


def test_the_round_budget_and_the_oldest_prompts_share_come_from_every_source(tmp_path: Path) -> None:
    assert (load_config(flags(), {}).max_batched_tokens, load_config(flags(), {}).oldest_prefill_share) == (256, 64)
    path = write_toml(tmp_path, "max_batched_tokens = 512\noldest_prefill_share = 128\n")
    config = load_config(flags(), {}, path)
    assert (config.max_batched_tokens, config.oldest_prefill_share) == (512, 128)
    config = load_config(flags(oldest_prefill_share="32"), {"FLARE_MAX_BATCHED_TOKENS": "1024"}, path)
    assert (config.max_batched_tokens, config.oldest_prefill_share) == (1024, 32)
    with pytest.raises(ConfigError, match=r"--oldest-prefill-share: expected an integer >= 1, got 0"):
        load_config(flags(oldest_prefill_share="0"), {})
    with pytest.raises(ConfigError, match=r"FLARE_MAX_BATCHED_TOKENS: expected an integer >= 1, got 'many'"):
        load_config(flags(), {"FLARE_MAX_BATCHED_TOKENS": "many"})
