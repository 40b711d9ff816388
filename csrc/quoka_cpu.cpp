// QuoKA page scoring and masked top-k on the CPU, keys read in place from vLLM's paged cache.
//
// Twins (tests/test_cpu_native.py compares against them):
//   vllm_sparse_cpu::quoka_score       <-> vllm_sparse.selectors.quoka.score_pages(qbar, page_keys[ids])
//   vllm_sparse_cpu::masked_topk       <-> scores[:, cols] = -inf (or scores[mask] = -inf); torch.topk(scores, k)
//   vllm_sparse_cpu::quoka_score_topk  <-> both, fused (scores never leave the op)
//
// Score of a page = max over the grouped queries q_i and the page's tokens t of
// (q_i . k_t) / ||k_t||. Per page the keys are first converted to a float tile kf[D][NP]
// (channel-major, NP = page size rounded up to 16; vLLM's CPU "vec" packing already stores K
// channel-major, so that is a straight convert), then an outer-product micro-kernel keeps a
// block of queries x 32 tokens in AVX-512 registers (one query element broadcast, one FMA per
// 16 tokens). Pages are spread over threads with at::parallel_for (torch's OpenMP pool).
//
// The AVX-512 code is compiled with a function target attribute and chosen at run time
// (__builtin_cpu_supports), so the library built on one x86-64 machine runs on any other;
// elsewhere a portable C++ loop of the same shape runs (the compiler vectorises it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMinSq = 1e-24f;  // the twin's clamp_min on the squared key norm

struct Page {
  const void* base;  // the page's first key element
  int64_t st;        // element stride between tokens
  int64_t sd;        // element stride between channels
};

// ------------------------------------------------------------------------------------------
// Portable path
// ------------------------------------------------------------------------------------------

template <typename T>
void pack_generic(const Page& pg, int n, int d, int np, float* kf) {
  const T* k = static_cast<const T*>(pg.base);
  for (int c = 0; c < d; ++c) {
    float* row = kf + (int64_t)c * np;
    for (int t = 0; t < n; ++t) row[t] = static_cast<float>(k[t * pg.st + c * pg.sd]);
    for (int t = n; t < np; ++t) row[t] = 0.f;
  }
}

// kf [D][NP] float, q [nq][D] float, scratch: acc/best/nrm of NP floats each.
float score_tile_generic(const float* q, int nq, int d, const float* kf, int n, int np, float* acc, float* best,
                         float* nrm) {
  for (int t = 0; t < np; ++t) {
    best[t] = kNegInf;
    nrm[t] = 0.f;
  }
  for (int c = 0; c < d; ++c) {
    const float* row = kf + (int64_t)c * np;
    for (int t = 0; t < np; ++t) nrm[t] += row[t] * row[t];
  }
  for (int i = 0; i < nq; ++i) {
    for (int t = 0; t < np; ++t) acc[t] = 0.f;
    const float* qi = q + (int64_t)i * d;
    for (int c = 0; c < d; ++c) {
      const float qc = qi[c];
      const float* row = kf + (int64_t)c * np;
      for (int t = 0; t < np; ++t) acc[t] += qc * row[t];
    }
    for (int t = 0; t < np; ++t) best[t] = acc[t] > best[t] ? acc[t] : best[t];
  }
  float s = kNegInf;
  for (int t = 0; t < n; ++t) {
    const float cs = best[t] * (1.f / std::sqrt(nrm[t] > kMinSq ? nrm[t] : kMinSq));
    s = cs > s ? cs : s;
  }
  return s;
}

// ------------------------------------------------------------------------------------------
// AVX-512 path (only static functions inside: no inline template of a header is instantiated
// with the AVX-512 target, so nothing of it can leak into the portable path at link time)
// ------------------------------------------------------------------------------------------

#if VSP_HAVE_AVX512

VSP_AVX512 static inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VSP_AVX512 static inline __m512 load_f32(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
VSP_AVX512 static inline __m512 load_f32(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// Channel-major page (token stride 1): vector converts, 16 tokens at a time, zero padding.
template <typename T>
VSP_AVX512 static void pack_avx512(const Page& pg, int n, int d, int np, float* kf) {
  const T* k = static_cast<const T*>(pg.base);
  for (int c = 0; c < d; ++c) {
    const T* src = k + c * pg.sd;
    float* row = kf + (int64_t)c * np;
    for (int t = 0; t < np; t += 16) {
      const int left = n - t;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
      _mm512_storeu_ps(row + t, load_f32(src + t, m));
    }
  }
}

// QB queries x TV*16 tokens starting at token t0: best[v] = max(best[v], q_i . k).
template <int QB, int TV>
VSP_AVX512 static inline void qblock(const float* q, int d, const float* kf, int np, int t0, __m512* best) {
  __m512 acc[QB][TV];
  for (int i = 0; i < QB; ++i)
    for (int v = 0; v < TV; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* kp = kf + t0;
  for (int c = 0; c < d; ++c, kp += np) {
    __m512 k[TV];
    for (int v = 0; v < TV; ++v) k[v] = _mm512_loadu_ps(kp + 16 * v);
    for (int i = 0; i < QB; ++i) {
      const __m512 qc = _mm512_set1_ps(q[i * d + c]);
      for (int v = 0; v < TV; ++v) acc[i][v] = _mm512_fmadd_ps(qc, k[v], acc[i][v]);
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int v = 0; v < TV; ++v) best[v] = _mm512_max_ps(best[v], acc[i][v]);
}

constexpr int kQB = 12;  // 12 queries x 2 vectors = 24 accumulators of the 32 zmm registers

// The queries in ceil(nq / kQB) blocks of near-equal size (64 = 11+11+11+11+10+10, not 5x12+4).
template <int TV>
VSP_AVX512 static void queries_tile(const float* q, int nq, int d, const float* kf, int np, int t0, __m512* best) {
  const int nb = (nq + kQB - 1) / kQB;
  for (int b = 0, i = 0; b < nb; ++b) {
    const int qb = nq / nb + (b < nq % nb ? 1 : 0);
    const float* qr = q + (int64_t)i * d;
    i += qb;
    switch (qb) {
      case 1: qblock<1, TV>(qr, d, kf, np, t0, best); break;
      case 2: qblock<2, TV>(qr, d, kf, np, t0, best); break;
      case 3: qblock<3, TV>(qr, d, kf, np, t0, best); break;
      case 4: qblock<4, TV>(qr, d, kf, np, t0, best); break;
      case 5: qblock<5, TV>(qr, d, kf, np, t0, best); break;
      case 6: qblock<6, TV>(qr, d, kf, np, t0, best); break;
      case 7: qblock<7, TV>(qr, d, kf, np, t0, best); break;
      case 8: qblock<8, TV>(qr, d, kf, np, t0, best); break;
      case 9: qblock<9, TV>(qr, d, kf, np, t0, best); break;
      case 10: qblock<10, TV>(qr, d, kf, np, t0, best); break;
      case 11: qblock<11, TV>(qr, d, kf, np, t0, best); break;
      default: qblock<kQB, TV>(qr, d, kf, np, t0, best); break;
    }
  }
}

VSP_AVX512 static float score_tile_avx512(const float* q, int nq, int d, const float* kf, int n, int np) {
  __m512 page_best = _mm512_set1_ps(kNegInf);
  for (int t0 = 0; t0 < np;) {
    const int tv = (np - t0) >= 32 ? 2 : 1;
    __m512 best[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
    __m512 nrm[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const float* kp = kf + t0;
    for (int c = 0; c < d; ++c, kp += np)
      for (int v = 0; v < tv; ++v) {
        const __m512 k = _mm512_loadu_ps(kp + 16 * v);
        nrm[v] = _mm512_fmadd_ps(k, k, nrm[v]);
      }
    if (tv == 2)
      queries_tile<2>(q, nq, d, kf, np, t0, best);
    else
      queries_tile<1>(q, nq, d, kf, np, t0, best);
    for (int v = 0; v < tv; ++v, t0 += 16) {
      const int left = n - t0;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
      const __m512 den = _mm512_sqrt_ps(_mm512_max_ps(nrm[v], _mm512_set1_ps(kMinSq)));
      const __m512 cs = _mm512_mul_ps(best[v], _mm512_div_ps(_mm512_set1_ps(1.f), den));
      page_best = _mm512_mask_max_ps(page_best, m, page_best, cs);
    }
  }
  return _mm512_reduce_max_ps(page_best);
}

#endif

// ------------------------------------------------------------------------------------------
// Driver
// ------------------------------------------------------------------------------------------

template <typename T>
void score_pages_impl(const at::Tensor& qbar, const at::Tensor& keys, const at::Tensor& ids, float* out) {
  const int64_t h = qbar.size(0), nq = qbar.size(1), d = qbar.size(2), p = ids.size(1);
  const int64_t n = keys.size(1);
  const int64_t np = (n + 15) / 16 * 16;
  const int64_t sp = keys.stride(0), st = keys.stride(1), sd = keys.stride(2);
  const T* kbase = static_cast<const T*>(keys.const_data_ptr());
  const float* qb = qbar.const_data_ptr<float>();
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  const bool avx = cpu_has_avx512();
  const bool cm = st == 1;  // channel-major (vLLM CPU "vec" packing)
  // ~256K multiply-adds per task at least, so small steps (decode, short contexts) stay serial
  const int64_t per_page = std::max<int64_t>(1, nq * d * n);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / per_page);
  at::parallel_for(0, h * p, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(d * np + 3 * np);
    float* kf = buf.data();
    float* acc = kf + d * np;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t head = job / p;
      const Page pg{kbase + idp[job] * sp, st, sd};
      const float* q = qb + head * nq * d;
#if VSP_HAVE_AVX512
      if (avx) {
        if (cm)
          pack_avx512<T>(pg, (int)n, (int)d, (int)np, kf);
        else
          pack_generic<T>(pg, (int)n, (int)d, (int)np, kf);
        out[job] = score_tile_avx512(q, (int)nq, (int)d, kf, (int)n, (int)np);
        continue;
      }
#endif
      (void)avx;
      (void)cm;
      pack_generic<T>(pg, (int)n, (int)d, (int)np, kf);
      out[job] = score_tile_generic(q, (int)nq, (int)d, kf, (int)n, (int)np, acc, acc + np, acc + 2 * np);
    }
  });
}

void check_inputs(const at::Tensor& qbar, const at::Tensor& keys, const at::Tensor& ids) {
  TORCH_CHECK(qbar.device().is_cpu() && keys.device().is_cpu() && ids.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(qbar.dim() == 3 && qbar.scalar_type() == at::kFloat && qbar.is_contiguous(),
              "qbar: contiguous float32 [Hkv, nq, D] expected");
  TORCH_CHECK(keys.dim() == 3 && keys.size(2) == qbar.size(2), "page_keys: [num_pages, N, D] with qbar's D expected");
  const auto kt = keys.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf, "page_keys: float32, bfloat16 or float16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == qbar.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids: contiguous int64 [Hkv, P] expected");
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  const int64_t num = keys.size(0);
  for (int64_t i = 0, e = ids.numel(); i < e; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < num, "page id ", idp[i], " out of range [0, ", num, ")");
}

void score_into(const at::Tensor& qbar, const at::Tensor& keys, const at::Tensor& ids, float* out) {
  if (ids.numel() == 0) return;
  if (qbar.size(1) == 0) {
    std::fill(out, out + ids.numel(), kNegInf);
    return;
  }
  switch (keys.scalar_type()) {
    case at::kBFloat16: score_pages_impl<c10::BFloat16>(qbar, keys, ids, out); break;
    case at::kHalf: score_pages_impl<c10::Half>(qbar, keys, ids, out); break;
    default: score_pages_impl<float>(qbar, keys, ids, out); break;
  }
}

// What a row may not pick: int64 [F] columns (the same for every row) or a bool [H, P] mask.
struct Excluded {
  const int64_t* cols = nullptr;
  int64_t num_cols = 0;
  const bool* mask = nullptr;  // row-major [H, P]
};

Excluded check_excluded(const at::Tensor& ex, int64_t h, int64_t p, int64_t k) {
  TORCH_CHECK(k >= 0 && k <= p, "k = ", k, " must be in [0, ", p, "]");
  TORCH_CHECK(ex.device().is_cpu() && ex.is_contiguous(), "excluded: contiguous CPU tensor expected");
  Excluded e;
  if (ex.scalar_type() == at::kBool) {
    TORCH_CHECK(ex.dim() == 2 && ex.size(0) == h && ex.size(1) == p, "excluded mask: bool [", h, ", ", p,
                "] expected");
    e.mask = ex.const_data_ptr<bool>();
    return e;
  }
  TORCH_CHECK(ex.dim() == 1 && ex.scalar_type() == at::kLong, "excluded: int64 [F] columns or bool [H, P] mask");
  e.cols = ex.const_data_ptr<int64_t>();
  e.num_cols = ex.numel();
  for (int64_t i = 0; i < e.num_cols; ++i)
    TORCH_CHECK(e.cols[i] >= 0 && e.cols[i] < p, "excluded column ", e.cols[i], " out of range [0, ", p, ")");
  return e;
}

// Row-wise top-k of scores [H][P], excluded entries set to -inf first; best first.
// NaN ranks above everything (like torch.topk); ties go to the lower column.
void masked_topk_into(const float* scores, int64_t h, int64_t p, const Excluded& ex, int64_t k, int64_t* out) {
  at::parallel_for(0, h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(p);
    std::vector<int64_t> idx(p);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = scores + r * p;
      for (int64_t j = 0; j < p; ++j)
        s[j] = std::isnan(row[j]) ? std::numeric_limits<float>::infinity() : row[j];
      for (int64_t f = 0; f < ex.num_cols; ++f) s[ex.cols[f]] = kNegInf;
      if (ex.mask != nullptr)
        for (int64_t j = 0; j < p; ++j)
          if (ex.mask[r * p + j]) s[j] = kNegInf;
      std::iota(idx.begin(), idx.end(), int64_t(0));
      auto before = [&](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      if (k < p) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
      std::sort(idx.begin(), idx.begin() + k, before);
      std::memcpy(out + r * k, idx.data(), sizeof(int64_t) * k);
    }
  });
}

at::Tensor quoka_score(const at::Tensor& qbar, const at::Tensor& page_keys, const at::Tensor& ids) {
  check_inputs(qbar, page_keys, ids);
  at::Tensor out = at::empty({ids.size(0), ids.size(1)}, qbar.options());
  score_into(qbar, page_keys, ids, out.mutable_data_ptr<float>());
  return out;
}

at::Tensor masked_topk(const at::Tensor& scores, const at::Tensor& excluded, int64_t k) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous() &&
                  scores.device().is_cpu(),
              "scores: contiguous float32 [H, P] CPU tensor expected");
  const Excluded ex = check_excluded(excluded, scores.size(0), scores.size(1), k);
  at::Tensor out = at::empty({scores.size(0), k}, scores.options().dtype(at::kLong));
  masked_topk_into(scores.const_data_ptr<float>(), scores.size(0), scores.size(1), ex, k,
                   out.mutable_data_ptr<int64_t>());
  return out;
}

at::Tensor quoka_score_topk(const at::Tensor& qbar, const at::Tensor& page_keys, const at::Tensor& ids,
                            const at::Tensor& excluded, int64_t k) {
  check_inputs(qbar, page_keys, ids);
  const int64_t h = ids.size(0), p = ids.size(1);
  const Excluded ex = check_excluded(excluded, h, p, k);
  std::vector<float> scores(h * p);
  score_into(qbar, page_keys, ids, scores.data());
  at::Tensor out = at::empty({h, k}, ids.options());
  masked_topk_into(scores.data(), h, p, ex, k, out.mutable_data_ptr<int64_t>());
  return out;
}

bool has_avx512() { return cpu_has_avx512(); }

}  // namespace

TORCH_LIBRARY(vllm_sparse_cpu, m) {
  m.def("quoka_score(Tensor qbar, Tensor page_keys, Tensor ids) -> Tensor");
  m.def("masked_topk(Tensor scores, Tensor excluded, int k) -> Tensor");
  m.def("quoka_score_topk(Tensor qbar, Tensor page_keys, Tensor ids, Tensor excluded, int k) -> Tensor");
  m.def("has_avx512() -> bool", has_avx512);
}

TORCH_LIBRARY_IMPL(vllm_sparse_cpu, CPU, m) {
  m.impl("quoka_score", quoka_score);
  m.impl("masked_topk", masked_topk);
  m.impl("quoka_score_topk", quoka_score_topk);
}
