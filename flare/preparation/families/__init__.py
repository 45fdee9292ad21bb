"""The model families flare serves, as Hugging Face checkpoints and llama.cpp's GGUF files write
them: what a source's config and tensors mean for each family.

A source is read in two steps, each a module per format: its config as a `ModelConfig`
(`hf_config.py`: `config.json`; `gguf_config.py`: the `{arch}.*` metadata, read through
`gguf_keys.py`), then its tensors under the package's names and layout (`hf_tensors.py`,
`gguf_tensors.py`). Those four hold the dense families (Llama, Mistral, Qwen2/Qwen3, Gemma 2/3,
Phi-3) whole, and every family's RoPE and sliding windows. What a family adds beyond a dense
decoder has a module of its own, both formats side by side: `moe.py` (experts and routing:
Qwen2-MoE, Qwen3-MoE, Mixtral, and the fields of the two below), `deepseek.py` (DeepSeek-V2/V3's
latent attention, routed experts and interleaved rope rows) and `gpt_oss.py` (gpt-oss's GGUF
names, SwiGLU limit and checkpoint expert layout). docs/packages.md "Model families" tabulates
the keys.
"""
