"""Device status codes: one int32 per row, written by the sample/verify kernels.

The table is the contract between kernels, scheduler and API (see DESIGN.md):
extend it, never renumber it.
"""

from __future__ import annotations

from enum import IntEnum


class DeviceStatus(IntEnum):
    OK = 0
    NONFINITE_LOGITS = 1
    INVALID_DRAFT_TOKEN = 2
    INVALID_DRAFT_PROBABILITY = 3
    EMPTY_DISTRIBUTION = 4
    INVALID_SAMPLING_PARAMETERS = 5
    INVALID_SPECULATION = 6


STATUS_MEANING: dict[DeviceStatus, str] = {
    DeviceStatus.OK: "ok",
    DeviceStatus.NONFINITE_LOGITS: "NaN or infinity in the row's target logits",
    DeviceStatus.INVALID_DRAFT_TOKEN: "a draft token id outside the vocabulary",
    DeviceStatus.INVALID_DRAFT_PROBABILITY: "draft probability of a proposed token is not in (0, 1]",
    DeviceStatus.EMPTY_DISTRIBUTION: "filters and penalties left no token with positive probability",
    DeviceStatus.INVALID_SAMPLING_PARAMETERS: "the row's sampling parameters reached the device out of range",
    DeviceStatus.INVALID_SPECULATION: (
        "a filtered target distribution (top-k, top-p < 1, min-p > 0) in vocabulary-parallel verification"
    ),
}
