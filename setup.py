"""The compiled parts of flare: the engine's CPU kernels (flare/engine/csrc/, module
`flare.engine._native`) and the sampler's (flare/sampler/csrc/, module `flare.sampler._native`).

Everything else is declared in pyproject.toml. The extensions are optional: where they cannot be
built (no C compiler), installation goes on and flare runs the torch expressions the kernels
stand for (`flare.engine.native.available()` and `flare.sampler.native_sampler.available()` say which;
`flare run` logs the engine's).
"""

from glob import glob

from setuptools import Extension, setup

# -fno-trapping-math lets the compiler turn the kernels' selects into vector blends (nothing here
# reads floating-point exception flags); GNU C with -ffp-contract=fast fuses multiply-adds (ISO C
# mode would forbid it, and the attention kernel's dot products want them fused).
COMPILE_ARGS = ["-O3", "-std=gnu11", "-ffp-contract=fast", "-fopenmp", "-fno-trapping-math"]


def kernels(module: str, folder: str) -> Extension:
    return Extension(
        module,
        sources=sorted(glob(f"{folder}/*.c")),
        depends=sorted(glob(f"{folder}/*.h")),
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-fopenmp"],
        optional=True,
    )


setup(ext_modules=[kernels("flare.engine._native", "flare/engine/csrc"), kernels("flare.sampler._native", "flare/sampler/csrc")])
