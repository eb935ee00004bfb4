"""int8 GEMV at batch 1 written in Gluon: `int8_gemv.py`'s input-stationary GEMV with its row sums laid out by hand,
as `int4_gemv_gluon.py` does for int4.

Thread slot q owns k in [16q, 16q + 16): one 16-byte quad (4 words of 4 signed bytes) of each row, and its 16
values of x, loaded, put through the prologue and lifted once (`x_slots`, shared with the int4 kernel). Rows stream
past R at a time on one wave of persistent programs; per row a thread does 16 masks and 16 FMAs (each byte XOR
0x80 is w + 128, read as an fp32 subnormal, `_byte_fma`), the codes' offset of 128 comes off as 128 x the slot's x
sum, and the row's scale multiplies the partial sums before they cross the threads. The cross-thread sums are the
int4 kernel's (an in-warp transpose, a butterfly, one trip through shared memory: that module's notes), and so
are the chunk loads, the store with the RMSNorm's rstd and the residual, and PDL.

A config with the keys R and GLUON (`candidate_configs`) runs it, on a CUDA GPU whose Triton has Gluon (`usable`);
elsewhere such a config runs `int8_gemv.py`'s Triton kernel, which computes the same sums. Not in the CPU
interpreter, which does not run Gluon. Step tuning times its configs beside the Triton GEMVs' where it runs
(`int8_matmul.candidate_configs(N, K, device=...)`).
"""

from __future__ import annotations

import warnings

import torch
import triton

from . import int4_gemv_gluon as g4

MAX_K = 16384  # rows of up to 1024 slots of 16 weights: 16 warps, two slots a thread
SHAPES = (8, 4, 16)  # rows per chunk R that `candidate_configs` offers

if g4.GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .int4_gemv_gluon import _chunk, _lift, _pdl, _split2, _store_rows, x_slots

    @gluon.jit
    def _byte(w, SHIFT: gl.constexpr):
        """The byte at bits SHIFT.. of int32 words w, read as an fp32 subnormal: byte * 2^(SHIFT - 149)."""
        return (w & (255 << SHIFT)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _byte_fma(w, a0, a1, a2, a3, acc):
        """acc (R, Q) + sum_i (byte_i(w) + 128) * a_i for (R, Q) int32 words of signed bytes and (Q,) lifted
        partners: XOR 0x80 makes each byte w + 128 in 0..255; bytes 2 and 3 are read from the upper half."""
        u = w ^ -0x7F7F7F80  # = 0x80808080 as int32
        top = u >> 16
        acc += _byte(u, 0) * a0[None, :]
        acc += _byte(u, 8) * a1[None, :]
        acc += _byte(top, 0) * a2[None, :]
        acc += _byte(top, 8) * a3[None, :]
        return acc

    @gluon.jit
    def _partners(xq, LQ: gl.constexpr):
        """xq (Q, 4) fp32: word J's x values of every slot -> their 4 lifted partners (bytes 0, 2 at shift 0; 1, 3
        at shift 8), (Q,) each, in the slots' layout LQ."""
        e, o = gl.split(gl.reshape(xq, [xq.shape[0], 2, 2]))  # (q, i1, i0): i = 2 i1 + i0; i0 = 0 / 1
        x0, x2 = _split2(e, LQ)
        x1, x3 = _split2(o, LQ)
        return _lift(x0, 0), _lift(x1, 8), _lift(x2, 0), _lift(x3, 8)

    @gluon.jit
    def _x_once(x_ptr, nw_ptr, K, eps, stride_xk, Q: gl.constexpr, LX: gl.constexpr, LQ: gl.constexpr,
                PROLOGUE: gl.constexpr):
        """x after the prologue (`x_slots`, slots of 16: k = 16 q + 4 J + i). Returns rstd, 128 x each slot's sum
        (the bytes' offset) and the lifted partners of words J = 0..3, each a tuple of 4 (Q,) tensors in LQ."""
        xt, rstd = x_slots(x_ptr, nw_ptr, K, K, eps, stride_xk, Q, 16, LX, PROLOGUE)
        off = gl.convert_layout(gl.sum(xt, axis=1), LQ) * (128.0 * 2.0 ** -64)
        xj = gl.reshape(xt, [Q, 2, 2, 4]).permute(0, 2, 3, 1)  # (q, J0, i, J1), J = 2 J1 + J0
        lo, hi = gl.split(xj)  # J1 = 0 / 1
        x0, x1 = gl.split(lo.permute(0, 2, 1))  # J = 0, 1: (q, i)
        x2, x3 = gl.split(hi.permute(0, 2, 1))  # J = 2, 3
        return rstd, off, _partners(x0, LQ), _partners(x1, LQ), _partners(x2, LQ), _partners(x3, LQ)

    @gluon.jit
    def _chunk_sums(w, s, a0, a1, a2, a3, off, L3A: gl.constexpr, L3B: gl.constexpr, LA: gl.constexpr,
                    R: gl.constexpr, Q: gl.constexpr):
        """One chunk: (R, Q // 32) fp32 row sums of each warp (rows on lanes), scaled by the rows' scales and
        lifted by 2^(X_EXP / 2) (`int4_gemv_gluon._chunk_sums`)."""
        t = gl.reshape(w, [R, Q, 2, 2])  # word 4q + 2 j1 + j0 of each row
        ev, od = gl.split(t)  # j0 = 0 / 1
        w0, w2 = _split2(ev, LA)
        w1, w3 = _split2(od, LA)
        acc = gl.zeros([R, Q], gl.float32, LA) - off[None, :]  # the bytes' offset of 128, once per row
        acc = _byte_fma(w0, a0[0], a0[1], a0[2], a0[3], acc)
        acc = _byte_fma(w1, a1[0], a1[1], a1[2], a1[3], acc)
        acc = _byte_fma(w2, a2[0], a2[1], a2[2], a2[3], acc)
        acc = _byte_fma(w3, a3[0], a3[1], a3[2], a3[3], acc)
        acc = acc * (s * 2.0 ** 32)
        t3 = gl.convert_layout(gl.reshape(acc, [R, Q // 32, 32]), L3A, assert_trivial=True)
        t3 = gl.convert_layout(t3, L3B)  # the in-warp transpose, rows onto lanes
        return gl.sum(t3, axis=2)

    @gluon.jit
    def _int8_gemv_gluon_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr,
        N, K, eps,
        # strides in elements (stride_wn in 32-bit words); the row strides are constants (`int4_gemv_gluon`)
        stride_xk, stride_wn: gl.constexpr, stride_sn: gl.constexpr, stride_yn,
        R: gl.constexpr, Q: gl.constexpr, PDL: gl.constexpr,
        # the small ops inside (`fused_quant_gemv`): 0 none, 1 RMSNorm, 2 SwiGLU; the residual add
        PROLOGUE: gl.constexpr, HAS_RES: gl.constexpr,
        # register layouts (`int4_gemv_gluon._layouts` with slots of 16)
        LW: gl.constexpr, LA: gl.constexpr, LX: gl.constexpr, L3A: gl.constexpr, L3B: gl.constexpr,
        LT: gl.constexpr,
    ):
        LQ: gl.constexpr = gl.SliceLayout(0, LA)
        buf = gl.allocate_shared_memory(gl.float32, [2, R, Q // 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rw = gl.arange(0, 4 * Q, layout=gl.SliceLayout(0, LW))
        q_ok = (rw // 4) < K // 16  # whole quads: the loads stay 16 bytes wide
        row_scale = gl.arange(0, Q, layout=LQ) * 0  # every slot reads its row's one scale (stride 0 over slots)
        w_words = w_ptr.to(gl.pointer_type(gl.int32))
        n_chunks = (N + R - 1) // R
        c = gl.program_id(0)
        step = gl.num_programs(0)
        if PDL:
            _pdl(False)
        # the first chunk depends on no earlier kernel: request it before waiting for x
        w, s = _chunk(w_words, s_ptr, c, N, stride_wn, stride_sn, 0, rw, q_ok, row_scale, R, LW, LA)
        if PDL:
            _pdl(True)
        rstd, off, a0, a1, a2, a3 = _x_once(x_ptr, nw_ptr, K, eps, stride_xk, Q, LX, LQ, PROLOGUE)
        turn = 0
        for c in range(c, n_chunks, step):
            w_next, s_next = _chunk(w_words, s_ptr, c + step, N, stride_wn, stride_sn, 0, rw, q_ok, row_scale, R,
                                    LW, LA)
            p = _chunk_sums(w, s, a0, a1, a2, a3, off, L3A, L3B, LA, R, Q)
            _store_rows(p, buf.index(turn % 2), y_ptr, res_ptr, rstd, c, N, stride_yn, LT, R, PROLOGUE == 1,
                        HAS_RES)
            w = w_next
            s = s_next
            turn += 1


def takes(K: int) -> bool:
    """Rows of K int8 weights it takes: a positive multiple of 16 (whole 16-byte quads) up to MAX_K."""
    return 0 < K <= MAX_K and K % 16 == 0


def layout(K: int) -> tuple[int, int]:
    """(NW warps, S slots per thread) for rows of K weights: Q = 32 NW S >= K / 16 slots, at most 16 warps."""
    Q = max(32, triton.next_power_of_2(K // 16))
    NW = min(16, Q // 32)
    return NW, Q // (32 * NW)


_FAILED: dict = {}  # device -> why its Gluon build failed there (then the Triton build runs its configs)


def usable(device: torch.device) -> bool:
    """Does a GLUON config run this kernel on `device`: a CUDA GPU whose Triton has Gluon, the Gluon GEMVs not
    switched off (`int4_matmul.USE_GLUON`) and no earlier failure to build it there."""
    from .int4_matmul import _cuda_index, _gluon_gemv

    return _gluon_gemv(device) and _cuda_index(device) not in _FAILED


def failed(device: torch.device, shape: tuple, e: Exception) -> None:
    """The kernel raised for a weight of `shape` on `device`: say so once and run the Triton build of the
    input-stationary GEMV for GLUON configs there from now on (the int4 Gluon GEMV is not affected)."""
    from .int4_matmul import _cuda_index

    device = _cuda_index(device)
    _FAILED[device] = f"{type(e).__name__}: {str(e)[:200]}"
    warnings.warn(f"int8 GEMV: the Gluon build failed for a {shape[0]} x {shape[1]} weight ({_FAILED[device]}); "
                  f"its configs run the Triton input-stationary GEMV on {device} from now on (correct, slower)",
                  stacklevel=3)


def candidate_configs(K: int, device: torch.device | None = None) -> list:
    """The Gluon GEMV's configs a step's tuning may time for rows of K weights: triton.Config({"R", "GLUON"}) for
    each R of SHAPES (num_warps as the kernel launches it); none where it cannot take K or does not run on `device`
    (`usable`; None: the current CUDA device)."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if not takes(K) or not usable(dev):
        return []
    return [triton.Config({"R": r, "GLUON": True}, num_warps=layout(K)[0]) for r in SHAPES]


_LAUNCH: dict = {}  # what a launch depends on -> (its meta-parameters, programs in one wave), built once per shape


def int8_gemv(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, R: int, pdl: dict,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-5, swiglu: bool = False,
              residual: torch.Tensor | None = None) -> None:
    """y = [residual +] x' @ (w_q * scales)^T for ONE row of x on a CUDA GPU, R rows per chunk, one wave of
    programs (writes y in place); x' = x, RMSNorm(x) with `norm_weight`, or silu(gate) * up with `swiglu`.

    Args: x (1, K) or (1, 2K) [gate | up], fp32 / fp16 / bf16; w_q (N, K) int8, rows contiguous and 4-byte aligned,
    K satisfying `takes`; scales (N,) float; y (1, N) in x's dtype; pdl: `pdl_kwargs(device)`; norm_weight (K,)
    and residual (1, N) contiguous in x's dtype, or None. The callers check them (`int8_matmul.launch_gemv`,
    `fused_quant_gemv`). Raises what Triton raises when the kernel cannot be built."""
    N, K = w_q.shape
    prologue = 2 if swiglu else 1 if norm_weight is not None else 0
    args = (x, w_q, scales, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
            N, K, float(eps), x.stride(-1), w_q.stride(0) // 4, scales.stride(0), y.stride(-1))
    key = (x.device.index, x.dtype, y.dtype, scales.dtype, K, R, w_q.stride(0), scales.stride(0), pdl.get("PDL"),
           prologue, residual is not None)
    launch = _LAUNCH.get(key)
    if launch is None:  # once per shape: the layouts and a compile
        NW, S = layout(K)
        meta = dict(R=R, num_warps=NW, PROLOGUE=prologue, HAS_RES=residual is not None,
                    **g4._layouts(R, NW, S, span=16), **pdl)
        kernel = _int8_gemv_gluon_kernel.warmup(*args, grid=(1,), **meta)
        kernel._init_handles()  # loads the binary, which sets n_regs
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        launch = _LAUNCH[key] = meta, g4._programs_per_sm(kernel.n_regs, NW) * sms
    meta, wave = launch
    _int8_gemv_gluon_kernel[(min(triton.cdiv(N, R), wave),)](*args, **meta)


def build_offline(K: int, R: int = 8, arch: int = 90, prologue: int = 0, residual: bool = False):
    """Compile the kernel for rows of K weights for a CUDA GPU of compute capability `arch` without one (bf16 x and
    y): the CompiledKernel (.asm holds "ttgir", "ptx", "cubin"). A layout conversion asserted trivial that would
    move data fails here. Not under TRITON_INTERPRET=1."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if g4.GLUON_ERROR:
        raise RuntimeError(f"this Triton ({triton.__version__}) has no usable Gluon: {g4.GLUON_ERROR}")
    if not takes(K):
        raise ValueError(f"build_offline: K = {K} must be a positive multiple of 16 up to {MAX_K}")
    NW, S = layout(K)
    fn = _int8_gemv_gluon_kernel
    constexprs = {"R": R, "PDL": False, "PROLOGUE": prologue, "HAS_RES": residual, "stride_xk": 1, "stride_yn": 1,
                  "stride_wn": K // 4, "stride_sn": 1, **g4._layouts(R, NW, S, span=16)}
    types = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*bf16", "nw_ptr": "*bf16",
             "res_ptr": "*bf16", "eps": "fp32"}
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a in types and a != "eps" or a == "K"}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": NW})
