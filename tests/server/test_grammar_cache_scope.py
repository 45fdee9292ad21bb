"""The grammar compile cache is scoped as the prefix cache is (api/cache_scope.py): a schema one
API key compiled is never found by another key's request, so a fast compile tells no tenant
what another sent. Through the real HTTP app, a fake scheduler and the real compiler."""

from __future__ import annotations

from pathlib import Path

from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import CHAT, MakeClient, make_client  # noqa: F401

from flare.package.directory import open_package
from flare.structured import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
STRUCTURED = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}


def _scheduler_with_compiler(tiny_package: Path) -> FakeScheduler:
    package = open_package(tiny_package)
    config = package.manifest.model
    scheduler = FakeScheduler()
    scheduler.grammars = GrammarCompiler(  # type: ignore[assignment]
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )
    return scheduler


async def test_one_keys_compiled_schema_is_not_found_by_another_key(make_client: MakeClient, tiny_package: Path) -> None:
    scheduler = _scheduler_with_compiler(tiny_package)
    client = await make_client(scheduler, api_keys=("sk-a", "sk-b"))
    compiler = scheduler.grammars
    assert compiler is not None
    for key in ("sk-a", "sk-a", "sk-b"):
        response = await client.post("/v1/chat/completions", json=STRUCTURED, headers={"Authorization": f"Bearer {key}"})
        assert response.status == 200
    # Key A's second request found its own compile; key B compiled its own.
    assert compiler.use().entries == 2
    # A salt narrows further, as for the prefix cache.
    salted = {**STRUCTURED, "cache_salt": "tenant-7"}
    assert (await client.post("/v1/chat/completions", json=salted, headers={"Authorization": "Bearer sk-a"})).status == 200
    assert compiler.use().entries == 3


async def test_without_keys_every_request_shares_the_compile(make_client: MakeClient, tiny_package: Path) -> None:
    scheduler = _scheduler_with_compiler(tiny_package)
    client = await make_client(scheduler)
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=STRUCTURED)).status == 200
    assert scheduler.grammars is not None and scheduler.grammars.use().entries == 1
