"""Errors raised by the rollout side (servers, launcher, client, weight sync)."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """Base class of every rollout-side error."""


class RolloutStartupError(RolloutError):
    """A rollout server or the router did not come up (exited during startup or timed out)."""


class ServerExitedError(RolloutStartupError):
    """A process exited while :func:`moerl.rollout.launcher.wait_healthy` waited for it to answer.

    Attributes:
        url: the base URL that was polled.
        returncode: the exit code (negative = killed by that signal number, subprocess convention).
    """

    def __init__(self, message: str, *, url: str, returncode: int):
        super().__init__(message)
        self.url = url
        self.returncode = returncode


class HealthTimeoutError(RolloutStartupError, TimeoutError):
    """A server did not answer its health check in time (:func:`moerl.rollout.launcher.wait_healthy`).

    Both a RolloutStartupError and a builtin TimeoutError. Attributes: ``url``, ``timeout_s``."""

    def __init__(self, message: str, *, url: str, timeout_s: float):
        super().__init__(message)
        self.url = url
        self.timeout_s = timeout_s


class PortInUseError(RolloutStartupError):
    """A port the rollout cluster needs is already taken; nothing was started."""


class RolloutServerDiedError(RolloutError):
    """A rollout server (or the router) process exited while the cluster was in use.

    Attributes:
        index: server index (0-based) or None for the router.
        url: the base URL of the dead process.
        pid: its process id.
        returncode: its exit code (negative = killed by that signal number, subprocess convention).
    """

    def __init__(self, message: str, *, index, url: str, pid: int, returncode: int):
        super().__init__(message)
        self.index = index
        self.url = url
        self.pid = pid
        self.returncode = returncode


class RolloutRequestError(RolloutError):
    """A /generate request failed (bad request, or still failing after the allowed retries)."""


class RolloutRequestRefusedError(RolloutRequestError):
    """The server answered HTTP 4xx (other than 408/429): the request itself is wrong, so sending it to
    another server would be refused too (not retried)."""


class WeightSyncError(RolloutError):
    """A weight update was refused by a server, or a server reports a different weight_version."""
