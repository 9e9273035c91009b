"""Progress bars on stderr that give way to an error: a verb that fails part-way ends with its one
error line, not with a half-drawn bar above it."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress_bar(show: bool | None = True, **kw) -> Iterator[tqdm]:
    """A tqdm bar on stderr (`show` None: only where stderr is a terminal), erased if the block raises."""
    bar = tqdm(file=sys.stderr, disable=None if show is None else not show, **kw)
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()
