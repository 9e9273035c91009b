"""A command run under a real memory cap: a cgroup whose limit charges the process's resident memory and the
page cache it brings in together, as the kernel enforces it (the OOM killer ends a process that cannot be
brought back under it); its peak charge, and whether it was killed. cgroup v1's memory controller or
cgroup v2, where this process may create groups (root, or a delegated subtree). And a process's reads from a disk
held at a chosen rate, by a block-I/O group (`ReadThrottle`)."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def cgroup_root() -> tuple[Path, int] | None:
    """(where new memory groups go, the cgroup version), or None where this process cannot create one."""
    for root, version in ((V1, 1), (V2 / "unified", 2), (V2, 2)):
        probe = (root / "memory.limit_in_bytes") if version == 1 else (root / "cgroup.subtree_control")
        if probe.exists() and os.access(root, os.W_OK):
            if version == 2 and "memory" not in probe.read_text():
                continue
            return root, version
    return None


def unavailable() -> str | None:
    """Why no memory cap can be set here (for a skip reason), or None."""
    if cgroup_root() is None:
        return "no writable cgroup memory controller (needs root, or a delegated cgroup v2 subtree)"
    return None


@dataclass
class CappedRun:
    """How a command ran under a memory cap."""
    returncode: int
    peak_bytes: int  # the group's highest charge: resident memory and page cache
    oom_killed: bool
    seconds: float
    stdout: str
    stderr: str


def run_capped(cmd: list[str], limit_bytes: int | None, timeout: float | None = None,
               env: dict | None = None) -> CappedRun:
    """Run `cmd` in a new memory cgroup limited to `limit_bytes` (None: no limit, to measure a peak) and
    return how it went; the group is removed afterwards."""
    found = cgroup_root()
    if found is None:
        raise RuntimeError(unavailable())
    root, version = found
    group = root / f"expertcache-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    try:
        if limit_bytes is not None:
            (group / limit_file).write_text(str(limit_bytes))
            if version == 1 and (group / "memory.memsw.limit_in_bytes").exists():
                try:  # no escape into swap either, where the machine has any
                    (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                except OSError:
                    pass
        procs = str(group / "cgroup.procs")

        def join():  # in the child, before exec: everything it allocates is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        start = time.perf_counter()
        out = subprocess.run(cmd, preexec_fn=join, capture_output=True, text=True, timeout=timeout, env=env)
        seconds = time.perf_counter() - start
        peak = _peak(group, version)
        return CappedRun(out.returncode, peak, _oom_killed(group, version, out.returncode), seconds, out.stdout,
                         out.stderr)
    finally:
        _remove(group)


def _peak(group: Path, version: int) -> int:
    name = "memory.max_usage_in_bytes" if version == 1 else "memory.peak"
    try:
        return int((group / name).read_text())
    except (OSError, ValueError):
        return -1


def _oom_killed(group: Path, version: int, returncode: int) -> bool:
    try:
        text = (group / ("memory.oom_control" if version == 1 else "memory.events")).read_text()
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        if int(fields.get("oom_kill", 0)) > 0:
            return True
    except (OSError, ValueError):
        pass
    return returncode == -9


def _remove(group: Path) -> None:
    for _ in range(50):  # the group empties once its last process has been reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only), so that each run starts with nothing cached; False where
    this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def device_of(path: Path) -> Path | None:
    """The block device holding `path`, as its /sys/block entry (a partition's parent disk), or None."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysfs.exists():
        return None
    real = sysfs.resolve()
    return real.parent if (real / "partition").exists() else real


def read_ahead_kb(path: Path, value: int | None = None) -> int | None:
    """The read-ahead (KiB) of the disk holding `path`; with `value`, set it first (root). None where unknown."""
    dev = device_of(path)
    if dev is None or not (dev / "queue" / "read_ahead_kb").exists():
        return None
    f = dev / "queue" / "read_ahead_kb"
    if value is not None:
        f.write_text(str(value))
    return int(f.read_text())


class ReadThrottle:
    """This process's reads from the disk holding `path`, held at a rate of our choosing (`set`), by a block-I/O
    cgroup it joins for the `with` block: a disk of another speed, with the real reads (O_DIRECT and io_uring's
    included), where this machine's own drifts. cgroup v1's blkio controller or v2's io controller, as root."""

    def __init__(self, path: Path):
        dev = device_of(path)
        if dev is None or not (dev / "dev").exists():
            raise RuntimeError(f"no block device found under {path} to hold at a rate")
        self.device = (dev / "dev").read_text().strip()  # "major:minor"
        v1 = Path("/sys/fs/cgroup/blkio")
        if (v1 / "blkio.throttle.read_bps_device").exists():
            self.root, self.limit_file = v1 / _own_group("blkio"), "blkio.throttle.read_bps_device"
        else:
            v2 = V2 / "unified" if (V2 / "unified" / "cgroup.procs").exists() else V2
            self.root, self.limit_file = v2 / _own_group(""), "io.max"
            if "io" not in _read(self.root / "cgroup.subtree_control"):
                raise RuntimeError("no block-I/O cgroup controller here: cgroup v1's blkio, or v2's io enabled in "
                                   f"{self.root / 'cgroup.subtree_control'}")
        if not os.access(self.root, os.W_OK):
            raise RuntimeError(f"cannot make a block-I/O cgroup under {self.root} (needs root)")
        self.group = self.root / f"expertcache-read-{os.getpid()}-{time.monotonic_ns()}"

    def __enter__(self) -> "ReadThrottle":
        self.group.mkdir()
        (self.group / "cgroup.procs").write_text(str(os.getpid()))  # every thread of this process, in v1 and v2
        return self

    def set(self, bytes_per_second: int | None) -> None:
        """Hold reads at `bytes_per_second`; None: the disk's own rate."""
        if self.limit_file == "io.max":
            value = f"rbps={'max' if bytes_per_second is None else bytes_per_second}"
        else:
            value = str(bytes_per_second or 0)  # 0 removes v1's rule
        (self.group / self.limit_file).write_text(f"{self.device} {value}")

    def __exit__(self, *exc) -> None:
        (self.root / "cgroup.procs").write_text(str(os.getpid()))  # back where it was
        _remove(self.group)


def _own_group(controller: str) -> str:
    """This process's group under `controller`'s hierarchy ("" : v2's), relative to its root."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, names, group = line.split(":", 2)
        if controller in names.split(","):
            return group.lstrip("/")
    return ""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
