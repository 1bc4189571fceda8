// Decode attention read in place from one layer's KV pool, on the CPU.
//
// Each sequence has one query token (num_heads x head_dim) and attends over its keys, which
// lie in the pool's rows at the slots its block table names: a row holds the token's keys
// (num_kv_heads x head_dim) then its values. The padded path gathers every key into a
// (B, kv_heads, L, head_dim) copy and calls SDPA; this reads each row once, where it lies,
// so that a decode step moves the KV bytes once instead of three times (read, write the
// copy, read it again).
//
// Work is split over sequences, on torch's intra-op threads, longest first. Scores, softmax
// and the weighted sum of values are in float32, as in SDPA's CPU kernel. With AVX-512 and a
// head_dim of 64, 128 or 256 a sequence runs in vector registers in one pass over its rows
// (`attend_seq_avx512`); otherwise each kv head's query heads (grouped-query attention) in
// plain loops the compiler vectorizes (`attend_pair`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <type_traits>
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

// Per-thread buffers, reused across the sequences a thread takes.
struct Scratch {
  std::vector<float> q, acc, row, scores, sums, top;
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
// A whole sequence (every kv head) for head_dim HD known at compile time, in AVX-512
// registers, in one pass over its rows, 16 at a time: each row (all heads' keys, then
// values) is read once, in order, while it is in the cache. The softmax is online (a
// running max and sum per query head, the accumulators rescaled when the max grows), as
// in flash attention. Scores: each key's products with a query head are summed across
// lanes for 16 keys at once (`sum_lanes16`, a transpose as it adds) rather than one
// horizontal sum per key; with AVX512-BF16 a bfloat16 key is multiplied as it lies
// (`dpbf16`: pairwise products, exact, summed in float32), otherwise the block's keys are
// widened to float32 once for the group's query heads. Values are summed into each query
// head's accumulators, which stay in registers across the block: with AVX512-BF16, two
// bfloat16 rows at once, interleaved once per block and head, weighted by probabilities
// rounded to bfloat16 (as SDPA's CPU kernel rounds them); otherwise widened to float32 once
// per block and head.

// Lane j of the result is the sum of v[j]'s 16 lanes: four rounds, each halving the vectors
// by adding matched halves of two (256-bit, 128-bit, 64-bit, 32-bit), then one permute
// puts the sums in order.
inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]),
                         _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
  const __m512 mixed = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  // Lane 4k + m now holds v[k + 4m]'s sum.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, mixed);
}

// Rows `rows[j] + offset`, j < m (HD values each), as float32 rows of `buf`, HD apart.
template <typename T, int HD>
inline void widen_block(const T* const (&rows)[16], int64_t offset, int m, float* buf) {
  for (int j = 0; j < m; ++j)
    for (int i = 0; i < HD / 16; ++i)
      _mm512_storeu_ps(buf + j * HD + i * 16, load16(rows[j] + offset + i * 16));
}

#if defined(__AVX512BF16__)
constexpr bool kPairwiseBF16 = true;

// Rows 2i and 2i+1 of a block's 16 (HD bfloat16 values each, at `offset`) interleaved, for
// `dpbf16`: out[i * HD/16 + z] holds 16 (row 2i, row 2i+1) pairs. The interleave works
// within 128-bit lanes, so the 16 sums a pair vector feeds are dims in `pair_order`.
template <int HD>
inline void interleave_pairs(const c10::BFloat16* const (&rows)[16], int64_t offset, __m512bh* out) {
  for (int i = 0; i < 8; ++i)
    for (int c = 0; c < HD / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(rows[2 * i] + offset + c * 32);
      const __m512i b = _mm512_loadu_si512(rows[2 * i + 1] + offset + c * 32);
      out[i * (HD / 16) + 2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      out[i * (HD / 16) + 2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
}
#else
constexpr bool kPairwiseBF16 = false;
#endif

// Where dim d's sum lies in accumulators filled from `interleave_pairs`: 32 dims a 512-bit
// chunk c; in 128-bit lane L, unpacklo takes dims 8L..8L+3, unpackhi 8L+4..8L+7.
constexpr int pair_order(int d) {
  const int c = d / 32, r = d % 32, lane = r / 8, within = r % 8;
  return (2 * c + within / 4) * 16 + 4 * lane + within % 4;
}

template <typename T, int HD>
void attend_seq_avx512(const T* q, const T* pool, int64_t row_stride, const int64_t* seq_slots,
                       int64_t n, int64_t kv_heads, int64_t group, float scale, Scratch& w,
                       T* out) {
  constexpr int V = HD / 16;
  constexpr bool pairwise = kPairwiseBF16 && std::is_same_v<T, c10::BFloat16>;
  constexpr bool as_is = std::is_same_v<T, float>;  // rows read in place, not widened
  constexpr int SETS = V >= 8 ? 1 : 2;  // two accumulator sets keep short rows' FMAs in flight
  const int64_t heads = kv_heads * group;
  const int64_t row_bytes = 2 * kv_heads * HD * static_cast<int64_t>(sizeof(T));
  if constexpr (!pairwise) {  // the float32 path multiplies float32 queries
    w.q.resize(heads * HD);
    for (int64_t i = 0; i < heads * V; ++i) _mm512_storeu_ps(w.q.data() + i * 16, load16(q + i * 16));
  }
  w.acc.assign(heads * HD, 0.f);
  w.top.assign(heads, -std::numeric_limits<float>::infinity());
  w.sums.assign(heads, 0.f);
  w.row.resize(2 * 16 * HD);
  float* keys_f = w.row.data();
  float* values_f = keys_f + 16 * HD;
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[16];
#if defined(__AVX512BF16__)
  __m512bh values_pairs[8 * V];  // (bfloat16 path) the block's values, two rows interleaved
#endif
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
    const __mmask16 live = tail_mask(m);
    const T* rows[16];  // past the end: the block's last row again (its score is masked)
    for (int j = 0; j < 16; ++j) rows[j] = pool + seq_slots[t0 + std::min(j, m - 1)] * row_stride;
    // The next block's rows lie on pages of their own: ask for them now, so that the memory
    // system fetches them while this block computes (its prefetchers stop at page edges).
    for (int64_t t = t0 + 16; t < std::min(n, t0 + 32); ++t) {
      const char* row = reinterpret_cast<const char*>(pool + seq_slots[t] * row_stride);
      for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T2);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t k_at = h * HD, v_at = (kv_heads + h) * HD;
      if constexpr (!pairwise && !as_is) widen_block<T, HD>(rows, k_at, 16, keys_f);
#if defined(__AVX512BF16__)
      if constexpr (pairwise) interleave_pairs<HD>(rows, v_at, values_pairs);
#endif
      if constexpr (!pairwise && !as_is) widen_block<T, HD>(rows, v_at, m, values_f);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t qh = h * group + g;
        __m512 part[16];
        if constexpr (pairwise) {
#if defined(__AVX512BF16__)
          __m512bh qv[HD / 32];
          for (int i = 0; i < HD / 32; ++i)
            qv[i] = (__m512bh)_mm512_loadu_si512(q + qh * HD + i * 32);
          for (int j = 0; j < 16; ++j) {
            __m512 dot = _mm512_setzero_ps();
            for (int i = 0; i < HD / 32; ++i)
              dot = _mm512_dpbf16_ps(dot, qv[i], (__m512bh)_mm512_loadu_si512(rows[j] + k_at + i * 32));
            part[j] = dot;
          }
#endif
        } else {
          const float* qf = w.q.data() + qh * HD;
          for (int j = 0; j < 16; ++j) {
            const float* k = as_is ? reinterpret_cast<const float*>(rows[j] + k_at) : keys_f + j * HD;
            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf), _mm512_loadu_ps(k));
            for (int i = 1; i < V; ++i)
              dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i * 16), _mm512_loadu_ps(k + i * 16), dot);
            part[j] = dot;
          }
        }
        const __m512 s = _mm512_mask_mul_ps(minus_inf, live, sum_lanes16(part), scale16);
        const float old = w.top[qh], top = std::max(old, _mm512_reduce_max_ps(s));
        const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(top)));  // 0 in dead lanes
        _mm512_store_ps(p, e);
        const float shrink = std::exp(old - top);  // 0 on the first block, 1 mostly after
        w.top[qh] = top;
        w.sums[qh] = w.sums[qh] * shrink + _mm512_reduce_add_ps(e);
        float* a = w.acc.data() + qh * HD;
        __m512 acc[SETS][V];
        for (int i = 0; i < V; ++i) {
          acc[0][i] = _mm512_mul_ps(_mm512_loadu_ps(a + i * 16), _mm512_set1_ps(shrink));
          if constexpr (SETS == 2) acc[1][i] = _mm512_setzero_ps();
        }
        if constexpr (pairwise) {
#if defined(__AVX512BF16__)
          // Probabilities rounded to bfloat16 (as SDPA's CPU kernel rounds them for its
          // bfloat16 GEMM), two rows' weights a lane; accumulators in pair order.
          alignas(32) uint32_t pp[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(e));
          for (int i = 0; i < (m + 1) / 2; ++i) {
            const __m512bh pi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i]));
            for (int z = 0; z < V; ++z)
              acc[i % SETS][z] = _mm512_dpbf16_ps(acc[i % SETS][z], values_pairs[i * V + z], pi);
          }
#endif
        } else {
          for (int j = 0; j < m; ++j) {
            const float* v = as_is ? reinterpret_cast<const float*>(rows[j] + v_at) : values_f + j * HD;
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int i = 0; i < V; ++i)
              acc[j % SETS][i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + i * 16), acc[j % SETS][i]);
          }
        }
        for (int i = 0; i < V; ++i) {
          __m512 sum = acc[0][i];
          if constexpr (SETS == 2) sum = _mm512_add_ps(sum, acc[1][i]);
          _mm512_storeu_ps(a + i * 16, sum);
        }
      }
    }
  }
  for (int64_t qh = 0; qh < heads; ++qh) {
    const float inv = 1.f / w.sums[qh];
    for (int d = 0; d < HD; ++d)
      out[qh * HD + d] = from_f<T>(w.acc[qh * HD + (pairwise ? pair_order(d) : d)] * inv);
  }
}
#endif

// Every sequence's attention, on torch's intra-op threads. Sequences are taken longest
// first from a shared counter, so that unequal lengths still share the threads evenly.
template <typename T>
void decode_attention(const T* q, int64_t q_stride, const T* pool, int64_t row_stride,
                      const int64_t* slots, const int64_t* kv_lens, int64_t kv_max, T* out,
                      int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                      int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  auto span = [&](int64_t b) {  // (first row, rows) of sequence b
    const int64_t first = window > 0 ? std::max<int64_t>(0, kv_lens[b] - window) : 0;
    return std::pair<int64_t, int64_t>(first, kv_lens[b] - first);
  };
  std::vector<int64_t> order(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return span(x).second > span(y).second; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next++; i < num_seqs; i = next++) {
      const int64_t b = order[i];
      const auto [first, n] = span(b);
      const int64_t* seq_slots = slots + b * kv_max + first;
      const T* q_seq = q + b * q_stride;
      T* out_seq = out + b * num_heads * head_dim;
#if defined(__AVX512F__)
      if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
        auto attend = head_dim == 64    ? attend_seq_avx512<T, 64>
                      : head_dim == 128 ? attend_seq_avx512<T, 128>
                                        : attend_seq_avx512<T, 256>;
        attend(q_seq, pool, row_stride, seq_slots, n, num_kv_heads, group, scale, w, out_seq);
        continue;
      }
#endif
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t heads = h * group * head_dim;  // the kv head's query heads, adjacent
        attend_pair(q_seq + heads, pool + h * head_dim, pool + (num_kv_heads + h) * head_dim,
                    row_stride, seq_slots, n, group, head_dim, scale, w, out_seq + heads);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                        const at::Tensor& kv_lens, int64_t num_kv_heads, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: (B, num_heads, head_dim), heads adjacent (rows may be strided)");
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
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "paged_decode: float64 is not supported");
    } else {
      decode_attention<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), pool.data_ptr<scalar_t>(),
                                 pool.stride(0), slots.data_ptr<int64_t>(),
                                 kv_lens.data_ptr<int64_t>(), kv_max,
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
