"""The per-request checks every engine applies before it queues a request.

The request engine (``runtime.engine.engine.Engine``) and the generation runner
(``runtime.generation.runner.StepRunner``) both take a ``priority`` and a
``timeout_ms`` from the caller, fall back to their model's settings when one is
left out, and turn the timeout into a deadline on the monotonic clock. They do it
here, so both refuse the same values with the same messages:

* ``priority``: an integer from 0 (most urgent) to ``priority_levels - 1``;
  ``None`` means the settings' ``default_priority``.
* ``timeout_ms``: a finite number of milliseconds above 0; ``None`` means the
  settings' ``default_timeout_ms`` (which may itself be ``None``: no deadline).

Plain functions, no state: they sit on the request path, so each is one call.
"""

from __future__ import annotations

import math
from typing import Protocol

from runtime.api.errors import ValidationError


class AdmissionSettings(Protocol):
    """The settings fields admission reads (``BatchingConfig`` and ``GenerationConfig``
    both have them)."""

    priority_levels: int
    default_priority: int
    default_timeout_ms: float | None


def priority_of(priority: int | None, settings: AdmissionSettings) -> int:
    """The priority a request runs at: ``priority`` checked, or the default when None.
    Raises ``ValidationError`` for anything but an integer in range."""
    if priority is None:
        return settings.default_priority
    if (isinstance(priority, int) and not isinstance(priority, bool)
            and 0 <= priority < settings.priority_levels):
        return priority
    raise ValidationError(f"priority={priority!r} must be an integer from 0 (most urgent) "
                          f"to {settings.priority_levels - 1}", param="priority")


def deadline_of(timeout_ms: float | None, settings: AdmissionSettings,
                now: float) -> float | None:
    """The monotonic time past which a request arriving at ``now`` is not run: from
    ``timeout_ms`` when given (checked), else from the default; None when neither
    sets one. Raises ``ValidationError`` for anything but a finite number above 0."""
    if timeout_ms is None:
        timeout_ms = settings.default_timeout_ms
        if timeout_ms is None:
            return None
    elif (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float))
          or not timeout_ms > 0 or not math.isfinite(timeout_ms)):
        raise ValidationError(f"timeout_ms={timeout_ms!r} must be a finite number of "
                              "milliseconds above 0; leave it out to use the model's "
                              "default_timeout_ms", param="timeout_ms")
    return now + timeout_ms / 1000.0
