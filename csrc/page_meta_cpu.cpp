// Quest page summaries written on CPUs in one call: the native twin of the torch writer
// vllm_sparse.metadata.page_minmax.write_page_minmax (its CPU branch).
//
// page_minmax_write(keys, slots, kmin, kmax, kmin8, kmax8, mscale): for every page (block) written
// this step (slots = block * N + offset, negative = padding), the channel-wise min and max of its
// keys at offsets 0 .. the last offset written, per KV head, stored in the metadata planes in place;
// where the INT8 planes are kept (kmin8 defined), their codes rounded outward as
// vllm_sparse.metadata.minmax_int8.encode_minmax_int8 computes them (float64, a float32 scale).
//
// Shapes (strided views are fine, read through their strides):
//   keys  [num_blocks, Hkv, N, D]  the cache's keys (PageLayout.keys), this step's already written
//   slots int64 [T]
//   kmin, kmax [num_blocks, Hkv, D] (the cache dtype); kmin8, kmax8 int8 [num_blocks, Hkv, D];
//   mscale float32 [num_blocks, Hkv]
//
// Per layer and decode step the torch writer makes about twenty small ops (a unique, a scatter,
// a gathered copy of the pages, masks, reductions, the INT8 encode): some 200 us on two cores, where
// this call reads the few pages once.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace {

constexpr double kCodeMax = 127.0;

template <typename K, typename P>
void write_pages(const at::Tensor& keys, const std::vector<std::pair<int64_t, int64_t>>& pages, at::Tensor& kmin,
                 at::Tensor& kmax, const at::Tensor& kmin8, const at::Tensor& kmax8, const at::Tensor& mscale) {
  const int64_t hkv = keys.size(1), d = keys.size(3);
  const K* kp = keys.data_ptr<K>();
  const int64_t kb = keys.stride(0), kh = keys.stride(1), kt = keys.stride(2), kd = keys.stride(3);
  P* lo_p = kmin.data_ptr<P>();
  P* hi_p = kmax.data_ptr<P>();
  const int64_t mb = kmin.stride(0), mh = kmin.stride(1), md = kmin.stride(2);
  const bool codes = kmin8.defined();
  int8_t* lo8 = codes ? kmin8.data_ptr<int8_t>() : nullptr;
  int8_t* hi8 = codes ? kmax8.data_ptr<int8_t>() : nullptr;
  float* sc = codes ? mscale.data_ptr<float>() : nullptr;
  const int64_t cb = codes ? kmin8.stride(0) : 0, ch = codes ? kmin8.stride(1) : 0, cd = codes ? kmin8.stride(2) : 0;
  const int64_t sb = codes ? mscale.stride(0) : 0, sh = codes ? mscale.stride(1) : 0;
  std::vector<double> lo(d), hi(d);
  for (const auto& [block, fill] : pages) {
    for (int64_t h = 0; h < hkv; ++h) {
      const K* base = kp + block * kb + h * kh;
      P* out_lo = lo_p + block * mb + h * mh;
      P* out_hi = hi_p + block * mb + h * mh;
      double absmax = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        float mn = std::numeric_limits<float>::infinity(), mx = -mn;
        for (int64_t t = 0; t < fill; ++t) {
          const float v = static_cast<float>(base[t * kt + c * kd]);
          mn = std::min(mn, v);
          mx = std::max(mx, v);
        }
        // the planes hold the cache dtype; the codes are made from the stored values
        const P smn = static_cast<P>(static_cast<K>(mn)), smx = static_cast<P>(static_cast<K>(mx));
        out_lo[c * md] = smn;
        out_hi[c * md] = smx;
        lo[c] = static_cast<double>(static_cast<float>(smn));
        hi[c] = static_cast<double>(static_cast<float>(smx));
        absmax = std::max({absmax, std::abs(lo[c]), std::abs(hi[c])});
      }
      if (!codes) continue;
      float scale = absmax > 0 ? static_cast<float>(absmax / kCodeMax) : 1.0f;
      if (static_cast<double>(scale) * kCodeMax < absmax)  // rounded down to float32: one step up
        scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
      const double s = scale;
      int8_t* out_lo8 = lo8 + block * cb + h * ch;
      int8_t* out_hi8 = hi8 + block * cb + h * ch;
      for (int64_t c = 0; c < d; ++c) {
        out_lo8[c * cd] = static_cast<int8_t>(std::clamp(std::floor(lo[c] / s), -kCodeMax, kCodeMax));
        out_hi8[c * cd] = static_cast<int8_t>(std::clamp(std::ceil(hi[c] / s), -kCodeMax, kCodeMax));
      }
      sc[block * sb + h * sh] = scale;
    }
  }
}

void page_minmax_write(const at::Tensor& keys, const at::Tensor& slots, at::Tensor kmin, at::Tensor kmax,
                       const c10::optional<at::Tensor>& kmin8, const c10::optional<at::Tensor>& kmax8,
                       const c10::optional<at::Tensor>& mscale) {
  TORCH_CHECK(keys.dim() == 4 && kmin.dim() == 3 && kmax.dim() == 3, "page_minmax_write: keys [B, H, N, D], planes [B, H, D]");
  TORCH_CHECK(kmin.strides() == kmax.strides() && kmin.scalar_type() == kmax.scalar_type(), "page_minmax_write: kmin/kmax differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "page_minmax_write: slots int64, contiguous");
  const bool codes = kmin8.has_value() && kmin8->defined();
  if (codes) {
    TORCH_CHECK(kmax8.has_value() && mscale.has_value(), "page_minmax_write: INT8 planes come together");
    TORCH_CHECK(kmin8->scalar_type() == at::kChar && kmax8->scalar_type() == at::kChar && kmin8->strides() == kmax8->strides(),
                "page_minmax_write: int8 codes");
    TORCH_CHECK(mscale->scalar_type() == at::kFloat, "page_minmax_write: float32 scales");
  }
  // each written page once, with its last written offset (a prefill chunk writes many slots of a page)
  const int64_t n = keys.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> pages;  // (block, fill)
  std::unordered_map<int64_t, size_t> where;
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (sp[i] < 0) continue;
    const int64_t block = sp[i] / n, fill = sp[i] % n + 1;
    auto [it, fresh] = where.try_emplace(block, pages.size());
    if (fresh)
      pages.emplace_back(block, fill);
    else
      pages[it->second].second = std::max(pages[it->second].second, fill);
  }
  if (pages.empty()) return;
  const at::Tensor none;
  const at::Tensor& c8lo = codes ? *kmin8 : none;
  const at::Tensor& c8hi = codes ? *kmax8 : none;
  const at::Tensor& c8s = codes ? *mscale : none;
  TORCH_CHECK(keys.scalar_type() == kmin.scalar_type(), "page_minmax_write: planes in the cache dtype");
  switch (keys.scalar_type()) {
    case at::kBFloat16:
      write_pages<c10::BFloat16, c10::BFloat16>(keys, pages, kmin, kmax, c8lo, c8hi, c8s);
      break;
    case at::kHalf:
      write_pages<c10::Half, c10::Half>(keys, pages, kmin, kmax, c8lo, c8hi, c8s);
      break;
    case at::kFloat:
      write_pages<float, float>(keys, pages, kmin, kmax, c8lo, c8hi, c8s);
      break;
    default:
      TORCH_CHECK(false, "page_minmax_write: unsupported dtype ", keys.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_sparse_cpu, m) {
  m.def("page_minmax_write(Tensor keys, Tensor slots, Tensor(a!) kmin, Tensor(b!) kmax, Tensor(c!)? kmin8, "
        "Tensor(d!)? kmax8, Tensor(e!)? mscale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_sparse_cpu, CPU, m) { m.impl("page_minmax_write", page_minmax_write); }
