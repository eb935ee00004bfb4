"""Weight-only int8 and int4 quantization: the formats, quantize / dequantize, the PyTorch reference matmul, and
the argument checks the kernels' wrappers share (`llmlab.kernels.int8_matmul`, `llmlab.kernels.int4_matmul`).

At decode time a Linear layer is a GEMV: every weight is read once per step and used for M multiply-adds, so the
step time is the weight bytes over the memory bandwidth. Storing weights in 8 or 4 bits halves or quarters those
bytes; the kernels read the small integers, convert them to the activation dtype in registers, and multiply.
(gpt-fast, https://github.com/pytorch-labs/gpt-fast; Frantar et al., GPTQ https://arxiv.org/abs/2210.17323 for
group-wise scales; Marlin https://github.com/IST-DASLab/marlin for the fp16 x int4 kernel the kernels imitate,
simply.)

Formats (`quantize_int8`, `quantize_int4` make them; `dequantize_*` undo them, the references):

  int8, per output channel:  w_q (N, K) int8 in [-127, 127], scales (N,):  W[n, k] ~= w_q[n, k] * scales[n]
  int4, group-wise:          packed (N, K // 2) uint8, scales (N, K // G):   W[n, k] ~= (u[n, k] - 8) * scales[n, k // G]
      where u[n, k] in 0..15 is the 4-bit code of weight k: TWO PER BYTE, the even k in the LOW nibble and the odd
      k in the HIGH nibble:  packed[n, j] = u[n, 2j] | (u[n, 2j + 1] << 4).  Codes are symmetric (-8..7 + 8).

M: the kernels tile M in blocks of BLOCK_M = 16 rows (tl.dot's minimum), so M = 1..16 is one tile and reads W once.
A larger M still gives the right answer but re-reads W once per 16 rows, and a warning says so (`check_x`): use a
dense (dequantized) matmul for prefill.
"""

from __future__ import annotations

import warnings

import torch

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16


# -- the PyTorch references: quantize, dequantize, matmul ----------------------------------------------------------


def check_weight(op: str, w: torch.Tensor, name: str | None = None) -> None:
    """A weight that can be quantized: a non-empty 2-D float tensor of finite values (one NaN or inf makes its row's
    or group's scale NaN or inf, and every output that reads it NaN)."""
    what = "the weight" if name is None else f"the weight {name!r}"
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {what} is a {type(w).__name__}, not a tensor; give a 2-D float (N, K) tensor, e.g. "
                        f"torch.tensor(w) or a layer's .weight")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{op}: {what} must be a 2-D float (N, K) tensor (out_features x in_features, as "
                         f"nn.Linear.weight), got {w.dtype} of shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{op}: {what} has shape {tuple(w.shape)}, no values to quantize: give at least one row "
                         f"and one column")
    if w.is_meta:
        raise ValueError(f"{op}: {what} is on the meta device (a shape without values), so there is nothing to "
                         f"quantize; load the model's weights first (llmlab.load, or .to_empty and a state dict)")
    bad = ~torch.isfinite(w)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        n = int(bad.sum())
        raise ValueError(f"{op}: {what} is not finite: {n} of its {w.numel()} values {'is' if n == 1 else 'are'} "
                         f"NaN or inf (the first, {w[row, col].item()}, at row {row}, column {col}), so its scales "
                         f"would be too. Quantize finite weights: reload the checkpoint, or fix the layer that "
                         f"produced them")


def check_int4_range(op: str, w: torch.Tensor, name: str | None = None) -> None:
    """A finite weight whose int4 scales (a group's max |w| / 7) stay below SCALE_LIMIT, the M = 1 GEMVs' range
    (they lift scales by 2^32 so that small products do not underflow); ValueError naming `op` and `name` else."""
    top = w.detach().abs().max().item()
    if top / 7.0 >= SCALE_LIMIT:
        where = f" in {name}" if name else ""
        raise ValueError(f"{op}: weights{where} up to {top:.3g} need int4 scales of 2^96 or more, beyond "
                         f"int4_matmul's range at M = 1; rescale the layer (such weights are usually a bug upstream) "
                         f"or keep it in bf16")


def quantize_int8(w: torch.Tensor, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (w_q (N, K) int8, scales (N,) fp32), symmetric per output channel (row).

    name: the weight's name (e.g. "layers.0.mlp.down_proj.weight"), for error messages.

    Raises:
        ValueError: w is not a 2-D float tensor, or holds NaN or inf (the message names `name` and the first one)."""
    check_weight("quantize_int8", w, name)
    w32 = w.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    w_q = torch.clamp(torch.round(w32 / scales[:, None]), -127, 127).to(torch.int8)
    return w_q, scales


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w_q (N, K) int8, scales (N,) fp32 (one per output row, from `quantize_int8`) -> W (N, K) fp32: w_q * scale.

    Raises ValueError when scales does not hold one value per row of w_q."""
    if w_q.dim() != 2 or scales.shape != (w_q.shape[0],):
        raise ValueError(f"dequantize_int8: w_q {tuple(w_q.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"give the (N, K) int8 weight and its (N,) scales from quantize_int8")
    return w_q.float() * scales.float()[:, None]


# int4 scales must stay below this: the M = 1 GEMVs multiply them by 2^32 (`llmlab.kernels.packed_fields.X_EXP`)
SCALE_LIMIT = 2.0 ** 96


def check_k(K: int) -> None:
    """K (the input dimension) a multiple of 32, the kernels' smallest K tile: else no group size fits it."""
    if K % 32:
        raise ValueError(f"int4: K = {K} (the input dimension) is not a multiple of 32, so no group size the kernels "
                         f"can use fits it; pad the input dimension to a multiple of 32 or keep this layer in "
                         f"bf16 or int8")


def check_group(K: int, group_size: int) -> None:
    """A group size the kernels can use: a positive multiple of 32 (their smallest K tile) that divides K."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"int4: group_size must be an int (e.g. 128), got {group_size!r}")
    check_k(K)
    fits = [g for g in (256, 128, 64, 32) if K % g == 0]
    hint = f"e.g. {fits[1] if len(fits) > 1 and fits[0] > 128 else fits[0]}"
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"int4: group_size must be a positive multiple of 32 (the kernels' smallest K tile), got "
                         f"{group_size}; use one that divides K = {K} ({hint})")
    if group_size > K:
        raise ValueError(f"int4: group_size {group_size} is larger than K = {K} (a row's length); use a group size "
                         f"that divides K ({hint})")
    if K % group_size:
        raise ValueError(f"int4: group_size {group_size} does not divide K = {K}; use a group size that divides K "
                         f"({hint}) or pad K to a multiple of {group_size}")


def quantize_int4(w: torch.Tensor, group_size: int = 128, *, name: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (packed (N, K // 2) uint8, scales (N, K // group_size) fp32): symmetric, group-wise.

    name: the weight's name (e.g. "layers.0.mlp.down_proj.weight"), for error messages.

    Raises:
        ValueError: w is not a 2-D float tensor, or holds NaN or inf (the message names `name` and the first one);
            group_size not a positive multiple of 32 (the kernels' smallest K tile), larger than K, or not dividing
            K; K not a multiple of 32 (the messages name the fix); a scale of 2^96 or more (|w| above ~5.5e29),
            beyond the M = 1 kernels' range (they lift scales by 2^32 to keep small products from underflowing).
        TypeError: group_size not an int.
    """
    check_weight("quantize_int4", w, name)
    N, K = w.shape
    check_group(K, group_size)
    check_int4_range("quantize_int4", w, name)
    w32 = w.float().view(N, K // group_size, group_size)
    scales = w32.abs().amax(dim=2).clamp(min=1e-12) / 7.0  # (N, K // G); -8 is never used: symmetric
    u = (torch.clamp(torch.round(w32 / scales[..., None]), -8, 7) + 8).to(torch.uint8).view(N, K)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)  # even k: low nibble, odd k: high nibble
    return packed, scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed (N, K // 2) uint8 (two 4-bit values per byte, low nibble first, stored as value + 8) and scales
    (N, K // G) fp32 (one per group of G consecutive inputs, from `quantize_int4`) -> W (N, K) fp32:
    (nibble - 8) * its group's scale.

    Raises ValueError when scales does not hold one row per row of packed and a whole number of groups per row."""
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or not scales.shape[1] \
            or (2 * packed.shape[1]) % scales.shape[1]:
        raise ValueError(f"dequantize_int4: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not "
                         f"match: give the (N, K // 2) uint8 weight and its (N, K // group_size) scales from "
                         f"quantize_int4")
    N, half = packed.shape
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(N, 2 * half)  # (N, K): low nibble first
    G = 2 * half // scales.shape[1]  # the group size
    return (u.float() - 8) * scales.float().repeat_interleave(G, dim=1)


def dequant_matmul_reference(x: torch.Tensor, w_dequant: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w_dequant (N, K)^T in fp32, cast to x's dtype.

    Bytes: eager PyTorch first materializes dequant(W) in the activation dtype (read N x K x 1 or 0.5 bytes, write
    N x K x 2), then reads it again for the matmul; the fused kernel reads only the packed weights and scales.
    """
    return (x.float() @ w_dequant.float().T).to(x.dtype)


# -- the wrappers' checks ------------------------------------------------------------------------------------------

_warned_large_m = False


def word_rows(w: torch.Tensor, row_bytes: int, word: int) -> bool:
    """Can the GEMV read w's rows as `word`-byte words? Contiguous rows, each starting on a word boundary. Other
    layouts (a strided view) take the tl.dot kernel, which reads any strides."""
    return (w.stride(1) == 1 and w.stride(0) % word == 0 and row_bytes % word == 0
            and w.data_ptr() % word == 0)


def check_x(op: str, x: torch.Tensor, K: int, how: str = "") -> None:
    """x is (M, K) with 1 <= M; `how` says how K was read from the weights, for the error message."""
    global _warned_large_m
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{op}: x must be (M, {K}) to match the weights{how}, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{op}: x has no rows (M = 0)")
    if x.shape[0] > BLOCK_M and not _warned_large_m:
        _warned_large_m = True
        warnings.warn(f"{op}: M = {x.shape[0]} > {BLOCK_M}: the kernel is built for decode (M = 1..{BLOCK_M}); it "
                      f"stays correct but re-reads the weights once per {BLOCK_M} rows — for prefill, dequantize "
                      f"once and use a dense matmul", stacklevel=3)


def check_are_tensors(op: str, **args) -> None:
    """TypeError naming an argument that is not a tensor (a list of weights would fail later on `.dtype`)."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}; quantize the weights with "
                            f"quantize_int8 / quantize_int4, which return tensors")

