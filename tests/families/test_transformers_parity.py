"""Every family flare serves, as a tiny random checkpoint transformers builds from its own config
class (tests/family_checkpoints.py), exported from its Hugging Face directory in float32: its logits are
transformers' (eager attention) within 1e-4, in one prefill and through the paged cache in
chunks and decode rounds, and its greedy continuation through the scheduler is transformers' own,
token for token. The prompts are longer than every sliding window."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from tests.family_checkpoints import DEEPSEEK_MOE_FAMILIES, FAMILIES, MOE_FAMILIES, PHI3_ORIGINAL_CONTEXT, Checkpoint, write_checkpoint
from tests.running_scheduler import running
from safetensors import safe_open

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.tokenizer import Tokenizer
from flare.preparation.export import ExportOptions, export_package
from flare.package.directory import open_package
from flare.preparation.source import ModelSource
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta

pytest.importorskip("transformers")

# Both sides compute in float32 and sum in different orders (fused q/k/v and gate/up GEMMs,
# another attention kernel): differences of order 1e-6 on logits of magnitude ~10.
LOGIT_TOLERANCE = 1e-4
# A greedy choice may differ from transformers' only where its top two logits are this close.
NEAR_TIE = 1e-3
BLOCK_SIZE = 4  # windows of 8 and 16 then span blocks in every alignment
PROMPTS = (
    (
        "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest to hide from the "
        "hunters, who follow its tracks through the snow until the night falls and the wind covers them."
    ),
    (
        "Numbers: 1, 22, 333, 4444; café, naïve, 東京 — and a longer tail of words, many more of them, to pass "
        "every window of every layer at least twice over."
    ),
)
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=FAMILIES + MOE_FAMILIES + DEEPSEEK_MOE_FAMILIES)
def exported(request: pytest.FixtureRequest, smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> tuple[Checkpoint, Path]:
    """The family's checkpoint and its float32 package (`flare export --dtype float32`)."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_checkpoint(request.param, root / request.param, smollm2_source.tokenizer_json, smollm2_source.chat_template)
    context = PHI3_ORIGINAL_CONTEXT if request.param == "phi3" else None
    export_package(str(checkpoint.path), root / "package", ExportOptions(dtype="float32", max_context=context), stderr=io.StringIO())
    return checkpoint, root / "package"


def reference_logits(checkpoint: Checkpoint, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return checkpoint.model(torch.tensor([ids])).logits[0].float()


def forward_in_pieces(
    model: DecoderModel, prompts: list[list[int]], pieces: list[list[int]], cache: KVCache | None = None
) -> list[torch.Tensor]:
    """Every position's logits of each prompt, fed through one paged cache as rounds: round r
    gives prompt i its next `pieces[r][i]` tokens (0: none), all of them scored. `cache`: the
    pool to fill (a fresh one of 16 MiB if None)."""
    cache = KVCache.for_budget(model.config, 16 * 1024**2, BLOCK_SIZE) if cache is None else cache
    allocator = BlockAllocator(cache.num_blocks)
    tables = [allocator.allocate(-(-len(p) // BLOCK_SIZE)) for p in prompts]
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for sizes in pieces:
        members = [i for i, n in enumerate(sizes) if n]
        rows = [ForwardRow(prompts[i][done[i] : done[i] + sizes[i]], done[i], tables[i], num_logits=sizes[i]) for i in members]
        out = model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)
        for i, part in zip(members, out.split([sizes[i] for i in members])):
            logits[i].append(part)
            done[i] += sizes[i]
    assert done == [len(p) for p in prompts]
    return [torch.cat(parts) for parts in logits]


def test_prompt_logits_match_transformers_in_one_prefill_and_through_the_paged_cache(exported: tuple[Checkpoint, Path]) -> None:
    checkpoint, package_path = exported
    package = open_package(package_path)
    model = load_model(package)
    tokenizer = Tokenizer.from_package(package)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert min(len(p) for p in prompts) > 2 * 16, "prompts must pass every window"
    expected = [reference_logits(checkpoint, p) for p in prompts]

    a, b = (len(p) for p in prompts)
    together = [[a, b]]
    # Chunks of prompt lengths, decode rounds of one token and verify-sized rows, two rows at once.
    chunked = [[19, 1], [1, 3], [1, 18], [5, 1], *([[1, 1]] * 4)]
    chunked.append([a - sum(s[0] for s in chunked), b - sum(s[1] for s in chunked)])
    for pieces in (together, chunked):
        for got, want in zip(forward_in_pieces(model, prompts, pieces), expected):
            difference = (got - want).abs().max().item()
            assert difference <= LOGIT_TOLERANCE, f"{checkpoint.family} {pieces}: max |logit difference| {difference:.2e}"


def test_a_float16_package_scores_text_as_the_float32_one_within_float16_rounding(
    exported: tuple[Checkpoint, Path], tmp_path: Path
) -> None:
    """`flare export` stores a float source as float16 by default: the family's steps then run
    between the engine's float16 GEMMs. Rounding every weight once (relative 2^-11) moves logits
    of magnitude ~10 by hundredths; a wrong step moves them by whole units. The format is named:
    `auto` runs float16 weights in bfloat16 on an AMX CPU, which rounds them again (8 bits)."""
    checkpoint, package_path = exported
    context = PHI3_ORIGINAL_CONTEXT if checkpoint.family == "phi3" else None
    export_package(str(checkpoint.path), tmp_path / "float16", ExportOptions(dtype="float16", max_context=context), stderr=io.StringIO())
    float32, float16 = load_model(open_package(package_path)), load_model(open_package(tmp_path / "float16"), weight_format="float16")
    prompts = [Tokenizer.from_package(open_package(package_path)).encode(text) for text in PROMPTS]
    pieces = [[len(p) for p in prompts]]
    for exact, rounded in zip(forward_in_pieces(float32, prompts, pieces), forward_in_pieces(float16, prompts, pieces)):
        difference = (exact - rounded).abs().max().item()
        assert difference <= 0.1, f"{checkpoint.family}: float16 moved a logit by {difference:.3f}"


async def test_greedy_continuation_through_the_scheduler_is_transformers_own(exported: tuple[Checkpoint, Path]) -> None:
    checkpoint, package_path = exported
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    async with running(package_path, block_size=BLOCK_SIZE, draft_tokens=0) as scheduler:
        prompt = scheduler.tokenizer.encode(PROMPTS[0])
        output: list[int] = []
        async for event in scheduler.submit(GenerationRequest("greedy", tuple(prompt), params)):
            if isinstance(event, TextDelta):
                output += event.token_ids
            else:
                assert isinstance(event, Finished), event
    assert output, "no tokens generated"
    # transformers' choice after every prefix of flare's continuation (one forward, teacher-forced):
    # by induction its greedy continuation is flare's wherever no top-two near-tie intervenes.
    reference = reference_logits(checkpoint, prompt + output)[len(prompt) - 1 : len(prompt) + len(output) - 1]
    ties = 0
    for step, (token, logits) in enumerate(zip(output, reference)):
        best = int(logits.argmax())
        if token != best:
            gap = (logits[best] - logits[token]).item()
            assert gap <= NEAR_TIE, f"{checkpoint.family}: step {step} chose {token}, transformers {best} by {gap:.2e}"
            ties += 1
    if ties == 0:
        with torch.inference_mode():
            generated = checkpoint.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                max_new_tokens=len(output), eos_token_id=list(scheduler.tokenizer.eos_token_ids), pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert generated == output


def test_a_multimodal_gemma3_is_served_as_its_text_model(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """A Gemma 3 with a vision tower (`model_type` gemma3, a `text_config`, the text weights under
    `language_model`): the package is its text model, whose logits on text are the whole model's."""
    checkpoint = write_checkpoint("gemma3-multimodal", tmp_path / "gemma3", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    with safe_open(str(checkpoint.path / "model.safetensors"), framework="pt") as saved:
        names = list(saved.keys())
    assert any(".vision_tower." in f".{name}" for name in names) and any("language_model." in name for name in names)
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    assert package.manifest.model.architecture == "gemma3" and package.manifest.model.sliding_layers == (0, 1)
    prompt = Tokenizer.from_package(package).encode(PROMPTS[0])
    (got,) = forward_in_pieces(load_model(package), [prompt], [[len(prompt)]])
    difference = (got - reference_logits(checkpoint, prompt)).abs().max().item()
    assert difference <= LOGIT_TOLERANCE, f"max |logit difference| {difference:.2e}"
