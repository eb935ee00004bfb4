"""The batch-1 decode step's quantized GEMVs with the small ops inside: `fused_gemv` (llmlab/kernels/fused_gemv.py)
for int8 and int4 weights.

A weight-only quantized step reads fewer bytes per layer, so the launches between its GEMVs weigh more: each costs
a fill and a drain of the GPU for almost no bytes. Run as modules, a quantized layer's step has ten launches (an
RMSNorm before the q/k/v and gate/up GEMVs, SwiGLU before the down GEMV); the float step folds the small ops into
its GEMVs and has seven. Here the quantized GEMV kernels do the same:

* RMSNorm prologue: the GEMV reads x * nw and scales its row sums by rstd = 1/sqrt(mean(x^2) + eps). The int4
  GEMVs are input-stationary (each program loads the whole x once, `int4_gemv.py`), so each program sums x^2 over
  the row it already holds; the int8 GEMV walks K and sums x^2 on the way, so it runs with one split of K;
* SwiGLU prologue: x is the gate/up GEMV's output [gate | up] and the input is silu(gate) * up, computed as x is
  loaded. A prologue, not the float step's epilogue on the gate/up GEMV: an epilogue needs gate row n and up row
  n in one program, which the persistent int4 programs, walking chunks of consecutive rows, do not have. It pays
  in the input-stationary GEMVs (int4's, and int8's `int8_gemv` configs), whose one wave of programs each compute
  the K sigmoids once; the int8 K-walking GEMV's thousands of programs would each compute them for their K tiles,
  so an int8 step whose down GEMV walks K keeps SwiGLU as a launch of its own (`KernelDecodeStep.one_token`);
* residual epilogue: y = residual + W x, the output rounded to the activation dtype first, as the unfused add.

The step per layer: norm + q/k/v GEMV, RoPE + K/V write, attention, o GEMV + add, norm + gate/up GEMV, SwiGLU +
down GEMV + add: six launches and the attention's merge (seven where SwiGLU has its own). Every GEMV also loads its
first weights before it waits for the kernel before it (PDL, `pdl_enabled` in _util.py). What the fusion gains, and
what SwiGLU as the int8 K-walking down GEMV's prologue cost, is in `docs/results.md` ("The quantized step with its
small ops inside").

Numerics: as `fused_gemv`'s (the normalized x is not rounded to the activation dtype; SwiGLU and the residual add
round where the unfused ops round), with the quantized GEMVs' own range (`int8_matmul`'s notes: exact for
2^-62 <= |x| < 2^43). With the RMSNorm prologue that range holds for the raw x, before the norm: rstd scales the
row sums at the end, so an x of 2^43 (~9e12) or more gives inf / NaN where the unfused ops would first bring it
down to ~1. (A residual stream that large is a broken model anyway.)
"""

from __future__ import annotations

import torch

from ._util import check_eps, check_flag, check_tensors, pdl_kwargs
from .fused_gemv import DTYPES, fused_gemv_reference, prologue_reference


def _layer_check(layer) -> str:
    """The layer's scheme ("int8" / "int4"), or ValueError naming why the fused GEMV cannot take it."""
    from llmlab.quant.linear import Int4Linear, Int8Linear

    from .weight_quant import check_group

    if not isinstance(layer, (Int8Linear, Int4Linear)):
        raise TypeError(f"fused_quant_gemv: layer must be an Int8Linear or Int4Linear (llmlab.quant), got "
                        f"{type(layer).__name__}; a float weight takes llmlab.kernels.fused_gemv.fused_gemv")
    if layer.bias is not None:
        raise ValueError("fused_quant_gemv: the layer has a bias, which the fused GEMV does not add; run the layer "
                         "itself (layer(x))")
    if layer.padded_in_features != layer.in_features:
        raise ValueError(f"fused_quant_gemv: the layer's rows are padded ({layer.in_features} -> "
                         f"{layer.padded_in_features} inputs); run the layer itself (layer(x))")
    N, K = layer.out_features, layer.in_features
    if isinstance(layer, Int8Linear):
        w, scales, want = layer.w_q, layer.scales, (N,)
        if w.dtype != torch.int8:
            raise TypeError(f"fused_quant_gemv: the int8 layer's w_q is {w.dtype}, not torch.int8; build it with "
                            f"Int8Linear.from_linear or quantize_int8")
    else:
        w, scales = layer.packed, layer.scales
        if w.dtype != torch.uint8:
            raise TypeError(f"fused_quant_gemv: the int4 layer's packed weights are {w.dtype}, not torch.uint8 (two "
                            f"4-bit codes a byte); build it with Int4Linear.from_linear or quantize_int4")
        check_group(K, layer.group_size)  # K and the group size multiples of 32, the group dividing K
        want = (N, K // layer.group_size)
    if not scales.is_floating_point() or tuple(scales.shape) != want:
        raise ValueError(f"fused_quant_gemv: the layer's scales are {scales.dtype} {tuple(scales.shape)}, expected "
                         f"float {want} for its {N} x {K} weight; build it with from_linear or quantize_model")
    return layer.scheme


def fused_quant_gemv_reference(x: torch.Tensor, layer, norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                               swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused ops in PyTorch: [RMSNorm or SwiGLU] -> x @ dequant(W)^T -> [+ residual] (`fused_gemv_reference`
    on the layer's dequantized weight, in x's dtype). Refuses what `fused_quant_gemv` refuses (a bias, padded rows,
    malformed buffers)."""
    _layer_check(layer)
    return fused_gemv_reference(x, layer.dequantize(x.dtype), norm_weight=norm_weight, eps=eps, swiglu=swiglu,
                                residual=residual)


def fused_quant_gemv(x: torch.Tensor, layer, norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                     swiglu: bool = False, residual: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """y = [residual +] layer(prologue(x)) for ONE token with a weight-only quantized layer, in one launch.

    Args:
        x: (..., K_in) holding one row, fp32 / fp16 / bf16 (fp32 in the CPU interpreter), contiguous. K_in = K
            (the layer's in_features), or 2K with `swiglu` ([gate | up]).
        layer: an `llmlab.quant.Int8Linear` or `Int4Linear` without bias or padded rows, on x's device (a fused
            q/k/v or gate/up layer: `llmlab.quant.fused`).
        norm_weight: (K,) RMSNorm weight in x's dtype: x is normalized first (eps `eps`).
        swiglu: x is [gate | up]: silu(gate) * up is the input. Not together with norm_weight.
        residual: (..., N) one row in x's dtype, contiguous: added to the output.
        config: a triton.Config for the GEMV, as step tuning chooses it: int8, the K-walking or input-stationary
            GEMV's (`int8_matmul.candidate_configs`; with norm_weight, one split); int4, the Gluon GEMV's R and
            DEPTH (`int4_gemv_gluon.candidate_configs`; where the Triton int4 GEMV runs instead, it runs its own
            config and computes the same sums). None: the autotuner's pick (int8), `int4_gemv_gluon.config`
            (int4). Rows the kernel does not take (below) run the unfused ops, without it.

    Returns:
        (..., N) in x's dtype.

    Which kernel: int8, `int8_matmul._int8_gemv_kernel` (rows 4-byte aligned); int4, the Gluon GEMV on a CUDA GPU
    (`int4_gemv_gluon`, K <= its MAX_K), else the Triton input-stationary GEMV (`int4_gemv`, K <= IS_MAX_K). Rows
    no kernel takes run the unfused ops (the PyTorch prologue, the layer's own matmul kernel, the add).

    Raises:
        TypeError: a layer that is not Int8Linear / Int4Linear; dtypes that differ or are not supported; swiglu
            not True/False; a config that is not one of the layer's format (`int8_matmul.check_gemv_config`,
            `int4_gemv_gluon.check_config`).
        ValueError: a layer with a bias or padded rows; x not one contiguous row of K_in; norm_weight or residual
            of the wrong shape; both prologues; a split int8 config with norm_weight.
        An int4 config the Gluon GEMV fails to build or launch raises what Triton raised (step tuning records the
        config as failed); without a config such a failure turns the Gluon GEMV off on that GPU, with a warning,
        and the Triton GEMV answers.
    """
    scheme = _layer_check(layer)
    if config is not None and scheme == "int8":  # checked before the fallback below could skip it
        from .int8_matmul import check_gemv_config
        check_gemv_config(config, rmsnorm=norm_weight is not None)
    elif config is not None:
        from .int4_gemv_gluon import check_config
        check_config(config)
    tensors = {"x": x, **({"norm_weight": norm_weight} if norm_weight is not None else {}),
               **({"residual": residual} if residual is not None else {})}
    check_tensors("fused_quant_gemv", DTYPES, **tensors)
    if len({t.dtype for t in tensors.values()}) != 1:
        raise TypeError("fused_quant_gemv: x, norm_weight and residual must share one dtype, got " +
                        ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
    eps = check_eps("fused_quant_gemv", eps)
    swiglu = check_flag("fused_quant_gemv", "swiglu", swiglu)
    N, K = layer.out_features, layer.in_features
    k_in = 2 * K if swiglu else K
    if x.dim() == 0 or x.shape[-1] != k_in or x.numel() != k_in:
        raise ValueError(f"fused_quant_gemv: x must be one row of {k_in} numbers "
                         f"({'[gate | up], 2K' if swiglu else 'K'} for a {N} x {K} layer), got {tuple(x.shape)}")
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        raise ValueError("fused_quant_gemv: x and residual must be contiguous; pass x.contiguous() (and "
                         "residual.contiguous())")
    if swiglu and norm_weight is not None:
        raise ValueError("fused_quant_gemv: choose one prologue, RMSNorm (norm_weight) or swiglu")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"fused_quant_gemv: norm_weight must be ({K},), got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.dim() == 0 or residual.shape[-1] != N or residual.numel() != N):
        raise ValueError(f"fused_quant_gemv: residual must be one row of {N}, got {tuple(residual.shape)}")
    packed = layer.packed_tensors()[0]
    if packed.device != x.device:
        raise ValueError(f"fused_quant_gemv: the layer is on {packed.device}, x on {x.device}; move one of them")
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    x2, y2 = x.view(1, k_in), y.view(1, N)
    res2 = None if residual is None else residual.view(1, N)
    nw = None if norm_weight is None else norm_weight.contiguous()
    fused = dict(norm_weight=nw, eps=eps, swiglu=swiglu, residual=res2)
    if _launch(scheme, layer, x2, y2, fused, config):
        return y
    # no kernel takes these rows: the prologue in PyTorch, the layer's own matmul, the add
    out = layer(prologue_reference(x2, nw, eps, swiglu))
    return (out if res2 is None else res2 + out).view_as(y)


def _launch(scheme: str, layer, x, y, fused: dict, config=None) -> bool:
    """Run the fused kernel for this layer into y with `config` (None: the kernel's own pick), or return False
    when no kernel takes its rows."""
    from .weight_quant import word_rows

    if scheme == "int8":
        from .int8_matmul import launch_gemv
        if not word_rows(layer.w_q, layer.in_features, 4):
            return False
        launch_gemv(x, layer.w_q, layer.scales.contiguous(), y, **fused, config=config)
        return True
    from . import int4_gemv
    from .int4_matmul import _gluon, _gluon_failed, _gluon_gemv

    packed, scales = layer.packed, layer.scales
    K, G = layer.in_features, layer.group_size
    if not word_rows(packed, K // 2, 4):
        return False
    if _gluon_gemv(x.device) and K <= _gluon().MAX_K:
        try:
            _gluon().int4_gemv(x, packed, scales, y, pdl_kwargs(x.device), **fused, tile=config)
            return True
        except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build it: the Triton GEMV below
            if config is not None:  # a config being tried (step tuning): the failure is the config's, not the GPU's
                raise
            _gluon_failed(x.device, (layer.out_features, K), e)
    if K <= int4_gemv.IS_MAX_K:
        int4_gemv.launch_input_stationary(x, packed, scales, y, layer.out_features, K, G, **fused)
        return True
    return False
