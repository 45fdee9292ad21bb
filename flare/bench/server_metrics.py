"""flare's `/metrics` read before and after a level, and what changed over it.

Only a flare server exposes these (`flare_device_statuses_total` is the sign); for any other
server, or a `/metrics` that cannot be read, the level's `server_metrics` is null. What is
reported: rows by device status before, after and in between; draft tokens proposed and
accepted (in all and by drafter), and accepted per speculative row and round (the histogram's sum over its count);
tokens generated per row and round (generated tokens / rows sampled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from flare.bench.client import Endpoint

STATUSES = "flare_device_statuses_total"
GENERATED = "flare_generated_tokens_total"
PROPOSED = "flare_draft_tokens_proposed_total"
ACCEPTED = "flare_draft_tokens_accepted_total"
PER_ROUND_SUM = "flare_draft_tokens_accepted_per_round_sum"
PER_ROUND_COUNT = "flare_draft_tokens_accepted_per_round_count"


@dataclass(frozen=True)
class Snapshot:
    """The counters that matter here, from one read of /metrics."""

    statuses: dict[str, float]
    values: dict[str, float]
    by_drafter: dict[tuple[str, str], float]  # (PROPOSED or ACCEPTED, drafter label) -> count

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


async def read_snapshot(session: aiohttp.ClientSession, endpoint: Endpoint) -> Snapshot | None:
    """flare's counters now, or None when the server is not flare or /metrics cannot be read."""
    try:
        async with session.get(
            f"{endpoint.url}/metrics", headers=endpoint.headers(), timeout=aiohttp.ClientTimeout(total=10)
        ) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, ConnectionError):
        return None
    return parse_snapshot(text)


def parse_snapshot(text: str) -> Snapshot | None:
    statuses: dict[str, float] = {}
    values: dict[str, float] = {}
    by_drafter: dict[tuple[str, str], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == STATUSES:
                    statuses[sample.labels.get("status", "")] = sample.value
                elif sample.name in (GENERATED, PROPOSED, ACCEPTED, PER_ROUND_SUM, PER_ROUND_COUNT):
                    # Draft counters carry a drafter label: their total is the sum over it.
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                    if "drafter" in sample.labels:
                        by_drafter[(sample.name, sample.labels["drafter"])] = sample.value
    except ValueError:
        return None  # not the Prometheus text format
    return Snapshot(statuses, values, by_drafter) if statuses else None


def difference(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """What one level did to flare's counters (None unless both reads succeeded)."""
    if before is None or after is None:
        return None
    rows = {status: after.statuses.get(status, 0.0) - before.statuses.get(status, 0.0) for status in after.statuses}
    rows_sampled = sum(rows.values())
    generated = after.get(GENERATED) - before.get(GENERATED)
    proposed = after.get(PROPOSED) - before.get(PROPOSED)
    accepted = after.get(ACCEPTED) - before.get(ACCEPTED)
    speculative_rows = after.get(PER_ROUND_COUNT) - before.get(PER_ROUND_COUNT)
    drafters = {}
    for drafter in sorted({d for _, d in after.by_drafter}):
        moved = {
            kind: after.by_drafter.get((name, drafter), 0.0) - before.by_drafter.get((name, drafter), 0.0)
            for kind, name in (("proposed", PROPOSED), ("accepted", ACCEPTED))
        }
        if moved["proposed"]:
            drafters[drafter] = {**moved, "acceptance": moved["accepted"] / moved["proposed"]}
    return {
        "device_statuses_before": dict(before.statuses),
        "device_statuses_after": dict(after.statuses),
        "device_statuses": rows,
        "generated_tokens": generated,
        "tokens_per_row_round": generated / rows_sampled if rows_sampled else None,
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
        "draft_acceptance": accepted / proposed if proposed else None,
        "drafts_by_drafter": drafters,  # drafters that proposed in the level: proposed, accepted, acceptance
        "speculative_row_rounds": speculative_rows,
        "accepted_per_round": (
            (after.get(PER_ROUND_SUM) - before.get(PER_ROUND_SUM)) / speculative_rows if speculative_rows else None
        ),
    }

