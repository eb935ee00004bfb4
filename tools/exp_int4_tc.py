"""Device experiment (call Y): an int4 M = 1 GEMV that dequantizes TWO weights per instruction in packed bf16x2 lanes
(inline PTX: PRMT + LOP3 into the exponent of 128, then one fma.rn.bf16x2 removes 128 + 8, as Marlin does with
fp16) and multiplies on the tensor cores (tl.dot with x as a (BLOCK_K, 16) tile, column 0 real). The offline SASS
count (sm_90, Triton 3.9): 3.4 instructions per weight at 128 x 128 / 4 warps, against 3.9 for the package's
FMA GEMV. Times every config by CUDA-graph replay against cuBLAS bf16 and the package's GEMV; argv[1]: JSON out."""

import json
import sys

import torch
import triton
import triton.language as tl

from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels.bench_kernels import _graph_ms
from llmlab.kernels.dequant_matmul import _split_k_range, _split_k_store

# pack=2: two words (w_a in $8, w_b in $9) -> eight bf16x2 registers $0..$7:
# output i = (code i of w_a, code i of w_b) - 8
_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, t;
.reg .b32 one, off;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t, lo, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $0, t, one, off;
shr.u32 t, lo, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $1, t, one, off;
shr.u32 t, lo, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $2, t, one, off;
shr.u32 t, lo, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $3, t, one, off;
lop3.b32 t, hi, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $4, t, one, off;
shr.u32 t, hi, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $5, t, one, off;
shr.u32 t, hi, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $6, t, one, off;
shr.u32 t, hi, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $7, t, one, off;
}
""")


@triton.jit
def _k_order8(c0, c1, c2, c3, c4, c5, c6, c7):
    lo = tl.join(tl.join(c0, c4), tl.join(c2, c6))
    hi = tl.join(tl.join(c1, c5), tl.join(c3, c7))
    return tl.reshape(tl.join(lo, hi), (c0.shape[0], c0.shape[1] * 8))


@triton.jit
def int4_tc2(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, stride_xk, stride_wn, stride_sn, stride_sg, stride_yn,
             stride_ws, magic, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    J: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, J)
    n_mask = rn < N
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    k_start, k_end = _split_k_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    rk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, 16)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_words + rn[:, None] * stride_wn + (k0 // 8 + rj)[None, :], mask=n_mask[:, None], other=0)
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        wk = _k_order8(c0, c1, c2, c3, c4, c5, c6, c7)
        xt = tl.load(x_ptr + (k0 + rk)[:, None] * stride_xk + col[None, :] * 0, mask=(col == 0)[None, :], other=0.0)
        s = tl.load(s_ptr + rn * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.dot(wk, xt) * s[:, None]
    _split_k_store(tl.sum(acc, axis=1), y_ptr, stride_yn, rn, n_mask, ws_ptr, stride_ws, cnt_ptr, SPLIT_K)


def launch(x, w4, s4, y, N, K, BN, BK, SK, warps, ST):
    ws, cnt = dq._scratch(x.device, N)
    return lambda: int4_tc2[(triton.cdiv(N, BN), SK)](
        x, w4, s4, y, ws, cnt, N, K, 1, w4.stride(0) // 4, s4.stride(0), 1, 1, ws.stride(0), dq.MAGIC,
        GROUP=K // s4.shape[1], BLOCK_N=BN, BLOCK_K=BK, SPLIT_K=SK, STAGES=ST, num_warps=warps)


if __name__ == "__main__":
    torch.manual_seed(0)
    dev, out = "cuda", []
    configs = [(64, 128, 1, 4, 3), (64, 128, 2, 4, 3), (64, 128, 4, 4, 3), (128, 128, 1, 4, 3), (128, 128, 2, 4, 3),
               (128, 128, 4, 4, 3), (128, 128, 4, 4, 4), (64, 64, 2, 4, 4), (128, 64, 2, 4, 4), (128, 128, 8, 4, 3),
               (256, 128, 4, 8, 3), (64, 128, 1, 4, 5), (32, 128, 1, 4, 3), (32, 128, 4, 4, 3)]
    for N, K in [(14336, 4096), (4096, 14336), (4096, 4096)]:
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        dense = [W.clone() for _ in range(8)]
        t_bf16 = _graph_ms([lambda Wd=Wd: x @ Wd.T for Wd in dense])
        del dense
        w4, s4 = dq.quantize_int4(W, 128)
        ref = dq.dequant_matmul_reference(x, dq.dequantize_int4(w4, s4)).float()
        sets = [(w4.clone(), s4.clone()) for _ in range(8)]
        t_pkg = _graph_ms([lambda a=a, b=b: dq.int4_matmul(x, a, b) for a, b in sets])
        print(f"\nint4 {N}x{K}: bf16 {t_bf16 * 1e3:.1f} us, package GEMV {t_pkg * 1e3:.1f} us "
              f"(x{t_bf16 / t_pkg:.2f}, {dq._int4_gemv_kernel.best_config})")
        for cfg in configs:
            try:
                y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
                launch(x, w4, s4, y, N, K, *cfg)()
                torch.cuda.synchronize()
                err = float((y.float() - ref).norm() / ref.norm())
                t = _graph_ms([launch(x, a, b, torch.empty(1, N, device=dev, dtype=torch.bfloat16), N, K, *cfg)
                               for a, b in sets])
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"  {t * 1e3:6.1f} us x{t_bf16 / t:.2f} err {err:.1e} (BN, BK, SK, warps, stages) = {cfg}")
            out.append(dict(N=N, K=K, config=cfg, time_us=t * 1e3, speedup_vs_bf16=t_bf16 / t, rel_err=err,
                            bf16_us=t_bf16 * 1e3, package_us=t_pkg * 1e3))
    json.dump(out, open(sys.argv[1], "w"), indent=1)
