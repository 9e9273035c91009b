"""The decorator of the decision kernel's compiled functions."""
from numba import njit

# Kernel functions only read and write arrays that their caller owns and never allocate:
# compiled without numba's reference counting, a helper call costs nothing instead of two
# runtime calls per array it touches (which made small helpers ~50x slower than inline code).
compiled = njit(cache=True, _nrt=False, inline="always")
