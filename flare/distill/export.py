"""`flare export --drafter mtp`: the package with a draft head distilled on its own target, or
the checkpoint's own multi-token-prediction layer where the source ships one
(`hf_source.read_mtp_head`), which is kept instead of distilling.

The target package is exported first, hidden next to DIR (`.DIR.target-` and 12 random hex digits), because the
distillation serves it with flare's scheduler; then the final package (the same files plus the
head) is written at DIR atomically, and the hidden one removed. An interrupt at any point (Ctrl-C
included) removes the hidden package and leaves DIR as it was: no half package.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import uuid
from pathlib import Path
from typing import TextIO

from flare.distill.distill import DistillOptions, distill_head, imported_head
from flare.preparation.export import ExportError, ExportOptions, export_package, open_source
from flare.package.manifest import Manifest
from flare.package.directory import PackageError, check_destination, open_package, write_package
from flare.preparation.source import SourceError


def export_with_draft_head(
    source: str, out_dir: Path, options: ExportOptions, distill: DistillOptions, *, stderr: TextIO | None = None
) -> Manifest:
    out_dir = Path(out_dir)
    try:
        check_destination(out_dir, overwrite=options.overwrite)
    except PackageError as error:
        raise ExportError(str(error)) from None
    draft_tokens = options.draft_tokens if options.draft_tokens is not None else distill.draft_tokens
    if draft_tokens < 1:
        raise ExportError("--drafter mtp needs --mtp-draft-tokens of at least 1", option="--mtp-draft-tokens")
    distill = dataclasses.replace(distill, draft_tokens=draft_tokens)
    try:
        # Read (and checked) before anything is exported: a layer flare cannot serve is refused
        # up front. An unreadable source is left to export_package to report.
        opened = open_source(source)
    except SourceError:
        opened = None
    try:
        imported = opened.read_draft_head() if opened is not None and opened.read_draft_head is not None else None
    except SourceError as error:
        raise ExportError(str(error)) from None
    if imported is None and opened is not None and opened.config.latent_attention is not None:
        # Distillation trains a Llama-layer head, which cannot read a latent-attention target's
        # shapes: such a model drafts with its checkpoint's own MTP layer only.
        gguf = (
            " llama.cpp's deepseek2 GGUF files carry no MTP layer (its converter drops the layers after "
            "num_hidden_layers), so export the Hugging Face checkpoint instead."
            if opened.source_format == "gguf"
            else ""
        )
        raise ExportError(
            f"--drafter mtp: {source} is a latent-attention ({opened.config.architecture}) model without a "
            f"multi-token-prediction layer, and flare distills draft heads for other models only; its drafter is "
            f"the checkpoint's own MTP layer (config.json num_nextn_predict_layers).{gguf} Export with --drafter "
            "ngram to draft by n-gram lookup.",
            option="--drafter",
        )
    staging = out_dir.parent / f".{out_dir.name}.target-{uuid.uuid4().hex[:12]}"
    try:
        export_package(
            source,
            staging,
            dataclasses.replace(options, drafter="ngram", draft_tokens=draft_tokens, overwrite=False),
            stderr=stderr,
        )
        target = open_package(staging)
        progress = stderr if stderr is not None else sys.stderr
        if imported is not None:
            info, tensors = imported_head(target, imported, distill, stderr=progress)
        else:
            info, tensors = distill_head(target, distill, stderr=progress)
        m = target.manifest
        floats, blocks = target.load_weights()
        return write_package(
            out_dir,
            config=m.model,
            state_dict=floats,
            blocks=blocks,
            dequantized=m.dequantized,
            tokenizer_json=target.tokenizer_json_path.read_text(encoding="utf-8"),
            chat_template=target.chat_template,
            policy=m.sampling,
            serving=dataclasses.replace(m.serving, drafter="auto"),
            provenance=m.provenance,
            overwrite=options.overwrite,
            draft_head=(info, tensors),
        )
    except PackageError as error:
        raise ExportError(str(error)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
