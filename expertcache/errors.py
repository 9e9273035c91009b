"""Typed errors. Each message is one line that names the problem and the fix."""
import numbers
import operator


class ExpertCacheError(Exception):
    """Base of every error the library raises on bad input or a failed I/O."""


class CheckpointError(ExpertCacheError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint's model_type is not one of the families expertcache implements."""


class CacheTooSmall(ExpertCacheError):
    """The fast tier cannot hold top-k experts of one layer."""


class NotEnoughMemory(ExpertCacheError):
    """The machine has less free memory than a run would hold: refused before loading, not killed while loading."""


class NotEnoughDisk(ExpertCacheError):
    """The disk has less free space than a store conversion writes: refused before writing, not failed near its end."""


class UnknownName(ExpertCacheError):
    """An unknown policy, eviction, store or preset name."""


def did_you_mean(name: object, choices) -> str:
    """" (did you mean X?)" for the choice closest to a misspelt `name`, where one is close; else ""."""
    import difflib
    near = difflib.get_close_matches(str(name), [str(c) for c in choices], 1, 0.7)
    return f" (did you mean {near[0]}?)" if near else ""


class FetchError(ExpertCacheError):
    """A read from the slow tier failed or came back short."""


class BadInput(ExpertCacheError):
    """An argument or an input text the library cannot work with (too short, too long)."""


class OutputError(ExpertCacheError):
    """A file a run writes (its --json) could not be written: a full disk, a read-only one."""


class ReadModeUnsupported(ExpertCacheError):
    """The disk store cannot be read the way asked (no O_DIRECT on this platform or filesystem)."""


class NonFiniteOutput(ExpertCacheError):
    """The model produced NaN or infinite logits: corrupt weights, never a result to report."""


def size_text(nbytes: int) -> str:
    """A byte count as the messages give it: GiB from one GiB up, else MiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def whole_number(value, what: str) -> int:
    """`value` as an int where it is one (a Python or NumPy integer, not a bool); BadInput naming `what` otherwise:
    a float, a string or None would fail far from the mistake, inside torch or the compiled kernels."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise BadInput(f"{what}={value!r} must be a whole number (an int), not {type(value).__name__}")


def truth(value, what: str) -> bool:
    """`value` where it is a bool (a NumPy one too); BadInput naming `what` otherwise: "no" would read as true."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # NumPy's, without importing it here
        return bool(value)
    raise BadInput(f"{what}={value!r} must be True or False")


def real_number(value, what: str) -> float:
    """`value` as a float where it is a real number (not a bool); BadInput naming `what` otherwise."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise BadInput(f"{what}={value!r} must be a number, not {type(value).__name__}")
