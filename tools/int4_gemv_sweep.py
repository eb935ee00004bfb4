"""The harness shared by the M = 1 int4 GEMV experiments (`exp_int4_persistent.py`, `exp_int4_prefetch.py`): a
correctness check in the CPU interpreter and a GPU sweep that times an experimental kernel's configs against the
package's `_int4_gemv_kernel` (its winning configs) and cuBLAS bf16 at Llama-3.1-8B's layer shapes, group 128,
by CUDA-graph replay over 8 weight copies (several times the L2). An experiment passes its `launch(x, packed,
scales, y, cfg) -> callable`, where cfg holds its meta-parameters and num_warps."""

from __future__ import annotations

import json

import torch
import triton

from llmlab.kernels import dequant_matmul as dq

PACKAGE = [(32, 128, 8, 1, 4), (32, 128, 4, 1, 4), (32, 128, 2, 1, 4)]  # the package kernel's winners (calls AI-AK)
SHAPES = [(14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]


def launcher(kernel, scratch=None):
    """`launch(x, packed, scales, y, cfg)` for an M = 1 int4 GEMV `kernel` with the package kernel's arguments
    (x, w, s, y, ws, cnt, N, K, strides; GROUP, num_warps and cfg's meta-parameters as keywords), on a grid of
    cdiv(N, BLOCK_N) x SPLIT_K programs. Returns a no-argument callable that launches it. scratch(device, N):
    the split-K scratch (default: the package's, up to 8 splits)."""
    scratch = scratch or dq._scratch

    def launch(x, packed, scales, y, cfg: dict):
        N, K = packed.shape[0], 2 * packed.shape[1]
        ws, cnt = scratch(x.device, N)
        meta = {k: v for k, v in cfg.items() if k != "num_warps"}
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
        return lambda: kernel[grid](
            x, packed, scales, y, ws, cnt, N, K,
            x.stride(1), packed.stride(0) // 4, scales.stride(0), scales.stride(1), y.stride(1), ws.stride(0),
            GROUP=K // scales.shape[1], num_warps=cfg["num_warps"], **meta)
    return launch


def check_small(launch, cases, prepare=None) -> None:
    """The interpreter: each (N, K, group, cfg) of `cases` (one-warp programs) against the fp32 reference;
    `prepare(packed) -> packed` puts the package's packing into the experiment's own order, if it has one."""
    torch.manual_seed(0)
    for N, K, G, cfg in cases:
        packed, scales = dq.quantize_int4(torch.randn(N, K), G)
        x = torch.randn(1, K)
        y = torch.full((1, N), float("nan"))
        launch(x, prepare(packed) if prepare else packed, scales, y, dict(cfg, num_warps=1))()
        err = float((y - dq.dequant_matmul_reference(x, dq.dequantize_int4(packed, scales))).abs().max())
        print(N, K, G, cfg, "max err", err)
        assert err < 1e-3, err


def sweep(out_path: str, name: str, launch, configs: list[dict], prepare=None, keep=None) -> None:
    """Time every cfg of `configs` with `launch` and the package kernel's PACKAGE configs at each of SHAPES; print
    each shape's ten fastest; write every row (time, speedup over bf16, relative error, config) to out_path.
    `prepare(packed) -> packed`: the experiment's own weight order (done once, untimed), as in `check_small`;
    `keep(N, K, cfg) -> bool`: which configs to time at a shape (default: all)."""
    from llmlab.kernels.bench_kernels import _graph_ms

    torch.manual_seed(0)
    rows = []
    for N, K in SHAPES:
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        t_bf16 = _graph_ms([lambda Wd=W.clone(): x @ Wd.T for _ in range(8)])
        packed, scales = dq.quantize_int4(W, 128)
        ref = dq.dequant_matmul_reference(x, dq.dequantize_int4(packed, scales)).float()
        sets = [(packed.clone(), scales.clone()) for _ in range(8)]
        own = [((prepare(a) if prepare else a), b) for a, b in sets]
        ws, cnt = dq._scratch(x.device, N)
        first = len(rows)

        def timed(impl, make, cfg):
            try:
                y = torch.full((1, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                make(y)()
                torch.cuda.synchronize()
                err = float((y.float() - ref).norm() / ref.norm())
                t = _graph_ms([make(torch.empty(1, N, device="cuda", dtype=torch.bfloat16), i) for i in range(8)])
            except Exception as e:  # noqa: BLE001
                print(f"  {impl} {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}")
                return
            rows.append(dict(N=N, K=K, impl=impl, time_us=t * 1e3, speedup_vs_bf16=t_bf16 / t,
                             bf16_us=t_bf16 * 1e3, rel_err=err, config=cfg))

        for n, k, sk, nw, st in PACKAGE:
            meta = dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, STAGES=st)

            def make(y, i=0, meta=meta, nw=nw):
                a, b = sets[i]
                return lambda: dq._int4_gemv_kernel.fn[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
                    x, a, b, y, ws, cnt, N, K, x.stride(1), a.stride(0) // 4, b.stride(0), b.stride(1),
                    y.stride(1), ws.stride(0), GROUP=128, num_warps=nw, **meta)
            timed("package", make, dict(meta, num_warps=nw))
        for cfg in configs:
            if keep is not None and not keep(N, K, cfg):
                continue
            timed(name, lambda y, i=0, cfg=cfg: launch(x, *own[i], y, cfg), cfg)
        print(f"\n{N}x{K}: bf16 cuBLAS {t_bf16 * 1e3:.1f} us")
        for r in sorted(rows[first:], key=lambda r: r["time_us"])[:10]:
            print(f"  {r['impl']:10s} {r['time_us']:6.1f} us x{r['speedup_vs_bf16']:.2f} err {r['rel_err']:.1e} "
                  f"{r['config']}")
        del W, sets, own
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
                   "triton": triton.__version__}, "rows": rows}, f, indent=1)


def loop_instructions(fn, constexprs: dict, num_warps: int, weights_per_thread: int, out_prefix: str = "") -> None:
    """Compile `fn` (a GEMV kernel with the argument names of `_int4_gemv_kernel`) for sm_90 without a GPU and print
    its registers, the layout conversions in its TTGIR and the SASS opcode mix of its K loop (the one backward
    branch), per weight of `weights_per_thread`. out_prefix: also write <prefix>.ttgir and <prefix>.sass.
    Count with the device's Triton version: 3.9 and 3.6 placed call BI's layout conversion differently (a venv
    with `pip install triton==3.6.0`, torch taken from the main venv, compiles for sm_90 without a GPU)."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32"}
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and a not in ("N", "K")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobj, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True).stdout
    if out_prefix:
        open(out_prefix + ".ttgir", "w").write(k.asm["ttgir"])
        open(out_prefix + ".sass", "w").write(sass)
    lines = sass.splitlines()
    ops = [re.search(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln) for ln in lines]
    print(fn.__name__, constexprs, "num_warps", num_warps, " ".join(re.findall(r"REG:\d+", res)),
          "convert_layout:", k.asm["ttgir"].count("convert_layout"))
    for line in lines:
        m = re.search(r"/\*([0-9a-f]{4})\*/.*BRA (0x[0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            lo, hi = int(m.group(2), 16), int(m.group(1), 16)
            loop = collections.Counter(o.group(2) for o in ops if o and lo <= int(o.group(1), 16) <= hi)
            n = sum(loop.values())
            print(f"  loop: {n} instructions, {n / weights_per_thread:.2f} per weight;",
                  sorted(loop.items(), key=lambda t: -t[1])[:16])
