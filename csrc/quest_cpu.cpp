// Quest page upper bounds on the CPU, page summaries read in place from the metadata planes.
//
// Twins (tests/test_cpu_native.py compares against them):
//   vllm_sparse_cpu::quest_bounds <-> vllm_sparse.selectors.quest.page_upper_bounds (one request, S = 1)
//                                     and page_upper_bounds_rows (one decode query per slot, C = 1)
//
// For row (slot s, KV head h), page p (physical block blocks[s, p]) and head g of the GQA group:
//   out[s * Hkv + h, g, p] = max_c sum_d max(q[s,c,h*G+g,d] * kmax[blk,h,d], q[s,c,h*G+g,d] * kmin[blk,h,d])
// computed as q+ . kmax + q- . kmin: a product of length K = 2 * DP (DP = D rounded up to 16)
// between the row's queries [q+ | q-] and the page's [kmax ; kmin], so the whole thing is a GEMM
// with a fused max over the chunk's queries. One job = one row and a tile of up to kPB pages: the
// tile's summaries are converted to float and transposed to channel-major kt[K][kPB] (16x16
// register transposes), then an outer-product micro-kernel keeps a block of queries x 32 pages in
// AVX-512 registers (one query element broadcast, one FMA per 16 pages). Jobs are spread over
// torch's thread pool (at::parallel_for). AVX-512 is chosen at run time (__builtin_cpu_supports);
// elsewhere a portable loop of the same shape runs (skipping the zero half of [q+ | q-]).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kPB = 64;     // pages per job (tile columns)
constexpr int kQChunk = 256;  // queries streamed per pass over the tile (their [q+|q-] stay in L2)

struct Plane {
  const void* base;
  int64_t sb;  // element stride between blocks
  int64_t sh;  // element stride between KV heads (channels are contiguous)
};

struct Job {
  int64_t d, dp, k;    // head size, padded, 2 * padded
  int64_t g, c, nq;    // group size, queries per slot, g * c
  int64_t hkv, p;      // KV heads, pages per slot
};

// ------------------------------------------------------------------------------------------
// Portable path
// ------------------------------------------------------------------------------------------

template <typename T>
void pack_generic(const Plane& hi, const Plane& lo, const int64_t* blk, int np, int64_t head, const Job& jb,
                  float* kt) {
  std::fill(kt, kt + jb.k * kPB, 0.f);
  for (int j = 0; j < np; ++j) {
    const T* a = static_cast<const T*>(hi.base) + blk[j] * hi.sb + head * hi.sh;
    const T* b = static_cast<const T*>(lo.base) + blk[j] * lo.sb + head * lo.sh;
    for (int64_t c = 0; c < jb.d; ++c) {
      kt[c * kPB + j] = static_cast<float>(a[c]);
      kt[(jb.dp + c) * kPB + j] = static_cast<float>(b[c]);
    }
  }
}

// best[G][kPB] = max over the row's queries qq [nq][K] (g-major: i = g * C + c) of qq[i] . kt[:, j]
void bounds_generic(const float* qq, const Job& jb, const float* kt, int np, float* best) {
  float acc[kPB];
  for (int64_t i = 0; i < jb.nq; ++i) {
    std::fill(acc, acc + kPB, 0.f);
    const float* qi = qq + i * jb.k;
    for (int64_t c = 0; c < jb.k; ++c) {
      const float qc = qi[c];
      if (qc == 0.f) continue;  // one of q+ / q- is zero in every channel
      const float* row = kt + c * kPB;
      for (int j = 0; j < kPB; ++j) acc[j] += qc * row[j];
    }
    float* b = best + (i / jb.c) * kPB;
    for (int j = 0; j < np; ++j) b[j] = acc[j] > b[j] ? acc[j] : b[j];
  }
}

// ------------------------------------------------------------------------------------------
// AVX-512 path (static functions only, so nothing compiled for AVX-512 leaks into the portable path)
// ------------------------------------------------------------------------------------------

#if VSP_HAVE_AVX512

VSP_AVX512 static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VSP_AVX512 static inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
VSP_AVX512 static inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// r[i][j] -> r[j][i] for a 16x16 float block.
VSP_AVX512 static inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4q + m], 128-bit lane L: column 4L + m of rows 4q .. 4q + 3
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), w0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
    const __m512 v1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    r[4 + m] = _mm512_shuffle_f32x4(w0, w1, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
  }
}

// One plane of a tile: rows row0 .. row0 + DP of kt get channels 0 .. DP of the tile's pages.
template <typename T>
VSP_AVX512 static void pack_plane_avx512(const Plane& pl, const int64_t* blk, int np, int64_t head, const Job& jb,
                                        float* kt) {
  __m512 r[16];
  for (int j0 = 0; j0 < kPB; j0 += 16) {
    const T* src[16];
    for (int j = 0; j < 16; ++j)
      src[j] = j0 + j < np ? static_cast<const T*>(pl.base) + blk[j0 + j] * pl.sb + head * pl.sh : nullptr;
    for (int64_t c0 = 0; c0 < jb.dp; c0 += 16) {
      const int64_t left = jb.d - c0;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      for (int j = 0; j < 16; ++j) r[j] = src[j] ? load16(src[j] + c0, m) : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (c0 + c) * kPB + j0, r[c]);
    }
  }
}

// QB queries x TV*16 pages from column t0: best[g(i)][t0 ..] = max(best, qq[i] . kt[:, t0 ..]).
template <int QB, int TV>
VSP_AVX512 static inline void qblock(const float* q, int64_t i0, const Job& jb, const float* kt, int t0,
                                    float* best) {
  __m512 acc[QB][TV];
  for (int i = 0; i < QB; ++i)
    for (int v = 0; v < TV; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* kp = kt + t0;
  const int64_t k = jb.k;
  for (int64_t c = 0; c < k; ++c, kp += kPB) {
    __m512 kv[TV];
    for (int v = 0; v < TV; ++v) kv[v] = _mm512_loadu_ps(kp + 16 * v);
    for (int i = 0; i < QB; ++i) {
      const __m512 qc = _mm512_set1_ps(q[i * k + c]);
      for (int v = 0; v < TV; ++v) acc[i][v] = _mm512_fmadd_ps(qc, kv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < QB; ++i) {
    float* b = best + ((i0 + i) / jb.c) * kPB + t0;
    for (int v = 0; v < TV; ++v) _mm512_storeu_ps(b + 16 * v, _mm512_max_ps(_mm512_loadu_ps(b + 16 * v), acc[i][v]));
  }
}

constexpr int kQB = 12;  // 12 queries x 2 vectors = 24 accumulators of the 32 zmm registers

template <int TV>
VSP_AVX512 static void queries_tile(const float* qq, int64_t i0, int64_t n, const Job& jb, const float* kt, int t0,
                                   float* best) {
  const int64_t nb = (n + kQB - 1) / kQB;  // near-equal blocks: 64 = 11+11+11+11+10+10
  for (int64_t b = 0, i = i0; b < nb; ++b) {
    const int qb = (int)(n / nb + (b < n % nb ? 1 : 0));
    const float* q = qq + i * jb.k;
    switch (qb) {
      case 1: qblock<1, TV>(q, i, jb, kt, t0, best); break;
      case 2: qblock<2, TV>(q, i, jb, kt, t0, best); break;
      case 3: qblock<3, TV>(q, i, jb, kt, t0, best); break;
      case 4: qblock<4, TV>(q, i, jb, kt, t0, best); break;
      case 5: qblock<5, TV>(q, i, jb, kt, t0, best); break;
      case 6: qblock<6, TV>(q, i, jb, kt, t0, best); break;
      case 7: qblock<7, TV>(q, i, jb, kt, t0, best); break;
      case 8: qblock<8, TV>(q, i, jb, kt, t0, best); break;
      case 9: qblock<9, TV>(q, i, jb, kt, t0, best); break;
      case 10: qblock<10, TV>(q, i, jb, kt, t0, best); break;
      case 11: qblock<11, TV>(q, i, jb, kt, t0, best); break;
      default: qblock<kQB, TV>(q, i, jb, kt, t0, best); break;
    }
    i += qb;
  }
}

VSP_AVX512 static void bounds_avx512(const float* qq, const Job& jb, const float* kt, int np, float* best) {
  for (int64_t i0 = 0; i0 < jb.nq; i0 += kQChunk) {
    const int64_t n = std::min<int64_t>(kQChunk, jb.nq - i0);
    for (int t0 = 0; t0 < np;) {
      if (np - t0 > 16) {
        queries_tile<2>(qq, i0, n, jb, kt, t0, best);
        t0 += 32;
      } else {
        queries_tile<1>(qq, i0, n, jb, kt, t0, best);
        t0 += 16;
      }
    }
  }
}

#endif

// ------------------------------------------------------------------------------------------
// Driver
// ------------------------------------------------------------------------------------------

template <typename T>
void bounds_impl(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& blocks,
                 float* out) {
  const int64_t s = q.size(0), c = q.size(1), hq = q.size(2), d = q.size(3);
  Job jb;
  jb.hkv = kmin.size(1);
  jb.g = hq / jb.hkv;
  jb.c = c;
  jb.nq = jb.g * c;
  jb.d = d;
  jb.dp = (d + 15) / 16 * 16;
  jb.k = 2 * jb.dp;
  jb.p = blocks.size(1);
  const int64_t rows = s * jb.hkv;

  // [q+ | q-] of every row, zero padded to DP channels each: qq[row][g * C + c][K]
  std::vector<float> qq(rows * jb.nq * jb.k, 0.f);
  const float* qp = q.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, jb.nq * d)), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t sl = row / jb.hkv, h = row % jb.hkv;
      for (int64_t g = 0; g < jb.g; ++g)
        for (int64_t ci = 0; ci < c; ++ci) {
          const float* src = qp + ((sl * c + ci) * hq + h * jb.g + g) * d;
          float* dst = qq.data() + (row * jb.nq + g * c + ci) * jb.k;
          for (int64_t x = 0; x < d; ++x) {
            dst[x] = src[x] > 0.f ? src[x] : 0.f;
            dst[jb.dp + x] = src[x] < 0.f ? src[x] : 0.f;
          }
        }
    }
  });

  const Plane hi{kmax.const_data_ptr(), kmax.stride(0), kmax.stride(1)};
  const Plane lo{kmin.const_data_ptr(), kmin.stride(0), kmin.stride(1)};
  const int64_t* blk = blocks.const_data_ptr<int64_t>();
  const int64_t tiles = (jb.p + kPB - 1) / kPB;
  const bool avx = cpu_has_avx512();
  // ~256K multiply-adds per task at least, so decode steps of short contexts stay serial
  const int64_t per_job = std::max<int64_t>(1, kPB * jb.nq * jb.k);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / per_job);
  at::parallel_for(0, rows * tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(jb.k * kPB + jb.g * kPB);
    float* kt = buf.data();
    float* best = kt + jb.k * kPB;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t row = job / tiles, p0 = (job % tiles) * kPB;
      const int64_t sl = row / jb.hkv, h = row % jb.hkv;
      const int np = (int)std::min<int64_t>(kPB, jb.p - p0);
      const int64_t* jb_blk = blk + sl * jb.p + p0;
      const float* qrow = qq.data() + row * jb.nq * jb.k;
      std::fill(best, best + jb.g * kPB, kNegInf);
#if VSP_HAVE_AVX512
      if (avx) {
        pack_plane_avx512<T>(hi, jb_blk, np, h, jb, kt);
        pack_plane_avx512<T>(lo, jb_blk, np, h, jb, kt + jb.dp * kPB);
        bounds_avx512(qrow, jb, kt, np, best);
      } else
#endif
      {
        (void)avx;
        pack_generic<T>(hi, lo, jb_blk, np, h, jb, kt);
        bounds_generic(qrow, jb, kt, np, best);
      }
      float* o = out + row * jb.g * jb.p + p0;
      for (int64_t g = 0; g < jb.g; ++g) std::copy(best + g * kPB, best + g * kPB + np, o + g * jb.p);
    }
  });
}

at::Tensor quest_bounds(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& blocks) {
  TORCH_CHECK(q.device().is_cpu() && kmin.device().is_cpu() && kmax.device().is_cpu() && blocks.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q: contiguous float32 [S, C, Hq, D] expected");
  TORCH_CHECK(kmin.dim() == 3 && kmax.sizes() == kmin.sizes() && kmin.size(2) == q.size(3),
              "kmin, kmax: [num_blocks, Hkv, D] with q's D expected");
  TORCH_CHECK(kmin.scalar_type() == kmax.scalar_type(), "kmin and kmax: one dtype expected");
  const auto kt = kmin.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf, "kmin, kmax: float32, bfloat16 or float16");
  TORCH_CHECK(kmin.stride(2) == 1 && kmax.stride(2) == 1, "kmin, kmax: contiguous channels expected");
  const int64_t hkv = kmin.size(1);
  TORCH_CHECK(hkv > 0 && q.size(2) % hkv == 0, "q heads (", q.size(2), ") must be a multiple of Hkv (", hkv, ")");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == q.size(0) && blocks.scalar_type() == at::kLong &&
                  blocks.is_contiguous(),
              "blocks: contiguous int64 [S, P] expected");
  const int64_t* bp = blocks.const_data_ptr<int64_t>();
  const int64_t nb = kmin.size(0);
  for (int64_t i = 0, e = blocks.numel(); i < e; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < nb, "block ", bp[i], " out of range [0, ", nb, ")");
  at::Tensor out = at::empty({q.size(0) * hkv, q.size(2) / hkv, blocks.size(1)}, q.options());
  if (out.numel() == 0) return out;
  if (q.size(1) == 0) return out.fill_(kNegInf);
  float* o = out.mutable_data_ptr<float>();
  switch (kt) {
    case at::kBFloat16: bounds_impl<c10::BFloat16>(q, kmin, kmax, blocks, o); break;
    case at::kHalf: bounds_impl<c10::Half>(q, kmin, kmax, blocks, o); break;
    default: bounds_impl<float>(q, kmin, kmax, blocks, o); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_sparse_cpu, m) {
  m.def("quest_bounds(Tensor q, Tensor kmin, Tensor kmax, Tensor blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_sparse_cpu, CPU, m) { m.impl("quest_bounds", quest_bounds); }
