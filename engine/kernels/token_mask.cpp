// A structured-output token mask applied to float32 logits in place, on the CPU.
//
// llguidance writes one bit per token, 32 tokens an int32 word (token 32 w + b is bit b of
// word w); a token whose bit is clear gets a logit of -inf. Words with every bit set (most
// of a row, inside a JSON string) are skipped whole. torch's own ops would expand the bits
// into a (rows, vocab) mask first: three passes over it where this makes one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: float32 (rows, vocab) logits, vocab contiguous");
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.is_contiguous() &&
                  bits.size(0) == logits.size(0) && bits.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask: int32 (rows, ceil(vocab / 32)) bits");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bits.size(1);
  const int64_t stride = logits.stride(0);
  float* out = logits.data_ptr<float>();
  const auto* mask = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + r * stride;
      const uint32_t* row_bits = mask + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = row_bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        for (int64_t b = 0; b < count; ++b)
          if (!((word >> b) & 1u)) row[first + b] = kMinusInf;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoflex, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bits) -> ()");
}

TORCH_LIBRARY_IMPL(nanoflex, CPU, m) { m.impl("apply_token_bitmask", apply_token_bitmask); }
