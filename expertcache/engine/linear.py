"""Dense weight matrices as the engine computes with them. On the CPU a matrix stays in the format it is
held in, the checkpoint's fp16 or bf16 (or fp32), or int8 / int4 in quant.py's packed groups when the
dense weights are quantized (`--dense-dtype`), and the compiled kernels read it as it is (kernel/linear.py:
16-bit weights widened exactly in registers, quantized ones with int8 activations), split over the
threads. On CUDA a matrix is a tensor in the compute dtype and `F.linear` runs it."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..choices import DENSE_DTYPES  # noqa: F401 (re-exported)
from ..errors import BadInput
from ..kernel.linear import activation_work, linear_token, linear_window
from . import threads
from .experts import RAW_ENCODINGS, plan_row
from .quant import ExpertFormat, decode_into, decode_plan, encode_matrix


def dense_format(name: str, device: torch.device) -> ExpertFormat | None:
    """The dense weights' format from --dense-dtype `name`: None for a float dtype held as a torch tensor (auto:
    the checkpoint's fp16 / bf16, else fp32 on the CPU and fp16 on CUDA), or int8 / int4 (group 32, asymmetric),
    the CPU kernel's quantized formats."""
    if name not in DENSE_DTYPES:
        raise BadInput(f"unknown dense dtype {name!r}; choose one of {', '.join(DENSE_DTYPES)}")
    if name in ("int8", "int4"):
        if device.type != "cpu":
            raise BadInput(f"--dense-dtype {name} computes with the CPU kernel; use --device cpu or --dense-dtype fp16")
        return ExpertFormat.parse(name, 32, "asym")
    return None


def float_dtype(name: str, device: torch.device, stored: torch.dtype) -> torch.dtype:
    """The torch dtype float dense weights are held in for --dense-dtype `name` (see dense_format): auto, and
    the matrices a quantized dense part keeps in floats (embedding, router): the checkpoint's fp16 / bf16,
    else fp32 on the CPU and fp16 on CUDA (a bf16 checkpoint kept in bf16: fp16 would overflow its range)."""
    if name in ("auto", "int8", "int4"):
        if stored in (torch.float16, torch.bfloat16):
            return stored
        return torch.float32 if device.type == "cpu" else torch.float16
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class ActivationScratch:
    """The int8 activations of a window, as the quantized dense products take them (kernel.linear), shared by
    every Linear of one model: one buffer of the largest window and width seen, not one per matrix."""

    def __init__(self):
        self.buffers: tuple[np.ndarray, ...] = (np.empty(0, np.int8), np.empty(0, np.float32),
                                                np.empty(0, np.float32), np.empty(0, np.int32))

    def get(self, tokens: int, cols: int, row: np.ndarray) -> tuple[np.ndarray, ...]:
        """activation_work(tokens, cols, row)'s arrays as views of the shared buffers, grown on demand."""
        shapes = [a.shape for a in activation_work(0, cols, row)]  # [0, width] and [0, groups]
        width, groups = shapes[0][1], shapes[1][1]
        need = (tokens * width, tokens * groups, tokens * groups, tokens * groups)
        if any(b.size < n for b, n in zip(self.buffers, need)):
            self.buffers = tuple(np.empty(max(b.size, n), b.dtype) for b, n in zip(self.buffers, need))
        return tuple(b[:n].reshape(tokens, -1) for b, n in zip(self.buffers, need))

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(b.nbytes for b in self.buffers)


class Linear:
    """y = x @ W.T (+ b) for one dense matrix W [rows, cols]: `weight` the matrix in its held dtype (a float
    tensor; None when quantized), `buf` and `row` its bytes and plan row for the CPU kernels; `scratch` the
    window activations it shares with the model's other matrices."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, fmt: ExpertFormat | None = None,
                 dtype: torch.dtype | None = None, scratch: ActivationScratch | None = None):
        assert weight.dim() == 2, f"a dense matrix is [rows, cols], got {tuple(weight.shape)}"
        self.rows, self.cols = weight.shape
        self.bias = None if bias is None else bias.float() if weight.device.type == "cpu" else bias
        self.cpu = weight.device.type == "cpu"
        self.fmt = fmt
        if fmt is not None:  # packed quantized bytes; no float copy is kept
            self.row = decode_plan([tuple(weight.shape)], fmt)[0]
            self.buf = encode_matrix(weight, fmt)
            self.weight = None
        else:
            self.weight = weight.to(dtype or weight.dtype).contiguous()
            if self.cpu and self.weight.dtype in RAW_ENCODINGS:
                self.buf = self.weight.view(-1).view(torch.uint8).numpy()
                self.row = plan_row(RAW_ENCODINGS[self.weight.dtype], self.rows, self.cols)
            else:
                self.buf = self.row = None
        self.parts = threads.parts(self.nbytes)
        self.scratch = scratch or ActivationScratch()
        self._token_work = None if self.row is None else activation_work(1, self.cols, self.row)

    @property
    def nbytes(self) -> int:
        """Bytes the matrix is held in (its bias aside)."""
        return self.buf.nbytes if self.buf is not None else self.weight.nbytes

    @property
    def compiled(self) -> bool:
        """Whether the CPU kernels run it."""
        return self.buf is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] -> [T, rows] (float32 on the CPU kernels; the compute dtype otherwise)."""
        if not self.compiled or x.requires_grad:
            return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        x = x.float().contiguous()
        T = x.shape[0]
        out = torch.empty(T, self.rows)
        if T == 1:
            linear_token(self.buf, self.row, x.numpy()[0], self._token_work, out.numpy()[0], self.parts)
        else:
            linear_window(self.buf, self.row, x.numpy(), self.scratch.get(T, self.cols, self.row), out.numpy(),
                          self.parts)
        return out if self.bias is None else out.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The matrix as float values [rows, cols]: the held tensor, or the quantized codes decoded."""
        if self.weight is not None:
            return self.weight
        out = torch.empty(self.rows, self.cols)
        decode_into(torch.from_numpy(self.buf.copy()), [(self.rows, self.cols)], self.fmt, [out])
        return out
