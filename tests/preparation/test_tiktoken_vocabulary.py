"""Kimi K2 and Moonlight repositories ship their tokenizer as a tiktoken file with remote code, no
tokenizer.json: flare rebuilds it (flare/preparation/tiktoken_vocabulary.py), and it must tokenize
as tiktoken does with the repository's own split pattern. The vocabulary here is o200k_base's
first ranks (a BPE's first ranks are a BPE: every token is a merge of two of lower rank), with
Kimi K2's special tokens after them at Kimi's offsets; a `kimi_k2` directory of a tiny DeepSeek-V3
checkpoint exports, tokenizes and scores as transformers' model of it."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest
from tests.family_checkpoints import VOCAB, Checkpoint, write_checkpoint
from tests.families.test_transformers_parity import LOGIT_TOLERANCE, PROMPTS, forward_in_pieces, reference_logits
from tests.gguf_vocabularies import corpus_texts, o200k_base_ranks
from tests.integration.daemon_process import start_daemon

from flare.engine.model import load_model
from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.export import ExportError, ExportOptions, export_package
from flare.preparation.source import ModelSource
from flare.package.tool_formats import KIMI
from flare.preparation.tiktoken_vocabulary import KIMI_PATTERN, RESERVED_SPECIAL_TOKENS

tiktoken = pytest.importorskip("tiktoken")

# tokenization_kimi.py's pat_str, as Moonshot publishes it (tokenization_moonshot.py's is the same).
PUBLISHED_KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])  # fmt: skip
RANKS = VOCAB - RESERVED_SPECIAL_TOKENS  # the tiny checkpoints' vocabulary: ranks and Kimi's 256 specials
# Kimi K2's tokenizer_config.json names these of its 256 special tokens (offsets from the first).
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip
KIMI_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "templates" / "kimi-k2.jinja").read_text()
TEXTS = [
    "Hello 世界abc日本語テスト HELLO'S it'S we'Ve 12345 naïve  \n\n  x",
    "中文和English混合，标点。한국어 텍스트 ça\u0301 va — “quotes” 3.14159",
    "<|im_user|>user<|im_middle|>Hi there!<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "x<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>",
    f"<|reserved_token_{RANKS + 5}|>[BOS]  spaced [EOS]\n",
]


def kimi_ranks() -> dict[bytes, int]:
    return {token: rank for token, rank in o200k_base_ranks().items() if rank < RANKS}


def write_kimi_tokenizer(directory: Path, ranks: dict[bytes, int], *, code: str = "tokenization_kimi.TikTokenTokenizer") -> None:
    """tiktoken.model and tokenizer_config.json as Kimi K2's repository has them."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(len(ranks) + offset): {"content": text, "special": True} for offset, text in KIMI_SPECIALS.items()}
    config = {"auto_map": {"AutoTokenizer": [code, None]}, "added_tokens_decoder": added, "bos_token": "[BOS]",
              "eos_token": "[EOS]", "chat_template": KIMI_TEMPLATE}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def kimi_encoding(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    """What Kimi's remote code runs: tiktoken with its pattern, the 256 specials after the ranks."""
    specials = {f"<|reserved_token_{i}|>": i for i in range(len(ranks), len(ranks) + RESERVED_SPECIAL_TOKENS)}
    for offset, text in KIMI_SPECIALS.items():
        del specials[f"<|reserved_token_{len(ranks) + offset}|>"]
        specials[text] = len(ranks) + offset
    return tiktoken.Encoding("kimi", pat_str=PUBLISHED_KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def kimi(smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> tuple[Checkpoint, Path]:
    """A tiny DeepSeek-V3 with experts saved as Kimi K2's repository is laid out (model_type
    kimi_k2, the tiktoken tokenizer, Kimi K2's chat template), and its float32 package."""
    root = tmp_path_factory.mktemp("kimi")
    ranks = kimi_ranks()
    checkpoint = write_checkpoint("deepseek_v3_moe", root / "kimi", smollm2_source.tokenizer_json, KIMI_TEMPLATE)
    (checkpoint.path / "tokenizer.json").unlink()
    write_kimi_tokenizer(checkpoint.path, ranks)
    config = json.loads((checkpoint.path / "config.json").read_text())
    config.update(model_type="kimi_k2", bos_token_id=RANKS, eos_token_id=RANKS + 1)
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    export_package(str(checkpoint.path), root / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    return checkpoint, root / "package"


def test_flares_kimi_pattern_is_the_one_moonshot_publishes() -> None:
    assert KIMI_PATTERN == PUBLISHED_KIMI_PAT_STR


def test_a_kimi_directory_tokenizes_as_tiktoken_with_kimis_pattern_and_special_tokens(kimi: tuple[Checkpoint, Path]) -> None:
    _, package_path = kimi
    tokenizer = Tokenizer.from_package(open_package(package_path))
    reference = kimi_encoding(kimi_ranks())
    texts = [*corpus_texts(), *TEXTS]
    differ = [t for t in texts if tokenizer.encode(t, add_special_tokens=False) != reference.encode(t, allowed_special="all")]
    assert not differ, f"{len(differ)} of {len(texts)} texts differ from tiktoken, first {differ[0]!r}"
    for text in texts:
        ids = reference.encode(text, allowed_special="all")
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text


def test_a_kimi_k2_directory_serves_as_the_deepseek_v3_it_is(kimi: tuple[Checkpoint, Path]) -> None:
    """model_type kimi_k2 is DeepSeek-V3's decoder: the package scores a chat prompt as
    transformers' DeepseekV3ForCausalLM does, and a turn ends at <|im_end|> as Kimi's template
    ends it."""
    checkpoint, package_path = kimi
    package = open_package(package_path)
    assert package.manifest.model.architecture == "deepseek2" and package.manifest.model.latent_attention is not None
    tokenizer = Tokenizer.from_package(package)
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    assert prompt[:1] == [RANKS + 10] and RANKS + 3 in prompt  # <|im_system|> ... <|im_user|>
    (got,) = forward_in_pieces(load_model(package), [prompt], [[len(prompt)]])
    assert (got - reference_logits(checkpoint, prompt)).abs().max().item() <= LOGIT_TOLERANCE
    assert RANKS + 2 in package.manifest.model.eos_token_ids  # <|im_end|>


def test_a_kimi_package_calls_tools_in_kimis_own_sections_and_answers_openai_tool_calls(kimi: tuple[Checkpoint, Path]) -> None:
    """Kimi's call marks are control tokens of its vocabulary: the grammar asks for those tokens,
    decoding keeps their text for the reader, and the calls come back in OpenAI's shape, whole
    and streamed; the conversation with them renders again through Kimi's template."""
    _, package_path = kimi
    tokenizer = Tokenizer.from_package(open_package(package_path))
    assert tokenizer.tool_format is KIMI and tokenizer.knows_tools
    assert set(tokenizer.tool_tokens) == {m for m in KIMI.marks if m.startswith("<|")}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["hours"],
        "additionalProperties": False}}}
    chat = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    daemon = start_daemon(package_path, ["--max-concurrency", "2"])
    try:
        client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0)
        model = daemon.model_name()
        answer = client.chat.completions.create(
            model=model, messages=chat, tools=[weather, clock], tool_choice="required", temperature=1.0, seed=3, max_tokens=120
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls or []
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
        for call in calls:
            arguments = json.loads(call.function.arguments)
            assert arguments in ({"city": "Paris"}, {"city": "Oslo"}) or set(arguments) == {"hours"}
        stream = client.chat.completions.create(
            model=model, messages=chat, tools=[weather, clock], stream=True, max_tokens=60, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        deltas = [d for chunk in stream for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
        assert deltas[0].function.name == "get_weather" and deltas[0].id and {d.index for d in deltas} == {0}
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) in ({"city": "Paris"}, {"city": "Oslo"})
        messages = [*chat, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                    *({"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in calls)]
        again = client.chat.completions.create(model=model, messages=messages, tools=[weather, clock], max_tokens=4)
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # The Messages and Responses APIs read the same sections into their own shapes.
        claude = anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0)
        message = claude.messages.create(
            model=model, max_tokens=60, messages=[{"role": "user", "content": chat[0]["content"]}],
            tools=[{"name": "get_weather", "input_schema": weather["function"]["parameters"]}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, message
        assert uses[0].name == "get_weather" and uses[0].input in ({"city": "Paris"}, {"city": "Oslo"}) and uses[0].id
        response = client.responses.create(
            model=model, input=chat[0]["content"], max_output_tokens=60, tools=[{"type": "function", **weather["function"]}],
            tool_choice="required", parallel_tool_calls=False, temperature=0,
        )
        items = [item for item in response.output if item.type == "function_call"]
        assert len(items) == 1 and items[0].name == "get_weather" and items[0].call_id, response.output
        assert json.loads(items[0].arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_tokenizer_code_flare_does_not_know_is_refused_naming_it(kimi: tuple[Checkpoint, Path], tmp_path: Path) -> None:
    checkpoint, _ = kimi
    shutil.copytree(checkpoint.path, tmp_path / "other")
    write_kimi_tokenizer(tmp_path / "other", kimi_ranks(), code="tokenization_other.OtherTokenizer")
    with pytest.raises(ExportError, match=r"tokenization_other\.OtherTokenizer.*split pattern flare does not know.*tokenization_kimi"):
        export_package(str(tmp_path / "other"), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda lines: lines[:5] + ["not-base64! 5"] + lines[6:], r"line 6 is not 'base64-bytes rank'"),
        (lambda lines: lines[:5] + [lines[4].split()[0] + " 5"] + lines[6:], r"line 6 repeats the byte sequence of rank 4"),
        (lambda lines: lines[:5] + lines[6:], r"ranks of its \d+ tokens are not 0\.\.\d+"),
    ],
    ids=["not-base64", "repeated", "rank-missing"],
)
def test_a_damaged_tiktoken_file_is_refused_naming_the_line(kimi: tuple[Checkpoint, Path], tmp_path: Path, damage, message) -> None:
    checkpoint, _ = kimi
    shutil.copytree(checkpoint.path, tmp_path / "damaged")
    path = tmp_path / "damaged" / "tiktoken.model"
    path.write_text("\n".join(damage(path.read_text().splitlines())) + "\n")
    with pytest.raises(ExportError, match=message):
        export_package(str(tmp_path / "damaged"), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())


@pytest.mark.parametrize(
    ("added", "message"),
    [
        ({str(VOCAB): {"content": "<|beyond|>", "special": True}}, rf"added_tokens_decoder '{VOCAB}' must name .* id from {RANKS} to {VOCAB - 1}"),
        ({str(RANKS + 7): {"content": "[BOS]"}}, "names one text for two ids"),
        (["[BOS]"], "added_tokens_decoder must be an object of id -> token"),
    ],
    ids=["outside", "twice", "not-an-object"],
)
def test_special_tokens_flare_cannot_place_are_refused(kimi: tuple[Checkpoint, Path], tmp_path: Path, added: object, message: str) -> None:
    checkpoint, _ = kimi
    shutil.copytree(checkpoint.path, tmp_path / "outside")
    config_path = tmp_path / "outside" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {**config["added_tokens_decoder"], **added} if isinstance(added, dict) else added
    config_path.write_text(json.dumps(config))
    with pytest.raises(ExportError, match=message):
        export_package(str(tmp_path / "outside"), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
