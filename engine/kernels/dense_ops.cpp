// The small operations around a decoder layer's GEMMs, fused, on the CPU.
//
// Unfused, RMSNorm is eight torch operators, rotary six, SiLU-and-multiply two, each a pass
// over the rows and a dispatch: at a decode step's few rows, a dozen microseconds each, 20+
// times a layer. Each op here is one pass and one dispatch, and rounds where the torch ops it
// replaces round (to the tensor's dtype after each of them), so that half-precision results
// match those ops except for how the norm's mean and the exp are computed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "vector_math.h"

namespace {

constexpr int64_t kRowsPerTask = 4;

// RMSNorm of one row as transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in float32,
// rounded to T, then times the weight, rounded to T.
template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, int64_t hidden, T* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_f(x[i]);
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    const float normed = round_to<T>(to_f(x[i]) * inv);
    out[i] = from_f<T>(to_f(weight[i]) * normed);
  }
}

template <typename T>
void add_row(const T* a, const T* b, int64_t n, T* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: contiguous (T, hidden) x and (hidden,) weight of its dtype");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const auto* xs = x.data_ptr<scalar_t>();
    const auto* w = weight.data_ptr<scalar_t>();
    auto* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(xs + r * hidden, w, static_cast<float>(eps), hidden, o + r * hidden);
    });
  });
  return out;
}

// h + delta (rounded to T: the residual stream), and its RMSNorm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.is_contiguous() &&
                  delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(),
              "add_rms_norm: h and delta contiguous (T, hidden) of one dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) &&
                  weight.scalar_type() == h.scalar_type(),
              "add_rms_norm: (hidden,) weight of h's dtype");
  auto sum = at::empty_like(h);
  auto out = at::empty_like(h);
  const int64_t rows = h.size(0), hidden = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    const auto* hs = h.data_ptr<scalar_t>();
    const auto* ds = delta.data_ptr<scalar_t>();
    const auto* w = weight.data_ptr<scalar_t>();
    auto* s = sum.data_ptr<scalar_t>();
    auto* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(hs + r * hidden, ds + r * hidden, hidden, s + r * hidden);
        rms_norm_row(s + r * hidden, w, static_cast<float>(eps), hidden, o + r * hidden);
      }
    });
  });
  return {sum, out};
}

template <typename T>
void rotary_head(const T* in, const T* c, const T* s, int64_t half, T* dst) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {  // rotate_half(x) is (-x2, x1)
    const float x1 = to_f(in[i]), x2 = to_f(in[i + half]);
    const float a = round_to<T>(x1 * to_f(c[i]));
    const float b = round_to<T>(-x2 * to_f(s[i]));
    dst[i] = from_f<T>(a + b);
    const float a2 = round_to<T>(x2 * to_f(c[i + half]));
    const float b2 = round_to<T>(x1 * to_f(s[i + half]));
    dst[i + half] = from_f<T>(a2 + b2);
  }
}

// Rotary embedding of heads [0, rotated) of x (T, heads, D; rows may be strided, heads
// adjacent) with per-row cos and sin tables (T, 1, D): x * cos + rotate_half(x) * sin, each
// product and the sum rounded to T as the three torch ops round; heads from `rotated` on
// are copied as they are (a fused projection's values, so that keys and values come out
// side by side, as a KV row lays them out). Returns a contiguous (T, heads, D).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotated) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x (T, heads, D) with heads adjacent and D contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(0 <= rotated && rotated <= heads, "rotary: 0 <= rotated <= heads");
  TORCH_CHECK(dim % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == rows * dim && sin.numel() == rows * dim &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin contiguous (T, 1, D) of x's dtype");
  auto out = at::empty({rows, heads, dim}, x.options());
  const int64_t row_stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const auto* xs = x.data_ptr<T>();
    const auto* cs = cos.data_ptr<T>();
    const auto* ss = sin.data_ptr<T>();
    auto* o = out.data_ptr<T>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = cs + r * dim;
        const T* s = ss + r * dim;
        for (int64_t h = 0; h < rotated; ++h)
          rotary_head(xs + r * row_stride + h * dim, c, s, half, o + (r * heads + h) * dim);
        std::copy_n(xs + r * row_stride + rotated * dim, (heads - rotated) * dim,
                    o + (r * heads + rotated) * dim);
      }
    });
  });
  return out;
}

template <typename T>
void silu_mul_row(const T* gate, int64_t width, float* e, T* out) {
  const T* up = gate + width;
  for (int64_t i = 0; i < width; ++i) e[i] = -to_f(gate[i]);
  exp_in_place(e, width);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float silu = round_to<T>(to_f(gate[i]) / (1.f + e[i]));
    out[i] = from_f<T>(silu * to_f(up[i]));
  }
}

// SiLU(gate) * up over (T, 2I) rows holding gate then up: silu rounded to T, then the
// product rounded to T, as `F.silu(gate) * up` rounds.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: contiguous (T, 2 * intermediate) gate then up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    using T = scalar_t;
    const auto* in = gate_up.data_ptr<T>();
    auto* o = out.data_ptr<T>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> e(width);
      for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * width, width, e.data(), o + r * width);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoflex, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int rotated) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoflex, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary", rotary);
  m.impl("silu_mul", silu_mul);
}
