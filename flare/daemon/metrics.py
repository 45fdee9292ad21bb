"""The daemon's metrics: one registry per process, HTTP-level counters, and GET /metrics.

The registry is built once at start (`DaemonMetrics.create`) and passed down to whatever
registers collectors; nothing uses prometheus_client's global default registry, so tests
(and two daemons in one process) never see each other's numbers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.exposition import choose_encoder

from flare.scheduler.metrics import SchedulerMetrics

# How one HTTP request ended, the `outcome` label of flare_http_requests_total:
#   success    answered in full (2xx, a stream that ended with [DONE])
#   failed     ended by a RequestFailure (a device status, a timeout, shutdown)
#   cancelled  the client went away, or an operator cancelled it (`flare ctl cancel`)
#   rejected   refused at admission: queue full (429) or draining (503)
#   invalid    refused for its input or credentials (other 4xx)
#   error      anything else (5xx); the rules say this never happens, this label proves it
Outcome = Literal["success", "failed", "cancelled", "rejected", "invalid", "error"]
OUTCOMES: tuple[Outcome, ...] = ("success", "failed", "cancelled", "rejected", "invalid", "error")


def outcome_for_status(status: int) -> Outcome:
    """The outcome of a request whose HTTP status says it all (not a stream that failed midway)."""
    if status < 400:
        return "success"
    if status in (429, 503):
        return "rejected"
    if status < 500:
        return "invalid"
    return "error"


class HttpMetrics:
    """Requests by endpoint (the route, never the raw path: bounded label values) and outcome."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "flare_http_requests",
            "HTTP requests answered, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=registry,
        )

    def count(self, endpoint: str, outcome: Outcome) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()


@dataclass(frozen=True)
class DaemonMetrics:
    registry: CollectorRegistry
    http: HttpMetrics
    scheduler: SchedulerMetrics

    @classmethod
    def create(cls, *, max_draft_tokens: int = 8) -> DaemonMetrics:
        registry = CollectorRegistry()
        # Resident memory, CPU time and open files: the soak test watches memory through these.
        ProcessCollector(namespace="flare", registry=registry)
        return cls(
            registry=registry,
            http=HttpMetrics(registry),
            scheduler=SchedulerMetrics(registry, max_draft_tokens=max_draft_tokens),
        )


def metrics_handler(registry: CollectorRegistry) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: the registry in the Prometheus text format (OpenMetrics when the scraper
    asks for it). Whether it needs an API key is the API's authentication middleware's call
    (`metrics_require_key`)."""

    async def handle(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    return handle
