"""The sampler's CPU kernels (flare/sampler/csrc/, module `flare.sampler._native`), checked and
called on tensors.

- `stream_uniforms` and `top_p_threshold`: the sampler's random stream over whole vocabulary rows
  and its top-p radix select, the bits of their torch twins (random_stream.py, distribution.py;
  one pass where those take ten, and a 2048-bin histogram in cache where they call bincount).
- `kept_gumbel_argmax`: a Gumbel-max candidate per row over its kept tokens (gumbel_max.py's
  candidates of one shard without a draft distribution), one pass where the twin takes five.
- `greedy_tokens`: a round of greedy rows (bias, penalties and draft verification included),
  sample_round's results for it in one call instead of a few hundred operators, each of which
  costs more to dispatch at one row than its arithmetic.

The extension is optional, as the engine's is: where it was not built (no C compiler at install
time) the twins run. The kernels trust the addresses they are given, so every function here
first checks the tensors behind them; they release the GIL and run on `torch.get_num_threads()`
threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flare.sampler.status import DeviceStatus

if TYPE_CHECKING:
    from flare.sampler.batch import SamplingBatch

try:
    from flare.sampler import _native
except ImportError:  # built without a C compiler: the torch twins run
    _native = None


def available() -> bool:
    """Whether the kernels were built and import."""
    return _native is not None


def _module():
    if _native is None:
        raise RuntimeError("the sampler's CPU kernels were not built; the torch twins must be used")
    return _native


def stream_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The random stream's uniforms u = ((mix32(key + i GOLDEN) >> 8) + 0.5) 2^-24 at every
    vocabulary index i of every stream, [rows, vocab_size] float32: the bits of the torch twin's
    `uniform`-and-`gumbel_` steps before their logarithms (random_stream.py)."""
    native = _module()
    if keys.dtype != torch.int32 or keys.device.type != "cpu" or keys.dim() != 1 or not keys.is_contiguous():
        raise ValueError(f"stream_uniforms: keys must be a contiguous CPU int32 [rows], got {keys.device} {keys.dtype} {tuple(keys.shape)}")
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32)
    native.stream_uniforms(keys.data_ptr(), keys.shape[0], vocab_size, out.data_ptr(), torch.get_num_threads())
    return out


def top_p_threshold(scaled: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of `scaled` [N, V], the largest logit whose tokens carry at least `target` [N] of
    `mass` [N, V] (float32, contiguous): the bits of the torch twin's radix select
    (distribution.py, `largest_reaching_mass`)."""
    native = _module()
    rows, vocab = scaled.shape
    problems = [
        f"{name} must be a CPU torch.float32 tensor, got {tensor.device} {tensor.dtype}"
        for name, tensor in (("scaled", scaled), ("mass", mass), ("target", target))
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32
    ]
    if mass.shape != scaled.shape or target.shape != (rows,) or not all(t.is_contiguous() for t in (scaled, mass, target)):
        problems.append(f"scaled and mass must be contiguous [{rows}, {vocab}] and target [{rows}]")
    if problems:
        raise ValueError("top_p_threshold: " + "; ".join(problems))
    out = torch.empty(rows, dtype=torch.float32)
    if rows:
        native.top_p_threshold(scaled.data_ptr(), mass.data_ptr(), target.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads())
    return out


def kept_gumbel_argmax(
    noise: torch.Tensor, scaled: torch.Tensor, position: torch.Tensor, threshold: torch.Tensor, exclude: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r of `noise` [R, V] samples position `position[r]` of `scaled` [N, V]: the first index
    of the largest noise + logit over the tokens with logit >= `threshold[r]`, token `exclude[r]`
    (-1: none) left out, and that value ([R] int64, [R] float32; index 0 and -inf where no token
    is kept): the twin's argmax and value (gumbel_max.py)."""
    native = _module()
    rows, vocab = noise.shape
    floats = (("noise", noise), ("scaled", scaled), ("threshold", threshold))
    longs = (("position", position), ("exclude", exclude))
    problems = [
        f"{name} must be a contiguous CPU {dtype}, got {tensor.device} {tensor.dtype}"
        for group, dtype in ((floats, torch.float32), (longs, torch.int64))
        for name, tensor in group
        if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous()
    ]
    if scaled.dim() != 2 or scaled.shape[1] != vocab or any(t.shape != (rows,) for _, t in (*longs, ("threshold", threshold))):
        problems.append(f"scaled must be [N, {vocab}] and position, threshold and exclude [{rows}]")
    elif rows and not 0 <= int(position.min()) <= int(position.max()) < scaled.shape[0]:
        problems.append(f"positions must be rows of scaled (0..{scaled.shape[0] - 1})")
    if problems:
        raise ValueError("kept_gumbel_argmax: " + "; ".join(problems))
    index = torch.empty(rows, dtype=torch.int64)
    value = torch.empty(rows, dtype=torch.float32)
    if rows:
        native.kept_gumbel_argmax(
            noise.data_ptr(), scaled.data_ptr(), position.data_ptr(), threshold.data_ptr(), exclude.data_ptr(),
            rows, vocab, index.data_ptr(), value.data_ptr(), torch.get_num_threads(),
        )
    return index, value


def greedy_tokens(
    logits: torch.Tensor, num_drafts: torch.Tensor, draft_tokens: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [R, Kmax + 1] int64 (the accepted drafts, then the argmax after bias and penalties,
    then -1), emitted [R] int32 and status [R] int32 of a round whose rows are all greedy or
    invalid (greedy_tokens.c): sample_round's results for such a round without a token mask,
    draft probabilities or log-probabilities. The penalty ids are read only when some row is
    penalized (`batch.facts`), as in sample_round."""
    native = _module()
    positions, vocab = logits.shape
    rows, max_drafts = draft_tokens.shape
    parameters = {
        "temperature": batch.temperature, "top_p": batch.top_p, "min_p": batch.min_p,
        "repetition_penalty": batch.repetition_penalty, "presence_penalty": batch.presence_penalty,
        "frequency_penalty": batch.frequency_penalty, "top_k": batch.top_k,
    }
    penalized = batch.facts.any_penalized
    prompt_ids, output_ids = (batch.prompt_ids, batch.output_ids) if penalized else (None, None)
    lists = {"prompt_ids": prompt_ids, "output_ids": output_ids, "bias_ids": batch.bias_ids}
    problems = []
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        problems.append(f"logits must be a contiguous CPU torch.float32 [positions, vocab], got {logits.device} {logits.dtype}")
    if draft_tokens.device.type != "cpu" or draft_tokens.dtype != torch.int64 or not draft_tokens.is_contiguous():
        problems.append("draft_tokens must be a contiguous CPU torch.int64 [rows, max_drafts]")
    for name, tensor in {**parameters, "num_drafts": num_drafts}.items():
        dtype = torch.int64 if name in ("top_k", "num_drafts") else torch.float32
        if tensor.device.type != "cpu" or tensor.dtype != dtype or tensor.shape != (rows,) or not tensor.is_contiguous():
            problems.append(f"{name} must be a contiguous CPU {dtype} [{rows}]")
    for name, tensor in lists.items():
        if tensor is not None and (
            tensor.device.type != "cpu" or tensor.dtype != torch.int64 or tensor.dim() != 2
            or tensor.shape[0] != rows or not tensor.is_contiguous()
        ):
            problems.append(f"{name} must be a contiguous CPU torch.int64 [{rows}, width]")
    if penalized and (prompt_ids is None or output_ids is None):
        problems.append("a penalized batch must carry prompt_ids and output_ids")
    bias_values = batch.bias_values
    if (batch.bias_ids is None) != (bias_values is None) or (
        bias_values is not None and batch.bias_ids is not None and (
            bias_values.device.type != "cpu" or bias_values.dtype != torch.float32
            or bias_values.shape != batch.bias_ids.shape or not bias_values.is_contiguous()
        )
    ):
        problems.append("bias_values must be a contiguous CPU torch.float32 tensor shaped as bias_ids")
    if problems:
        raise ValueError("greedy_tokens: " + "; ".join(problems))

    def address(tensor: torch.Tensor | None) -> int:
        return 0 if tensor is None else tensor.data_ptr()

    def columns(tensor: torch.Tensor | None) -> int:
        return 0 if tensor is None else tensor.shape[1]

    tokens = torch.empty(rows, max_drafts + 1, dtype=torch.int64)
    emitted = torch.empty(rows, dtype=torch.int32)
    status = torch.empty(rows, dtype=torch.int32)
    native.greedy_tokens(
        logits.data_ptr(), rows, positions, vocab, max_drafts, num_drafts.data_ptr(), draft_tokens.data_ptr(),
        *(tensor.data_ptr() for tensor in parameters.values()),
        address(prompt_ids), columns(prompt_ids), address(output_ids), columns(output_ids),
        address(batch.bias_ids), address(bias_values), columns(batch.bias_ids),
        DeviceStatus.EMPTY_DISTRIBUTION, DeviceStatus.NONFINITE_LOGITS, DeviceStatus.INVALID_DRAFT_TOKEN,
        DeviceStatus.INVALID_SAMPLING_PARAMETERS,
        tokens.data_ptr(), emitted.data_ptr(), status.data_ptr(), torch.get_num_threads(),
    )
    return tokens, emitted, status
