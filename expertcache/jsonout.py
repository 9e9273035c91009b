"""Strict JSON for what the verbs write: numpy values as Python ones, an undefined figure (NaN,
such as a correlation over a single policy, or an infinity) as null, since strict parsers refuse NaN,
and -0.0 as 0.0."""
from __future__ import annotations

import errno
import json
import math
from pathlib import Path
from typing import TextIO

import numpy as np

from .atomic import write_text
from .errors import OutputError


def json_ready(x):
    """`x` with numpy scalars and arrays as Python values, and NaN or infinite floats as None."""
    if isinstance(x, dict):
        return {str(k): json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if isinstance(x, np.ndarray):
        return json_ready(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, float) and x == 0.0:
        return 0.0  # a rounded-away difference (-0.0) reads as zero, not as a sign
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def dump_json(path: Path | TextIO, data) -> None:
    """Write `data` to `path` (a file name or an open text stream) as strict JSON."""
    text = json.dumps(json_ready(data), indent=1, allow_nan=False)
    if hasattr(path, "write"):
        path.write(text + "\n")
        return
    try:
        write_text(Path(path), text)  # a run's earlier output is not cut short by a failed write
    except OSError as e:  # a full disk's error names no file (the write's, not the open's): the advice blamed the
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)  # store; the file named, with a fix of its own
        raise OutputError(f"cannot write {path} ({e.strerror}); " +
                          ("free space there, or give another path" if full else "give a path that can be written")
                          ) from None
