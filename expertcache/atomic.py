"""Files written whole or not at all: a run interrupted while it writes (Ctrl-C, a full disk, a kill) leaves the
file as it was, not cut short, and a process that reads it meanwhile (a server starting) sees the old one."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; it replaces `path` when the block ends without an error, and is
    removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """Path.write_text, whole or not at all."""
    with replaced(path) as tmp:
        tmp.write_text(text)
