"""What the HTTP API needs to know about the running daemon, owned by the server and passed down."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from flare.api.errors import SERVER_ERROR, ApiError
from flare.api.fields import ServedNames

if TYPE_CHECKING:
    from flare.scheduler.scheduler import Scheduler

LOADING_RETRY_AFTER_S = 5


class Phase(Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


class ServingState:
    """The daemon's phase, the scheduler once it is loaded, and the requests being answered.

    `in_flight` holds the scheduler request id of every generation whose HTTP response is not
    yet fully written; shutdown waits for it to empty, so no completed response is lost.
    """

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.names: ServedNames | None = None  # once the package is open
        self._scheduler: Scheduler | None = None
        self.in_flight: set[str] = set()
        # Whether the HTTP API listens on a loopback address only (then the Host header is checked).
        self.loopback = False

    def ready(self, scheduler: Scheduler, names: tuple[str, ...], *, accept_any_name: bool = False) -> None:
        self._scheduler = scheduler
        self.names = ServedNames(names, accept_any_name)
        self.phase = Phase.READY

    @property
    def model_name(self) -> str | None:
        """The served model's first name, once it is loaded."""
        return self.names.primary if self.names is not None else None

    def require_names(self) -> ServedNames:
        """The served model's names (a 503 while loading, as require_scheduler)."""
        self.require_scheduler()
        assert self.names is not None
        return self.names

    def stopping(self) -> None:
        self.phase = Phase.STOPPING

    @property
    def is_stopping(self) -> bool:
        return self.phase is Phase.STOPPING

    def require_scheduler(self) -> Scheduler:
        """The scheduler, or a 503 while the model is loading."""
        if self._scheduler is None:
            raise ApiError(
                503,
                "the model is still loading; retry when GET /health answers 200",
                type=SERVER_ERROR,
                code="model_loading",
                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            )
        return self._scheduler
