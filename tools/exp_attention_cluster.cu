// Device experiment (session 16): decode attention at batch 1 with the split partials merged inside a thread-block
// cluster through distributed shared memory — the "next idea" of issue 5's closing notes, which Triton 3.6 cannot
// express. Not part of the package: it answers one question, whether the ~2 us combine measured in session 10
// (calls BB, BD) is what keeps the 8K figure at 57% of copy bandwidth.
//
// One cluster per (sequence, KV head); its CTAs split the keys. Each CTA streams its K/V slice through a ring of
// shared-memory stages filled by the bulk copy engine (cp.async.bulk + mbarrier, Hopper's TMA without a tensor map),
// keeps a running softmax per worker (8 threads per key), folds its workers into one partial (max, sum, unnormalized
// output) in its own shared memory, and after a cluster barrier each CTA reads every CTA's partial for its share of
// the outputs (DSMEM: cooperative_groups' map_shared_rank) and writes them. No second launch, no global scratch.
//
// Shapes: q (B, Hkv * 4, 128) bf16; k, v (B, Hkv, S, 128) bf16 contiguous; out (B, Hkv * 4, 128) bf16. The keys per
// CTA (S / cluster size) must be a multiple of 64. Sources: Flash-Decoding (Dao et al. 2023,
// https://crfm.stanford.edu/2023/10/12/flashdecoding.html); clusters and DSMEM: CUDA C++ Programming Guide,
// "Thread Block Clusters" / "Distributed Shared Memory"; cp.async.bulk and mbarrier: PTX ISA 8.x.
//
// Build (on the device): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC
//                        -o libclattn.so tools/exp_attention_cluster.cu
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

constexpr int HD = 128;        // head dim
constexpr int G = 4;           // query heads per KV head (Llama-3.1-8B: 32 / 8)
constexpr int TN = 64;         // keys per stage (16 KB of K + 16 KB of V)
constexpr int THREADS = 256;   // 8 warps
constexpr int LANES = 8;       // threads per key: each holds dims [8l, 8l+8) and [64+8l, 64+8l+8)
constexpr int WORKERS = THREADS / LANES;  // 32 keys in flight per pass
constexpr int U = TN / WORKERS;           // keys per worker per stage (2)
constexpr int STAGE_BYTES = 2 * TN * HD * 2;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void unpack8(uint4 w, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <int NS>
__global__ void __launch_bounds__(THREADS, 1)
    cluster_decode_attention(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                             const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int S,
                             float scale_log2, int pdl, int mode) {
  // mode (a diagnosis: time with a stage left out): 0 the kernel; 1 no cluster merge (each CTA writes its own
  // partial's share, wrong output); 2 stream only (the tiles are waited for, not used; no merge)
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;                                                        // NS stages of (K tile, V tile)
  float* cta_acc = reinterpret_cast<float*>(smem + NS * STAGE_BYTES);          // (G, HD) unnormalized output
  float* cta_m = cta_acc + G * HD;                                             // (G,) max of log2-scores
  float* cta_l = cta_m + G;                                                    // (G,) sum of exp2(score - max)
  float* w_m = cta_l + G;                                                      // (WORKERS, G)
  float* w_l = w_m + WORKERS * G;                                              // (WORKERS, G)
  uint64_t* bars = reinterpret_cast<uint64_t*>(w_l + WORKERS * G);             // (NS,)

  cg::cluster_group cluster = cg::this_cluster();
  const int split = blockIdx.x, n_split = gridDim.x, kvh = blockIdx.y, b = blockIdx.z, Hkv = gridDim.y;
  const int tid = threadIdx.x, lane = tid % LANES, worker = tid / LANES;
  const int chunk = S / n_split, n_tiles = chunk / TN;
  const size_t head = (static_cast<size_t>(b) * Hkv + kvh) * S;
  const __nv_bfloat16* kbase = k + (head + static_cast<size_t>(split) * chunk) * HD;
  const __nv_bfloat16* vbase = v + (head + static_cast<size_t>(split) * chunk) * HD;

  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (tid == 0) {
    for (int s = 0; s < NS; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int tile) {
    const int s = tile % NS;
    uint8_t* dst = ring + s * STAGE_BYTES;
    mbar_expect_tx(&bars[s], STAGE_BYTES);
    bulk_load(dst, kbase + static_cast<size_t>(tile) * TN * HD, TN * HD * 2, &bars[s]);
    bulk_load(dst + TN * HD * 2, vbase + static_cast<size_t>(tile) * TN * HD, TN * HD * 2, &bars[s]);
  };
  if (tid == 0)
    for (int t = 0; t < NS && t < n_tiles; ++t) issue(t);

  // this thread's query dims, pre-scaled so that exp2 of a score is exp of the softmax logit
  float qf[G][16];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const __nv_bfloat16* qh = q + (static_cast<size_t>(b) * Hkv * G + kvh * G + g) * HD;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      unpack8(*reinterpret_cast<const uint4*>(qh + (lane + LANES * c) * 8), &qf[g][8 * c]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qf[g][8 * c + i] *= scale_log2;
    }
  }
  float m[G], l[G], acc[G][16];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[g][i] = 0.f;
  }

  for (int t = 0; t < n_tiles; ++t) {
    const int s = t % NS;
    mbar_wait(&bars[s], (t / NS) & 1);
    if (mode == 2) {
      __syncthreads();
      if (tid == 0 && t + NS < n_tiles) issue(t + NS);
      continue;
    }
    const __nv_bfloat16* Ks = reinterpret_cast<const __nv_bfloat16*>(ring + s * STAGE_BYTES);
    const __nv_bfloat16* Vs = Ks + TN * HD;
    float sc[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = u * WORKERS + worker;
      float kf[16];
      unpack8(*reinterpret_cast<const uint4*>(Ks + key * HD + lane * 8), kf);
      unpack8(*reinterpret_cast<const uint4*>(Ks + key * HD + (lane + LANES) * 8), kf + 8);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) d = fmaf(qf[g][i], kf[i], d);
        sc[u][g] = d;
      }
    }
#pragma unroll
    for (int off = 1; off < LANES; off *= 2)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int g = 0; g < G; ++g) sc[u][g] += __shfl_xor_sync(0xffffffffu, sc[u][g], off);
    float alpha[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mn = fmaxf(mn, sc[u][g]);
      alpha[g] = exp2f(m[g] - mn);
      m[g] = mn;
      float ps = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        sc[u][g] = exp2f(sc[u][g] - mn);
        ps += sc[u][g];
      }
      l[g] = l[g] * alpha[g] + ps;
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[g][i] *= alpha[g];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = u * WORKERS + worker;
      float vf[16];
      unpack8(*reinterpret_cast<const uint4*>(Vs + key * HD + lane * 8), vf);
      unpack8(*reinterpret_cast<const uint4*>(Vs + key * HD + (lane + LANES) * 8), vf + 8);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[g][i] = fmaf(sc[u][g], vf[i], acc[g][i]);
    }
    __syncthreads();  // every thread is done with stage s
    if (tid == 0 && t + NS < n_tiles) issue(t + NS);
  }

  // fold the workers into this CTA's partial; the ring is free now (every stage was waited for and read)
  float* w_acc = reinterpret_cast<float*>(ring);  // (WORKERS, G, HD)
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* dst = w_acc + (worker * G + g) * HD;
    *reinterpret_cast<float4*>(dst + lane * 8) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    *reinterpret_cast<float4*>(dst + lane * 8 + 4) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    *reinterpret_cast<float4*>(dst + 64 + lane * 8) = make_float4(acc[g][8], acc[g][9], acc[g][10], acc[g][11]);
    *reinterpret_cast<float4*>(dst + 64 + lane * 8 + 4) =
        make_float4(acc[g][12], acc[g][13], acc[g][14], acc[g][15]);
    if (lane == 0) {
      w_m[worker * G + g] = m[g];
      w_l[worker * G + g] = l[g];
    }
  }
  __syncthreads();
  for (int o = tid; o < G * HD; o += THREADS) {
    const int g = o / HD, d = o % HD;
    float mx = -INFINITY;
#pragma unroll 8
    for (int w = 0; w < WORKERS; ++w) mx = fmaxf(mx, w_m[w * G + g]);
    float a = 0.f, ls = 0.f;
#pragma unroll 8
    for (int w = 0; w < WORKERS; ++w) {
      const float e = exp2f(w_m[w * G + g] - mx);
      a = fmaf(w_acc[(w * G + g) * HD + d], e, a);
      ls = fmaf(w_l[w * G + g], e, ls);
    }
    cta_acc[o] = a;
    if (d == 0) {
      cta_m[g] = mx;
      cta_l[g] = ls;
    }
  }

  // merge across the cluster: CTA `split` writes outputs [split * per, (split + 1) * per) of the G * HD
  const int per = G * HD / n_split;
  if (mode != 0) {
    __syncthreads();
    if (tid < per) {
      const int o = split * per + tid, g = o / HD;
      out[(static_cast<size_t>(b) * Hkv * G + kvh * G) * HD + o] = __float2bfloat16(cta_acc[o] / cta_l[g]);
    }
    return;
  }
  cluster.sync();  // every CTA's partial is written (release / acquire at cluster scope)
  if (tid < per) {
    const int o = split * per + tid, g = o / HD;
    float ms[16], as[16], lsum[16];
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < 16; ++r) {  // unrolled with a guard, so ms/as/lsum stay in registers
      if (r >= n_split) break;
      const float* rm = cluster.map_shared_rank(cta_m, r);
      const float* rl = cluster.map_shared_rank(cta_l, r);
      const float* ra = cluster.map_shared_rank(cta_acc, r);
      ms[r] = rm[g];
      lsum[r] = rl[g];
      as[r] = ra[o];
      mx = fmaxf(mx, ms[r]);
    }
    float a = 0.f, ls = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      if (r >= n_split) break;
      const float e = exp2f(ms[r] - mx);
      a = fmaf(as[r], e, a);
      ls = fmaf(lsum[r], e, ls);
    }
    out[(static_cast<size_t>(b) * Hkv * G + kvh * G) * HD + o] = __float2bfloat16(a / ls);
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}

template <int NS>
static size_t smem_bytes() {
  return NS * STAGE_BYTES + (G * HD + 2 * G + 2 * WORKERS * G) * sizeof(float) + NS * sizeof(uint64_t) + 16;
}

template <int NS>
static int launch_t(const void* q, const void* k, const void* v, void* out, int B, int Hkv, int S, int n_split,
                    float scale_log2, int pdl, int mode, void* stream, int query_only, int* max_clusters) {
  auto kernel = cluster_decode_attention<NS>;
  const size_t sm = smem_bytes<NS>();
  static bool configured = false;  // once, before any graph capture (the first call is never captured)
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm));
    if (e != cudaSuccess) return e;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(n_split, Hkv, B);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = sm;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = n_split;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attrs;
  cfg.numAttrs = 2;
  if (query_only) return cudaOccupancyMaxActiveClusters(max_clusters, kernel, &cfg);
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
                            static_cast<const __nv_bfloat16*>(v), static_cast<__nv_bfloat16*>(out), S, scale_log2,
                            pdl, mode);
}

// Returns a cudaError_t (0 = success); with query_only, writes cudaOccupancyMaxActiveClusters to *max_clusters.
extern "C" int cluster_attention(const void* q, const void* k, const void* v, void* out, int B, int Hkv, int S,
                                 int n_split, int stages, float scale_log2, int pdl, int mode, void* stream,
                                 int query_only, int* max_clusters) {
  if (n_split < 1 || n_split > 16 || (G * HD) % n_split || S % n_split || (S / n_split) % TN) return 1;
  switch (stages) {
    case 2: return launch_t<2>(q, k, v, out, B, Hkv, S, n_split, scale_log2, pdl, mode, stream, query_only, max_clusters);
    case 4: return launch_t<4>(q, k, v, out, B, Hkv, S, n_split, scale_log2, pdl, mode, stream, query_only, max_clusters);
    case 6: return launch_t<6>(q, k, v, out, B, Hkv, S, n_split, scale_log2, pdl, mode, stream, query_only, max_clusters);
    default: return 1;
  }
}
