"""Error hierarchy of the runtime.

Every error knows the HTTP status it maps to and carries a message that says
what was wrong and what the caller can do about it. The HTTP layer turns any
``BatchScopeError`` into ``{"error": message}`` with that status; anything else
becomes a generic 500 that leaks no internals.
"""

from __future__ import annotations


class BatchScopeError(Exception):
    """Base class: an error with an HTTP status and a user-facing message."""

    http_status: int = 500
    #: short machine-readable reason, also used as the outcome label in metrics
    reason: str = "internal"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, str]:
        return {"error": self.message}


class ClientError(BatchScopeError):
    """The request is malformed (bad JSON, wrong shape or datatype...)."""

    http_status = 400
    reason = "bad_request"


class ValidationError(BatchScopeError):
    """The request is well-formed but a value is out of range or inconsistent."""

    http_status = 422
    reason = "invalid"


class ConfigError(ValidationError):
    """A batching or server setting is invalid; nothing was changed."""

    reason = "invalid_config"


class ModelNotFound(BatchScopeError):
    http_status = 404
    reason = "not_found"


class QueueFull(BatchScopeError):
    """Backpressure: the model's queue is at ``max_queue_size``."""

    http_status = 429
    reason = "rejected"


class RequestExpired(BatchScopeError):
    """The request's timeout passed while it waited in the queue; it never ran."""

    http_status = 503
    reason = "expired"


class ModelNotReady(BatchScopeError):
    http_status = 503
    reason = "not_ready"


class ShuttingDown(BatchScopeError):
    http_status = 503
    reason = "shutting_down"


class ModelError(BatchScopeError):
    """The model raised while running the batch this request was in."""

    http_status = 500
    reason = "model_error"


class OutOfMemory(BatchScopeError):
    """A single request does not fit in memory even alone."""

    http_status = 507
    reason = "oom"
