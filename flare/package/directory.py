"""A prepared package on disk: writing it atomically, opening and verifying it.

A package is a directory:

    manifest.json         the Manifest, with the sha256 of every other file
    model.safetensors     weights with Hugging Face Llama names, in serving.dtype (every weight
                          not kept as blocks)
    model.blocks          quantized weights as ggml blocks, only where the manifest has `blocks`
                          (`blocks.py`); a package with blocks stores the rest in float32
    tokenizer.json        a Hugging Face `tokenizers` tokenizer
    chat_template.jinja   the chat template (Jinja, rendered sandboxed by the engine)
    draft_head.safetensors  the learned draft head, only where the manifest has `draft_head`
                          (`draft_head.py`)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from flare.package.blocks import (
    BLOCKS_NAME,
    BlocksError,
    BlockTensor,
    dequantized,
    entry_problems,
    map_blocks,
    write_blocks,
)
from flare.package.draft_head import DRAFT_HEAD_NAME, FINAL_NORM_TENSOR, draft_head_shapes
from flare.package.layer_shapes import decoder_layer_shapes
from flare.package.manifest import MANIFEST_NAME, DraftHeadInfo, Manifest, Provenance, ServingConfig
from flare.package.model_config import ManifestError, ModelConfig
from flare.package.problems import listed
from flare.package.staging import claim_staging, remove_abandoned_staging
from flare.policy.policy import SamplingPolicy

WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
PACKAGE_FILES = (WEIGHTS_NAME, TOKENIZER_NAME, CHAT_TEMPLATE_NAME)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# The largest finite float16: a weight beyond it cannot be stored, nor multiplied, in float16.
FLOAT16_MAX = torch.finfo(torch.float16).max


def fits_float16(weights: torch.Tensor) -> bool:
    """Whether every value of `weights` is finite in float16 (float16 tops out at 65504)."""
    return bool(weights.abs().max() <= FLOAT16_MAX) if weights.numel() else True


class PackageError(Exception):
    """A package that cannot be written or served; `problems` lists every reason."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of `model.safetensors` and its shape ([out, in] for linear weights).

    Names are Hugging Face Llama's for every family, with `post_attention_layernorm` the norm
    before the MLP. What the family fields add (`ModelConfig`): q/k/v biases
    (`self_attn.{q,k,v}_proj.bias`), per-head q/k norms (`self_attn.{q,k}_norm.weight`,
    [head_dim]), and sandwich norms on the sublayers' outputs (`attention_output_norm.weight`,
    `mlp_output_norm.weight`; Gemma's `post_attention_layernorm`, `pre_feedforward_layernorm`
    and `post_feedforward_layernorm` are renamed to these three at export).

    A mixture-of-experts layer (`ModelConfig.moe_layers`) holds, instead of the dense
    `mlp.{gate,up,down}_proj.weight`, with E experts of width I (`moe_intermediate_size`):
    `mlp.router.weight` [E, hidden] (its logits: x @ router^T), `mlp.router.bias` [E] where
    `router_bias`, `mlp.router.score_correction_bias` [E] for sigmoid_group routing (DeepSeek-V3's
    `e_score_correction_bias`, float32); the experts stacked, one tensor per projection,
    `mlp.experts.gate_up_proj.weight` [E, 2 I, hidden] (expert e's gate rows, then its up rows:
    transformers 5's fused layout, so that one expert's gate and up are one contiguous [2 I,
    hidden] matrix, as floats or as block rows mapped from the file) and
    `mlp.experts.down_proj.weight` [E, hidden, I]; where the model has a shared expert of width S
    (`shared_expert_intermediate_size`), `mlp.shared_expert.{gate,up}_proj.weight` [S, hidden] and
    `mlp.shared_expert.down_proj.weight` [hidden, S], and with `shared_expert_gate`
    `mlp.shared_expert_gate.weight` [1, hidden]; with `expert_bias` the experts' biases
    `mlp.experts.gate_up_proj.bias` [E, 2 I] (gate's, then up's) and `mlp.experts.down_proj.bias`
    [E, hidden] (gpt-oss).

    gpt-oss adds `self_attn.o_proj.bias` [hidden] (`attention_output_bias`) and
    `self_attn.sinks` [heads] (`attention_sinks`).
    """
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        shapes.update(decoder_layer_shapes(config, i, f"model.layers.{i}"))
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def layers_held(names: Iterable[str], pattern: re.Pattern[str] = _LAYER_TENSOR) -> int:
    """How many distinct layers the tensors `names` belong to (`pattern` matches a layer's
    tensor name, its first group the index): the bound on a layer count a source may claim."""
    return len({match.group(1) for name in names if (match := pattern.match(name)) is not None})


def weight_problems(
    config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source_name: Callable[[str], str] | None = None
) -> list[str]:
    """Missing, unexpected and mis-shaped tensors, one line each (empty when all match).
    `source_name`: what a source calls a tensor, named beside the package's name where it
    differs. A config claiming more layers than the tensors hold is that one problem: nothing is
    listed per layer, so a claim of millions costs nothing."""
    held = layers_held(shapes)
    if config.num_layers > held:
        return [f"the config claims {config.num_layers} layers but the weights hold tensors for {held}"]

    def weight(name: str) -> str:
        source = name if source_name is None else source_name(name)
        return f"weight {name}" if source == name else f"weight {name} ({source})"

    expected = expected_weight_shapes(config)
    problems = [f"{weight(name)} is missing" for name in expected if name not in shapes]
    problems += [
        f"{weight(name)} is not part of a {config.architecture} model with this config"
        for name in shapes
        if name not in expected
    ]
    problems += [
        f"{weight(name)} has shape {list(shapes[name])}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and tuple(shapes[name]) != shape
    ]
    return problems


def check_destination(out_dir: Path, *, overwrite: bool) -> None:
    """Raise PackageError unless a package may be written at out_dir.

    An existing directory is replaced only with overwrite, and only when it is empty or holds a
    package (a manifest.json), so a mistyped -o never deletes unrelated files.
    """
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise PackageError(f"{out_dir} exists and is not a directory; choose another output directory with -o")
    if not overwrite:
        raise PackageError(
            f"{out_dir} already exists; pass --overwrite to replace it, or choose another directory with -o"
        )
    if any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file():
        raise PackageError(
            f"{out_dir} is not empty and holds no package (no {MANIFEST_NAME}); "
            "--overwrite replaces only packages, so choose another directory with -o"
        )


def write_package(
    out_dir: Path,
    *,
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    tokenizer_json: str,
    chat_template: str,
    policy: SamplingPolicy,
    serving: ServingConfig,
    provenance: Provenance,
    overwrite: bool = False,
    draft_head: tuple[DraftHeadInfo, Mapping[str, torch.Tensor]] | None = None,
    blocks: Mapping[str, BlockTensor] | None = None,
    dequantized: Mapping[str, str] | None = None,
) -> Manifest:
    """Write a package at out_dir, atomically: all of it appears at once, or nothing does.

    `blocks`: weights kept as ggml blocks (`model.blocks`), checked by the caller
    (`blocks.block_problems`); `state_dict` then holds every other weight.

    Files go into a temporary directory next to out_dir (same file system), are fsynced, and the
    directory is renamed into place; any failure or interrupt removes the temporary directory.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite=overwrite)
    blocks = blocks or {}
    shapes = {name: tuple(t.shape) for name, t in state_dict.items()}
    problems = [f"weight {name} is given both as blocks and as floats" for name in blocks if name in shapes]
    problems += weight_problems(config, {**shapes, **{name: t.shape for name, t in blocks.items()}})
    if problems:
        raise PackageError("the weights do not match the model config" + listed(problems), tuple(problems))
    head_info = draft_head[0] if draft_head is not None else None
    if draft_head is not None:
        problems = _head_problems(config, head_info, {n: tuple(t.shape) for n, t in draft_head[1].items()})
        if problems:
            raise PackageError("the draft head does not match the model" + listed(problems), tuple(problems))
    # Validates the combination (max_context against the model, max_tokens against max_context).
    manifest = Manifest(model=config, serving=serving, sampling=policy, provenance=provenance, draft_head=head_info)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(out_dir)  # what a killed export left (staging.py)
    claimed = claim_staging(out_dir)
    staging = claimed.path
    try:
        dtype = TORCH_DTYPES[serving.dtype]
        tensors = {name: state_dict[name].detach().to("cpu", dtype).contiguous() for name in state_dict}
        save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        del tensors
        (staging / TOKENIZER_NAME).write_text(tokenizer_json, encoding="utf-8")
        (staging / CHAT_TEMPLATE_NAME).write_text(chat_template, encoding="utf-8")
        names = list(PACKAGE_FILES)
        entries = {}
        if blocks:
            entries = write_blocks(staging / BLOCKS_NAME, blocks, list(expected_weight_shapes(config)))
            names.append(BLOCKS_NAME)
        if draft_head is not None:
            head_dtype = TORCH_DTYPES[draft_head[0].dtype]
            save_file(
                {
                    name: t.detach().to("cpu", t.dtype if not t.is_floating_point() else head_dtype).contiguous()
                    for name, t in draft_head[1].items()
                },
                str(staging / DRAFT_HEAD_NAME),
                metadata={"format": "pt"},
            )
            names.append(DRAFT_HEAD_NAME)
        files = {}
        for name in names:
            # safetensors creates its file 0600; a package is read by the daemon's own user.
            os.chmod(staging / name, 0o644)
            _fsync(staging / name)
            files[name] = sha256_of(staging / name)
        manifest = Manifest(
            model=config,
            serving=serving,
            sampling=policy,
            provenance=provenance,
            files=files,
            draft_head=head_info,
            blocks=entries,
            dequantized=dict(dequantized or {}),
        )
        (staging / MANIFEST_NAME).write_text(manifest.dumps(), encoding="utf-8")
        _fsync(staging / MANIFEST_NAME)
        _fsync(staging)
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        claimed.release()
    return manifest


def _move_into_place(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        # Two renames rather than rmtree-then-rename: the old package stays whole until the new
        # one is complete; a crash between the renames leaves no package at out_dir, never half of one.
        retired = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(out_dir, retired)
        os.rename(staging, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, out_dir)
    _fsync(out_dir.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class IntegrityReport:
    """The result of checking a package directory against its manifest.

    files maps each file the manifest lists, and each file it does not, to one of
    "ok", "missing", "checksum mismatch", "not in manifest", "invalid name" (a listed name that
    is not a plain file name in the package directory).
    """

    path: Path
    files: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    manifest: Manifest | None = None  # None when manifest.json is missing or unreadable

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "files": dict(self.files), "problems": list(self.problems)}


def verify_package(path: Path) -> IntegrityReport:
    """Check every file of the package at path against the manifest's checksums."""
    path = Path(path)
    if not path.is_dir():
        return IntegrityReport(path, problems=(f"{path} is not a directory",))
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return IntegrityReport(path, problems=(f"{MANIFEST_NAME} is missing",))
    try:
        manifest = Manifest.loads(manifest_path.read_text(encoding="utf-8"))
    except (ManifestError, UnicodeDecodeError, TypeError) as error:
        return IntegrityReport(path, problems=(f"{MANIFEST_NAME}: {error}",))

    statuses: dict[str, str] = {}
    problems: list[str] = []
    for name in PACKAGE_FILES:
        if name not in manifest.files:
            problems.append(f"{MANIFEST_NAME} lists no checksum for {name}")
    for name, digest in sorted(manifest.files.items()):
        file = path / name
        if Path(name).name != name or name == MANIFEST_NAME:
            statuses[name] = "invalid name"
            problems.append(f"{MANIFEST_NAME} lists an invalid file name {name!r}")
        elif not file.is_file():
            statuses[name] = "missing"
            problems.append(f"{name} is missing")
        elif sha256_of(file) != digest:
            statuses[name] = "checksum mismatch"
            problems.append(f"{name} does not match its checksum (changed or truncated after export)")
        else:
            statuses[name] = "ok"
    for file in sorted(path.iterdir()):
        if file.name != MANIFEST_NAME and file.name not in manifest.files:
            statuses[file.name] = "not in manifest"
            problems.append(f"{file.name} is not part of the package (not in {MANIFEST_NAME})")
    if manifest.blocks and BLOCKS_NAME not in manifest.files:
        problems.append(f"{MANIFEST_NAME} describes blocks but lists no checksum for {BLOCKS_NAME}")
    elif BLOCKS_NAME in manifest.files and not manifest.blocks:
        problems.append(f"{BLOCKS_NAME} is listed but the manifest describes no blocks")
    if statuses.get(WEIGHTS_NAME) == "ok" and statuses.get(BLOCKS_NAME, "ok") == "ok":
        problems += _weights_header_problems(path, manifest)
    if manifest.draft_head is not None:
        if DRAFT_HEAD_NAME not in manifest.files:
            problems.append(f"{MANIFEST_NAME} describes a draft head but lists no checksum for {DRAFT_HEAD_NAME}")
        elif statuses.get(DRAFT_HEAD_NAME) == "ok":
            try:
                with safe_open(str(path / DRAFT_HEAD_NAME), framework="pt") as f:
                    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
                problems += _head_problems(manifest.model, manifest.draft_head, shapes)
            except (SafetensorError, OSError) as error:
                problems.append(f"{DRAFT_HEAD_NAME} cannot be read: {error}")
    elif DRAFT_HEAD_NAME in manifest.files:
        problems.append(f"{DRAFT_HEAD_NAME} is listed but the manifest describes no draft head")
    return IntegrityReport(path, statuses, tuple(problems), manifest)


def _weights_header_problems(path: Path, manifest: Manifest) -> list[str]:
    weights = path / WEIGHTS_NAME
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    except (SafetensorError, OSError) as error:
        return [f"{WEIGHTS_NAME} cannot be read: {error}"]
    if manifest.model.num_layers > layers_held([*shapes, *manifest.blocks]):
        # The one problem, before anything is built per layer the manifest claims.
        return weight_problems(manifest.model, {**shapes, **dict.fromkeys(manifest.blocks, ())})
    expected = expected_weight_shapes(manifest.model)
    problems = [f"weight {name} is both in {WEIGHTS_NAME} and in {BLOCKS_NAME}" for name in manifest.blocks if name in shapes]
    problems += weight_problems(manifest.model, {**shapes, **{n: expected.get(n, ()) for n in manifest.blocks}})
    if manifest.blocks and not problems:
        size = (path / BLOCKS_NAME).stat().st_size
        problems += [p for n, e in manifest.blocks.items() for p in entry_problems(n, e, expected[n], size)]
    wanted = _SAFETENSORS_DTYPES[manifest.serving.dtype]
    if dtypes - {wanted}:
        problems.append(
            f"{WEIGHTS_NAME} holds {', '.join(sorted(dtypes))} tensors, serving.dtype says {manifest.serving.dtype}"
        )
    return problems


def _head_problems(config: ModelConfig, info: DraftHeadInfo | None, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    assert info is not None
    expected = draft_head_shapes(config, info.draft_vocab_size, own_final_norm=FINAL_NORM_TENSOR in shapes, layer=info.layer)
    problems = [f"draft head tensor {name} is missing" for name in expected if name not in shapes]
    problems += [f"draft head tensor {name} is not part of a draft head" for name in shapes if name not in expected]
    problems += [
        f"draft head tensor {name} has shape {list(shapes[name])}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and tuple(shapes[name]) != shape
    ]
    return problems


@dataclass(frozen=True)
class Package:
    """An opened, verified package."""

    path: Path
    manifest: Manifest

    @property
    def tokenizer_json_path(self) -> Path:
        return self.path / TOKENIZER_NAME

    @property
    def chat_template(self) -> str:
        return (self.path / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8")

    def load_weights(self, *, huge_pages: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, BlockTensor]]:
        """The weights, with Hugging Face Llama names: those of model.safetensors in
        serving.dtype, and those kept as blocks mapped from model.blocks (not copied; with
        `huge_pages`, the matrices moved into huge pages, `blocks.in_huge_pages`). Raises
        PackageError naming a tensor whose blocks cannot be served (a NaN or infinite scale)."""
        floats = load_file(str(self.path / WEIGHTS_NAME))
        try:
            blocks = map_blocks(
                self.path / BLOCKS_NAME, self.manifest.blocks, expected_weight_shapes(self.manifest.model), huge_pages=huge_pages
            )
        except BlocksError as error:
            raise PackageError(f"the package at {self.path} cannot be used: {error}", (str(error),)) from None
        return floats, blocks

    def load_state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every weight as a tensor, with Hugging Face Llama names: in serving.dtype, and those
        kept as blocks dequantized to float32 (gguf-py's values)."""
        floats, blocks = self.load_weights()
        state = {**floats, **{name: dequantized(tensor) for name, tensor in blocks.items()}}
        return {name: tensor.to(device) for name, tensor in state.items()}

    def load_tensor(self, name: str) -> torch.Tensor:
        """One weight as float32 (dequantized if it is kept as blocks)."""
        if name in self.manifest.blocks:
            return dequantized(self.load_weights()[1][name])
        with safe_open(str(self.path / WEIGHTS_NAME), framework="pt") as f:
            return f.get_tensor(name).float()

    def weight_types(self) -> dict[str, dict[str, int]]:
        """`weight_types` of this package's manifest."""
        return weight_types(self.manifest)

    def load_draft_head(self) -> dict[str, torch.Tensor]:
        """The draft head's tensors (`draft_head.py`); PackageError when the package ships none."""
        if self.manifest.draft_head is None:
            raise PackageError(
                f"the package at {self.path} ships no draft head; re-export it with --drafter mtp to distill one"
            )
        return load_file(str(self.path / DRAFT_HEAD_NAME))


_FLOAT_TYPE_NAMES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2)}


def weight_types(manifest: Manifest) -> dict[str, dict[str, int]]:
    """Tensors and bytes of the weights by the type they are stored in (ggml names: Q4_1, F32, ...),
    largest first: what `flare inspect`, the `engine_loaded` log line and `flare ctl status` report."""
    float_type, float_size = _FLOAT_TYPE_NAMES[manifest.serving.dtype]
    totals: dict[str, dict[str, int]] = {}
    for name, shape in expected_weight_shapes(manifest.model).items():
        entry = manifest.blocks.get(name)
        kind = entry.type if entry is not None else float_type
        nbytes = entry.nbytes if entry is not None else float_size * _numel(shape)
        total = totals.setdefault(kind, {"tensors": 0, "bytes": 0})
        total["tensors"] += 1
        total["bytes"] += nbytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]["bytes"]))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def open_package(path: Path) -> Package:
    """Open the package at path after verifying it; PackageError lists every problem found."""
    path = Path(path)
    report = verify_package(path)
    if report.manifest is None or not report.ok:
        raise PackageError(
            f"the package at {path} cannot be used (re-export it: flare export SOURCE -o {path} --overwrite)"
            + listed(report.problems),
            report.problems,
        )
    return Package(path=path, manifest=report.manifest)
