"""Typed errors. Each message is one line that names the problem and the fix."""


class ExpertCacheError(Exception):
    """Base of every error the library raises on bad input or a failed I/O."""


class CheckpointError(ExpertCacheError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint's model_type is not one of the families expertcache implements."""


class CacheTooSmall(ExpertCacheError):
    """The fast tier cannot hold top-k experts of one layer."""


class UnknownName(ExpertCacheError):
    """An unknown policy, eviction, store or preset name."""


class BadInput(ExpertCacheError):
    """A value given by the user is out of range or malformed (a flag, a text, a request)."""


class FetchError(ExpertCacheError):
    """A read from the slow tier failed or came back short."""
