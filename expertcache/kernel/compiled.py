"""The decorator of the decision kernel's compiled functions, where their machine code is
cached, and a prefetch hint."""
import hashlib
import os
from pathlib import Path

import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# numba's cache is keyed on each function's own file: a function that inlines kernel code from
# another module would keep stale code after that module changes. A cache directory per
# version of the kernel's sources (every module of this folder) rules that out.
_digest = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(Path(__file__).parent.glob("*.py")))).hexdigest()[:16]
if not os.environ.get("NUMBA_CACHE_DIR"):
    _home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    numba.config.CACHE_DIR = str(_home / "expertcache-numba" / _digest)

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
