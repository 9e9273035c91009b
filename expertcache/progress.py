"""Progress bars on stderr that give way to an error: a verb that fails part-way ends with its one
error line, not with a half-drawn bar above it."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress_bar(show: bool | None = True, **kw) -> Iterator[tqdm]:
    """A tqdm bar on stderr (`show` None: only where stderr is a terminal), erased if the block raises. One without a
    total yet waits a moment to show, for the total its work sets (it printed an empty `0it` line first)."""
    if kw.get("total") is None:
        kw.setdefault("delay", 0.1)
    bar = tqdm(file=sys.stderr, disable=None if show is None else not show, **kw)
    # once a phase sets the total the bar shows at once, its last state too (a delay hid a fast one's); a disabled
    # bar has no delay
    if getattr(bar, "delay", 0):
        reset = bar.reset

        def reset_shown(total=None):
            bar.delay = 0
            reset(total)
        bar.reset = reset_shown
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


def phases(bar: tqdm):
    """A `progress(label, n, total=None)` for work in phases (the study's, speculation's): a phase opens with its
    total, which resets `bar`; each label is shown as it changes; n counts onwards."""
    last = [None]

    def progress(label: str, n: int, total: int | None = None) -> None:
        if total is not None:
            bar.reset(total=total)
        if label != last[0]:
            bar.set_description(label)
            last[0] = label
        bar.update(n)
    return progress
