"""Device experiment (calls P, Q, W, X, AC): every config of the M = 1 int4/int8 GEMVs (split-K x tile x stages)
timed by CUDA-graph replay at Llama-3.1-8B's shapes, each checked against x @ dequant(W)^T; and decode attention
with the split kernel's own merge (FUSE_MERGE) against the merge kernel, each tuned afresh. Prints tables; writes
JSON to argv[1]; argv[2] (optional): a comma list of int4, int8, attention, attention_sweep (default the first
three); argv[3] (optional): "x" for call X's candidate list, "pkg" for the package's own configs (+ 6144 x 4096),
"ae" for the package's configs and call AE's candidates (+ 6144 x 4096), "ai" for call AI's candidates (+ 6144 x 4096).
("x" ran in call X only: its X_DIRECT variant is gone from the kernel since.)

Call P ran it at fc6f159 (the attention A/B there: FUSE_MERGE forced for every config; since then the fused merge
is a tuned config option and FUSE_MERGE only covers untuned launches)."""

import json
import sys

import torch
import triton

from llmlab.kernels import decode_attention as da
from llmlab.kernels import dequant_matmul as dq
from llmlab.kernels.bench_kernels import _graph_ms

torch.manual_seed(0)
dev = "cuda"
out = {"gemv": [], "attention": []}
want = sys.argv[2].split(",") if len(sys.argv) > 2 else ["int4", "int8", "attention"]
SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096)]  # (N, K) of Llama-3.1-8B's layers
COPIES = 8  # distinct weight sets per timing: >= 4x the 50 MB L2 at the int4 sizes


# the candidates timed (call W: the GEMVs that read 32-bit words); the kernels' GEMV1_CONFIGS keep the winners
_SWEEP = [(16, 128, 1, 1, 4), (32, 128, 1, 2, 4), (64, 128, 1, 2, 3), (64, 128, 1, 4, 3), (128, 128, 1, 4, 3),
          (128, 128, 2, 4, 3), (64, 128, 2, 4, 3), (64, 128, 4, 4, 3), (32, 128, 4, 2, 4), (128, 128, 4, 8, 3),
          (64, 64, 1, 2, 4), (64, 64, 4, 2, 4), (128, 64, 2, 4, 4), (64, 128, 1, 4, 5), (128, 128, 1, 8, 4),
          (64, 256, 1, 4, 3), (32, 256, 1, 2, 3), (64, 256, 2, 4, 3), (128, 256, 1, 8, 3), (32, 512, 1, 4, 2),
          (64, 256, 4, 4, 3), (64, 512, 1, 8, 2)]  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, STAGES)
SWEEP = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
         for n, k, sk, w, st in _SWEEP]
# call X: W's winners had 1-2 warps; x loaded per field (X_DIRECT) or as one (J, 8) tile split in registers
_SWEEP_X = [(16, 128, 1, 1, 4), (16, 128, 1, 1, 6), (8, 128, 1, 1, 4), (32, 128, 1, 1, 4), (32, 128, 1, 2, 4),
            (32, 128, 4, 2, 4), (16, 128, 4, 1, 4), (32, 128, 2, 2, 4), (16, 64, 1, 1, 6), (16, 128, 1, 1, 1),
            (16, 256, 1, 1, 4), (32, 256, 1, 2, 3), (8, 256, 1, 1, 4), (32, 256, 4, 2, 3), (64, 128, 1, 4, 4)]
if len(sys.argv) > 3 and sys.argv[3] == "pkg":  # call AC: the package's own configs, with the q/k/v shape too
    SWEEP = dq.GEMV1_CONFIGS
    SHAPES.append((6144, 4096))
# call AE (session 6): the GEMVs read fields as subnormal floats (`_field`, no FADD per weight), which makes the x side
# (convert, lift, offset sum) a larger share of a thread's work: more rows per thread (BLOCK_N) amortize it
_SWEEP_AE = [(64, 128, 1, 1, 4), (64, 128, 2, 1, 4), (64, 64, 1, 1, 6), (32, 128, 2, 1, 4), (32, 128, 1, 1, 6),
             (64, 128, 1, 2, 4), (128, 128, 1, 2, 4), (128, 128, 2, 2, 4), (64, 128, 4, 2, 4), (32, 256, 1, 1, 4),
             (64, 256, 1, 1, 3), (32, 256, 2, 1, 4), (16, 256, 2, 1, 4), (64, 256, 1, 2, 3)]
if len(sys.argv) > 3 and sys.argv[3] == "ae":
    SWEEP = dq.GEMV1_CONFIGS + [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
                                for n, k, sk, w, st in _SWEEP_AE]
    SHAPES.append((6144, 4096))
# call AI: around call AE's winners — one-warp programs, split-K 2..8, deeper pipelines, longer int8 tiles (for the
# short 6144 x 4096 int8 GEMV: 1.64-1.66x, 1.7x wanted)
_SWEEP_AI = [(32, 128, 2, 1, 6), (32, 128, 3, 1, 4), (32, 64, 2, 1, 8), (32, 128, 4, 1, 4), (32, 128, 8, 1, 4),
             (16, 128, 8, 1, 4), (16, 128, 4, 1, 4), (8, 512, 1, 1, 3), (4, 256, 1, 1, 4), (8, 256, 1, 1, 6),
             (8, 128, 1, 1, 8), (16, 512, 1, 1, 2), (4, 512, 1, 1, 4), (8, 256, 2, 1, 6), (16, 256, 2, 1, 6)]
if len(sys.argv) > 3 and sys.argv[3] == "ai":
    SWEEP = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st}, num_warps=w)
             for n, k, sk, w, st in _SWEEP_AI]
    SHAPES.append((6144, 4096))
if len(sys.argv) > 3 and sys.argv[3] == "x":
    SWEEP = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st, "X_DIRECT": xd}, num_warps=w)
             for n, k, sk, w, st in _SWEEP_X for xd in (False, True)]


def raw_launch(kernel, x, w, s, y, cfg, N, K, G=None):
    ws, cnt = dq._scratch(x.device, N)
    meta = dict(cfg.all_kwargs())
    grid = (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])
    if G is not None:
        return lambda: kernel.fn[grid](x, w, s, y, ws, cnt, N, K, x.stride(1), w.stride(0) // 4,
                                       s.stride(0), s.stride(1), y.stride(1), ws.stride(0), GROUP=G, **meta)
    return lambda: kernel.fn[grid](x, w, s, y, ws, cnt, N, K, x.stride(1), w.stride(0) // 4, y.stride(1),
                                   ws.stride(0), **meta)


for N, K in SHAPES:
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    dense = [W.clone() for _ in range(COPIES)]
    t_bf16 = _graph_ms([lambda Wd=Wd: x @ Wd.T for Wd in dense])
    del dense
    for name, kernel, quant, deq, G in [("int4", dq._int4_gemv_kernel, lambda w: dq.quantize_int4(w, 128),
                                         dq.dequantize_int4, 128),
                                        ("int8", dq._int8_gemv_kernel, dq.quantize_int8, dq.dequantize_int8, None)]:
        if name not in want:
            continue
        wq, sc = quant(W)
        ref = dq.dequant_matmul_reference(x, deq(wq, sc)).float()
        sets = [(wq.clone(), sc.clone()) for _ in range(COPIES)]
        nbytes = wq.numel() * wq.element_size() + sc.numel() * 4
        named = {"N": N, "K": K} | ({"GROUP": G} if G else {})
        configs = dq._gemv1_prune(SWEEP, named, **({"GROUP": G} if G else {}))
        rows = []
        for cfg in configs:
            y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
            try:
                fn = raw_launch(kernel, x, wq, sc, y, cfg, N, K, G)
                y.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = float((y.float() - ref).norm() / ref.norm())
                fns = [raw_launch(kernel, x, a, b, torch.empty(1, N, device=dev, dtype=torch.bfloat16), cfg, N, K, G)
                       for a, b in sets]
                t = _graph_ms(fns)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {N}x{K} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(dict(op=name, N=N, K=K, config=str(cfg), time_us=t * 1e3, GBps=nbytes / t / 1e6,
                             speedup_vs_bf16=t_bf16 / t, rel_err=err))
        rows.sort(key=lambda r: r["time_us"])
        print(f"\n{name} {N}x{K}: bf16 cuBLAS {t_bf16 * 1e3:.1f} us ({N * K * 2 / t_bf16 / 1e6:.0f} GB/s)")
        for r in rows:
            print(f"  {r['time_us']:7.1f} us {r['GBps']:7.0f} GB/s x{r['speedup_vs_bf16']:.2f} err {r['rel_err']:.1e}  "
                  f"{r['config']}")
        out["gemv"] += rows
    del W

B, H, Hkv, hd = 1, 32, 8, 128
for S in (1024, 8192, 16384, 32768) if "attention" in want else ():
    sets = [(torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16)) for _ in range(max(2, 4 * 32768 // S))]
    nbytes = 2 * B * Hkv * S * hd * 2
    q, k, v = sets[0]
    ref = da.decode_attention_reference(q, k, v).float()
    for fused in (True, False):
        da.FUSE_MERGE = fused
        da._decode_split_tuned.cache.clear()
        o = da.decode_attention(q, k, v)
        err = float((o.float() - ref).norm() / ref.norm())
        cfg = str(da._decode_split_tuned.best_config)
        t = _graph_ms([lambda q=q, k=k, v=v: da.decode_attention(q, k, v) for q, k, v in sets])
        r = dict(S=S, fused_merge=fused, time_us=t * 1e3, GBps=nbytes / t / 1e6, config=cfg, rel_err=err)
        print(f"attention S={S:6d} fused_merge={fused!s:5s}: {t * 1e3:6.1f} us {nbytes / t / 1e6:7.0f} GB/s "
              f"err {err:.1e} {cfg}")
        out["attention"].append(r)
da.FUSE_MERGE = True

# every split config at 8K, each timed as split + merge by graph replay (the tuner's choice was 55% of copy
# bandwidth in call Q)
if "attention_sweep" in want:
    S = 8192
    sets = [(torch.randn(B, H, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16)) for _ in range(16)]
    nbytes = 2 * B * Hkv * S * hd * 2
    q, k, v = sets[0]
    ref = da.decode_attention_reference(q, k, v).float()
    rows = []
    tiles = [(32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 8, 3), (32, 2, 4), (64, 4, 5), (64, 8, 4), (128, 4, 3),
             (128, 8, 4), (32, 4, 6)]  # (BLOCK_N, num_warps, num_stages): the kernel's four, and more
    cands = [triton.Config({"BLOCK_N": n, "SPLIT_N": sl, "FUSED_MERGE": f}, num_warps=w, num_stages=st)
             for f in (False, True) for sl in (128, 256, 512, 1024, 2048) for n, w, st in tiles
             if sl % n == 0 and (not f or S // sl <= 8)]
    scale = hd ** -0.5
    for cfg in cands:
        try:
            o = da._decode(q, k, v, None, scale, config=cfg)
            err = float((o.float() - ref).norm() / ref.norm())
            t = _graph_ms([lambda q=q, k=k, v=v: da._decode(q, k, v, None, scale, config=cfg) for q, k, v in sets])
        except Exception as e:  # noqa: BLE001
            print(f"attention 8K {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(S=S, config=str(cfg), time_us=t * 1e3, GBps=nbytes / t / 1e6, rel_err=err))
    rows.sort(key=lambda r: r["time_us"])
    for r in rows[:15]:
        print(f"attention 8K sweep: {r['time_us']:6.1f} us {r['GBps']:7.0f} GB/s err {r['rel_err']:.1e} {r['config']}")
    out["attention_sweep"] = rows
out["versions"] = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
json.dump(out, open(sys.argv[1], "w"), indent=1)
