"""`flare export --drafter mtp`: the package with a draft head distilled on its own target.

The target package is exported first, hidden next to DIR (`.DIR.target-XXXX`), because the
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

from flare.distill.distill import DistillOptions, distill_head
from flare.preparation.export import ExportError, ExportOptions, export_package
from flare.preparation.manifest import Manifest
from flare.preparation.package import PackageError, check_destination, open_package, write_package


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
    staging = out_dir.parent / f".{out_dir.name}.target-{uuid.uuid4().hex[:12]}"
    try:
        export_package(
            source,
            staging,
            dataclasses.replace(options, drafter="ngram", draft_tokens=draft_tokens, overwrite=False),
            stderr=stderr,
        )
        target = open_package(staging)
        info, tensors = distill_head(target, distill, stderr=stderr if stderr is not None else sys.stderr)
        m = target.manifest
        return write_package(
            out_dir,
            config=m.model,
            state_dict=target.load_state_dict(),
            tokenizer_json=target.tokenizer_json_path.read_text(encoding="utf-8"),
            chat_template=target.chat_template,
            policy=m.sampling,
            serving=dataclasses.replace(m.serving, drafter="mtp"),
            provenance=m.provenance,
            overwrite=options.overwrite,
            draft_head=(info, tensors),
        )
    except PackageError as error:
        raise ExportError(str(error)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
