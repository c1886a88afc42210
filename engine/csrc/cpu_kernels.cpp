// The CPU engine's own kernels (engine/cpu_kernels.py), each where torch's calls spent most of their time
// outside the arithmetic for the few rows of a decode step:
// - w8a8's work around fbgemm's matmul, per token row, in one pass each: quantizing the activations before it and
//   scaling the int32 sums back after (a dozen small torch calls each, which took 2-4x the matmul's own time). The
//   arithmetic is exactly that of the Python fallbacks, operation for operation (no fused multiply-adds: built with
//   -ffp-contract=off), so both paths give the same floats.
// - decode attention straight over the paged KV pool: each row's query against its own slots, without gathering
//   K and V into a padded batch first (the gather and SDPA over it were a quarter of a 16-row decode step).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {
constexpr int64_t kRowsPerTask = 16;
constexpr float kLevels = 255.f;  // uint8
constexpr float kMid = 128.f;     // the zero point fbgemm is given
constexpr float kTiny = 1e-12f;   // an all-zero row's scale (engine/quant.py's _TINY)

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor of ", dim, " dimensions");
}
}  // namespace

// x [T, K] -> (q - 128 as float [T, K], scale [T], zero - 128 [T]): each row over its own [min, max] (widened to
// take in 0) in 255 steps, q = clamp(round(x / scale) + zero, 0, 255), zero = round(-min / scale)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  check(x, 2, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = at::empty({rows, cols}, x.options());
  auto scale = at::empty({rows}, x.options());
  auto shifted = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = scale.data_ptr<float>();
  float* zp = shifted.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * cols;
      float low = 0.f, high = 0.f;
      for (int64_t k = 0; k < cols; ++k) {
        low = std::min(low, row[k]);
        high = std::max(high, row[k]);
      }
      const float s = std::max((high - low) / kLevels, kTiny);
      const float zero = std::nearbyint(-low / s);
      float* o = op + t * cols;
      for (int64_t k = 0; k < cols; ++k) {
        const float q = std::nearbyint(row[k] / s) + zero;
        o[k] = std::min(std::max(q, 0.f), kLevels) - kMid;
      }
      sp[t] = s;
      zp[t] = zero - kMid;
    }
  });
  return {out, scale, shifted};
}

// y [T, N] in place: (y - shifted[t] * unit[n]) * scale[t], unit being what one zero-point step adds to output n
at::Tensor dequantize_rows(at::Tensor y, const at::Tensor& scale, const at::Tensor& shifted, const at::Tensor& unit) {
  check(y, 2, "y");
  check(scale, 1, "scale");
  check(shifted, 1, "shifted");
  check(unit, 1, "unit");
  const int64_t rows = y.size(0), cols = y.size(1);
  TORCH_CHECK(scale.size(0) == rows && shifted.size(0) == rows && unit.size(0) == cols, "shapes do not match");
  float* yp = y.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = shifted.data_ptr<float>();
  const float* up = unit.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = yp + t * cols;
      const float s = sp[t], z = zp[t];
      for (int64_t n = 0; n < cols; ++n) {
        const float correction = z * up[n];
        r[n] = (r[n] - correction) * s;
      }
    }
  });
  return y;
}

namespace {
constexpr int64_t kLanes = 16;  // partial sums a dot product keeps apart, so that the compiler can vectorize it

// sum of a[d] * b[d], in kLanes interleaved partial sums added pairwise at the end (a float sum in one chain would
// not vectorize without licence to reorder it)
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[d + l] * b[d + l];
  }
  for (; d < n; ++d) part[d % kLanes] += a[d] * b[d];
  for (int64_t width = kLanes / 2; width >= 1; width /= 2) {  // pairwise, as a tree: no chain of 16 dependent adds
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

// T: q's and the output's dtype; P: the pool's (T, or int8 with a float scale per slot and KV head, k_scale and
// v_scale [slots, KV], each element read as q * scale)
template <typename T, typename P>
void decode_attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                           const at::Tensor& lens, const float* k_scale, const float* v_scale, at::Tensor& out,
                           float scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const int64_t group = heads / kv_heads, width = slots.size(1);
  const int64_t qs_row = q.stride(0), qs_head = q.stride(1);
  const T* qp = q.data_ptr<T>();
  const P* kp = k.data_ptr<P>();
  const P* vp = v.data_ptr<P>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), acc(group * dim), key_f(dim), scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / kv_heads, kvh = i % kv_heads, n = lp[row];
      const int64_t* row_slots = sp + row * width;
      for (int64_t h = 0; h < group; ++h) {
        const T* src = qp + row * qs_row + (kvh * group + h) * qs_head;
        for (int64_t d = 0; d < dim; ++d) query[h * dim + d] = static_cast<float>(src[d]);
      }
      scores.resize(group * n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = row_slots[j] * kv_heads + kvh;
        const P* key = kp + at * dim;
        const float* key_row = key_f.data();
        if constexpr (std::is_same_v<P, float>) {
          key_row = key;
        } else if constexpr (std::is_same_v<P, int8_t>) {
          const float ks = k_scale[at];
          for (int64_t d = 0; d < dim; ++d) key_f[d] = static_cast<float>(key[d]) * ks;
        } else {
          for (int64_t d = 0; d < dim; ++d) key_f[d] = static_cast<float>(key[d]);
        }
        for (int64_t h = 0; h < group; ++h) scores[h * n + j] = dot(query.data() + h * dim, key_row, dim) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> total(group, 0.f);
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - top);
          sum += s[j];
        }
        total[h] = sum;
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = row_slots[j] * kv_heads + kvh;
        const P* value = vp + at * dim;
        const float vs = std::is_same_v<P, int8_t> ? v_scale[at] : 1.f;  // an int8 pool's scale, folded into p
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * n + j] * vs;
          float* a = acc.data() + h * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        T* dst = op + (row * heads + kvh * group + h) * dim;
        const float inv = 1.f / total[h];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[h * dim + d] * inv);
      }
    }
  });
}
}  // namespace

// q [B, H, D] (any row and head strides, D contiguous), k and v [slots, KV, D] the pool, slots [B, W] each row's
// slots (the first lens[b] of them hold its context), lens [B] -> [B, H * D]: softmax(q.k / sqrt(D)) . v per row
// and head, a query head reading KV head h / (H / KV) (grouped-query attention). An int8 pool comes with
// k_scale and v_scale [slots, KV] (float32), and is read as q * scale.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lens, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU tensor [B, H, D]");
  const bool int8_pool = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.sizes() == k.sizes() && v.is_contiguous() &&
                  v.scalar_type() == k.scalar_type() && (int8_pool || k.scalar_type() == q.scalar_type()) &&
                  k.size(2) == q.size(2),
              "k and v must be contiguous pools [slots, KV, D] of q's dtype or int8");
  TORCH_CHECK(int8_pool == (k_scale.has_value() && v_scale.has_value()), "an int8 pool, and only one, has scales");
  if (int8_pool) {
    for (const auto& t : {*k_scale, *v_scale}) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == k.size(0) &&
                      t.size(1) == k.size(1),
                  "an int8 pool's scales must be contiguous float32 [slots, KV]");
    }
  }
  const float* ks = int8_pool ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8_pool ? v_scale->data_ptr<float>() : nullptr;
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.is_contiguous() &&
                  slots.size(0) == q.size(0) && lens.scalar_type() == at::kLong && lens.dim() == 1 &&
                  lens.size(0) == q.size(0),
              "slots [B, W] and lens [B] must be int64");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < lens.size(0); ++row) {  // a plain loop: torch's min / max cost more than the kernel
    TORCH_CHECK(lp[row] >= 1 && lp[row] <= slots.size(1), "each row needs 1..W context slots");
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
  if (q.scalar_type() == at::kFloat && int8_pool) {
    decode_attention_rows<float, int8_t>(q, k, v, slots, lens, ks, vs, out, scale);
  } else if (q.scalar_type() == at::kFloat) {
    decode_attention_rows<float, float>(q, k, v, slots, lens, ks, vs, out, scale);
  } else if (q.scalar_type() == at::kBFloat16 && int8_pool) {
    decode_attention_rows<c10::BFloat16, int8_t>(q, k, v, slots, lens, ks, vs, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_rows<c10::BFloat16, c10::BFloat16>(q, k, v, slots, lens, ks, vs, out, scale);
  } else {
    TORCH_CHECK(false, "decode_attention takes float32 or bfloat16");
  }
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "w8a8's activations, quantized per row");
  m.def("dequantize_rows", &dequantize_rows, "int32 sums scaled back per row, in place");
  m.def("decode_attention", &decode_attention, "one query per row against its slots of the paged KV pool",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("lens"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
}
