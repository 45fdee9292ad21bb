"""The one compiled part of flare: the engine's CPU kernels (flare/engine/csrc/, module
`flare.engine._native`).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), installation goes on and the engine runs the torch expressions the
kernels stand for (`flare.engine.native.available()` says which; `flare run` logs it).
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "flare.engine._native",
            sources=sorted(glob("flare/engine/csrc/*.c")),
            depends=sorted(glob("flare/engine/csrc/*.h")),
            # -fno-trapping-math lets the compiler turn the kernels' selects into vector blends
            # (nothing here reads floating-point exception flags); GNU C with
            # -ffp-contract=fast fuses multiply-adds (ISO C mode would forbid it: the attention
            # kernel took 9.7 ms instead of 8.0 for 30 layers of 32 rows in cache).
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=fast", "-fopenmp", "-fno-trapping-math"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
