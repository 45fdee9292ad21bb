"""Why the scheduler refuses a request at submission (the daemon maps each to an HTTP status)."""

from __future__ import annotations


class AdmissionError(Exception):
    """The request was not admitted; nothing about it is held by the scheduler."""


class QueueFull(AdmissionError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(AdmissionError):
    def __init__(self, retry_after_s: float = 5.0) -> None:
        super().__init__("the server is draining and admits no new requests")
        self.retry_after_s = retry_after_s


class PromptTooLong(AdmissionError, ValueError):
    """The prompt can never be served: longer than the context or than the whole KV cache."""

    def __init__(self, message: str, prompt_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class DuplicateRequestId(AdmissionError, ValueError):
    pass


class ContractViolation(ValueError):
    """The package's stored sampling policy contradicts its sampler; it is not served."""


class TooManyChoices(AdmissionError, ValueError):
    """More choices (n) than the scheduler runs sequences at once: they could never run together."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit
