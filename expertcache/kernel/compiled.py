"""The decorator of the decision kernel's compiled functions, where their machine code is
cached, and a prefetch hint."""
import hashlib
import os
from pathlib import Path

import numba
from llvmlite import ir
from numba import njit, types
from numba.core import caching, cgutils
from numba.extending import intrinsic

# numba's cache is keyed on each function's own file: a function that inlines kernel code from
# another module would keep stale code after that module changes. A cache directory per
# version of the kernel's sources (every module of this folder) rules that out.
KERNEL_DIR = Path(__file__).parent.resolve()
DIGEST = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(KERNEL_DIR.glob("*.py")))).hexdigest()[:16]


def cache_dir() -> Path:
    """Where the kernel's machine code is cached: one folder per version of its sources, under
    NUMBA_CACHE_DIR when the user set one, else under XDG_CACHE_HOME (default ~/.cache)."""
    base = numba.config.CACHE_DIR or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "expertcache-numba" / DIGEST


def kernels_compiled(kernels: str = "engine") -> Path:
    """A mark left in `cache_dir` once a run of this kernel version has compiled the set it uses, `kernels`: the
    engine's or the simulator's (the command line's notice of a first run's minutes of compiling is shown until it
    exists; one mark for both kept quiet the simulator's first compile after a `generate`)."""
    return cache_dir() / ("compiled" if kernels == "engine" else f"compiled-{kernels}")


def kernels_cached() -> bool:
    """Whether this version's kernels are in numba's cache (a run loads them in a fraction of a second), or must be
    compiled: numba's own index files, which a run through the Python API leaves too, where `kernels_compiled`'s
    mark is the command line's."""
    folder = cache_dir()
    return folder.is_dir() and any(folder.glob("*.nbi"))


class KernelCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """numba's cache locator for the functions of this folder only (`cache_dir`); numba's own
    locators keep serving every other function, and numba's configuration is left as it is."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(cache_dir())

    def get_cache_path(self):
        """The folder of this kernel version's cached machine code (`cache_dir`)."""
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        """The locator of a function in this folder; None for any other function, so numba's own locators serve it."""
        if Path(py_file).resolve().parent != KERNEL_DIR:
            return None
        return super().from_function(py_func, py_file)  # None (numba falls back) if it cannot write there


_locators = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # _CacheImpl in older numba
if KernelCacheLocator not in _locators._locator_classes:
    _locators._locator_classes.insert(0, KernelCacheLocator)

# Kernel functions only read and write arrays that their caller owns and never allocate:
# compiled without numba's reference counting, a call costs nothing instead of two runtime
# calls per array it touches. Inlined into their callers, no call passes the whole state.
compiled = njit(cache=True, _nrt=False, inline="always")


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the CPU to bring the cache line of array[index] in ahead of use (llvm.prefetch)."""
    def codegen(context, builder, signature, args):
        arrayty = signature.args[0]
        ary = context.make_array(arrayty)(context, builder, args[0])
        ptr = builder.bitcast(cgutils.get_item_pointer(context, builder, arrayty, ary, [args[1]]),
                              ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()
    return types.void(array, index), codegen


@intrinsic
def widen(typingctx, value):
    """A stored weight as float32: float32 as it is; uint16 as the bits of an fp16 value, int16 as
    those of a bf16 one (numpy has neither type), converted exactly (LLVM's fpext, or the bf16 bits
    as the top half of an fp32). Lets a kernel read slots kept in the checkpoint's 16-bit dtype,
    halving the bytes each expert's products stream from memory."""
    if isinstance(value, types.Float):
        def codegen(context, builder, signature, args):
            return builder.fpext(args[0], ir.FloatType()) if value.bitwidth < 32 else args[0]
        return types.float32(value), codegen
    if value not in (types.uint16, types.int16):
        return None

    def codegen(context, builder, signature, args):
        if value == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(value), codegen
