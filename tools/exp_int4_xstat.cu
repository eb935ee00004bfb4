// Device experiment (session 17): an "x-stationary" int4 GEMV (M = 1) on the package's int4 layout. Not part of
// the package; it asks whether issue 5's >= 3x over the bf16 GEMV is reachable when the work is cut the other way.
//
// The GEMVs measured so far (the package's Triton kernel, tools/exp_int4_cuda.cu) give each warp a few ROWS and walk
// it along K: every step reloads and converts x, and a row is read in 512-byte pieces at different times. Here a
// block of T = K / 32 threads spans one whole row: thread t owns k in [32t, 32t + 32) for the kernel's lifetime, so
// its 32 x values are loaded, converted and pre-scaled ONCE, and rows stream past it R at a time (one 16-byte load
// per row per thread; a block's loads cover R whole rows, R x K / 2 contiguous bytes). Each row's sum is then
// reduced across the block: a transposed shuffle reduction (R values over 32 lanes in R - 1 + log2(32 / R)
// shuffles, not 5R), then the warps' partials through shared memory.
//
// The weights become floats as in the package (`kernels/dequant_matmul.py`, `_field` / `_lift`): one AND leaves a
// 4-bit field inside the mantissa of a zero-exponent fp32 (an exact subnormal: field x 2^(shift - 149)), and the FMA
// partner is x pre-scaled by 2^(149 - shift - XE). The codes' offset of 8 comes off as 8 x (the thread's x sum),
// once per row; the thread's 32 k lie in one group (32 | G), so one scale per row per thread.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o libxstat.so exp_int4_xstat.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int XE = 64;  // the sums are kept x 2^-XE (as the package's X_EXP)

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ float field(uint32_t w, uint32_t mask) { return __uint_as_float(w & mask); }

__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }  // 2^e, -126 <= e <= 127

// sum over the 8 codes of one word: code i at bits 4i; codes 5..7 read from w >> 12 (bits 8..19)
__device__ __forceinline__ float word_dot(uint32_t w, const float* xl, float acc) {
  const uint32_t top = w >> 12;
  acc = fmaf(field(w, 0xFu), xl[0], acc);
  acc = fmaf(field(w, 0xF0u), xl[1], acc);
  acc = fmaf(field(w, 0xF00u), xl[2], acc);
  acc = fmaf(field(w, 0xF000u), xl[3], acc);
  acc = fmaf(field(w, 0xF0000u), xl[4], acc);
  acc = fmaf(field(top, 0xF00u), xl[5], acc);
  acc = fmaf(field(top, 0xF000u), xl[6], acc);
  acc = fmaf(field(top, 0xF0000u), xl[7], acc);
  return acc;
}

// v[0..R) per lane -> the warp's sum of row `row` in v[0] of every lane (returned row index). R | 32, R a power of 2.
template <int R>
__device__ __forceinline__ int warp_reduce_rows(float (&v)[R], int lane) {
  int row = 0, bit = 16;
#pragma unroll
  for (int h = R / 2; h >= 1; h /= 2) {
    const bool up = lane & bit;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = up ? v[i] : v[i + h];
      const float keep = up ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
    row += up ? h : 0;
    bit /= 2;
  }
#pragma unroll
  for (int b = 32 / (2 * R); b >= 1; b /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], b);
  return row;
}

template <int R, bool PREFETCH>
__global__ void int4_gemv_xstat(const uint8_t* __restrict__ w, const float* __restrict__ scales,
                                const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int N, int K,
                                int G, int pdl) {
  extern __shared__ float red[];  // [2][R][warps]
  const int t = threadIdx.x, lane = t % 32, warp = t / 32, warps = blockDim.x / 32;
  const int n_chunks = N / R, n_groups = K / G, grp = (32 * t) / G;
  const size_t row_bytes = K / 2;
  const uint8_t* wt = w + 16 * t;
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  int c = blockIdx.x;
  uint4 cur[R];
  float sc[R];
  // the weights and scales do not depend on the kernel before: their first loads go out before the PDL wait
  if (c < n_chunks) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      cur[r] = ld_stream(wt + static_cast<size_t>(c * R + r) * row_bytes);
      sc[r] = __ldg(scales + static_cast<size_t>(c * R + r) * n_groups + grp);
    }
  }
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  float xl[4][8], xsum = 0.f;
  {
    const uint4* xv = reinterpret_cast<const uint4*>(x + 32 * t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = __ldg(xv + j);
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
      constexpr int shift[8] = {0, 4, 8, 12, 16, 8, 12, 16};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float f = __bfloat162float(e[i]);
        xsum += f;
        xl[j][i] = f * pow2(149 - shift[i] - XE);  // a power of two: exact
      }
    }
  }
  const float off = 8.f * xsum * pow2(-XE);
  int buf = 0;
  for (; c < n_chunks; c += gridDim.x) {
    uint4 nxt[PREFETCH ? R : 1];
    float nsc[PREFETCH ? R : 1];
    const int cn = c + gridDim.x;
    if (PREFETCH && cn < n_chunks) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        nxt[r] = ld_stream(wt + static_cast<size_t>(cn * R + r) * row_bytes);
        nsc[r] = __ldg(scales + static_cast<size_t>(cn * R + r) * n_groups + grp);
      }
    }
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float acc = -off;
      acc = word_dot(cur[r].x, xl[0], acc);
      acc = word_dot(cur[r].y, xl[1], acc);
      acc = word_dot(cur[r].z, xl[2], acc);
      acc = word_dot(cur[r].w, xl[3], acc);
      v[r] = acc * (sc[r] * 4294967296.f);  // x 2^32 now, 2^32 at the end: small parts x small scales stay normal
    }
    const int row = warp_reduce_rows<R>(v, lane);
    if (lane % (32 / R) == 0) red[(buf * R + row) * warps + warp] = v[0];
    __syncthreads();
    if (t < R) {
      float s = 0.f;
      for (int q = 0; q < warps; ++q) s += red[(buf * R + t) * warps + q];
      y[c * R + t] = __float2bfloat16(s * 4294967296.f);
    }
    buf ^= 1;  // the next chunk writes the other half; the one after waits behind the next barrier
    if (!PREFETCH) {
      const int c2 = c + gridDim.x;
      if (c2 < n_chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          cur[r] = ld_stream(wt + static_cast<size_t>(c2 * R + r) * row_bytes);
          sc[r] = __ldg(scales + static_cast<size_t>(c2 * R + r) * n_groups + grp);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        cur[r] = nxt[r];
        sc[r] = nsc[r];
      }
    }
  }
}

template <int R, bool P>
static int launch_t(const void* w, const void* s, const void* x, void* y, int N, int K, int G, int blocks, int pdl,
                    void* stream) {
  const int threads = K / 32, warps = threads / 32;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks, 1, 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = 2 * R * warps * sizeof(float);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, int4_gemv_xstat<R, P>, static_cast<const uint8_t*>(w),
                            static_cast<const float*>(s), static_cast<const __nv_bfloat16*>(x),
                            static_cast<__nv_bfloat16*>(y), N, K, G, pdl);
}

// y (N,) bf16 = dequant(W) x for x (K,) bf16. blocks <= 0: one block per chunk of R rows. Returns a cudaError_t, or
// 1 for a shape it does not handle (K a multiple of 1024 up to 32768, G a multiple of 32 dividing K, R | N).
extern "C" int int4_gemv_xstat_cuda(const void* w, const void* s, const void* x, void* y, int N, int K, int G,
                                    int rows, int prefetch, int blocks, int pdl, void* stream) {
  if (K % 1024 || K > 32768 || G % 32 || K % G || N % rows) return 1;
  if (blocks <= 0 || blocks > N / rows) blocks = N / rows;
#define XSTAT_CASE(RR)                                                                              \
  case RR:                                                                                          \
    return prefetch ? launch_t<RR, true>(w, s, x, y, N, K, G, blocks, pdl, stream)                 \
                    : launch_t<RR, false>(w, s, x, y, N, K, G, blocks, pdl, stream);
  switch (rows) {
    XSTAT_CASE(2)
    XSTAT_CASE(4)
    XSTAT_CASE(8)
    XSTAT_CASE(16)
    default: return 1;
  }
#undef XSTAT_CASE
}

// blocks of this config that fit on one SM at once (for choosing a persistent grid)
extern "C" int int4_gemv_xstat_occupancy(int K, int rows, int prefetch) {
  const int threads = K / 32, warps = threads / 32;
  int n = -1;
  const size_t smem = 2 * rows * warps * sizeof(float);
#define XSTAT_OCC(RR)                                                                                            \
  case RR:                                                                                                       \
    if (prefetch) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, int4_gemv_xstat<RR, true>, threads, smem);   \
    else cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, int4_gemv_xstat<RR, false>, threads, smem);           \
    break;
  switch (rows) {
    XSTAT_OCC(2)
    XSTAT_OCC(4)
    XSTAT_OCC(8)
    XSTAT_OCC(16)
    default: break;
  }
#undef XSTAT_OCC
  return n;
}
