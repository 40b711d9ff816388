// Kascade anchor scoring on the CPU: the pooled post-softmax mass of every past page, keys read in place.
//
// Twin (tests/test_cpu_native.py compares against it):
//   vllm_sparse_cpu::anchor_page_mass <-> vllm_sparse.kernels.anchor_mass.anchor_page_mass
//
// One work item is a (KV head, scored tile): its rows are the tile's queries times the G query heads of the KV
// head, scaled by scale * log2(e) once, so that every exponential is a base-2 one. One pass walks the pages
// the tile sees (keys below the tile's first position): each page's keys are converted to a float tile
// kf[D][NP] (channel-major, NP = page size rounded up to 16), an outer-product block of kRB rows x 16 tokens
// gives the scores, and per row and page the kernel keeps the page's max m[r, p] and sum_t 2^(s - m[r, p]),
// while a running log-sum-exp per row grows page by page. At the end the mass of page p is
// mean_r sum_t 2^(s - m[r, p]) * 2^(m[r, p] - M_r) / L_r, which is the page's softmax weight (the scores are
// never stored beyond one page). Items run in parallel (at::parallel_for); the chunk's score of a page is the
// largest over its scored tiles.
//
// The AVX-512 build of the same loops is picked at run time (cpu_features.h); elsewhere the portable build runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRB = 8;  // rows per register block: 8 x 16 tokens = 8 accumulators

#define VSP_INLINE inline __attribute__((always_inline))

// 2^x for x <= 0, branch-free so that loops over it vectorise (x below -126 gives 2^-126, ~1e-38: nothing
// next to the 1 that every row's largest page contributes). Cephes' exp2f polynomial on [-0.5, 0.5].
static VSP_INLINE float exp2_neg(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  x = x < -126.f ? -126.f : x;
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

static VSP_INLINE float to_float(float x) { return x; }
static VSP_INLINE float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
static VSP_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }

struct Keys {
  const void* base;
  int64_t sp, st, sd;  // element strides: page, token, channel
};

struct Item {
  const float* q;       // [m_pad, D] rows, pre-scaled by scale * log2(e) (rows past m are zero)
  int m, m_pad;         // rows (tile queries x G) and rows rounded up to kRB
  int64_t visible;      // keys the rows attend: positions [0, visible)
  const int64_t* ids;   // physical page id of each logical page
};

// The scratch of one thread: sized for the largest item.
struct Scratch {
  std::vector<float> kf, s, pm, ps, rm, rl;
  Scratch(int d, int np, int m_pad, int64_t past)
      : kf((size_t)d * np), s((size_t)kRB * np), pm((size_t)m_pad * past), ps((size_t)m_pad * past),
        rm(m_pad), rl(m_pad) {}
};


// ---- per page: scores of a block of kRB rows, then each row's max and sum of 2^(s - max) ----

// kf[c * np + t] = key t's channel c as float (t < cnt), 0 for the padding tokens up to np.
template <typename T>
static VSP_INLINE void pack_portable(const T* kp, int64_t st, int64_t sd, int cnt, int d, int np, float* kf) {
  for (int c = 0; c < d; ++c) {
    float* row = kf + (int64_t)c * np;
    for (int t = 0; t < cnt; ++t) row[t] = to_float(kp[t * st + c * sd]);
    for (int t = cnt; t < np; ++t) row[t] = 0.f;
  }
}

struct Portable {
  template <typename T>
  static VSP_INLINE void pack(const T* kp, int64_t st, int64_t sd, int cnt, int d, int np, float* kf) {
    pack_portable(kp, st, sd, cnt, d, np, kf);
  }
  // s[i * np + t] = q_i . k_t for the kRB rows of q ([kRB, D]) and the np tokens of kf ([D][np]).
  static VSP_INLINE void block_scores(const float* q, int d, const float* kf, int np, float* s) {
    for (int t0 = 0; t0 < np; t0 += 16) {
      float acc[kRB][16] = {};
      const float* kc = kf + t0;
      for (int c = 0; c < d; ++c, kc += np)
        for (int i = 0; i < kRB; ++i) {
          const float qv = q[i * d + c];
          for (int t = 0; t < 16; ++t) acc[i][t] += qv * kc[t];
        }
      for (int i = 0; i < kRB; ++i)
        for (int t = 0; t < 16; ++t) s[i * np + t0 + t] = acc[i][t];
    }
  }
  // max over the first cnt scores of si, and sum of 2^(si[t] - max) over them.
  static VSP_INLINE void row_stats(const float* si, int cnt, int np, float* mx_out, float* sum_out) {
    (void)np;
    float mx = si[0];
    for (int t = 1; t < cnt; ++t) mx = si[t] > mx ? si[t] : mx;
    float sum = 0.f;
    for (int t = 0; t < cnt; ++t) sum += exp2_neg(si[t] - mx);
    *mx_out = mx;
    *sum_out = sum;
  }
};

#if VSP_HAVE_AVX512
VSP_AVX512 static inline __m512 exp2_neg_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

VSP_AVX512 static inline __mmask16 token_mask(int t0, int cnt) {
  const int left = cnt - t0;
  return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

VSP_AVX512 static void block_scores_avx512(const float* q, int d, const float* kf, int np, float* s) {
  for (int t0 = 0; t0 < np; t0 += 16) {
    __m512 acc[kRB];
    for (int i = 0; i < kRB; ++i) acc[i] = _mm512_setzero_ps();
    const float* kc = kf + t0;
    for (int c = 0; c < d; ++c, kc += np) {
      const __m512 k = _mm512_loadu_ps(kc);
      for (int i = 0; i < kRB; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * d + c]), k, acc[i]);
    }
    for (int i = 0; i < kRB; ++i) _mm512_storeu_ps(s + i * np + t0, acc[i]);
  }
}

VSP_AVX512 static void row_stats_avx512(const float* si, int cnt, int np, float* mx_out, float* sum_out) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = neg_inf;
  for (int t0 = 0; t0 < np; t0 += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, token_mask(t0, cnt), si + t0));
  const float top = _mm512_reduce_max_ps(mx);
  const __m512 topv = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int t0 = 0; t0 < np; t0 += 16) {
    const __mmask16 m = token_mask(t0, cnt);
    const __m512 e = exp2_neg_avx512(_mm512_sub_ps(_mm512_mask_loadu_ps(topv, m, si + t0), topv));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  *mx_out = top;
  *sum_out = _mm512_reduce_add_ps(sum);
}

VSP_AVX512 static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VSP_AVX512 static inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
VSP_AVX512 static inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// Channel-major pages (token stride 1, vLLM's CPU packing): vector converts, 16 tokens at a time.
template <typename T>
VSP_AVX512 static void pack_avx512(const T* kp, int64_t st, int64_t sd, int cnt, int d, int np, float* kf) {
  if (st != 1) return pack_portable(kp, st, sd, cnt, d, np, kf);
  for (int c = 0; c < d; ++c) {
    const T* src = kp + c * sd;
    float* row = kf + (int64_t)c * np;
    for (int t = 0; t < np; t += 16) _mm512_storeu_ps(row + t, load16(src + t, token_mask(t, cnt)));
  }
}

struct Avx512 {
  template <typename T>
  static inline void pack(const T* kp, int64_t st, int64_t sd, int cnt, int d, int np, float* kf) {
    pack_avx512<T>(kp, st, sd, cnt, d, np, kf);
  }
  static inline void block_scores(const float* q, int d, const float* kf, int np, float* s) {
    block_scores_avx512(q, d, kf, np, s);
  }
  static inline void row_stats(const float* si, int cnt, int np, float* mx, float* sum) {
    row_stats_avx512(si, cnt, np, mx, sum);
  }
};
#endif

// One item's mass per past page into out[past].
template <typename T, typename K>
static VSP_INLINE void item_mass(const Item& it, const Keys& keys, int n, int d, int np, int64_t past, Scratch& sc,
                                 float* out) {
  float* kf = sc.kf.data();
  float* s = sc.s.data();
  float* pm = sc.pm.data();
  float* ps = sc.ps.data();
  float* rm = sc.rm.data();
  float* rl = sc.rl.data();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < it.m_pad; ++r) {
    rm[r] = neg_inf;
    rl[r] = 0.f;
  }
  const T* kbase = static_cast<const T*>(keys.base);
  const int64_t pages = (it.visible + n - 1) / n;
  for (int64_t p = 0; p < pages; ++p) {
    const int cnt = static_cast<int>(std::min<int64_t>(n, it.visible - p * n));
    const T* kp = kbase + it.ids[p] * keys.sp;
    K::pack(kp, keys.st, keys.sd, cnt, d, np, kf);
    for (int r0 = 0; r0 < it.m; r0 += kRB) {
      K::block_scores(it.q + (int64_t)r0 * d, d, kf, np, s);
      const int rb = std::min(kRB, it.m - r0);
      for (int i = 0; i < rb; ++i) {
        float mx, sum;
        K::row_stats(s + i * np, cnt, np, &mx, &sum);
        const int r = r0 + i;
        if (p < past) {
          pm[(int64_t)r * past + p] = mx;
          ps[(int64_t)r * past + p] = sum;
        }
        if (mx > rm[r]) {  // the row's log-sum-exp, base 2, grown page by page
          rl[r] = rl[r] * exp2_neg(rm[r] - mx) + sum;
          rm[r] = mx;
        } else {
          rl[r] += sum * exp2_neg(mx - rm[r]);
        }
      }
    }
  }
  for (int64_t p = 0; p < past; ++p) out[p] = 0.f;
  for (int r = 0; r < it.m; ++r) {
    const float inv = 1.f / (rl[r] * static_cast<float>(it.m));
    const float top = rm[r];
    const float* pmr = pm + (int64_t)r * past;
    const float* psr = ps + (int64_t)r * past;
    for (int64_t p = 0; p < past; ++p) out[p] += psr[p] * exp2_neg(pmr[p] - top) * inv;
  }
}

template <typename T>
static void item_generic(const Item& it, const Keys& k, int n, int d, int np, int64_t past, Scratch& sc, float* out) {
  item_mass<T, Portable>(it, k, n, d, np, past, sc, out);
}

#if VSP_HAVE_AVX512
// The same loops compiled for AVX-512 (the always-inline body takes this function's target).
VSP_AVX512 static void item_avx512_f32(const Item& it, const Keys& k, int n, int d, int np, int64_t past, Scratch& sc,
                                       float* out) {
  item_mass<float, Avx512>(it, k, n, d, np, past, sc, out);
}
VSP_AVX512 static void item_avx512_bf16(const Item& it, const Keys& k, int n, int d, int np, int64_t past,
                                        Scratch& sc, float* out) {
  item_mass<c10::BFloat16, Avx512>(it, k, n, d, np, past, sc, out);
}
VSP_AVX512 static void item_avx512_f16(const Item& it, const Keys& k, int n, int d, int np, int64_t past, Scratch& sc,
                                       float* out) {
  item_mass<c10::Half, Avx512>(it, k, n, d, np, past, sc, out);
}
#endif

template <typename T>
static void run_item(bool avx, const Item& it, const Keys& k, int n, int d, int np, int64_t past, Scratch& sc,
                     float* out) {
#if VSP_HAVE_AVX512
  if (avx) {
    if constexpr (std::is_same_v<T, float>) return item_avx512_f32(it, k, n, d, np, past, sc, out);
    if constexpr (std::is_same_v<T, c10::BFloat16>) return item_avx512_bf16(it, k, n, d, np, past, sc, out);
    if constexpr (std::is_same_v<T, c10::Half>) return item_avx512_f16(it, k, n, d, np, past, sc, out);
  }
#endif
  (void)avx;
  item_generic<T>(it, k, n, d, np, past, sc, out);
}

// q [C, Hq, D] float32 contiguous, page_keys [num_pages, N, D], page_ids int64 [Hkv, P] -> float32 [Hkv, past].
at::Tensor anchor_page_mass(const at::Tensor& q, const at::Tensor& page_keys, const at::Tensor& page_ids,
                            int64_t context_len, double scale, int64_t tile, int64_t stride) {
  TORCH_CHECK(q.device().is_cpu() && page_keys.device().is_cpu() && page_ids.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q: contiguous float32 [C, Hq, D] expected");
  TORCH_CHECK(page_keys.dim() == 3 && page_keys.size(2) == q.size(2), "page_keys: [num_pages, N, D] with q's D expected");
  const auto kt = page_keys.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf, "page_keys: float32, bfloat16 or float16");
  TORCH_CHECK(page_ids.dim() == 2 && page_ids.scalar_type() == at::kLong && page_ids.is_contiguous(),
              "page_ids: contiguous int64 [Hkv, P] expected");
  TORCH_CHECK(tile > 0 && stride > 0 && context_len >= 0, "tile and stride must be positive, context_len >= 0");
  const int64_t c = q.size(0), hq = q.size(1), d = q.size(2), hkv = page_ids.size(0);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads ", hq, " not a multiple of KV heads ", hkv);
  const int64_t g = hq / hkv, n = page_keys.size(1);
  const int64_t past = context_len / n;
  auto out = at::zeros({hkv, past}, q.options());
  if (past == 0 || c == 0) return out;
  const int64_t needed = (context_len + c - 1 + n - 1) / n;  // pages the last tile's keys lie in
  TORCH_CHECK(page_ids.size(1) >= needed, "page_ids: ", needed, " pages per KV head needed, got ", page_ids.size(1));
  const int64_t* idp = page_ids.const_data_ptr<int64_t>();
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t p = 0; p < needed; ++p) {
      const int64_t id = idp[h * page_ids.size(1) + p];
      TORCH_CHECK(id >= 0 && id < page_keys.size(0), "page id ", id, " out of range [0, ", page_keys.size(0), ")");
    }

  std::vector<int64_t> tiles;  // the last tile and every stride-th before it (anchor_mass.scored_tiles)
  for (int64_t t = (c + tile - 1) / tile - 1; t >= 0; t -= stride) tiles.push_back(t);
  const int64_t nt = static_cast<int64_t>(tiles.size());
  const int m_max = static_cast<int>(std::min(tile, c) * g);
  const int m_pad_max = (m_max + kRB - 1) / kRB * kRB;
  const int np = static_cast<int>((n + 15) / 16 * 16);

  // rows of every item: [hkv * nt, m_pad_max, D], pre-scaled, zero past each item's rows
  std::vector<float> rows((size_t)hkv * nt * m_pad_max * d, 0.f);
  const float* qp = q.const_data_ptr<float>();
  const float qs = static_cast<float>(scale) * kLog2e;
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t t0 = tiles[j] * tile, t1 = std::min(c, t0 + tile);
      float* dst = rows.data() + ((h * nt + j) * m_pad_max) * d;
      for (int64_t i = t0; i < t1; ++i)
        for (int64_t k = 0; k < g; ++k) {
          const float* src = qp + (i * hq + h * g + k) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = src[e] * qs;
          dst += d;
        }
    }

  std::vector<float> per_item((size_t)hkv * nt * past);
  const Keys keys{page_keys.const_data_ptr(), page_keys.stride(0), page_keys.stride(1), page_keys.stride(2)};
  const bool avx = cpu_has_avx512();
  at::parallel_for(0, hkv * nt, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(static_cast<int>(d), np, m_pad_max, past);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / nt, j = job % nt;
      const int64_t t0 = tiles[j] * tile;
      const int m = static_cast<int>((std::min(c, t0 + tile) - t0) * g);
      const Item it{rows.data() + job * m_pad_max * d, m, (m + kRB - 1) / kRB * kRB, context_len + t0,
                    idp + h * page_ids.size(1)};
      float* dst = per_item.data() + job * past;
      switch (kt) {
        case at::kBFloat16:
          run_item<c10::BFloat16>(avx, it, keys, (int)n, (int)d, np, past, sc, dst);
          break;
        case at::kHalf:
          run_item<c10::Half>(avx, it, keys, (int)n, (int)d, np, past, sc, dst);
          break;
        default:
          run_item<float>(avx, it, keys, (int)n, (int)d, np, past, sc, dst);
          break;
      }
    }
  });
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t j = 0; j < nt; ++j) {
      const float* src = per_item.data() + (h * nt + j) * past;
      for (int64_t p = 0; p < past; ++p) o[h * past + p] = std::max(o[h * past + p], src[p]);
    }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_sparse_cpu, m) {
  m.def(
      "anchor_page_mass(Tensor q, Tensor page_keys, Tensor page_ids, int context_len, float scale, int tile, "
      "int stride) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_sparse_cpu, CPU, m) { m.impl("anchor_page_mass", anchor_page_mass); }
