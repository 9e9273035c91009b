"""Files written whole or not at all: a run interrupted while it writes (Ctrl-C, a full disk, a kill) leaves the
file as it was, not cut short, and a process that reads it meanwhile (a server starting) sees the old one."""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced(path: Path, named: bool = True) -> Iterator[Path]:
    """A temporary path beside `path` to write; it replaces `path` when the block ends without an error, and is
    removed when it raises. A path that is not a regular file (/dev/stdout, a FIFO) is written in place: renaming
    over it would replace the device or pipe itself (and as root, the system's). Through a symbolic link the file it
    points to is replaced, and the link kept. `named`: a system error of the block's that names no file, or the
    temporary, is raised naming `path` (`named_error`)."""
    path = Path(path)
    if written_in_place(path):
        yield path
        return
    path = path.resolve() if path.is_symlink() else path
    # its own name: two processes writing the same file wrote into one temporary, and one published the other's half
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        yield tmp
        # a writer may make its file private (safetensors' save_file: 0600); the file takes the mode it replaces, or
        # a new file's under the umask, so that others who share the folder can read it as before
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if named and (renamed := named_error(e, path, tmp)) is not None:
            raise renamed from e
        raise


@contextmanager
def replaced_together(*paths: Path) -> Iterator[tuple[Path, ...]]:
    """`replaced` of several files that belong together (a calibration's counts and vectors): every one is written
    before any replaces its file, so that a write that fails (a full disk) leaves the old set, not half of each."""
    try:
        with contextlib.ExitStack() as stack:
            yield tuple(stack.enter_context(replaced(p, named=False)) for p in paths)
    except BaseException as e:  # which of them failed is not known here: their folder is what a full disk needs
        if (renamed := named_error(e, Path(os.path.commonpath([Path(p).absolute() for p in paths])))) is not None:
            raise renamed from e
        raise


def system_error(e: BaseException) -> OSError | None:
    """`e` as the system error it is: itself where it is an OSError; safetensors' own type, which its writer raises
    for the system's error (a full disk while a file is saved), as the OSError of the "os error N" it names; None
    for any other error."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError" and (code := re.search(r"os error (\d+)", str(e))):
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
    return None


def named_error(e: BaseException, path: Path, temporary: Path | None = None) -> OSError | None:
    """The system error `e` (`system_error`) of a write of `path` as an OSError that names `path`, where it names no
    file (a full disk's is the write's, not the open's) or the temporary written in its place; None where it names
    another file already or is no system error."""
    s = system_error(e)
    if s is not None and s.errno is not None and (s.filename is None or s.filename == str(temporary)):
        return OSError(s.errno, s.strerror, str(path))
    return None


def written_in_place(path: Path) -> bool:
    """Whether `replaced` writes `path` itself rather than a file beside it: one that exists and is not a regular
    file (a device, a FIFO, or a link to one)."""
    return path.exists() and not path.is_file()


def write_text(path: Path, text: str) -> None:
    """Path.write_text, whole or not at all."""
    with replaced(path) as tmp:
        tmp.write_text(text)


def writable_folder(folder: Path) -> bool:
    """Whether a file can be made in `folder`, by making one: os.access answers yes to root wherever the
    filesystem is not read-only, /proc included."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, which races with other threads' files)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
