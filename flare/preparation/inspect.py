"""`flare inspect`: what a package holds, whether its files are intact, and what contradicts itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flare.package.blocks import KEPT_TYPES
from flare.package.chat_template import check_chat_template
from flare.package.contract import Problem, check_contract
from flare.package.directory import CHAT_TEMPLATE_NAME, verify_package, weight_types
from flare.package.manifest import INTEGER_ACTIVATION_TYPES, auto_activations
from flare.package.model_config import ModelConfig
from flare.package.problems import capped

UNSERVABLE_CHAT_TEMPLATE = "unservable_chat_template"


def inspect_package(path: Path) -> dict[str, Any]:
    """The manifest as JSON, plus `weight_types` (tensors and bytes by stored type, `package.weight_types`),
    `integrity` (the checksum report) and `problems` (the contract check).

    When the manifest cannot be read, only `integrity` and an empty `problems` are given.
    """
    report = verify_package(Path(path))
    info: dict[str, Any] = report.manifest.to_json() if report.manifest is not None else {}
    if report.manifest is not None:
        info["weight_types"] = weight_types(report.manifest)
        info["integer_activation_types"] = sorted(set(INTEGER_ACTIVATION_TYPES) & set(info["weight_types"]))
        info["kv_cache"] = kv_cache_cost(report.manifest.model)
    info["integrity"] = report.to_json()
    problems = []
    if report.manifest is not None:
        problems = check_contract(report.manifest.serving, report.manifest.sampling, str(path))
        problems += _chat_template_problems(Path(path))
    info["problems"] = [problem.to_json() for problem in problems]
    return info


# Bytes an element of the KV cache takes in each dtype `flare run --kv-cache-dtype` takes.
_KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_cache_cost(config: ModelConfig) -> dict[str, Any]:
    """What one cached token costs the KV cache, all layers, in each dtype it may store (the
    model's layout, `ModelConfig.kv_layout`: a latent row for latent attention), and what each
    tensor-parallel rank keeps of it: its share of the KV heads, or the whole latent row (the
    latent is shared by every head, `parallel/tensor_split.py`)."""
    layout = config.kv_layout
    latent = config.latent_attention is not None
    return {
        "layout": "latent" if latent else "per kv head",
        "elements_per_token_per_layer": layout.elements_per_token,
        "bytes_per_token": {dtype: config.kv_elements_per_token * size for dtype, size in _KV_ITEMSIZE.items()},
        "per_tensor_parallel_rank": "whole" if latent else "its share of the kv heads",
    }


def _chat_template_problems(path: Path) -> list[Problem]:
    """The check `flare run` makes of the chat template (it compiles, and renders a plain
    conversation within its budget), as a problem; a missing file is integrity's to report."""
    try:
        source = (path / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    why = check_chat_template(source)
    if why is None:
        return []
    fix = f"export the package again from a source whose chat template works, or correct {CHAT_TEMPLATE_NAME}"
    return [Problem(UNSERVABLE_CHAT_TEMPLATE, f"{path / CHAT_TEMPLATE_NAME}: {why}; flare run refuses it", (fix,))]


def servable(info: dict[str, Any]) -> bool:
    """True when `flare run` would serve the package as it is."""
    return bool(info["integrity"]["ok"]) and not info["problems"]


def render_text(info: dict[str, Any], path: Path | str) -> str:
    """`inspect_package`'s result for a person to read."""
    lines = [f"package {path}"]
    if "model" in info:
        config, provenance = info["model"]["config"], info["model"]["provenance"]
        serving, sampling = info["serving"], info["sampling"]
        lines += [
            "",
            "model",
            f"  name                {provenance['name']}",
            f"  architecture        {config['architecture']}, {config['num_layers']} layers, "
            f"hidden {config['hidden_size']}, ffn {config['intermediate_size']}",
            f"  attention           {config['num_heads']} heads, {config['num_kv_heads']} kv heads, "
            f"head dim {config['head_dim']}, rope theta {config['rope_theta']:g}",
            *_kv_cache(info.get("kv_cache"), config.get("latent_attention")),
            f"  vocabulary          {config['vocab_size']} tokens, bos {config['bos_token_id']}, "
            f"eos {', '.join(map(str, config['eos_token_ids']))}",
            f"  context             {config['max_position_embeddings']} positions"
            f"{', tied embeddings' if config['tie_word_embeddings'] else ''}",
            f"  source              {provenance['source']} ({provenance['source_format']}"
            f"{', sha256 ' + provenance['source_sha256'][:16] + '...' if provenance['source_sha256'] else ''})",
            f"  recipe              {provenance['recipe']}",
            f"  exported            {provenance['created']} by flare {provenance['flare_version']}",
            "",
            "serving",
            f"  max_concurrency     {serving['max_concurrency']}",
            f"  max_context         {serving['max_context']}",
            f"  dtype               {serving['dtype']}",
            f"  sampler             {_sampler(serving)}",
            f"  speculation         {_speculation(serving)}",
        ]
        lines += _draft_head(info.get("draft_head"))
        lines += _weights(info["weight_types"], info.get("blocks", {}), info.get("dequantized", {}))
        lines += _activations(info.get("integer_activation_types", []), info["weight_types"], info.get("blocks", {}))
        lines += [
            "",
            "sampling              default     range",
        ]
        for name, default in sampling["defaults"].items():
            bounds = sampling["ranges"].get(name)
            allowed = f"[{bounds[0]}, {bounds[1]}]" if bounds else "fixed at the default"
            lines.append(f"  {name:<20}{default!s:<12}{allowed}")
    integrity = info["integrity"]
    lines += ["", f"integrity             {'ok' if integrity['ok'] else 'FAILED'}"]
    lines += [f"  {name:<19} {status}" for name, status in integrity["files"].items()]
    lines += [f"  ! {problem}" for problem in capped(integrity["problems"])]
    lines += ["", f"problems              {len(info['problems']) or 'none'}"]
    lines += [f"  ! {problem['message']}" for problem in info["problems"]]
    return "\n".join(lines) + "\n"


def _kv_cache(cost: dict[str, Any] | None, latent: dict[str, Any] | None) -> list[str]:
    lines = []
    if latent is not None:
        q = "q_proj" if latent["q_lora_rank"] is None else f"q rank {latent['q_lora_rank']}"
        lines.append(
            f"  latent attention    {q}, kv rank {latent['kv_lora_rank']}, nope {latent['qk_nope_head_dim']}, "
            f"rope {latent['qk_rope_head_dim']}, value {latent['v_head_dim']}"
        )
    if cost is not None:
        sizes = ", ".join(f"{count} {dtype}" for dtype, count in cost["bytes_per_token"].items())
        lines.append(f"  kv cache            bytes a token ({cost['layout']} layout): {sizes}")
        if cost.get("per_tensor_parallel_rank") == "whole":
            lines.append("                      the same on every tensor-parallel rank (each keeps the whole latent row)")
    return lines


def _weights(types: dict[str, dict[str, int]], blocks: dict[str, Any], dequantized: dict[str, str]) -> list[str]:
    block_types = {entry["type"] for entry in blocks.values()}
    lines = ["", "weights               tensors     bytes"]
    for kind, total in types.items():
        stored = "ggml blocks, mapped by flare run" if kind in block_types else "floats"
        lines.append(f"  {kind:<20}{total['tensors']:<12}{_size(total['bytes'])} ({stored})")
    # A source tensor export dequantized, counted by its source type and what became of it.
    kept = {t.name for t in KEPT_TYPES}
    by_line: dict[tuple[str, str], int] = {}
    for name, kind in dequantized.items():
        if name in blocks:
            line = f"as {blocks[name]['type']} at export (--quantize)"
        elif kind not in kept:
            line = "at export (no kernel for the type; flare export --quantize q8_0 or q4_k_m stores such tensors as blocks)"
        elif blocks:
            line = "at export (joined with another tensor into one float32 tensor)"
        else:
            line = "at export (a --dtype asked for floats)"
        by_line[kind, line] = by_line.get((kind, line), 0) + 1
    for (kind, line), count in sorted(by_line.items()):
        label = "quantized again" if line.startswith("as ") else "dequantized"
        lines.append(f"  {label:<20}{count} {kind} tensor{'s' if count > 1 else ''} {line}")
    return lines


def _activations(integer: list[str], types: dict[str, dict[str, int]], blocks: dict[str, Any]) -> list[str]:
    """What `flare run` multiplies the blocks by by default (`--activations auto`,
    `quantized.served_activations`), and which types the integer kernels take."""
    if not blocks:
        return []
    if not integer:
        return ["  activations         float32 (no integer kernels for these types)"]
    chosen = auto_activations(types)
    other = "float32 for exact float32 activations" if chosen != "float32" else "int8x2 or int8"
    return [f"  activations         {chosen}; integer kernels for {' '.join(integer)} (flare run --activations {other})"]


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:,.1f} kB"


def _draft_head(head: dict[str, Any] | None) -> list[str]:
    if head is None:
        return ["  draft head          none (re-export with --drafter mtp to distill one)"]
    imported = head.get("imported_from")
    reads = "after its final norm" if head.get("target_hidden") == "final_norm" else "its residual stream"
    lines = [
        "",
        "draft head            multi-token prediction (one decoder block, the target's LM head)",
        f"  draft steps K       {head['draft_tokens']}",
        f"  parameters          {head['parameters']:,} ({head['dtype']}), draft vocabulary {head['draft_vocab_size']} tokens",
        f"  reads the target    {reads}",
        "  decoder layer       "
        + ("the target's own kind (its attention and MLP)" if head.get("layer") == "target" else "Llama's"),
    ]
    if imported:
        lines.append(f"  imported from       {imported}")
        lines.append(f"  measured on         {head['prompt_set']}")
    else:
        lines.append(f"  distilled on        {head['prompt_set']}")
        lines.append(
            f"  budget              {head['budget'].get('tokens')} positions or {head['budget'].get('seconds')} s, "
            f"seed {head['budget'].get('seed')}"
        )
    trained = head.get("trained") or {}
    if trained and not imported:
        lines.append(
            f"  trained             {trained.get('generated_tokens')} generated tokens, {trained.get('positions')} positions, "
            f"{trained.get('seconds')} s"
        )
    held = head.get("held_out")
    if held is not None:
        steps = ", ".join(f"{rate:.2f}" for rate in held["per_step"])
        lines.append(
            f"  held-out acceptance {held['tokens_per_round']:.2f} tokens per round at K (greedy; "
            f"chain rates per step {steps}; {held['positions']} positions)"
        )
    return lines


def _sampler(serving: dict[str, Any]) -> str:
    return "vocabulary-parallel (unfiltered only)" if serving["vocabulary_parallel_sampling"] else "standard"


def _speculation(serving: dict[str, Any]) -> str:
    if serving["draft_tokens"] == 0:
        return "off"
    return f"{serving['drafter']} drafter, {serving['draft_tokens']} draft tokens per round"
