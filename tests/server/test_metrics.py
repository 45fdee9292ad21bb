"""What a Prometheus scrape of GET /metrics shows."""

from __future__ import annotations

from collections import Counter

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from flare.api.answer import OUTCOME
from flare.sampler.status import DeviceStatus
from flare.scheduler.metrics import SchedulerMetrics
from flare.server.metrics import DaemonMetrics, http_metrics_middleware, metrics_handler, outcome_for_status
from flare.scheduler.stats import Occupancy, RoundTally


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


async def scrape(registry: CollectorRegistry, accept: str = "") -> tuple[str, str]:
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics", headers={"Accept": accept} if accept else {})
        assert response.status == 200
        return response.headers["Content-Type"], await response.text()


async def test_exposition_names_every_issue_metric_with_the_flare_prefix() -> None:
    metrics = DaemonMetrics.create()
    SchedulerMetrics(metrics.registry)
    content_type, text = await scrape(metrics.registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "flare_http_requests",
        "flare_device_statuses",
        "flare_prompt_tokens",
        "flare_generated_tokens",
        "flare_draft_tokens_proposed",
        "flare_draft_tokens_accepted",
        "flare_draft_tokens_accepted_per_round",
        "flare_draft_head_seconds",
        "flare_time_to_first_token_seconds",
        "flare_inter_token_latency_seconds",
        "flare_e2e_request_latency_seconds",
        "flare_requests_running",
        "flare_requests_waiting",
        "flare_kv_blocks_used",
        "flare_kv_blocks_total",
        "flare_process_resident_memory_bytes",
    } <= names
    assert all(name.startswith("flare_") for name in names)


async def test_openmetrics_is_served_when_the_scraper_asks_for_it() -> None:
    content_type, text = await scrape(DaemonMetrics.create().registry, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")


async def test_a_scrape_shows_what_the_scheduler_and_the_api_counted() -> None:
    metrics = DaemonMetrics.create()
    sm = SchedulerMetrics(metrics.registry, max_draft_tokens=4)
    sm.round_applied(
        RoundTally(
            statuses=[DeviceStatus.OK, DeviceStatus.OK, DeviceStatus.INVALID_SPECULATION],
            accepted_per_row=[3, 1],
            proposed=Counter({"mtp": 5, "ngram": 3}),
            accepted_by=Counter({"mtp": 1, "ngram": 3}),
            generated=6,
            prompt_tokens=20,
            head_seconds=0.004,
            first_token_seconds=[0.2],
            token_gaps=[(0.3, 3)],
        )
    )
    sm.request_ended(1.5)
    sm.occupancy_changed(Occupancy(running=2, waiting=1, kv_blocks_used=7, kv_blocks_total=64))
    metrics.http.count("/v1/chat/completions", "success")
    metrics.http.count("/v1/chat/completions", outcome_for_status(429))

    _, text = await scrape(metrics.registry)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert values[("flare_device_statuses_total", (("status", "OK"),))] == 2
    assert values[("flare_device_statuses_total", (("status", "INVALID_SPECULATION"),))] == 1
    assert values[("flare_device_statuses_total", (("status", "NONFINITE_LOGITS"),))] == 0
    assert values[("flare_prompt_tokens_total", ())] == 20
    assert values[("flare_generated_tokens_total", ())] == 6
    assert values[("flare_draft_tokens_proposed_total", (("drafter", "mtp"),))] == 5
    assert values[("flare_draft_tokens_proposed_total", (("drafter", "ngram"),))] == 3
    assert values[("flare_draft_tokens_proposed_total", (("drafter", "grammar"),))] == 0
    assert values[("flare_draft_tokens_accepted_total", (("drafter", "mtp"),))] == 1
    assert values[("flare_draft_tokens_accepted_total", (("drafter", "ngram"),))] == 3
    assert values[("flare_draft_head_seconds_total", ())] == pytest.approx(0.004)
    assert values[("flare_draft_tokens_accepted_per_round_bucket", (("le", "1.0"),))] == 1
    assert values[("flare_draft_tokens_accepted_per_round_bucket", (("le", "3.0"),))] == 2
    assert values[("flare_inter_token_latency_seconds_count", ())] == 3
    assert values[("flare_inter_token_latency_seconds_sum", ())] == pytest.approx(0.3)
    assert values[("flare_time_to_first_token_seconds_count", ())] == 1
    assert values[("flare_e2e_request_latency_seconds_count", ())] == 1
    assert values[("flare_requests_running", ())] == 2
    assert values[("flare_requests_waiting", ())] == 1
    assert values[("flare_kv_blocks_used", ())] == 7
    assert values[("flare_kv_blocks_total", ())] == 64
    ok = (("endpoint", "/v1/chat/completions"), ("outcome", "success"))
    rejected = (("endpoint", "/v1/chat/completions"), ("outcome", "rejected"))
    assert values[("flare_http_requests_total", ok)] == 1
    assert values[("flare_http_requests_total", rejected)] == 1


def test_an_unknown_device_status_is_counted_under_its_number() -> None:
    registry = CollectorRegistry()
    SchedulerMetrics(registry).round_applied(RoundTally(statuses=[0, 42]))
    assert samples(registry)[("flare_device_statuses_total", (("status", "42"),))] == 1


def test_registries_are_independent() -> None:
    first, second = DaemonMetrics.create(), DaemonMetrics.create()
    SchedulerMetrics(first.registry).round_applied(RoundTally(generated=5))
    SchedulerMetrics(second.registry)
    assert samples(second.registry)[("flare_generated_tokens_total", ())] == 0


def test_outcome_of_a_status_code() -> None:
    assert [outcome_for_status(s) for s in (200, 401, 404, 413, 422, 429, 503, 502, 504, 500)] == [
        "success",
        "invalid",
        "invalid",
        "invalid",
        "invalid",
        "rejected",
        "rejected",
        "failed",
        "failed",
        "error",
    ]


async def test_middleware_counts_each_request_by_route_and_outcome() -> None:
    metrics = DaemonMetrics.create()

    async def model(request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["model"]})

    async def stream_that_failed(request: web.Request) -> web.Response:
        request[OUTCOME] = "failed"  # the status line said 200 before the failure event
        return web.Response(text="data: {...}\n\n")

    async def refused(_request: web.Request) -> web.Response:
        raise web.HTTPTooManyRequests()

    app = web.Application(middlewares=[http_metrics_middleware(metrics.http)])
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/chat/completions", stream_that_failed)
    app.router.add_post("/v1/completions", refused)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/v1/models/a")).status == 200
        assert (await client.get("/v1/models/b")).status == 200
        assert (await client.post("/v1/chat/completions")).status == 200
        assert (await client.post("/v1/completions")).status == 429
        assert (await client.get("/nowhere")).status == 404

    counted = {
        labels: value
        for (name, labels), value in samples(metrics.registry).items()
        if name == "flare_http_requests_total"
    }
    assert counted == {
        (("endpoint", "/v1/models/{model}"), ("outcome", "success")): 2,
        (("endpoint", "/v1/chat/completions"), ("outcome", "failed")): 1,
        (("endpoint", "/v1/completions"), ("outcome", "rejected")): 1,
        (("endpoint", "unmatched"), ("outcome", "invalid")): 1,
    }
