"""The layers `DecoderModel` (engine/model.py) composes, one file each, as nano-vllm's `layers/`:
attention over the paged KV cache (`attention.py`), RoPE (`rope.py`), the gated MLP (`mlp.py`)
and the residual add with its norms (`norms.py`). Each runs as the CPU kernels of
`flare.engine.native` where the model runs them, as its torch counterpart otherwise."""
