"""The sampler's Triton kernels, one module a step, each the twin of the torch step of the same
name one folder up (docs/kernels.md lists the pairs). Importing flare.sampler never imports them:
the Triton backend loads them on a CUDA device or under TRITON_INTERPRET."""
