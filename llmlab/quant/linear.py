"""Weight-only quantized linear layers: `Int8Linear` and `Int4Linear`, drop-in replacements for `nn.Linear`.

Only the WEIGHTS are stored in 8 or 4 bits; activations stay in the model's dtype (fp32 / fp16 / bf16) and every
product is computed in that dtype (or fp32). At decode time a linear layer is memory-bound (each weight is read once
per step and used for a handful of multiply-adds), so storing it in fewer bytes makes the step faster by about the
ratio of bytes; `weight_bytes()` gives those bytes, for model-bandwidth-utilisation (MBU) numbers.

The formats are those of `llmlab.kernels.weight_quant` (this module only wraps them in nn.Modules):

  int8, per output channel, SYMMETRIC:
      w_q (N, K) int8 in [-127, 127], scales (N,) fp32 = max |W[n, :]| / 127
      W[n, k] ~= w_q[n, k] * scales[n]
  int4, group-wise (G = group_size consecutive inputs of one row share a scale), SYMMETRIC, two values per byte:
      packed (N, K // 2) uint8, scales (N, K // G) fp32 = max |W[n, group]| / 7
      W[n, k] ~= (u[n, k] - 8) * scales[n, k // G],   u in 0..15 the 4-bit code,
      packed[n, j] = u[n, 2j] | (u[n, 2j + 1] << 4)   (even k in the low nibble, odd k in the high nibble)

Symmetric or zero-point? Both formats are SYMMETRIC: there are no zero points. The code `u - 8` is a signed value
in -8..7 centred on 0, and the scale is chosen from the group's largest magnitude, so 0.0 is always represented
exactly and -8 is never produced (the quantizer clamps to -7..7 in effect: round(w / (absmax / 7)) lies in
[-7, 7]). Why symmetric: (1) the Triton kernels `int8_matmul` / `int4_matmul` take only (packed, scales), so the
format must be what they read; (2) trained LLM weights are close to zero-mean within a row or a group of 32-128, so
a zero point buys little; (3) one fewer tensor to read per group and one fewer subtraction per weight in the
kernel. What it costs: one of the 16 int4 codes (-8) is unused and a lopsided group (all weights of one sign) uses
only half of the code range. Asymmetric (zero-point) int4, as used by AWQ (Lin et al.,
https://arxiv.org/abs/2306.00978) and many GPTQ (Frantar et al., https://arxiv.org/abs/2210.17323) checkpoints,
would add `zeros (N, K // G)` and compute (u - z) * s. Those papers also choose the rounding (GPTQ: error feedback
from second-order statistics) or rescale salient channels (AWQ: activation-aware scaling); here rounding is plain
round-to-nearest, the baseline both papers improve on.

The module-swap idea (replace each nn.Linear by a quantized module that holds packed weights as buffers and keeps
the model code unchanged) is gpt-fast's (https://github.com/pytorch-labs/gpt-fast, quantize.py).

Padding (int4, a group size that does not divide K): the weight is stored padded with zero columns to
Kp = K rounded up to a multiple of group_size (`padded_k`), e.g. Llama-style MLPs with K = 704 at group_size 128
store Kp = 768. The padded columns are 0.0, which the symmetric format stores exactly (code 8), and they do not move
the last group's scale (its largest magnitude comes from the real columns), so the real weights are quantized as
they would be without padding. `in_features` stays K (what x has), `padded_in_features` is Kp (what `packed` and
`scales` hold), `dequantize()` returns (N, K) with the padding sliced off, the PyTorch forward multiplies by that,
and the kernel forward pads x with zeros to Kp (the kernels need Kp a multiple of 32 and of the group size; zero
inputs times zero weights add nothing). `weight_bytes()` counts the padded bytes: they are stored and read. With
K a multiple of group_size, Kp = K and nothing is padded.

Forward, y = x @ dequant(W)^T + bias, x (..., K) -> y (..., N) in x's dtype:
  * on a CUDA device, with 1..16 rows (M = the product of x's leading dimensions) and a Triton install: the fused
    kernel `llmlab.kernels.int8_matmul.int8_matmul` / `llmlab.kernels.int4_matmul.int4_matmul`, which reads the
    packed weights and converts them in registers (the decode case);
  * on a CUDA device with more rows (a prefill): the weight is dequantized to x's dtype by one Triton pass
    (`llmlab.kernels.dequantize`: packed bytes and scales read once, the (N, K) weight written once) and F.linear
    runs the compute-bound GEMM on it (cuBLAS);
  * otherwise (a CPU, no Triton, use_kernel=False): plain PyTorch, `dequantize` (fp32 temporaries) then F.linear.
  Both dense paths materialise an (N, K) copy of the weight per call: a quantized prefill saves memory at rest,
  not bandwidth.
Triton is imported lazily, at the first call that takes the kernel path: `import llmlab.quant` does not import it.
"""

from __future__ import annotations

import numbers
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmlab.kernels.weight_quant import (ACT_DTYPES, BLOCK_M, check_weight, dequantize_int4, dequantize_int8,
                                         quantize_int4, quantize_int8)

__all__ = ["QuantizedLinear", "Int8Linear", "Int4Linear", "KERNEL_MAX_M", "check_group_size", "padded_k"]

KERNEL_MAX_M = BLOCK_M  # rows up to which the fused kernels are used (one 16-row tile: W is read once)

_warned_no_triton = False


def check_group_size(op: str, group_size) -> int:
    """An int4 group size the kernels can read: a positive int multiple of 32 (their smallest K tile). Any K fits
    it once padded (`padded_k`). Returns it as a Python int (a NumPy integer is taken).

    Raises:
        TypeError: group_size is not an integer (a bool or a float included).
        ValueError: group_size is not a positive multiple of 32; the message names group_size and usual values.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{op}: group_size must be an int, a positive multiple of 32 such as 32, 64 or 128; got "
                        f"{group_size!r}")
    group_size = int(group_size)
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"{op}: group_size must be a positive multiple of 32 (the int4 kernels' smallest K tile), "
                         f"got {group_size}; use 32, 64 or 128 (128 is the usual choice)")
    return group_size


def padded_k(K: int, group_size: int) -> int:
    """Kp: the input dimension K rounded up to a multiple of `group_size`, the row length an `Int4Linear` stores
    (K itself when group_size divides K). E.g. padded_k(704, 128) = 768, padded_k(704, 64) = 704."""
    return -(-K // group_size) * group_size


def _check_linear(op: str, linear) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{op}: expected an nn.Linear, got {type(linear).__name__}; quantize a model's layers with "
                        f"llmlab.quant.quantize_model(model, ...)")


class QuantizedLinear(nn.Module):
    """What `Int8Linear` and `Int4Linear` share: shapes, the bias, the forward dispatch, `weight_bytes`.

    Attributes:
        in_features (K), out_features (N): as nn.Linear's.
        padded_in_features (Kp): the row length the packed tensors hold: K, or for an int4 layer whose group size
            does not divide K, K rounded up to a multiple of it (see the module docstring, "Padding").
        bias: (N,) buffer in the original layer's dtype, or None. Not quantized.
        orig_dtype: the dtype of the original weight (what `dequantize_model` restores).
        use_kernel: True (default) lets the forward use the Triton kernels on CUDA (the decode kernel for
            M <= 16, the one-pass dequantize for more rows); False forces the PyTorch path everywhere (a switch for
            comparing the two).
    """

    scheme = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, orig_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.padded_in_features = in_features
        self.orig_dtype = orig_dtype
        self.use_kernel = True
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _apply(self, fn, recurse: bool = True):
        """`model.to(...)`, `.cuda()`, `.bfloat16()` and the like: the bias moves and converts as nn.Linear's would,
        and `orig_dtype` follows the new float dtype (what `dequantize_model` restores and `save_quantized`
        records); the scales only MOVE, staying fp32: rounding them to bf16 would change every weight they scale
        (the format keeps them in fp32, and `save_quantized` refuses other dtypes)."""
        scales = self._buffers.pop("scales", None)
        try:
            super()._apply(fn, recurse)
            if scales is not None:
                moved = fn(scales)
                if moved.dtype != scales.dtype:  # a dtype conversion: move the fp32 scales instead
                    moved = scales.to(device=moved.device)
                self.orig_dtype = fn(torch.empty(0, dtype=self.orig_dtype, device=scales.device)).dtype
                scales = moved
        finally:
            if scales is not None:
                self._buffers["scales"] = scales
        return self

    # -- to be provided by the subclasses -------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight the packed values stand for, in `dtype`."""
        raise NotImplementedError

    def packed_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the weight (packed values, scales, zero points if any): what `weight_bytes` sums."""
        raise NotImplementedError

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d (M, K) -> (M, N) from the packed weights (the decode kernel; CUDA, M = 1..16)."""
        raise NotImplementedError

    def _dequantize_kernel(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, Kp) weight in `dtype`, padded columns included, by one Triton pass (`llmlab.kernels.dequantize`;
        CUDA). Equals `dequantize(dtype)` on the real columns."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the stored weight: packed values + scales (+ zero points; these formats have none), padded
        columns included (they are stored and read). The bias is not included (it is not quantized;
        `llmlab.quant.weight_bytes(model)` counts it with the other tensors)."""
        return sum(t.numel() * t.element_size() for t in self.packed_tensors())

    def _on_gpu(self, x2d: torch.Tensor) -> bool:
        """The Triton paths may run: switched on, x on a CUDA device with the packed weights, a float dtype."""
        return (self.use_kernel and x2d.is_cuda and x2d.dtype in ACT_DTYPES
                and self.packed_tensors()[0].device == x2d.device)

    def _kernel_ok(self, x2d: torch.Tensor) -> bool:
        return self._on_gpu(x2d) and 1 <= x2d.shape[0] <= KERNEL_MAX_M

    def _triton(self, fn, *args):
        """fn(*args), or None after a warning (once per process) when Triton cannot be imported; the layer then
        stays on the PyTorch path, which gives the same answer."""
        global _warned_no_triton
        try:
            return fn(*args)
        except ImportError as e:  # no triton on this machine
            if not _warned_no_triton:
                _warned_no_triton = True
                warnings.warn(f"{type(self).__name__}: the Triton kernel cannot be imported ({e}); using "
                              f"dequantize + F.linear instead", stacklevel=3)
            self.use_kernel = False
            return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) float -> (..., N) in x's dtype: x @ dequant(W)^T + bias (see the module docstring for which
        path runs). Raises ValueError when x's last dimension is not K."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: x has last dimension {x.shape[-1]}, the layer expects "
                             f"in_features = {self.in_features}")
        x2d = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self._kernel_ok(x2d):  # decode: the packed weights are read once, converted in registers
            y = self._triton(self._kernel, x2d)
            if y is not None:
                y = y if bias is None else y + bias
                return y.reshape(*x.shape[:-1], self.out_features)
        if self._on_gpu(x2d) and x2d.shape[0]:  # prefill: one-pass dequantize, then a dense GEMM
            w = self._triton(self._dequantize_kernel, x.dtype)  # (N, Kp)
            if w is not None:
                pad = self.padded_in_features - self.in_features
                return F.linear(F.pad(x, (0, pad)) if pad else x, w, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}")


class Int8Linear(QuantizedLinear):
    """nn.Linear with its weight stored as int8, one fp32 scale per output channel (row), symmetric.

    Buffers: w_q (N, K) int8, scales (N,) fp32, bias (N,) or None. Bytes: N*K + 4*N (vs 2*N*K in bf16).
    """

    scheme = "int8"

    def __init__(self, w_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 orig_dtype: torch.dtype = torch.float32):
        N, K = w_q.shape
        super().__init__(K, N, bias, orig_dtype)
        self.register_buffer("w_q", w_q)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str | None = None) -> "Int8Linear":
        """Quantize `linear` (any float dtype, any device; it is left unchanged) into a new Int8Linear on the same
        device. `name` names the layer in error messages.

        Raises:
            TypeError: `linear` is not an nn.Linear.
            ValueError: its weight holds NaN or inf (from `quantize_int8`).
        """
        _check_linear("Int8Linear.from_linear", linear)
        with torch.no_grad():
            w_q, scales = quantize_int8(linear.weight.detach(), name=name)
        return cls(w_q, scales, linear.bias, linear.weight.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight w_q * scales[:, None], computed in fp32 then cast to `dtype`."""
        return dequantize_int8(self.w_q, self.scales).to(dtype)

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.w_q, self.scales]

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        from llmlab.kernels.int8_matmul import int8_matmul  # lazy: imports triton
        return int8_matmul(x2d, self.w_q, self.scales)

    def _dequantize_kernel(self, dtype: torch.dtype) -> torch.Tensor:
        from llmlab.kernels.dequantize import int8_dequantize  # lazy: imports triton
        return int8_dequantize(self.w_q, self.scales, dtype)


class Int4Linear(QuantizedLinear):
    """nn.Linear with its weight stored as int4, two per byte, one fp32 scale per group of `group_size` inputs of a
    row, symmetric (no zero points; see the module docstring).

    Buffers: packed (N, Kp // 2) uint8, scales (N, Kp // group_size) fp32, bias (N,) or None, where Kp =
    `padded_in_features` is K rounded up to a multiple of group_size (K itself when group_size divides it; the
    padded columns are zeros: see the module docstring, "Padding").
    Bytes: N*Kp/2 + 4*N*Kp/group_size (at group_size 128: 0.53 bytes per weight, vs 2 in bf16).

    Args:
        packed, scales: as `llmlab.kernels.weight_quant.quantize_int4` returns them for the padded (N, Kp) weight.
        bias, orig_dtype: as `QuantizedLinear`'s.
        in_features: K, the layer's real input dimension; None means Kp (no padding).

    Raises:
        ValueError: packed or scales not 2-D, of different row counts, scales not a whole number of groups of Kp,
            or in_features outside Kp - group_size < K <= Kp (the padding is less than one group).
    """

    scheme = "int4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 orig_dtype: torch.dtype = torch.float32, in_features: int | None = None):
        if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or not scales.shape[1] \
                or (2 * packed.shape[1]) % scales.shape[1]:
            raise ValueError(f"Int4Linear: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not "
                             f"match: give the (N, Kp // 2) uint8 weight and its (N, Kp // group_size) scales from "
                             f"quantize_int4")
        N, half = packed.shape
        Kp, G = 2 * half, 2 * half // scales.shape[1]
        K = Kp if in_features is None else in_features
        if isinstance(K, bool) or not isinstance(K, int) or not Kp - G < K <= Kp:
            raise ValueError(f"Int4Linear: in_features={K!r} does not fit packed rows of Kp = {Kp} in groups of "
                             f"{G}: K must satisfy {Kp - G} < K <= {Kp} (the padding is less than one group)")
        super().__init__(K, N, bias, orig_dtype)
        self.padded_in_features = Kp
        self.group_size = G
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, *, name: str | None = None) -> "Int4Linear":
        """Quantize `linear` (any float dtype, any device; it is left unchanged) into a new Int4Linear on the same
        device, one scale per `group_size` consecutive inputs. When group_size does not divide in_features K, the
        weight is first padded with zero columns to Kp = `padded_k(K, group_size)` (module docstring, "Padding").
        `name` names the layer in error messages. A group_size larger than K is taken: each row is padded to one
        group (at G > 4K that is more bytes than the bf16 weight); `quantize_model` refuses such a group for a
        whole model (`check_int4_group`).

        Raises:
            TypeError: `linear` is not an nn.Linear; group_size is not an int.
            ValueError: group_size not a positive multiple of 32 (`check_group_size`); NaN or inf weights (from
                `llmlab.kernels.weight_quant.quantize_int4`).
        """
        _check_linear("Int4Linear.from_linear", linear)
        group_size = check_group_size("Int4Linear.from_linear", group_size)
        K = linear.in_features
        pad = padded_k(K, group_size) - K
        with torch.no_grad():
            w = linear.weight.detach()
            check_weight("quantize_int4", w, name)  # before padding: a message counts the layer's own values
            w = F.pad(w, (0, pad)) if pad else w  # (N, Kp): zero columns at the end
            packed, scales = quantize_int4(w, group_size, name=name)
        return cls(packed, scales, linear.bias, linear.weight.dtype, in_features=K)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight (code - 8) * its group's scale, computed in fp32 then cast to `dtype`; padded columns (all
        zeros) are sliced off."""
        w = dequantize_int4(self.packed, self.scales)  # (N, Kp)
        return (w if self.padded_in_features == self.in_features else w[:, :self.in_features]).to(dtype)

    def packed_tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales]

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        from llmlab.kernels.int4_matmul import int4_matmul  # lazy: imports triton
        pad = self.padded_in_features - self.in_features
        x2d = F.pad(x2d, (0, pad)) if pad else x2d  # (M, Kp): zero inputs meet the zero columns
        return int4_matmul(x2d, self.packed, self.scales)

    def _dequantize_kernel(self, dtype: torch.dtype) -> torch.Tensor:
        from llmlab.kernels.dequantize import int4_dequantize  # lazy: imports triton
        return int4_dequantize(self.packed, self.scales, dtype)

    def extra_repr(self) -> str:
        padded = (f", padded_in_features={self.padded_in_features}"
                  if self.padded_in_features != self.in_features else "")
        return super().extra_repr() + f", group_size={self.group_size}{padded}"
