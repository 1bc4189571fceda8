// gpt-oss's attention sinks, shared by the decode and prefill kernels: each query head's
// softmax has one more column, its sink logit, with no value, so the keys' probabilities sum
// to less than one.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

// What query head `head`'s sink adds to the sum of its probabilities, e^(sink - top), taken
// against the running maximum `top` its sum was taken against (0 without sinks). A sink far
// above every score makes it inf, and the output 0: the limit the exact softmax approaches.
inline float sink_weight(const float* sinks, int64_t head, float top) {
  return sinks == nullptr ? 0.f : std::exp(sinks[head] - top);
}

// The sinks a kernel takes: none, or (num_heads,) float32, contiguous, on the CPU.
inline void check_sinks(const std::optional<at::Tensor>& sinks, int64_t num_heads) {
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->numel() == num_heads && sinks->device().is_cpu()),
              "sinks: (num_heads,) float32 on the CPU");
}
