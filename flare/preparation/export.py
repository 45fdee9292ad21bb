"""`flare export`: prepare a package from a GGUF file, a Hugging Face directory, or the default model.

Every option is checked before any heavy work: first on its own, then against the destination and
the source's metadata (architecture, tokenizer, chat template). Only then are the weights read,
converted and written, atomically (`write_package`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TextIO

import torch

from flare.package.chat_template import check_chat_template
from flare.package.contract import check_contract
from flare.preparation.default_model import DEFAULT_SOURCE, default_gguf_path
from flare.preparation.gguf_source import open_gguf
from flare.preparation.hf_source import open_hf_directory
from flare.package.manifest import AUTO_DTYPE, DRAFTERS, DTYPES, MANIFEST_NAME, MAX_DRAFT_TOKENS, Manifest, Provenance, ServingConfig
from flare.package.model_config import ManifestError
from flare.package.directory import PackageError, check_destination, fits_float16, write_package
from flare.preparation.quantize import QUANTIZE_TYPES, quantize_weights
from flare.preparation.recipes import Recipe, recipe_for, with_declared_defaults
from flare.preparation.stop_tokens import with_template_stop_tokens
from flare.preparation.source import ModelSource, SourceError, SourceWeights
from flare.policy.policy import (
    FILTER_PARAMS,
    INTEGER_PARAMS,
    POLICY_PARAMS,
    PolicyError,
    SamplingPolicy,
    filter_enabled,
    range_allows_filter,
)
from flare.policy.validation import InvalidParameter, check_raw_range, integer, real_number

Number = int | float

# Filter values that disable each filter, for resetting a recipe's defaults under
# --vocabulary-parallel-sampling.
_DISABLED_FILTERS: dict[str, Number] = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}


class ExportError(Exception):
    """An export that cannot go ahead. `option` names the command-line option at fault, if one is."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class ExportOptions:
    """The options of `flare export`; None means the recipe's (or the model's) value."""

    name: str | None = None  # None: the model's own name
    max_concurrency: int | None = None
    max_context: int | None = None
    dtype: str = AUTO_DTYPE  # resolved by `resolve_dtype`
    sampling_defaults: Mapping[str, Number] = field(default_factory=dict)
    sampling_ranges: Mapping[str, tuple[Number, Number]] = field(default_factory=dict)
    vocabulary_parallel_sampling: bool = False
    draft_tokens: int | None = None
    drafter: str = "ngram"
    overwrite: bool = False
    quantize: str | None = None  # QUANTIZE_TYPES: a directory's float weights, or a GGUF's tensors it would store as floats, to blocks


# What a client may send as `model`: no spaces or control characters, as OpenAI model ids.
_MODEL_NAME = re.compile(r"[A-Za-z0-9._\-/:]{1,128}")

def parse_sampling_default(text: str) -> tuple[str, Number]:
    """`NAME=VALUE` of --sampling-default, checked against the raw range of NAME."""
    name, value = _split_assignment(text, "--sampling-default", "NAME=VALUE, e.g. temperature=0.7")
    return name, _parse_value(name, value, "--sampling-default")


def parse_sampling_range(text: str) -> tuple[str, tuple[Number, Number]]:
    """`NAME=LO:HI` of --sampling-range, both bounds checked against the raw range of NAME."""
    name, bounds = _split_assignment(text, "--sampling-range", "NAME=LO:HI, e.g. top_p=0.1:1")
    lo, sep, hi = bounds.partition(":")
    if not sep:
        raise ExportError(f"--sampling-range {text}: expected NAME=LO:HI, e.g. top_p=0.1:1", option="--sampling-range")
    return name, (_parse_value(name, lo, "--sampling-range"), _parse_value(name, hi, "--sampling-range"))


def _split_assignment(text: str, option: str, form: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep:
        raise ExportError(f"{option} {text}: expected {form}", option=option)
    if name not in POLICY_PARAMS:
        raise ExportError(
            f"{option} {text}: {name!r} is not a policy parameter; choose one of {', '.join(POLICY_PARAMS)}",
            option=option,
        )
    return name, value.strip()


def _parse_value(name: str, text: str, option: str) -> Number:
    try:
        number = float(text)
    except ValueError:
        raise ExportError(f"{option}: {name} takes a number, got {text!r}", option=option) from None
    try:
        value: Number = integer(name, number) if name in INTEGER_PARAMS else real_number(name, number)
        check_raw_range(name, value)
    except InvalidParameter as error:
        raise ExportError(f"{option}: {error.message}", option=option) from None
    return value


def check_options(options: ExportOptions) -> None:
    """The checks that need neither the source nor the destination."""
    if options.max_concurrency is not None and options.max_concurrency < 1:
        raise ExportError(
            f"--max-concurrency must be at least 1, got {options.max_concurrency}", option="--max-concurrency"
        )
    if options.name is not None and not _MODEL_NAME.fullmatch(options.name):
        raise ExportError(
            f"--name {options.name!r}: use 1 to 128 letters, digits and . _ - / : (no spaces), "
            "e.g. --name my-model-v2",
            option="--name",
        )
    if options.max_context is not None and options.max_context < 1:
        raise ExportError(f"--max-context must be at least 1, got {options.max_context}", option="--max-context")
    if options.dtype not in (AUTO_DTYPE, *DTYPES):
        raise ExportError(
            f"--dtype must be one of {', '.join((AUTO_DTYPE, *DTYPES))}, got {options.dtype!r}", option="--dtype"
        )
    if options.quantize is not None and options.quantize not in QUANTIZE_TYPES:
        raise ExportError(
            f"--quantize must be one of {', '.join(QUANTIZE_TYPES)}, got {options.quantize!r}", option="--quantize"
        )
    if options.quantize is not None and options.dtype != AUTO_DTYPE:
        raise ExportError(
            f"--quantize {options.quantize} stores the weights as blocks; it cannot be combined with "
            f"--dtype {options.dtype} (drop one of the two)",
            option="--quantize",
        )
    if options.draft_tokens is not None and not 0 <= options.draft_tokens <= MAX_DRAFT_TOKENS:
        raise ExportError(
            f"--mtp-draft-tokens must be from 0 (no speculation) to {MAX_DRAFT_TOKENS}, got {options.draft_tokens}",
            option="--mtp-draft-tokens",
        )
    if options.drafter not in DRAFTERS:
        raise ExportError(
            f"--drafter must be one of {', '.join(DRAFTERS)}, got {options.drafter!r}", option="--drafter"
        )
    if options.vocabulary_parallel_sampling:
        for name, value in options.sampling_defaults.items():
            if filter_enabled(name, value):
                raise ExportError(
                    f"--sampling-default {name}={value} enables a filter, but --vocabulary-parallel-sampling "
                    "packages an unfiltered policy (the vocabulary-parallel sampler cannot filter); "
                    f"drop one of the two options (the disabled value is {name}={_DISABLED_FILTERS[name]})",
                    option="--sampling-default",
                )
        for name, (lo, hi) in options.sampling_ranges.items():
            if name in FILTER_PARAMS and range_allows_filter(name, lo, hi):
                raise ExportError(
                    f"--sampling-range {name}={lo}:{hi} allows filtering, but --vocabulary-parallel-sampling "
                    "packages an unfiltered policy (the vocabulary-parallel sampler cannot filter); "
                    "drop one of the two options",
                    option="--sampling-range",
                )


def resolve_dtype(dtype: str) -> str:
    """`dtype`, or for `auto` float16: one package that serves well on every CPU kind, whatever
    format the engine multiplies in there (`engine.precision`), and the closer of the 16-bit
    types to the source. (A quantized GGUF's blocks are kept under `auto` instead, and a model
    with a weight beyond float16's range is stored in bfloat16: `export_package`, `store_dtype`.)
    """
    return "float16" if dtype == AUTO_DTYPE else dtype


def store_dtype(options: ExportOptions, serving: ServingConfig, state_dict: Mapping[str, torch.Tensor]) -> ServingConfig:
    """`serving` with the dtype the weights can be stored in: float16 only where every weight
    is finite in it; `auto` then falls back to bfloat16, an explicit `--dtype float16` is refused."""
    if serving.dtype != "float16" or all(fits_float16(tensor) for tensor in state_dict.values()):
        return serving
    if options.dtype != AUTO_DTYPE:
        raise ExportError(
            "--dtype float16: a weight of this model lies beyond float16's range (65504); "
            "use --dtype bfloat16 or float32",
            option="--dtype",
        )
    return dataclasses.replace(serving, dtype="bfloat16")


def open_source(source: str) -> ModelSource:
    """The source `flare export` was given: 'default', a GGUF file or a Hugging Face directory;
    its stop ids with the end-of-turn tokens its chat template writes (stop_tokens.py)."""
    if source == DEFAULT_SOURCE:
        return with_template_stop_tokens(open_gguf(default_gguf_path(), source=DEFAULT_SOURCE))
    path = Path(source)
    if path.is_dir() and (path / MANIFEST_NAME).is_file() and not (path / "config.json").is_file():
        raise SourceError(
            f"{source} is a flare package, not a model: serve it with `flare run {source}`, or export "
            f"again from the model it was made from (`flare inspect {source}` names it as its source)"
        )
    if path.is_dir():
        return with_template_stop_tokens(open_hf_directory(path, source=source))
    if path.is_file():
        return with_template_stop_tokens(open_gguf(path, source=source))
    raise SourceError(
        f"source {source!r} does not exist; give a GGUF file, a Hugging Face model directory, or 'default'"
    )


def build_serving(options: ExportOptions, recipe: Recipe, model_context: int) -> ServingConfig:
    max_context = options.max_context if options.max_context is not None else model_context
    if max_context > model_context:
        raise ExportError(
            f"--max-context {max_context} exceeds the model's context length {model_context}; "
            f"give at most {model_context}",
            option="--max-context",
        )
    return ServingConfig(
        max_context=max_context,
        max_concurrency=options.max_concurrency if options.max_concurrency is not None else recipe.max_concurrency,
        dtype=resolve_dtype(options.dtype),
        vocabulary_parallel_sampling=options.vocabulary_parallel_sampling,
        draft_tokens=options.draft_tokens if options.draft_tokens is not None else recipe.draft_tokens,
        drafter=options.drafter,
    )


def build_policy(options: ExportOptions, recipe: Recipe, max_context: int) -> SamplingPolicy:
    """The recipe's policy with the command line's overrides; unfiltered for vocabulary-parallel sampling."""
    defaults: dict[str, Number] = dict(recipe.defaults)
    defaults["max_tokens"] = min(int(defaults["max_tokens"]), max_context)
    ranges: dict[str, tuple[Number, Number]] = {**recipe.ranges, "max_tokens": (1, max_context)}
    if options.vocabulary_parallel_sampling:
        # The recipe's filters give way to the sampler; explicit filters were refused in check_options.
        defaults.update(_DISABLED_FILTERS)
        ranges = {name: bounds for name, bounds in ranges.items() if name not in FILTER_PARAMS}
    defaults.update(options.sampling_defaults)
    ranges.update(options.sampling_ranges)
    if defaults["max_tokens"] > max_context or ranges["max_tokens"][1] > max_context:
        raise ExportError(
            f"max_tokens cannot exceed the context: at most {max_context} (--max-context) for its default and range",
            option="--sampling-default" if defaults["max_tokens"] > max_context else "--sampling-range",
        )
    try:
        policy = SamplingPolicy(defaults=defaults, ranges=ranges)
    except PolicyError as error:
        option = "--sampling-range" if options.sampling_ranges else "--sampling-default"
        raise ExportError(f"the sampling options do not make a valid policy: {error}", option=option) from None
    return policy.unfiltered() if options.vocabulary_parallel_sampling else policy


class _Progress:
    """Progress lines for a person at a terminal; nothing at all when stderr is a pipe or a log."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._enabled = stream.isatty()

    def step(self, text: str) -> None:
        if self._enabled:
            self._stream.write(f"{text}\n")
            self._stream.flush()

    def count(self, done: int, total: int) -> None:
        if self._enabled:
            end = "\n" if done == total else ""
            self._stream.write(f"\r  reading weights: {done}/{total} tensors{end}")
            self._stream.flush()


def export_package(source: str, out_dir: Path, options: ExportOptions, *, stderr: TextIO | None = None) -> Manifest:
    """Prepare the package of `source` at `out_dir`.

    Raises ExportError (an option is at fault, or the source cannot be served), with nothing
    written; any failure while writing leaves nothing at out_dir.
    """
    progress = _Progress(stderr if stderr is not None else sys.stderr)
    out_dir = Path(out_dir)
    check_options(options)
    try:
        check_destination(out_dir, overwrite=options.overwrite)
        progress.step(f"reading {source}")
        model = open_source(source)
    except (PackageError, SourceError) as error:
        raise ExportError(str(error)) from None
    unservable = check_chat_template(model.chat_template)
    if unservable is not None:
        raise ExportError(f"{source}: chat template: {unservable}; flare run would refuse it")
    reach = _token_ids_reach(model.tokenizer_json)
    if reach > model.config.vocab_size:
        raise ExportError(
            f"{source}: the tokenizer's token ids reach {reach - 1}, but the model's vocabulary (vocab_size, the rows "
            f"of its embedding) holds {model.config.vocab_size} tokens: text would become ids the model cannot read; "
            "the tokenizer is not this model's"
        )
    recipe = with_declared_defaults(recipe_for(model.config), model.declared_defaults)
    serving = build_serving(options, recipe, model.config.max_position_embeddings)
    policy = build_policy(options, recipe, serving.max_context)
    problems = check_contract(serving, policy, str(out_dir))
    if problems:
        raise ExportError("; ".join(problem.message for problem in problems))
    provenance = Provenance(
        name=options.name or model.name,
        source=model.source,
        source_format=model.source_format,
        source_sha256=model.source_sha256,
        recipe=recipe.name,
        flare_version=_flare_version(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    try:
        Manifest(model=model.config, serving=serving, sampling=policy, provenance=provenance)
    except ManifestError as error:
        raise ExportError(str(error)) from None

    # Everything is checked: the heavy part starts here.
    try:
        weights = read_weights(model, options, progress.count)
    except SourceError as error:
        raise ExportError(str(error)) from None
    if weights.blocks:
        # Everything not kept as blocks (norms, tensors of types without a kernel) is stored
        # exactly: the package then scores text as its own float32 dequantization does.
        serving = dataclasses.replace(serving, dtype="float32")
    else:
        serving = store_dtype(options, serving, weights.floats)
    kinds = sorted({t.ggml_type.name for t in weights.blocks.values()})
    progress.step(f"writing {out_dir} ({', '.join(kinds) + ' blocks, ' if kinds else ''}{serving.dtype} weights)")
    try:
        manifest = write_package(
            out_dir,
            config=model.config,
            state_dict=weights.floats,
            blocks=weights.blocks,
            dequantized=weights.dequantized,
            tokenizer_json=model.tokenizer_json,
            chat_template=model.chat_template,
            policy=policy,
            serving=serving,
            provenance=provenance,
            overwrite=options.overwrite,
        )
    except PackageError as error:
        raise ExportError(str(error)) from None
    progress.step(f"wrote {out_dir} (recipe {recipe.name})")
    return manifest


def read_weights(model: ModelSource, options: ExportOptions, progress: Callable[[int, int], None]) -> SourceWeights:
    """The source's weights as the options store them: quantized (`--quantize`), a GGUF's blocks
    kept (`--dtype auto`), or all float32 (a named --dtype, or a source without blocks).

    `--quantize` on a GGUF keeps the blocks flare multiplies as they are (byte for byte) and
    quantizes the matrices it would otherwise store as float32: tensors of a type without a
    kernel (Q2_K, Q3_K, IQ*: a Q3_K_M file's are four fifths of it, and dequantized they
    quadruple its size) and F16/F32 ones. The manifest still names their source type
    (`dequantized`), so `flare inspect` says they were quantized again."""
    if options.quantize is not None:
        if model.source_format == "gguf" and model.read_blocks is not None:
            read = model.read_blocks(progress)
            floats = quantize_weights(read.floats, options.quantize, model.config)
            return SourceWeights(floats.floats, {**read.blocks, **floats.blocks}, read.dequantized)
        return quantize_weights(model.read_weights(progress), options.quantize, model.config)
    if options.dtype == AUTO_DTYPE and model.read_blocks is not None:
        return model.read_blocks(progress)
    if model.read_dequantized is not None:
        return model.read_dequantized(progress)
    return SourceWeights(model.read_weights(progress), {})


def _token_ids_reach(tokenizer_json: str) -> int:
    """One past the largest token id a tokenizer.json (one the sources checked) can give: its
    model's vocabulary (a map of token to id, or Unigram's list of pieces by id) and added tokens."""
    spec = json.loads(tokenizer_json)
    vocab = (spec.get("model") or {}).get("vocab") or {}
    ids = [*(vocab.values() if isinstance(vocab, dict) else range(len(vocab))), *(t["id"] for t in spec.get("added_tokens") or [])]
    return max(ids, default=-1) + 1


def _flare_version() -> str:
    try:
        return version("flare")
    except PackageNotFoundError:
        return "unknown (run from a source tree)"
