"""Typed errors. Each message says what to change."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A config value makes no sense; the message names the key and a valid range."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling params) cannot be served as given."""


class ModelLoadError(EngineError, RuntimeError):
    """A model path, weights file or architecture cannot be loaded."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop's thread died: this instance cannot serve until it restarts."""


class WorkerDiedError(EngineError, RuntimeError):
    """A tensor/pipeline-parallel rank failed; its engine cannot continue."""
