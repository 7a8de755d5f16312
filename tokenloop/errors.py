"""The tokenloop error hierarchy.

Every error a caller can act on derives from `TokenloopError`. The server maps each class to an
OpenAI-format error body and an HTTP status; the engine loop never swallows one silently: it fails
the request that caused it and keeps serving the others.
"""

from __future__ import annotations


class TokenloopError(Exception):
    """Base class of every error tokenloop raises on purpose."""


class ConfigError(TokenloopError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class ModelLoadError(TokenloopError):
    """A checkpoint could not be read: truncated, malformed, or of an unsupported kind."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model name or path resolves to nothing on this machine."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but describes an architecture or tensor type we do not run."""


class InvalidRequestError(TokenloopError, ValueError):
    """A request's inputs are invalid; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class CapacityError(TokenloopError):
    """The engine cannot accept more work right now (queue full); retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(TokenloopError):
    """A request failed inside the engine (the step that ran it raised); the server keeps serving others."""


class EngineStoppedError(TokenloopError):
    """The engine is shutting down or has stopped and accepts no new requests."""


class ReplicaNotFoundError(TokenloopError):
    """A cluster call named a replica (or request) the cluster does not have (HTTP 404)."""


class ClusterConflictError(TokenloopError):
    """A cluster call that would break the cluster (draining the last replica that admits work; HTTP 409)."""


class AdapterLoadError(ModelLoadError):
    """A LoRA adapter could not be loaded: missing or corrupt files, another base model's shapes, a rank over
    the limit, or options this engine does not run. The server keeps serving everything else."""


class AdapterNotFoundError(InvalidRequestError):
    """A request (or an unload) named a LoRA adapter this engine does not serve (HTTP 404,
    model_not_found)."""
