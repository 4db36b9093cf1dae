"""Exception hierarchy. Kernels never raise; these come from host-side validation and policies."""

from __future__ import annotations


class KVCanaryError(Exception):
    """Base of every error kv-canary raises."""


class ConfigError(KVCanaryError, ValueError):
    """A configuration value is out of its documented range."""


class CapacityError(KVCanaryError):
    """A fixed capacity chosen at install is too small for the requested work."""


class CanaryViolation(KVCanaryError):
    """Raised after a step by the ``raise`` policy; ``violations`` holds the decoded records and
    ``request_ids`` the engine's ids of the requests failed for reading the damage (empty when
    nothing failed, e.g. damage found by a sweep of idle cached slots, or when raised by the
    canary alone). An engine that fails the requests stays usable: step it again."""

    def __init__(self, message: str, violations: list | None = None, request_ids: tuple = ()):
        super().__init__(message)
        self.violations = list(violations or [])
        self.request_ids = tuple(request_ids)


class InputError(KVCanaryError, ValueError):
    """An argument handed to an op or the runtime is malformed: the message names the argument,
    the expected and the actual value. Raised before any state is written."""


class InputTypeError(InputError, TypeError):
    """An argument has the wrong type or dtype."""


class DeviceError(KVCanaryError):
    """A kernel raised the device error flag (a stale workspace, device-side bad offsets); raised
    after the step under the raise and recompute policies, logged under log."""
