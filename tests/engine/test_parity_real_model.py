"""Parity with Hugging Face transformers on the real default model (SmolLM2-135M-Instruct, fp32).

Both load the same GGUF weights: flare through its exported package, transformers' Llama from the
GGUF's tensors as gguf-py reads and dequantizes them, independently of flare. Greedy continuations
must be identical token for token, and the logits at the last prompt position must agree within
LOGIT_TOLERANCE.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.precision import WeightFormat, cpu_has_float16_gemm, cpu_has_native_bf16
from flare.engine.tokenizer import Tokenizer
from flare.preparation.default_model import default_gguf_path
from flare.preparation.default_package import default_package_path
from flare.package.directory import open_package

pytestmark = pytest.mark.real_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers and explain why they are prime."},
    ],
]
NEW_TOKENS = 64
BLOCK_SIZE = 16
# Logits of this model at the last prompt position range over about +-30. Both sides compute in
# float32, but sum in different orders (fused q/k/v and gate/up GEMMs, a different attention
# kernel), so each of the 30 layers adds rounding of order 1e-6 relative; the measured maximum
# absolute difference on these prompts is 3e-5 to 5e-5. 2e-3 leaves a margin of 40x over that
# and is still far below the gap between the top two logits that a greedy choice depends on.
LOGIT_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def flare_side(default_float32_package: Path) -> tuple[DecoderModel, Tokenizer]:
    package = open_package(default_float32_package)
    return load_model(package), Tokenizer.from_package(package)


# GGUF tensor names of a llama block (llama.cpp's gguf-py TensorNameMap) and transformers' names.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which stores each head's q/k rows with the two rotated halves
    interleaved (its `permute`: rows (2, d/2) of a head become (d/2, 2))."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.fixture(scope="module")
def transformers_model():
    """transformers' LlamaForCausalLM on the GGUF's weights, dequantized by gguf-py.

    What `from_pretrained(gguf_file=...)` does (gguf-py's dequantize, q/k rows unpermuted), once:
    that path reads the GGUF twice and rebuilds gguf-py's name map for every tensor, three times
    the cost. On transformers 5.25 both give the same weights bit for bit and the same logits.
    """
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(default_gguf_path()))

    def metadata(key: str) -> int | float:
        field = reader.fields[f"llama.{key}"]
        return field.parts[field.data[0]].item()

    heads, kv_heads = metadata("attention.head_count"), metadata("attention.head_count_kv")
    state = {}
    for tensor in reader.tensors:
        weight = gguf.dequantize(tensor.data, tensor.tensor_type)
        prefix, *rest = tensor.name.split(".")
        if prefix == "blk":
            layer, kind, _ = rest
            if kind in ("attn_q", "attn_k"):
                weight = _unpermute_rope_rows(weight, heads if kind == "attn_q" else kv_heads)
            name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"
        else:
            name = f"{_MODEL_TENSORS[prefix]}.weight"
        state[name] = torch.from_numpy(np.array(weight, dtype=np.float32))
    config = transformers.LlamaConfig(
        vocab_size=state["model.embed_tokens.weight"].shape[0],
        hidden_size=metadata("embedding_length"),
        intermediate_size=metadata("feed_forward_length"),
        num_hidden_layers=metadata("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=metadata("context_length"),
        rms_norm_eps=metadata("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": metadata("rope.freq_base")},
        tie_word_embeddings="lm_head.weight" not in state,
        dtype=torch.float32,
    )
    with torch.device("meta"):  # no random initialisation of weights replaced at once
        model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    # Buffers (the rotary inverse frequencies) are computed, not stored: build them on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


def flare_greedy(
    model: DecoderModel, prompts: list[list[int]], eos: set[int], new_tokens: int = NEW_TOKENS
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations of all prompts decoded together (up to `new_tokens`), and the
    last-prompt-position logits."""
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
    allocator = BlockAllocator(cache.num_blocks)
    longest = max(len(p) for p in prompts) + new_tokens
    tables = [allocator.allocate(-(-longest // BLOCK_SIZE)) for _ in prompts]

    rows = [ForwardRow(p, 0, t, num_logits=1) for p, t in zip(prompts, tables)]
    prompt_logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)
    outputs = [[int(token)] for token in prompt_logits.argmax(-1)]
    for _ in range(new_tokens - 1):
        running = [i for i, out in enumerate(outputs) if out[-1] not in eos]
        if not running:
            break
        rows = [
            ForwardRow([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i], num_logits=1)
            for i in running
        ]
        logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)
        for i, token in zip(running, logits.argmax(-1).tolist()):
            outputs[i].append(token)
    return outputs, prompt_logits


@pytest.fixture(scope="module")
def float32_answers(flare_side) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """The encoded PROMPTS, the float32 package's greedy answers to them decoded together and its
    logits at their last prompt positions: what transformers and the other packages are held to,
    decoded once for the module."""
    model, tokenizer = flare_side
    prompts = [tokenizer.encode_chat(messages) for messages in PROMPTS]
    outputs, prompt_logits = flare_greedy(model, prompts, set(tokenizer.eos_token_ids))
    return prompts, outputs, prompt_logits


def test_greedy_continuations_and_last_logits_match_transformers(flare_side, float32_answers, transformers_model) -> None:
    _, tokenizer = flare_side
    eos = set(tokenizer.eos_token_ids)
    prompts, outputs, prompt_logits = float32_answers

    for prompt, output, logits in zip(prompts, outputs, prompt_logits):
        # One transformers forward over prompt + flare's continuation: its greedy choice after
        # every prefix must be flare's next token, which by induction makes its greedy
        # continuation equal flare's (at a fraction of the cost of generate's token-by-token loop).
        with torch.inference_mode():
            reference = transformers_model(torch.tensor([prompt + output])).logits[0]
        difference = (logits - reference[len(prompt) - 1]).abs().max().item()
        print(f"max |logit difference| {difference:.2e}, {len(output)} tokens")
        assert difference <= LOGIT_TOLERANCE, f"max |logit difference| {difference:.2e}"
        greedy = reference[len(prompt) - 1 : len(prompt) + len(output) - 1].argmax(-1).tolist()
        assert tokenizer.decode(output) == tokenizer.decode(greedy)
        assert output == greedy
        assert len(output) == NEW_TOKENS or output[-1] in eos

    # And transformers' own generate loop agrees on the shortest answer.
    input_ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        generated = transformers_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=sorted(eos),
            pad_token_id=tokenizer.eos_token_ids[0],
        )[0, len(prompts[0]) :].tolist()
    assert generated == outputs[0]


def test_capital_of_france(flare_side) -> None:
    model, tokenizer = flare_side
    prompt = tokenizer.encode_chat(PROMPTS[0])
    (output,), _ = flare_greedy(model, [prompt], set(tokenizer.eos_token_ids))
    assert tokenizer.decode(output) == "The capital of France is Paris."


# A float16 package (`--dtype float16`) runs in the fastest format of the CPU. float16 GEMMs
# (AVX2 CPUs) round only the weights, to 11 significant bits; bfloat16 GEMMs (oneDNN,
# CPUs with native bfloat16) round the weights, each GEMM's input and its product to 8. Measured
# KL of the next-token distribution against float32: float16 1.6e-6 nats mean and 1.3e-5 at most
# over 335 answer positions of eight chat prompts (benchmarks/precision.py); bfloat16 3e-4 to
# 1.8e-3 at the last prompt position of these prompts.
MAX_KL = {WeightFormat.FLOAT16: 1e-3, WeightFormat.BFLOAT16: 1e-2}


@pytest.mark.parametrize(
    "weight_format",
    [
        pytest.param(WeightFormat.FLOAT16, marks=pytest.mark.skipif(not cpu_has_float16_gemm(), reason="no vectorised float16 here")),
        pytest.param(WeightFormat.BFLOAT16, marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bfloat16 here")),
    ],
)
def test_a_float16_package_answers_as_float32_does_within_a_stated_divergence(flare_side, float32_answers, weight_format) -> None:
    exact, tokenizer = flare_side
    package = open_package(default_package_path(dtype="float16"))
    assert package.manifest.serving.dtype == "float16"
    rounded = load_model(package, weight_format=weight_format)
    assert rounded.weight_format == weight_format
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(messages) for messages in PROMPTS]

    outputs, logits = flare_greedy(rounded, prompts, eos)
    _, _, reference = float32_answers  # only its prompt logits

    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    divergence = (log_p.exp() * (log_p - log_q)).sum(-1)  # KL(float32 || weight_format)
    print(f"KL against float32 at the last prompt position: {divergence.tolist()}")
    assert (divergence <= MAX_KL[weight_format]).all()
    if weight_format == WeightFormat.FLOAT16:
        assert tokenizer.decode(outputs[0]) == "The capital of France is Paris."
    # Every answer is float32's greedy answer but where float32's best tokens lie within the
    # format's rounding of each other: bfloat16 GEMMs round the logits themselves to 8
    # significant bits (0.125 apart at 16 to 32), and on this prompt float32's "The" leads "L"
    # by 0.08. So each token chosen must be, in float32's own logits along the same answer,
    # within 2^-7 of the best relative to it (one to two of bfloat16's steps there); float16
    # GEMMs keep float32 logits, and their answers must be float32's exactly.
    for prompt, output in zip(prompts, outputs):
        rows = [ForwardRow(prompt + output[:-1], 0, list(range(-(-(len(prompt) + len(output)) // BLOCK_SIZE))), num_logits=len(output))]
        cache = KVCache.for_budget(exact.config, 64 * 1024**2, BLOCK_SIZE)
        along = exact.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)
        chosen = along.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        best = along.max(-1).values
        resolution = best.abs() * 2**-7 if weight_format == WeightFormat.BFLOAT16 else torch.zeros_like(best)
        assert (best - chosen <= resolution).all(), tokenizer.decode(output)


@pytest.fixture(scope="module")
def default_blocks_package() -> Path:
    """The default package as `make run` serves it: the GGUF's Q4_1 and Q8_0 tensors kept as blocks."""
    return default_package_path()


# Measured on these prompts: echoed prompt log-probabilities 5e-6 apart on average (float32
# summed in another order); the bar is the issue's 1e-3.
MAX_MEAN_LOGPROB_DIFFERENCE = 1e-3


def test_the_blocks_package_scores_text_as_its_float32_dequantization_does(flare_side, float32_answers, default_blocks_package) -> None:
    # With float32 activations (`flare run --activations float32`): only the order of summation differs.
    exact, tokenizer = flare_side
    package = open_package(default_blocks_package)
    assert {entry.type for entry in package.manifest.blocks.values()} == {"Q4_1", "Q8_0"}
    stored = sum(file.stat().st_size for file in default_blocks_package.iterdir())
    assert stored <= 1.1 * default_gguf_path().stat().st_size
    served = load_model(package, activations="float32")
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(messages) for messages in PROMPTS]
    for prompt in prompts:
        rows = [ForwardRow(prompt, 0, list(range(-(-len(prompt) // BLOCK_SIZE))), num_logits=len(prompt))]
        echoed = []
        for model in (served, exact):
            cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
            logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)[:-1]
            echoed.append(logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1))
        difference = (echoed[0] - echoed[1]).abs().mean().item()
        print(f"mean |echoed log-probability difference| {difference:.2e} over {len(prompt) - 1} tokens")
        assert difference <= MAX_MEAN_LOGPROB_DIFFERENCE
    outputs, logits = flare_greedy(served, prompts, eos)
    _, reference_outputs, reference_logits = float32_answers
    assert (logits - reference_logits).abs().max().item() <= LOGIT_TOLERANCE
    assert outputs == reference_outputs
    assert tokenizer.decode(outputs[0]) == "The capital of France is Paris."


# A 60-token text echoed (issue 38's fidelity bar for 8-bit activations), and three more prompts
# for six greedy answers.
ECHOED_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills, while children watched the boats drift past the "
    "church, carrying chairs, baskets and a very surprised cat. By noon the rain had stopped, the "
    "sun came out over the flooded valley, and the mayor promised that the old bridge would be "
    "rebuilt before the first snow of winter."
)
MORE_PROMPTS = [
    [{"role": "user", "content": "How do I boil an egg?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "Give me two tips for writing clear emails."}],
]


def test_int8x2_activations_score_text_within_issue_38s_bars_of_float32(flare_side, default_blocks_package) -> None:
    # Two 8-bit blocks a 32 activations (the value and its residual, about 15 bits; `flare run
    # --activations int8x2`): measured mean |delta logprob| 2.7e-4, max 1.4e-3, KL 4.7e-8, every
    # greedy answer equal (benchmarks/activation_fidelity.py). One 8-bit block (int8) misses the
    # bar by 60x.
    exact, tokenizer = flare_side
    served = load_model(open_package(default_blocks_package), activations="int8x2")
    tokens = tokenizer.encode(ECHOED_TEXT)[:61]
    assert len(tokens) == 61
    rows = [ForwardRow(tokens, 0, list(range(-(-len(tokens) // BLOCK_SIZE))), num_logits=len(tokens))]
    echoed = []
    for model in (served, exact):
        cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
        logits = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)[:-1]
        echoed.append(logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1))
    delta = (echoed[0] - echoed[1]).abs()
    print(f"int8x2 activations: mean |delta logprob| {delta.mean():.2e}, max {delta.max():.2e}")
    assert delta.mean().item() <= 1e-3 and delta.max().item() <= 2e-2
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(messages) for messages in PROMPTS + MORE_PROMPTS]
    answers, reference = flare_greedy(served, prompts, eos, new_tokens=32)[0], flare_greedy(exact, prompts, eos, new_tokens=32)[0]
    assert sum(a == b for a, b in zip(answers, reference)) >= 5


@pytest.mark.parametrize("activations", ["int8x2", "float32"])
def test_the_blocks_package_decodes_the_same_bits_one_kernel_call_a_layer_as_step_by_step(
    flare_side, default_blocks_package, activations
) -> None:
    # native_layers.decoder_layer runs the same kernels on the blocks (integer_linear on the
    # activation blocks, or quantized_linear) in the same order as the step by step path: decode
    # rounds of one row and of three rows (batch-mates must not change a row's bits) give the
    # same logits and the same greedy continuations.
    _, tokenizer = flare_side
    fused = load_model(open_package(default_blocks_package), activations=activations)
    if fused.kernel_layers is None:
        pytest.skip("the engine's C kernels were not built")
    steps = copy.copy(fused)
    steps.kernel_layers = None
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(messages) for messages in PROMPTS]
    alone = [flare_greedy(model, prompts[:1], eos, new_tokens=24) for model in (fused, steps)]
    together = [flare_greedy(model, prompts, eos, new_tokens=24) for model in (fused, steps)]
    assert alone[0][0] == alone[1][0] and torch.equal(alone[0][1], alone[1][1])
    assert together[0][0] == together[1][0] and torch.equal(together[0][1], together[1][1])
    assert together[0][0][0] == alone[0][0][0]
