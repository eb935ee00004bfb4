"""Device experiment (session 12): decode attention's split kernel reading K/V through TMA tensor descriptors.

Issue 5 wants decode attention at >= 70% of the copy bandwidth from 8K keys on; the package's kernel makes 55% at
8K (69-70% at 16K, 82-83% at 32K), and session 10 measured its split kernel ALONE at 67% at 8K: the loop itself,
not only the merge, is short of the bytes. Its loads are pointer loads — per tile, every thread computes addresses
and masks and issues its share of 16-byte cp.async copies. Hopper's tensor memory accelerator (TMA) copies a whole
(BLOCK_N, hd) tile into shared memory from one instruction and a descriptor, out-of-range rows filled with zeros
(https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html#tensor-memory-accelerator; in Triton, host-side
`triton.tools.tensor_descriptor.TensorDescriptor` + `desc.load`, pipelined by `tl.range(num_stages=...)`).
Prediction: fewer instructions per byte and more bytes in flight per warp, so the split kernel closer to the
bandwidth at 8K: 67% -> 75%+ alone, the whole op 55% -> ~65%.

Variants, each timed as the kernel micro-benchmark times decode attention (`kernels.bench_kernels._graph_ms`:
CUDA-graph replay over buffers that add up to 4x the L2), B = 1, Llama-3.1-8B's 32 query / 8 KV heads, hd 128,
bf16, S = 8K, 16K, 32K:
    package      `decode_attention(q, k, v)`: the autotuned kernel, what the bench file reports
    ptr:<cfg>    the package's split kernel with one fixed config (no fused merge) + its merge kernel
    tma:<cfg>    this file's TMA split kernel with the same config + the same merge kernel
The configs: BLOCK_N 32/64/128 keys x split length 256..2048 x warps 4/8 x stages 2/3/4 (a sweep: TMA changes
which config wins). Every TMA config is checked against the reference first (the package's are checked by its
tests). The JSON is rewritten after every row, so a run cut short keeps what it measured. Writes JSON to argv[1]. Without a CUDA
GPU (TRITON_INTERPRET=1) it checks the kernel on small fp32 shapes and exits.
"""

import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmlab.kernels._util import pdl_kwargs
from llmlab.kernels.decode_attention import (_merge_into, _tile_output, _tile_scores, decode_attention,
                                             decode_attention_reference)


@triton.jit
def _tma_split_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, Hkv, N_REP, S, scale,
                      stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
                      STAGES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """Program (b * Hkv + kv head, split): the package's `_decode_split_kernel` without lengths or fused merge,
    its K and V tiles loaded through descriptors over the cache viewed as (B * Hkv * S, hd) rows. Keys past the
    split's end are masked in the scores (their rows belong to the next split or head, or are TMA's zeros past the
    tensor), so p = 0 there. PDL as the package's kernel without PREFETCH (so the two launch alike)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    b = pid // Hkv
    kvh = pid % Hkv
    split = tl.program_id(1)
    start = split * SPLIT_N
    end = tl.minimum(start + SPLIT_N, S)
    row0 = pid * S  # the row of (b, kvh, key 0)
    hi = tl.arange(0, BLOCK_H)
    heads = kvh * N_REP + hi
    hmask = hi < N_REP
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        k = k_desc.load([row0 + n0, 0])  # (BLOCK_N, BLOCK_D)
        nmask = n0 + tl.arange(0, BLOCK_N) < end
        p, alpha, m_i, l_i = _tile_scores(q, k, nmask, m_i, l_i, scale, IEEE)
        v = v_desc.load([row0 + n0, 0])
        acc = _tile_output(p, v, alpha, acc, IEEE)
    o = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], o,
             mask=hmask[:, None])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


def tma_attention(q, k, v, o_part, lse, out, block_n, split_n, warps, stages):
    """q (B, H, hd); k, v (B, Hkv, S, hd) contiguous, hd a power of 2 -> out (B, H, hd) (split + merge)."""
    B, H, hd = q.shape
    _, Hkv, S, _ = k.shape
    kd = TensorDescriptor.from_tensor(k.view(B * Hkv * S, hd), block_shape=[block_n, hd])
    vd = TensorDescriptor.from_tensor(v.view(B * Hkv * S, hd), block_shape=[block_n, hd])
    splits = triton.cdiv(S, split_n)
    _tma_split_kernel[(B * Hkv, splits)](
        q, kd, vd, o_part, lse, Hkv, H // Hkv, S, hd ** -0.5,
        q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0),
        lse.stride(1),
        BLOCK_H=max(16, triton.next_power_of_2(H // Hkv)), BLOCK_D=hd, BLOCK_N=block_n, SPLIT_N=split_n,
        STAGES=stages, IEEE=q.dtype == torch.float32, num_warps=warps, **pdl_kwargs(q.device))
    if splits > 1:
        _merge_into(o_part, lse, splits, out)
    else:
        out.copy_(o_part[:, :, 0])
    return out


def make(S, B=1, H=32, Hkv=8, hd=128, dtype=torch.bfloat16, device="cuda", max_splits=256):
    q = torch.randn(B, H, hd, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, S, hd, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, S, hd, device=device, dtype=dtype)
    o_part = torch.empty(B, H, max_splits, hd, device=device, dtype=torch.float32)
    lse = torch.empty(B, H, max_splits, device=device, dtype=torch.float32)
    out = torch.empty(B, H, hd, device=device, dtype=dtype)
    return q, k, v, o_part, lse, out


def check(S, cfg, **kw):
    q, k, v, o_part, lse, out = make(S, **kw)
    got = tma_attention(q, k, v, o_part, lse, out, *cfg).float()
    want = decode_attention_reference(q, k, v).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, f"S={S} cfg={cfg}: relative error {err:.3g}"
    return err


if not torch.cuda.is_available():  # the interpreter: correctness only
    for S, cfg in [(40, (16, 16, 4, 1)), (100, (16, 32, 4, 2)), (64, (32, 64, 4, 1)), (17, (16, 64, 4, 1))]:
        print(f"S={S} cfg={cfg}: max relative error {check(S, cfg, H=4, Hkv=2, hd=16, dtype=torch.float32, device='cpu', max_splits=8):.2e}")
    sys.exit(0)

from llmlab.kernels.bench_kernels import _copies, _graph_ms  # noqa: E402
from llmlab.measure.peaks import measure_peaks  # noqa: E402

peak = measure_peaks("cuda").copy_bw_gb_s  # cached per call in $LLMLAB_PEAKS_CACHE (tools/h200_lib.sh)
CONFIGS = [c for c in itertools.product((32, 64, 128), (256, 512, 1024, 2048), (4, 8), (2, 3, 4))
           if c[1] % c[0] == 0 and not (c[0] == 128 and c[2] == 4)]
rows = []


def save():
    json.dump({"device": torch.cuda.get_device_name(), "commit": os.environ.get("LLMLAB_COMMIT"),
               "versions": {"torch": torch.__version__, "triton": triton.__version__}, "copy_GBps": peak,
               "rows": rows}, open(sys.argv[1], "w"), indent=1)


for S in (8192, 16384, 32768):
    nbytes = 2 * 8 * S * 128 * 2
    n_sets = _copies(nbytes, "cuda")
    sets = [make(S) for _ in range(n_sets)]

    def record(name, fns):
        ms = _graph_ms(fns)
        rows.append({"S": S, "variant": name, "us": ms * 1e3, "bw_fraction": nbytes / (ms * 1e-3) / 1e9 / peak})
        save()

    record("package", [lambda s=s: decode_attention(s[0], s[1], s[2]) for s in sets])
    for cfg in CONFIGS:
        bn, sn, w, st = cfg
        tag = f"{bn}x{sn}/w{w}/s{st}"
        try:
            check(S, cfg)
            record("tma:" + tag, [lambda s=s, c=cfg: tma_attention(*s, *c) for s in sets])
        except Exception as e:  # a config the compiler or the TMA limits refuse
            rows.append({"S": S, "variant": "tma:" + tag, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            save()
        pc = triton.Config({"BLOCK_N": bn, "SPLIT_N": sn, "FUSED_MERGE": False}, num_warps=w, num_stages=st)
        try:
            record("ptr:" + tag, [lambda s=s, c=pc: decode_attention(s[0], s[1], s[2], config=c) for s in sets])
        except Exception as e:
            rows.append({"S": S, "variant": "ptr:" + tag, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            save()
    done = [r for r in rows if r["S"] == S and "us" in r]
    for kind in ("package", "ptr:", "tma:"):
        best = min((r for r in done if r["variant"].startswith(kind)), key=lambda r: r["us"], default=None)
        if best:
            print(f"S={S:6d} best {best['variant']:24s} {best['us']:7.2f} us  {best['bw_fraction']:.1%} of copy",
                  flush=True)
    del sets
    torch.cuda.empty_cache()
