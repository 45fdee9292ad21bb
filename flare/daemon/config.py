"""The daemon's settings, from command-line flags, FLARE_* environment variables and a TOML file.

Precedence, highest first: command-line flags > environment variables > the TOML file
(`--config PATH`, else FLARE_CONFIG) > defaults. `load_config` reads every source again each
time it is called, so a reload (SIGHUP) calls it with the original flags and gets the current
environment and file.

Every setting has one name: the TOML key is the field name (`kv_cache_memory = "2GiB"`), the
environment variable is FLARE_ plus the upper-cased name (`FLARE_KV_CACHE_MEMORY=2GiB`), the
flag is `--` plus the name with dashes (`--kv-cache-memory 2GiB`). API keys are the exception
that lists allow: `--api-key` repeats, FLARE_API_KEYS is comma-separated, TOML `api_keys` is an
array; `--api-key-file` / FLARE_API_KEY_FILE / TOML `api_key_file` names a file with one key a
line (blank lines and `#` comments ignored). The keys come from the highest-precedence source
that names any, so a flag replaces, rather than adds to, the keys of the environment or file.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare.package.manifest import ACTIVATION_CHOICES, KV_CACHE_DTYPES, WEIGHT_FORMATS

CONFIG_ENV = "FLARE_CONFIG"
API_KEYS_ENV = "FLARE_API_KEYS"
API_KEY_FILE_ENV = "FLARE_API_KEY_FILE"
# The system service's control socket (flare.service's RuntimeDirectory=flare).
SYSTEM_CONTROL_SOCKET = Path("/run/flare/control.sock")


def default_control_socket(environ: Mapping[str, str]) -> Path:
    """Where the daemon puts its socket without --control-socket: systemd's RuntimeDirectory
    (/run/flare), else /run/flare as root, else the user's runtime directory."""
    if runtime := environ.get("RUNTIME_DIRECTORY"):
        return Path(runtime.split(":")[0]) / "control.sock"
    if os.geteuid() != 0 and (user_runtime := environ.get("XDG_RUNTIME_DIR")):
        return Path(user_runtime) / "flare" / "control.sock"
    return SYSTEM_CONTROL_SOCKET


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """Where the daemon keeps state without --state-dir: systemd's StateDirectory
    (/var/lib/flare), else $XDG_STATE_HOME/flare, else ~/.local/state/flare."""
    if state := environ.get("STATE_DIRECTORY"):
        return Path(state.split(":")[0])
    if xdg := environ.get("XDG_STATE_HOME"):
        return Path(xdg) / "flare"
    return Path.home() / ".local" / "state" / "flare"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names where it came from and the expected form."""


@dataclass(frozen=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    package: Path | None = None  # None: the default model, exported once into the cache
    # The names clients send in `model`, all listed by /v1/models (vLLM takes several); empty:
    # the name in the package manifest (provenance.name).
    served_model_name: tuple[str, ...] = ()
    # Any other name in `model` is answered by the one package too (tools that send "gpt-4o").
    accept_any_model_name: bool = False
    control_socket: Path | None = None
    kv_cache_memory: int | None = None  # bytes; None: the scheduler's default budget
    kv_cache_dtype: str = "float32"  # KV_CACHE_DTYPES: what the KV cache stores keys and values as
    max_concurrency: int | None = None  # None: the package's serving.max_concurrency
    max_waiting: int = 256
    # Tokens fed per round, and of those what the oldest prompt still prefilling keeps while
    # shorter prompts go first (the prefill policy: docs/architecture.md).
    max_batched_tokens: int = 256
    oldest_prefill_share: int = 64
    prefix_cache: bool = True
    # Prefix-cache blocks are found only by requests of the API key that computed them (a key
    # could otherwise confirm another's prompt block by block); on: all keys share them.
    prefix_cache_across_keys: bool = False
    draft_tokens: int | None = None  # None: the package's; may only lower it
    drafter: str | None = None  # "ngram" | "mtp" | "auto"; None: the package's serving.drafter
    # "adaptive": the scheduler weighs each draft's cost against its saving and shortens or pauses
    # drafting; "fixed": every decode row verifies all the drafter proposes, up to draft_tokens.
    draft_length: str = "adaptive"
    vocabulary_shards: int = 1
    tensor_parallel: int = 1  # ranks of one model: this process and N - 1 spawned workers (flare/parallel/)
    nnodes: int = 1  # hosts the ranks are spread over (the same number on each)
    node_rank: int = 0  # this host: 0 serves the API and the rendezvous, K > 0 runs headless
    master_addr: str = "127.0.0.1"  # rank 0's host, as the other hosts reach it (a private network)
    master_port: int = 0  # the rendezvous port on rank 0's host; 0: a free one (one host only)
    # This host's ranks' CPU lists, "0-15|16-31" (one per rank, '|' between, as vLLM's
    # VLLM_CPU_OMP_THREADS_BIND); None: this process's CPUs cut into equal runs.
    tensor_parallel_cpus: str | None = None
    # How long a collective inside a round may wait for a peer before the group fails (waiting
    # for the next round has no deadline; liveness is checked apart, flare/parallel/launch.py).
    collective_timeout_s: float = 60.0
    sampling_policy: str = "package"  # "package" | "unfiltered"
    on_invalid_speculation: str = "fallback"  # "fallback" | "fail"
    fault_injection: bool = False
    log_level: str = "info"
    log_format: str = "auto"  # "auto" (console on a terminal, JSON otherwise) | "json" | "console"
    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False
    drain_grace_s: float = 30.0
    max_body_bytes: int = 1 << 20
    request_timeout_s: float | None = 600.0
    # A stream with no output for this long gets a keep-alive (an SSE comment; Messages: ping).
    stream_keepalive_s: float = 15.0
    # Connections (flare/server/connections.py): how many, and how long each may take or idle.
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    write_timeout_s: float = 30.0
    max_header_bytes: int = 32 << 10
    # Browser origins allowed to call the API (none by default); Host names accepted beyond
    # loopback's own while bound to loopback (DNS rebinding).
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    # Special-token text inside chat messages becomes those control tokens (off: it stays text).
    allow_special_tokens_in_messages: bool = False
    cache_dir: Path | None = None  # None: the preparation default (XDG cache)
    # What the daemon keeps across restarts (the stored Responses); None: default_state_dir().
    state_dir: Path | None = None
    # Responses of `store: true` (OpenAI's default) kept in <state_dir>/responses.sqlite3, each
    # deleted past the age, and the oldest first past the size; false: nothing is kept.
    responses_store: bool = True
    responses_store_max_age_s: float = 30 * 24 * 3600.0
    responses_store_max_bytes: int = 1 << 30
    device: str = "auto"  # "auto" (cuda when available, else cpu) | "cpu" | "cuda" | "cuda:N"
    weight_format: str = "auto"  # "auto" (the fastest this device runs) | "float32" | "bfloat16" | "float16"
    activations: str = "auto"  # ACTIVATION_CHOICES: what ggml block weights multiply, 8-bit blocks or float32 (exact)


# --- value parsers: each takes a flag/env string or a TOML value and returns the typed value ---

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_BYTES_FORM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """A byte size: an integer, or a number with a unit such as "512MiB", "2GiB", "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _BYTES_FORM.match(value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f'a byte size such as "512MiB" or "2GiB", got {value!r}')
    if unit not in _BYTE_UNITS:
        raise ValueError(f"a byte size with a unit of B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB), got {value!r}")
    size = int(number * _BYTE_UNITS[unit])
    if size < 1:
        raise ValueError(f"a positive byte size, got {value!r}")
    return size


def _integer(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        expected = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{expected}, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{expected}, got {value}")
        return value

    return parse


def _seconds(*, allow_none: bool) -> Callable[[Any], float | None]:
    def parse(value: Any) -> float | None:
        expected = "a number of seconds >= 0" + (' (or "none" for no limit)' if allow_none else "")
        if allow_none and isinstance(value, str) and value.strip().lower() in ("none", "off"):
            return None
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{expected}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
            raise ValueError(f"{expected}, got {value!r}")
        return float(value)

    return parse


def _positive_seconds(value: Any) -> float:
    seconds = _seconds(allow_none=False)(value)
    assert seconds is not None
    if seconds <= 0:
        raise ValueError(f"a number of seconds > 0, got {value!r}")
    return seconds


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"true or false (1/0, yes/no, on/off), got {value!r}")


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"one of {', '.join(choices)}, got {value!r}")
        return value

    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a non-empty string, got {value!r}")
    return value


def _device(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError(f"auto, cpu, cuda or cuda:N, got {value!r}")
    return value


def _names(value: Any) -> tuple[str, ...]:
    """A list of names: a TOML array of strings, or one string of comma-separated names."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f'a list of names ("a,b" or a TOML array of strings), got {value!r}')
    names = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))
    if any(c.isspace() for name in names for c in name):
        raise ValueError(f"names without whitespace, got {value!r}")
    return names


def _path(value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a path, got {value!r}")
    return Path(value).expanduser()


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "host": _text,
    "port": _integer(0, 65535),
    "package": _path,
    "served_model_name": _names,
    "accept_any_model_name": _boolean,
    "control_socket": _path,
    "kv_cache_memory": parse_bytes,
    "kv_cache_dtype": _choice(*KV_CACHE_DTYPES),
    "max_concurrency": _integer(1),
    "max_waiting": _integer(0),
    "max_batched_tokens": _integer(1),
    "oldest_prefill_share": _integer(1),
    "prefix_cache": _boolean,
    "prefix_cache_across_keys": _boolean,
    "draft_tokens": _integer(0),
    "drafter": _choice("ngram", "mtp", "auto"),
    "draft_length": _choice("adaptive", "fixed"),
    "vocabulary_shards": _integer(1),
    "tensor_parallel": _integer(1),
    "nnodes": _integer(1),
    "node_rank": _integer(0),
    "master_addr": _text,
    "master_port": _integer(0, 65535),
    "tensor_parallel_cpus": _text,
    "collective_timeout_s": _positive_seconds,
    "sampling_policy": _choice("package", "unfiltered"),
    "on_invalid_speculation": _choice("fallback", "fail"),
    "fault_injection": _boolean,
    "log_level": _choice("debug", "info", "warning", "error"),
    "log_format": _choice("auto", "json", "console"),
    "metrics_require_key": _boolean,
    "drain_grace_s": _seconds(allow_none=False),
    "max_body_bytes": parse_bytes,
    "request_timeout_s": _seconds(allow_none=True),
    "stream_keepalive_s": _positive_seconds,
    "max_connections": _integer(1),
    "header_timeout_s": _positive_seconds,
    "keepalive_timeout_s": _positive_seconds,
    "write_timeout_s": _positive_seconds,
    "max_header_bytes": parse_bytes,
    "allowed_origins": _names,
    "allowed_hosts": _names,
    "allow_special_tokens_in_messages": _boolean,
    "cache_dir": _path,
    "state_dir": _path,
    "responses_store": _boolean,
    "responses_store_max_age_s": _positive_seconds,
    "responses_store_max_bytes": parse_bytes,
    "device": _device,
    "weight_format": _choice(*WEIGHT_FORMATS),
    "activations": _choice(*ACTIVATION_CHOICES),
}
# Settings read from sources other than one scalar value each.
_LIST_SETTINGS = ("api_keys", "api_key_file")


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def env_name(setting: str) -> str:
    return "FLARE_" + setting.upper()


def load_config(
    args: argparse.Namespace | None, environ: Mapping[str, str], path: Path | None = None
) -> DaemonConfig:
    """The settings from every source, by precedence. Raises ConfigError naming the bad one.

    `args` holds one attribute per setting, None when the flag was not given (the `flare run`
    parser is built that way), plus `api_key` (a list), `api_key_file` and `config`.
    `path` overrides `--config` and FLARE_CONFIG; without any of them no file is read.
    """
    flags = vars(args) if args is not None else {}
    if path is None:
        given = flags.get("config") or environ.get(CONFIG_ENV) or None
        path = Path(given).expanduser() if given else None
    table = _read_toml(path) if path is not None else {}

    values: dict[str, Any] = {}
    for setting, parse in _PARSERS.items():
        flag = flags.get(setting)
        if flag is not None:
            values[setting] = _parsed(parse, flag, f"{flag_name(setting)}")
        elif env_name(setting) in environ:
            values[setting] = _parsed(parse, environ[env_name(setting)], env_name(setting))
        elif setting in table:
            values[setting] = _parsed(parse, table[setting], f"{path}: {setting}")
    values["api_keys"] = _api_keys(flags, environ, table, path)
    return DaemonConfig(**values)


def _parsed(parse: Callable[[Any], Any], value: Any, where: str) -> Any:
    try:
        return parse(value)
    except ValueError as error:
        raise ConfigError(f"{where}: expected {error}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path}: not found; pass an existing TOML file to --config or {CONFIG_ENV}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path}: cannot be read ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path}: not valid TOML ({error})") from None
    unknown = sorted(set(table) - set(_PARSERS) - set(_LIST_SETTINGS))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {', '.join(unknown)}; "
            f"the keys are {', '.join(sorted((*_PARSERS, *_LIST_SETTINGS)))}"
        )
    return table


def _api_keys(
    flags: Mapping[str, Any], environ: Mapping[str, str], table: Mapping[str, Any], path: Path | None
) -> tuple[str, ...]:
    sources: list[tuple[list[Any], Any, str, str]] = [
        (list(flags.get("api_key") or []), flags.get("api_key_file"), "--api-key", "--api-key-file"),
        (
            [k for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()],
            environ.get(API_KEY_FILE_ENV) or None,
            API_KEYS_ENV,
            API_KEY_FILE_ENV,
        ),
    ]
    table_keys = table.get("api_keys", [])
    if not isinstance(table_keys, list):
        raise ConfigError(f'{path}: api_keys: expected an array of strings such as ["sk-1", "sk-2"]')
    sources.append((table_keys, table.get("api_key_file"), f"{path}: api_keys", f"{path}: api_key_file"))
    for keys, key_file, keys_where, file_where in sources:
        if not keys and key_file is None:
            continue
        found = [_api_key(key, keys_where) for key in keys]
        if key_file is not None:
            found.extend(_api_key_file(key_file, file_where))
        return tuple(dict.fromkeys(found))
    return ()


def _api_key(key: Any, where: str) -> str:
    if not isinstance(key, str):
        raise ConfigError(f"{where}: expected an API key (a string), got {type(key).__name__}")
    key = key.strip()
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"{where}: expected a non-empty API key without whitespace")
    return key


def _api_key_file(key_file: Any, where: str) -> list[str]:
    if not isinstance(key_file, str) or not key_file:
        raise ConfigError(f"{where}: expected a path to a file with one API key a line, got {key_file!r}")
    try:
        lines = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{where}: cannot read {key_file} ({error}); pass a readable file with one API key a line"
        ) from None
    keys = [
        _api_key(line, f"{where} {key_file}") for line in map(str.strip, lines) if line and not line.startswith("#")
    ]
    if not keys:
        raise ConfigError(f"{where}: {key_file} holds no API key; write one key a line")
    return keys
