"""The fast tier's slots as memory: the format an expert takes there (--slot-dtype), its bytes, and the
page-aligned memory that holds a cache's stacked slots."""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch

from ..choices import SLOT_DTYPES
from ..errors import BadInput, UnknownName
from .quant import FLOAT_DTYPES, ExpertFormat, encoded_bytes
from .stores import ExpertShape


def slot_format(name: str, device: torch.device, stored: ExpertFormat, store: str = "disk") -> ExpertFormat:
    """The fast tier's format of one expert from --slot-dtype `name` and the slow tier's format
    `stored`. auto: the store's dtype when it is fp16 or bf16 (on the CPU the compiled kernel widens
    them exactly; on CUDA a bf16 checkpoint stays bf16), else fp32 on the CPU and fp16 on CUDA. int8/int4/mxfp4 keep the store's encoded blobs as they are
    (its group size and scheme), so the store must hold that dtype (on the disk, or emulated in
    RAM), for the CPU kernel."""
    if name not in SLOT_DTYPES:
        raise UnknownName(f"unknown slot dtype {name!r}; choose one of {', '.join(SLOT_DTYPES)}")
    if name == "auto":
        if stored.dtype in ("float16", "bfloat16"):
            return ExpertFormat(stored.dtype)
        return ExpertFormat("float32" if device.type == "cpu" else "float16")
    fmt = ExpertFormat.parse(name)
    if not fmt.quantized:
        return fmt
    if device.type != "cpu":
        raise BadInput(f"--slot-dtype {name} computes with the CPU kernel; use --device cpu or --slot-dtype fp16")
    if stored.dtype != fmt.dtype:
        raise BadInput(f"--slot-dtype {name} keeps the slow tier's {name} blobs as they are, but it holds "
                       f"{stored.tag}; add --store-dtype {name}")
    if store not in ("disk", "ram"):
        raise BadInput(f"--slot-dtype {name} copies encoded blobs, which the {store} store does not hold; "
                       "use --store disk or --store ram")
    return stored


def slot_bytes(shape: ExpertShape, fmt: ExpertFormat) -> int:
    """Fast-tier bytes of one expert's slot in `fmt`: its float values, or its encoded blob unpadded."""
    return encoded_bytes(shape.parts, fmt) if fmt.quantized else shape.numel * FLOAT_DTYPES[fmt.dtype].itemsize


def page_aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose storage starts on a page (an anonymous mmap): slot rows whose bytes
    are whole pages can then take O_DIRECT reads straight from the disk store."""
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=torch.uint8)[:n].view(dtype).view(shape)


def release_pages(rows: torch.Tensor) -> None:
    """Give the whole pages under `rows` (a contiguous CPU slice of `page_aligned_zeros`' tensor, whose values are
    no longer needed) back to the system: they read as zeros after, and are charged again only when written. On
    Linux; elsewhere nothing is released. The mapping is a shared one, whose pages MADV_DONTNEED would only unmap:
    MADV_REMOVE frees them."""
    if sys.platform != "linux" or not rows.numel():
        return
    page = mmap.PAGESIZE
    start = -(-rows.data_ptr() // page) * page
    end = (rows.data_ptr() + rows.numel() * rows.element_size()) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_REMOVE)
