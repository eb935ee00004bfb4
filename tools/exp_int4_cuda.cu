// Device experiment (session 16): an int4 weight-only GEMV (M = 1) in CUDA C++, on the package's int4 layout, to
// learn whether issue 5's >= 3x over the bf16 GEMV is reachable on the H200 outside Triton. Not part of the package.
//
// Layout (llmlab.kernels.dequant_matmul.quantize_int4): W packed (N, K / 2) uint8, byte j = k 2j (low nibble) and
// 2j + 1 (high), each stored as value + 8; scales (N, K / G) fp32. y[n] = sum_k x[k] * (nibble - 8) * scale.
//
// Each warp owns R rows; lane l reads 16 bytes (32 consecutive k) of each row per step and a step covers 1024 k.
// A 32-bit word holds k0..k7 of a lane's chunk at bits 4i; ONE lop3 turns (word >> 4i) into the fp16 pair
// (1024 + code(k_i), 1024 + code(k_{4+i})) ((w & 0x000F000F) | 0x64006400), one hsub2 makes it (code - 8) exactly,
// and one hfma2 multiplies it with the matching pair of x — the trick of FasterTransformer's and Marlin's int4
// kernels (Frantar et al. 2024, https://arxiv.org/abs/2408.11743). Products accumulate in fp16 over the 32 k of a
// lane's chunk (one group: 32 | G), then in fp32 after the scale. The next step's weights are loaded before this
// step's math. x is converted to fp16 pairs per step (its bf16 values are exact in fp16 inside fp16's range).
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o libint4.so exp_int4_cuda.cu
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ __half2 pair(uint32_t word, int shift) {
  uint32_t t;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(t) : "r"(word >> shift));  // (a & b) | c
  const __half2 h = *reinterpret_cast<__half2*>(&t);
  return __hsub2(h, __half2half2(__ushort_as_half(0x6408)));  // 1032 = 1024 + 8: exact code - 8
}

template <int R, bool F32>
__global__ void __launch_bounds__(256) int4_gemv(const uint8_t* __restrict__ w, const float* __restrict__ scales,
                                                 const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
                                                 int N, int K, int G, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  const int lane = threadIdx.x % 32, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int row0 = warp * R;
  if (row0 >= N) return;
  const int steps = K / 1024, n_groups = K / G;
  const uint8_t* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + static_cast<size_t>(row0 + r) * (K / 2) + lane * 16;
  uint4 cur[R], nxt[R];
#pragma unroll
  for (int r = 0; r < R; ++r) cur[r] = ld_stream(wr[r]);
  float sum[R];
#pragma unroll
  for (int r = 0; r < R; ++r) sum[r] = 0.f;

  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) {
#pragma unroll
      for (int r = 0; r < R; ++r) nxt[r] = ld_stream(wr[r] + (s + 1) * 512);
    }
    const int k0 = s * 1024 + lane * 32;
    __half2 xh[4][4];  // word j, pair i: (x[k0 + 8j + i], x[k0 + 8j + 4 + i])
    float2 xf[4][4];   // the same in fp32 (F32)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + k0 + 8 * j));
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&xv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xf[j][i] = make_float2(__bfloat162float(e[i]), __bfloat162float(e[4 + i]));
        if (!F32) xh[j][i] = __float22half2_rn(xf[j][i]);
      }
    }
    const int grp = k0 / G;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t words[4] = {cur[r].x, cur[r].y, cur[r].z, cur[r].w};
      if (F32) {  // fp32 products and sums: each fp16 pair (exact codes) widened, two FFMA
        float a0 = 0.f, a1 = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 c = __half22float2(pair(words[j], 4 * i));
            a0 = fmaf(c.x, xf[j][i].x, a0);
            a1 = fmaf(c.y, xf[j][i].y, a1);
          }
        sum[r] = fmaf(a0 + a1, __ldg(scales + static_cast<size_t>(row0 + r) * n_groups + grp), sum[r]);
        continue;
      }
      __half2 acc0 = __float2half2_rn(0.f), acc1 = __float2half2_rn(0.f);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc0 = __hfma2(pair(words[j], 0), xh[j][0], acc0);
        acc1 = __hfma2(pair(words[j], 4), xh[j][1], acc1);
        acc0 = __hfma2(pair(words[j], 8), xh[j][2], acc0);
        acc1 = __hfma2(pair(words[j], 12), xh[j][3], acc1);
      }
      const float2 a = __half22float2(__hadd2(acc0, acc1));
      sum[r] = fmaf(a.x + a.y, __ldg(scales + static_cast<size_t>(row0 + r) * n_groups + grp), sum[r]);
    }
    if (s + 1 < steps) {
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = nxt[r];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], off);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) y[row0 + r] = __float2bfloat16(sum[r]);
  }
}

template <int R, bool F32>
static int launch_t(const void* w, const void* s, const void* x, void* y, int N, int K, int G, int pdl, void* stream) {
  const int warps = N / R, blocks = (warps * 32 + 255) / 256;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks, 1, 1);
  cfg.blockDim = dim3(256, 1, 1);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, int4_gemv<R, F32>, static_cast<const uint8_t*>(w), static_cast<const float*>(s),
                            static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), N, K, G, pdl);
}

// y (N,) bf16 = W x for x (K,) bf16; f32: fp32 products and sums instead of fp16 within a 32-k chunk. Returns a cudaError_t, or 1 for a shape it does not handle.
extern "C" int int4_gemv_cuda(const void* w, const void* s, const void* x, void* y, int N, int K, int G, int rows,
                              int f32, int pdl, void* stream) {
  if (K % 1024 || G % 32 || K % G || N % rows) return 1;
  switch (rows) {
    case 1: return f32 ? launch_t<1, true>(w, s, x, y, N, K, G, pdl, stream) : launch_t<1, false>(w, s, x, y, N, K, G, pdl, stream);
    case 2: return f32 ? launch_t<2, true>(w, s, x, y, N, K, G, pdl, stream) : launch_t<2, false>(w, s, x, y, N, K, G, pdl, stream);
    case 4: return f32 ? launch_t<4, true>(w, s, x, y, N, K, G, pdl, stream) : launch_t<4, false>(w, s, x, y, N, K, G, pdl, stream);
    default: return 1;
  }
}

// The same math with a persistent grid (as many CTAs as fit at once): warp w takes row groups w, w + W, ... and
// its loads run D steps ahead across row-group boundaries, so no warp waits for a first load after the first.
template <int R, bool F32, int D>
__global__ void __launch_bounds__(256) int4_gemv_persistent(const uint8_t* __restrict__ w,
                                                            const float* __restrict__ scales,
                                                            const __nv_bfloat16* __restrict__ x,
                                                            __nv_bfloat16* __restrict__ y, int N, int K, int G,
                                                            int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  const int lane = threadIdx.x % 32, gw = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int W = gridDim.x * blockDim.x / 32, steps = K / 1024, n_groups = K / G, row_groups = N / R;
  if (gw >= row_groups) return;
  const int total = ((row_groups - gw + W - 1) / W) * steps;  // (row group, step) pairs of this warp
  auto ptr = [&](int i, int r) {
    const int rg = gw + (i / steps) * W, st = i % steps;
    return w + static_cast<size_t>(rg * R + r) * (K / 2) + st * 512 + lane * 16;
  };
  uint4 buf[D + 1][R];
#pragma unroll
  for (int d = 0; d < D; ++d)
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (d < total) buf[d][r] = ld_stream(ptr(d, r));
  float sum[R];
#pragma unroll
  for (int r = 0; r < R; ++r) sum[r] = 0.f;
  for (int i = 0; i < total; ++i) {
    if (i + D < total) {
#pragma unroll
      for (int r = 0; r < R; ++r) buf[D][r] = ld_stream(ptr(i + D, r));
    }
    const int rg = gw + (i / steps) * W, st = i % steps, row0 = rg * R;
    const int k0 = st * 1024 + lane * 32;
    __half2 xh[4][4];
    float2 xf[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + k0 + 8 * j));
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&xv);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        xf[j][q] = make_float2(__bfloat162float(e[q]), __bfloat162float(e[4 + q]));
        if (!F32) xh[j][q] = __float22half2_rn(xf[j][q]);
      }
    }
    const int grp = k0 / G;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t words[4] = {buf[0][r].x, buf[0][r].y, buf[0][r].z, buf[0][r].w};
      float part;
      if (F32) {
        float a0 = 0.f, a1 = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 c = __half22float2(pair(words[j], 4 * q));
            a0 = fmaf(c.x, xf[j][q].x, a0);
            a1 = fmaf(c.y, xf[j][q].y, a1);
          }
        part = a0 + a1;
      } else {
        __half2 acc0 = __float2half2_rn(0.f), acc1 = __float2half2_rn(0.f);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc0 = __hfma2(pair(words[j], 0), xh[j][0], acc0);
          acc1 = __hfma2(pair(words[j], 4), xh[j][1], acc1);
          acc0 = __hfma2(pair(words[j], 8), xh[j][2], acc0);
          acc1 = __hfma2(pair(words[j], 12), xh[j][3], acc1);
        }
        const float2 a = __half22float2(__hadd2(acc0, acc1));
        part = a.x + a.y;
      }
      sum[r] = fmaf(part, __ldg(scales + static_cast<size_t>(row0 + r) * n_groups + grp), sum[r]);
    }
    if (st == steps - 1) {  // this row group is done
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], off);
        if (lane == 0) y[row0 + r] = __float2bfloat16(sum[r]);
        sum[r] = 0.f;
      }
    }
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int r = 0; r < R; ++r) buf[d][r] = buf[d + 1][r];
  }
}

template <int R, bool F32, int D>
static int launch_p(const void* w, const void* s, const void* x, void* y, int N, int K, int G, int pdl, void* stream) {
  auto kernel = int4_gemv_persistent<R, F32, D>;
  int per_sm = 0, sms = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0);
  if (e != cudaSuccess) return e;
  const int need = (N / R * 32 + 255) / 256;
  const int blocks = need < per_sm * sms ? need : per_sm * sms;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks, 1, 1);
  cfg.blockDim = dim3(256, 1, 1);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<const uint8_t*>(w), static_cast<const float*>(s),
                            static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), N, K, G, pdl);
}

// The persistent kernel: rows per warp 1, 2 or 4; depth: loads in flight ahead of the math, 1-3 steps.
extern "C" int int4_gemv_cuda_persistent(const void* w, const void* s, const void* x, void* y, int N, int K, int G,
                                         int rows, int f32, int depth, int pdl, void* stream) {
  if (K % 1024 || G % 32 || K % G || N % rows) return 1;
#define LLMLAB_P(R, D) \
  if (rows == R && depth == D) \
    return f32 ? launch_p<R, true, D>(w, s, x, y, N, K, G, pdl, stream) : launch_p<R, false, D>(w, s, x, y, N, K, G, pdl, stream);
  LLMLAB_P(1, 1) LLMLAB_P(1, 2) LLMLAB_P(1, 3) LLMLAB_P(2, 1) LLMLAB_P(2, 2) LLMLAB_P(2, 3) LLMLAB_P(4, 1) LLMLAB_P(4, 2)
#undef LLMLAB_P
  return 1;
}
