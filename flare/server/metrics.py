"""The daemon's metrics: one registry per process, HTTP-level counters, and GET /metrics.

The registry is built once at start (`DaemonMetrics.create`) and passed down to whatever
registers collectors; nothing uses prometheus_client's global default registry, so tests
(and two daemons in one process) never see each other's numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.exposition import choose_encoder

from flare.api.answer import OUTCOME

# How one HTTP request ended, the `outcome` label of flare_http_requests_total:
#   success    answered in full (2xx, a stream that ended with [DONE])
#   failed     ended by a RequestFailure: the device failed the row (502), the request timed
#              out (504), or a stream reported a failure after its 200 status line
#   cancelled  the client went away, or an operator cancelled a stream (`flare ctl cancel`)
#   rejected   refused or ended by the server's state: queue full (429), draining, loading or
#              shutting down (503)
#   invalid    refused for its input or credentials (other 4xx, 422 included)
#   error      any other 5xx; the rules say this never happens, this label proves it
Outcome = Literal["success", "failed", "cancelled", "rejected", "invalid", "error"]
OUTCOMES: tuple[Outcome, ...] = ("success", "failed", "cancelled", "rejected", "invalid", "error")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def outcome_for_status(status: int) -> Outcome:
    """The outcome of a request whose HTTP status says it all (not a stream that failed midway)."""
    if status < 400:
        return "success"
    if status in (429, 503):
        return "rejected"
    if status < 500:
        return "invalid"
    if status in (502, 504):
        return "failed"
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


def http_metrics_middleware(http: HttpMetrics) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Counts every request once, by route and outcome. Install it outermost, so it sees the
    status the error middleware chose; a handler cancelled by a client disconnect counts as
    cancelled."""

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            http.count(endpoint, "cancelled")
            raise
        except web.HTTPException as error:
            http.count(endpoint, outcome_for_status(error.status))
            raise
        recorded = request.get(OUTCOME)
        http.count(endpoint, recorded if recorded in OUTCOMES else outcome_for_status(response.status))  # type: ignore[arg-type]
        return response

    return count


@dataclass(frozen=True)
class DaemonMetrics:
    """The registry and the collectors that exist from start; the scheduler's collectors
    (flare.scheduler.metrics.SchedulerMetrics) join the same registry once the package is
    open, because their buckets follow its draft length."""

    registry: CollectorRegistry
    http: HttpMetrics

    @classmethod
    def create(cls) -> DaemonMetrics:
        registry = CollectorRegistry()
        # Resident memory, CPU time and open files: the soak test watches memory through these.
        ProcessCollector(namespace="flare", registry=registry)
        return cls(registry=registry, http=HttpMetrics(registry))


def metrics_handler(registry: CollectorRegistry) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: the registry in the Prometheus text format (OpenMetrics when the scraper
    asks for it). Whether it needs an API key is the API's authentication middleware's call
    (`metrics_require_key`)."""

    async def handle(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    return handle
