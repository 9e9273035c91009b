"""The decision kernel, compiled with numba: cache bookkeeping, eviction orders, routing, the
policies' decisions and the replay loop. Shared by the engine and the simulator; it works
on numpy arrays and never calls back into the engine."""

from ..address_space import check_address_space

check_address_space()  # before numba's first import, where OpenBLAS spun for ever under a small ulimit -v

# numba picks a function's cache locator when the function is decorated: the kernel's own locator (one cache
# folder per version of this package's sources, compiled.py) must be registered before any module here is
from . import compiled  # noqa: E402,F401
