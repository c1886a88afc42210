// w8a8's work around fbgemm's matmul, per token row, in one pass each (engine/models/cpu_kernels.py):
// quantizing the activations before it and scaling the int32 sums back after. In Python each is a dozen small
// torch calls that took 2-4x as long as the matmul itself for the few rows of a decode step. The arithmetic is
// exactly that of the Python fallbacks in cpu_kernels.py, operation for operation (no fused multiply-adds:
// built with -ffp-contract=off), so both paths give the same floats.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "w8a8's activations, quantized per row");
  m.def("dequantize_rows", &dequantize_rows, "int32 sums scaled back per row, in place");
}
