// Decode attention read in place from one layer's KV pool, on the CPU.
//
// Each sequence has one query token (num_heads x head_dim) and attends over its keys, which
// lie in the pool's rows at the slots its block table names: a row holds the token's keys
// (num_kv_heads x head_dim) then its values. The padded path gathers every key into a
// (B, kv_heads, L, head_dim) copy and calls SDPA; this reads each row once, where it lies,
// so that a decode step moves the KV bytes once instead of three times (read, write the
// copy, read it again).
//
// Work is split over (sequence, kv head) pairs, on torch's intra-op threads: the pair's
// `group` query heads share every row it reads (grouped-query attention). Scores, softmax
// (max, then exp and sum) and the weighted sum of values are in float32, as in SDPA's CPU
// kernel. With AVX-512 and a head_dim of 64, 128 or 256 the pair runs in vector registers
// (`attend_pair_avx512`); otherwise in plain loops the compiler vectorizes (`attend_pair`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

// A row of head_dim values as float32: in place for float, converted into `buf` otherwise.
inline const float* as_float(const float* src, float*, int64_t) { return src; }

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f(src[i]);
  return buf;
}

// Per-thread buffers, reused across the pairs a thread takes.
struct Scratch {
  std::vector<float> q, acc, row, scores, sums;
#if defined(__AVX512F__)
  std::vector<__m512> vec;
#endif
};

// One (sequence, kv head) pair, any head_dim: scores, softmax, weighted sum of values.
template <typename T>
void attend_pair(const T* q_pair, const T* k_rows, const T* v_rows, int64_t row_stride,
                 const int64_t* seq_slots, int64_t n, int64_t group, int64_t head_dim,
                 float scale, Scratch& w, T* out) {
  w.q.resize(group * head_dim);
  w.acc.assign(group * head_dim, 0.f);
  w.row.resize(head_dim);
  w.scores.resize(group * n);
  w.sums.resize(group);
  const float* qg = as_float(q_pair, w.q.data(), group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) w.q[i] = qg[i] * scale;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = as_float(k_rows + seq_slots[t] * row_stride, w.row.data(), head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = w.q.data() + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
      w.scores[g * n + t] = dot;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = w.scores.data() + g * n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    w.sums[g] = sum;
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* v = as_float(v_rows + seq_slots[t] * row_stride, w.row.data(), head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = w.scores[g * n + t];
      float* a = w.acc.data() + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      out[g * head_dim + d] = static_cast<T>(w.acc[g * head_dim + d] / w.sums[g]);
}

#if defined(__AVX512F__)
// The same for head_dim HD known at compile time, in AVX-512 registers: each key and value
// row is loaded (and widened to float32) once for the pair's query heads, and the softmax's
// exp is a vector polynomial.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Softmax numerators of s[0..n) in place (exp(s - max)); returns their sum.
inline float exp_shifted(float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(top);
  for (; t < n; ++t) m = std::max(m, s[t]);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), shift));
    _mm512_mask_storeu_ps(s + t, live, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  return _mm512_reduce_add_ps(sum);
}

template <typename T, int HD>
void attend_pair_avx512(const T* q_pair, const T* k_rows, const T* v_rows, int64_t row_stride,
                        const int64_t* seq_slots, int64_t n, int64_t group, float scale,
                        Scratch& w, T* out) {
  constexpr int V = HD / 16;
  w.vec.resize(2 * group * V);
  __m512* qv = w.vec.data();
  __m512* acc = qv + group * V;
  for (int64_t i = 0; i < group * V; ++i) {
    qv[i] = _mm512_mul_ps(load16(q_pair + i * 16), _mm512_set1_ps(scale));
    acc[i] = _mm512_setzero_ps();
  }
  w.scores.resize(group * n);
  float* scores = w.scores.data();
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_rows + seq_slots[t] * row_stride;
    __m512 kv[V];
    for (int i = 0; i < V; ++i) kv[i] = load16(k + i * 16);
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot = _mm512_mul_ps(qv[g * V], kv[0]);
      for (int i = 1; i < V; ++i) dot = _mm512_fmadd_ps(qv[g * V + i], kv[i], dot);
      scores[g * n + t] = _mm512_reduce_add_ps(dot);
    }
  }
  w.sums.resize(group);
  for (int64_t g = 0; g < group; ++g) w.sums[g] = exp_shifted(scores + g * n, n);
  for (int64_t t = 0; t < n; ++t) {
    const T* v = v_rows + seq_slots[t] * row_stride;
    __m512 vv[V];
    for (int i = 0; i < V; ++i) vv[i] = load16(v + i * 16);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + t]);
      for (int i = 0; i < V; ++i) acc[g * V + i] = _mm512_fmadd_ps(p, vv[i], acc[g * V + i]);
    }
  }
  float row[HD];
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / w.sums[g]);
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(row + i * 16, _mm512_mul_ps(acc[g * V + i], inv));
    for (int d = 0; d < HD; ++d) out[g * HD + d] = static_cast<T>(row[d]);
  }
}
#endif

template <typename T>
void decode_attention(const T* q, const T* pool, int64_t row_stride, const int64_t* slots,
                      const int64_t* kv_lens, int64_t kv_max, T* out, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                      int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
      const int64_t len = kv_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* seq_slots = slots + b * kv_max + first;
      const int64_t heads = (b * num_heads + h * group) * head_dim;  // the pair's, adjacent
      const T* k_rows = pool + h * head_dim;
      const T* v_rows = pool + (num_kv_heads + h) * head_dim;
#if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
        auto attend = head_dim == 64    ? attend_pair_avx512<T, 64>
                      : head_dim == 128 ? attend_pair_avx512<T, 128>
                                        : attend_pair_avx512<T, 256>;
        attend(q + heads, k_rows, v_rows, row_stride, seq_slots, n, group, scale, w, out + heads);
        continue;
      }
#endif
      attend_pair(q + heads, k_rows, v_rows, row_stride, seq_slots, n, group, head_dim, scale, w,
                  out + heads);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                        const at::Tensor& kv_lens, int64_t num_kv_heads, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: contiguous (B, num_heads, head_dim)");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads % num_kv_heads");
  TORCH_CHECK(pool.dim() == 2 && pool.stride(1) == 1 && pool.scalar_type() == q.scalar_type() &&
                  pool.size(1) == 2 * num_kv_heads * head_dim,
              "pool: (slots, 2 * num_kv_heads * head_dim) rows of q's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous() &&
                  kv_lens.numel() == num_seqs && slots.numel() % std::max<int64_t>(num_seqs, 1) == 0,
              "slots: (B * kv_max,) int64; kv_lens: (B,) int64");
  const int64_t kv_max = num_seqs ? slots.numel() / num_seqs : 0;
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "paged_decode: float64 is not supported");
    } else {
      decode_attention<scalar_t>(q.data_ptr<scalar_t>(), pool.data_ptr<scalar_t>(), pool.stride(0),
                                 slots.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), kv_max,
                                 out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads,
                                 head_dim, static_cast<float>(scale), window);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoflex, m) {
  m.def("paged_decode(Tensor q, Tensor pool, Tensor slots, Tensor kv_lens, int num_kv_heads, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoflex, CPU, m) { m.impl("paged_decode", paged_decode); }
