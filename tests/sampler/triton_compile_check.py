"""Compile every Triton kernel variant for an NVIDIA target without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels on CPU but skips what only the compiler checks
(types across branches, constexpr-only globals, ptxas). ``python tests/sampler/triton_compile_check.py``
compiles each kernel, for each constexpr variant sample_round launches, down to a cubin for
sm_90 (Hopper) with ptxas from the triton wheel; test_triton_compiles.py runs it in a subprocess,
since the interpreter mode is fixed when a kernel module is imported. It proves compilation, not
GPU numerics or speed: those need a run on a GPU.
"""

from __future__ import annotations

import os
import sys

GPU_TARGET = ("cuda", 90, 32)

_SIGNATURES: dict[str, dict[str, str]] = {
    "penalties": {
        "logits_ptr": "*fp32", "scaled_ptr": "*fp32", "nonfinite_ptr": "*i32", "row_of_position_ptr": "*i64",
        "index_in_row_ptr": "*i64", "drafts_ptr": "*i64", "divisor_ptr": "*fp32", "repetition_ptr": "*fp32",
        "presence_ptr": "*fp32", "frequency_ptr": "*fp32", "prompt_mask_ptr": "*u8", "output_counts_ptr": "*i32",
        "token_mask_ptr": "*i32", "bias_ptr": "*fp32", "vocab_size": "i32", "logits_stride": "i32", "mask_words": "i32",
    },
    "top_tokens": {
        "scaled_ptr": "*fp32", "values_ptr": "*fp32", "ids_ptr": "*i64", "vocab_size": "i32", "shard_size": "i32",
        "num_shards": "i32",
    },
    "distribution": {
        "scaled_ptr": "*fp32", "row_of_position_ptr": "*i64", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
        "log_min_p_ptr": "*fp32", "max_ptr": "*fp32", "sumexp_ptr": "*fp32", "argmax_ptr": "*i64",
        "threshold_ptr": "*fp32", "vocab_size": "i32", "shard_size": "i32", "num_shards": "i32",
    },
    "gumbel_max": {
        "scaled_ptr": "*fp32", "position_ptr": "*i64", "key_ptr": "*i32", "row_max_ptr": "*fp32",
        "sumexp_ptr": "*fp32", "threshold_ptr": "*fp32", "exclude_ptr": "*i64", "draft_q_ptr": "*fp32",
        "index_ptr": "*i64", "value_ptr": "*fp32", "residual_index_ptr": "*i64", "residual_value_ptr": "*fp32",
        "residual_mass_ptr": "*fp32", "vocab_size": "i32", "shard_size": "i32", "num_shards": "i32",
        "first_index": "i32",
    },
}


def compile_all() -> list[str]:
    """Compile every variant; returns one line per compiled kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("triton_compile_check: unset TRITON_INTERPRET (the interpreter does not compile)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flare.sampler.triton import distribution as distribution_triton
    from flare.sampler.triton import gumbel_max as gumbel_max_triton
    from flare.sampler.triton import penalties as penalties_triton
    from flare.sampler.triton import top_tokens as top_tokens_triton
    from flare.sampler.triton.launch import FP_FUSION, GPU_BLOCK

    variants = [
        (
            penalties_triton.penalize_and_scale_kernel,
            "penalties",
            {"MAX_DRAFTS": k, "PENALIZE": pen, "SCALE": True, "MASK": constrained, "BIAS": constrained, "BLOCK": GPU_BLOCK},
        )
        for k in (0, 4)
        for pen in (False, True)
        for constrained in (False, True)
    ]
    variants += [
        (distribution_triton.distribution_statistics_kernel, "distribution", {"FILTER": f, "BLOCK": GPU_BLOCK})
        for f in (False, True)
    ]
    variants += [
        (gumbel_max_triton.gumbel_candidates_kernel, "gumbel_max", {"HAS_Q": q, "BLOCK": GPU_BLOCK}) for q in (False, True)
    ]
    variants += [(top_tokens_triton.shard_top_tokens_kernel, "top_tokens", {"K": k, "BLOCK": GPU_BLOCK}) for k in (1, 20)]
    target = GPUTarget(*GPU_TARGET)
    lines = []
    for kernel, name, constexprs in variants:
        names = kernel.arg_names
        signature = {arg: _SIGNATURES[name].get(arg, "constexpr") for arg in names}
        source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(source, target=target, options={"enable_fp_fusion": FP_FUSION})
        assert "cubin" in compiled.asm, f"{name}: no cubin produced"
        lines.append(f"{name} {constexprs}: cubin {len(compiled.asm['cubin'])} bytes")
    return lines


if __name__ == "__main__":
    for line in compile_all():
        print(line)
    sys.exit(0)
