// Decode attention read in place from one layer's KV pool, on the CPU.
//
// Each sequence has one query token (num_heads x head_dim) and attends over its keys, which
// lie in the pool's rows at the slots its block table names: a row holds the token's keys
// (num_kv_heads x head_dim) then its values, or, a row of the keys' width alone, keys that
// are the values too (multi-head latent attention's latent, stored once): the values are
// read where the keys are. The padded path gathers every key into a
// (B, kv_heads, L, head_dim) copy and calls SDPA; this reads each row once, where it lies,
// so that a decode step moves the KV bytes once instead of three times (read, write the
// copy, read it again).
//
// Work is split over sequences, on torch's intra-op threads, longest first. Scores, softmax
// and the weighted sum of values are in float32, as in SDPA's CPU kernel. With AVX-512 and a
// head_dim of 64, 128 or 256 a sequence runs in vector registers, 256 keys at a time, each
// read in two passes while it is in the cache: scores, then values (`attend_seq_avx512`);
// otherwise each kv head's query heads (grouped-query attention) in plain loops the compiler
// vectorizes (`attend_pair`). A layer with sinks (gpt-oss) adds each head's e^(sink - max) to
// the sum its output is divided by.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <type_traits>
#include <vector>

#include "attention_sinks.h"
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
  std::vector<float> q, acc, row, scores, sums, top, shrink;
};

// One (sequence, kv head) pair, any head_dim: scores, softmax, weighted sum of values.
template <typename T>
void attend_pair(const T* q_pair, const T* k_rows, const T* v_rows, int64_t row_stride,
                 const int64_t* seq_slots, int64_t n, int64_t group, int64_t head_dim,
                 float scale, const float* sinks, Scratch& w, T* out) {
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
    w.sums[g] = sum + sink_weight(sinks, g, top);
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
// registers, a segment of up to 256 keys at a time, in two passes over the segment's rows:
// 1. Scores of every query head, 16 keys at a time: each key's products with a query head
//    are summed across lanes for 16 keys at once (`sum_lanes16`, a transpose as it adds)
//    rather than one horizontal sum per key; with AVX512-BF16 a bfloat16 key is multiplied
//    as it lies (`dpbf16`: pairwise products, exact, summed in float32). Only the keys'
//    half of each row is read.
// 2. The softmax of the segment's scores, each head's row at once (16 lanes a step, no
//    chain from one block to the next), merged into the running max and sum of the
//    segments before (flash decoding's rescale, once per segment).
// 3. Values, read once for all the query heads of their kv head: the heads' accumulators
//    stay in registers across the segment's keys. With AVX512-BF16, two bfloat16 rows at a
//    time, interleaved, weighted by probabilities rounded to bfloat16 (as SDPA's CPU kernel
//    rounds them for its bfloat16 GEMM); otherwise widened to float32 as they are loaded.
// A segment's rows (256 x 2 x kv_dim values) stay in the core's cache between the passes.
#if defined(__AVX512BF16__)
constexpr bool kPairwiseBF16 = true;
#else
constexpr bool kPairwiseBF16 = false;
#endif

constexpr int64_t kSegment = 256;

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

// Pass 1 for one query head: scores of `m` keys (rows at `rows[t] + k_at`, t < m), scaled,
// into s[0, m); lanes past m in the last 16 hold scores of the last row again.
template <typename T, int HD, bool PAIRWISE>
void head_scores(const T* q, const float* qf, const T* const* rows, int64_t k_at, int64_t m,
                 float scale, float* s) {
  constexpr int V = HD / 16;
  for (int64_t t0 = 0; t0 < m; t0 += 16) {
    __m512 part[16];
    for (int j = 0; j < 16; ++j) {
      const T* k = rows[std::min<int64_t>(t0 + j, m - 1)] + k_at;
      if constexpr (PAIRWISE) {
#if defined(__AVX512BF16__)
        __m512 dot = _mm512_setzero_ps();
        for (int i = 0; i < HD / 32; ++i)
          dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + i * 32),
                                 (__m512bh)_mm512_loadu_si512(k + i * 32));
        part[j] = dot;
#endif
      } else {
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf), load16(k));
        for (int i = 1; i < V; ++i) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i * 16), load16(k + i * 16), dot);
        part[j] = dot;
      }
    }
    _mm512_storeu_ps(s + t0, _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale)));
  }
}

// Pass 2 for GC query heads of one kv head: acc[g] (HD floats each, HD apart) times
// rescale[g], plus the probabilities p[g] (kSegment apart; bfloat16 pairs when PAIRWISE)
// times the values of `m` rows (at `rows[t] + v_at`).
template <typename T, int HD, int GC, bool PAIRWISE>
void head_values(const void* p, const float* rescale, const T* const* rows, int64_t v_at,
                 int64_t m, float* acc_out) {
  constexpr int V = HD / 16;
  __m512 acc[GC][V];
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < V; ++i)
      acc[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc_out + g * HD + i * 16), _mm512_set1_ps(rescale[g]));
  if constexpr (PAIRWISE) {
#if defined(__AVX512BF16__)
    alignas(64) static const uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(order);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const auto* pw = static_cast<const uint32_t*>(p);  // (g, key pair) -> two bfloat16
    for (int64_t jp = 0; jp < (m + 1) / 2; ++jp) {
      const T* a = rows[2 * jp] + v_at;
      const T* b = 2 * jp + 1 < m ? rows[2 * jp + 1] + v_at : nullptr;
      __m512bh vp[V];
      for (int c = 0; c < HD / 32; ++c) {
        const __m512i va = _mm512_loadu_si512(a + c * 32);
        const __m512i vb = b ? _mm512_loadu_si512(b + c * 32) : _mm512_setzero_si512();
        vp[2 * c] = (__m512bh)_mm512_permutex2var_epi16(va, lo, vb);
        vp[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(va, hi, vb);
      }
      for (int g = 0; g < GC; ++g) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[g * (kSegment / 2) + jp]));
        for (int i = 0; i < V; ++i) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], pb, vp[i]);
      }
    }
#endif
  } else {
    const auto* pf = static_cast<const float*>(p);
    for (int64_t t = 0; t < m; ++t) {
      const T* v = rows[t] + v_at;
      __m512 vv[V];
      for (int i = 0; i < V; ++i) vv[i] = load16(v + i * 16);
      for (int g = 0; g < GC; ++g) {
        const __m512 pb = _mm512_set1_ps(pf[g * kSegment + t]);
        for (int i = 0; i < V; ++i) acc[g][i] = _mm512_fmadd_ps(pb, vv[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_out + g * HD + i * 16, acc[g][i]);
}

template <typename T, int HD, bool PAIRWISE, size_t... I>
constexpr auto head_values_table(std::index_sequence<I...>) {
  return std::array{&head_values<T, HD, static_cast<int>(I) + 1, PAIRWISE>...};
}

template <typename T, int HD>
void attend_seq_avx512(const T* q, const T* pool, int64_t row_stride, int64_t v_at,
                       const int64_t* seq_slots, int64_t n, int64_t kv_heads, int64_t group,
                       float scale,
                       const float* sinks, Scratch& w, T* out) {
  constexpr int V = HD / 16;
  constexpr bool pairwise = kPairwiseBF16 && std::is_same_v<T, c10::BFloat16>;
  constexpr int GC = std::max(1, 24 / V);  // query heads whose accumulators fit registers
  static constexpr auto values = head_values_table<T, HD, pairwise>(std::make_index_sequence<GC>());
  const int64_t heads = kv_heads * group;
  if constexpr (!pairwise) {  // the float32 path multiplies float32 queries
    w.q.resize(heads * HD);
    for (int64_t i = 0; i < heads * V; ++i) _mm512_storeu_ps(w.q.data() + i * 16, load16(q + i * 16));
  }
  w.acc.assign(heads * HD, 0.f);
  w.top.assign(heads, -std::numeric_limits<float>::infinity());
  w.sums.assign(heads, 0.f);
  w.shrink.resize(heads);
  w.scores.resize(heads * kSegment);
  w.row.resize(heads * kSegment);  // probabilities: float32, or bfloat16 in the first half
  thread_local std::vector<const T*> rows(kSegment);
  for (int64_t t0 = 0; t0 < n; t0 += kSegment) {
    const int64_t m = std::min(kSegment, n - t0);
    for (int64_t t = 0; t < m; ++t) rows[t] = pool + seq_slots[t0 + t] * row_stride;
    for (int64_t qh = 0; qh < heads; ++qh)
      head_scores<T, HD, pairwise>(q + qh * HD, pairwise ? nullptr : w.q.data() + qh * HD,
                                   rows.data(), (qh / group) * HD, m, scale,
                                   w.scores.data() + qh * kSegment);
    for (int64_t qh = 0; qh < heads; ++qh) {
      float* s = w.scores.data() + qh * kSegment;
      __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < m; t += 16)
        most = _mm512_mask_max_ps(most, tail_mask(m - t), most, _mm512_loadu_ps(s + t));
      const float top = std::max(w.top[qh], _mm512_reduce_max_ps(most));
      __m512 total = _mm512_setzero_ps();
      float* p = w.row.data() + qh * kSegment;
      for (int64_t t = 0; t < m; t += 16) {
        const __m512 e = _mm512_maskz_mov_ps(tail_mask(m - t),
                                             exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top))));
        total = _mm512_add_ps(total, e);
        if constexpr (pairwise) {
#if defined(__AVX512BF16__)
          auto* pb = reinterpret_cast<c10::BFloat16*>(w.row.data()) + qh * kSegment;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), (__m256i)_mm512_cvtneps_pbh(e));
#endif
        } else {
          _mm512_storeu_ps(p + t, e);
        }
      }
      const float shrink = w.top[qh] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(w.top[qh] - top);
      w.sums[qh] = w.sums[qh] * shrink + _mm512_reduce_add_ps(total);
      w.top[qh] = top;
      w.shrink[qh] = shrink;
    }
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += GC) {
        const int64_t gc = std::min<int64_t>(GC, group - g0);
        const int64_t qh = h * group + g0;
        const void* p = pairwise ? static_cast<const void*>(reinterpret_cast<const c10::BFloat16*>(w.row.data()) + qh * kSegment)
                                 : static_cast<const void*>(w.row.data() + qh * kSegment);
        values[gc - 1](p, w.shrink.data() + qh, rows.data(), v_at + h * HD, m,
                       w.acc.data() + qh * HD);
      }
  }
  for (int64_t qh = 0; qh < heads; ++qh) {
    const float inv = 1.f / (w.sums[qh] + sink_weight(sinks, qh, w.top[qh]));
    for (int d = 0; d < HD; ++d) out[qh * HD + d] = from_f<T>(w.acc[qh * HD + d] * inv);
  }
}
#endif

// Every sequence's attention, on torch's intra-op threads. Sequences are taken longest
// first from a shared counter, so that unequal lengths still share the threads evenly.
template <typename T>
void decode_attention(const T* q, int64_t q_stride, const T* pool, int64_t row_stride,
                      int64_t v_at, const int64_t* slots, const int64_t* kv_lens, int64_t kv_max, T* out,
                      int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                      int64_t window, const float* sinks) {
  const int64_t group = num_heads / num_kv_heads;
  auto span = [&](int64_t b) {  // (first row, rows) of sequence b
    // a sliding window keeps the last `window` keys; chunked attention (window < 0) the
    // query's own chunk of -window positions
    const int64_t last = kv_lens[b] - 1;
    const int64_t first = window > 0   ? std::max<int64_t>(0, kv_lens[b] - window)
                          : window < 0 ? last - last % -window
                                       : 0;
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
        attend(q_seq, pool, row_stride, v_at, seq_slots, n, num_kv_heads, group, scale, sinks,
               w, out_seq);
        continue;
      }
#endif
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t heads = h * group * head_dim;  // the kv head's query heads, adjacent
        attend_pair(q_seq + heads, pool + h * head_dim, pool + v_at + h * head_dim,
                    row_stride, seq_slots, n, group, head_dim, scale,
                    sinks == nullptr ? nullptr : sinks + h * group, w, out_seq + heads);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                        const at::Tensor& kv_lens, int64_t num_kv_heads, double scale,
                        int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: (B, num_heads, head_dim), heads adjacent (rows may be strided)");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads % num_kv_heads");
  const int64_t kv_dim = num_kv_heads * head_dim;
  TORCH_CHECK(pool.dim() == 2 && pool.stride(1) == 1 && pool.scalar_type() == q.scalar_type() &&
                  (pool.size(1) == 2 * kv_dim || pool.size(1) == kv_dim),
              "pool: (slots, 2 * num_kv_heads * head_dim) rows of q's dtype, or (slots, "
              "num_kv_heads * head_dim) where the values are the keys");
  const int64_t v_at = pool.size(1) == kv_dim ? 0 : kv_dim;  // where a row's values begin
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous() &&
                  kv_lens.numel() == num_seqs && slots.numel() % std::max<int64_t>(num_seqs, 1) == 0,
              "slots: (B * kv_max,) int64; kv_lens: (B,) int64");
  check_sinks(sinks, num_heads);
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  const int64_t kv_max = num_seqs ? slots.numel() / num_seqs : 0;
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "paged_decode: float64 is not supported");
    } else {
      decode_attention<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), pool.data_ptr<scalar_t>(),
                                 pool.stride(0), v_at, slots.data_ptr<int64_t>(),
                                 kv_lens.data_ptr<int64_t>(), kv_max,
                                 out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads,
                                 head_dim, static_cast<float>(scale), window, sink_ptr);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoflex, m) {
  m.def("paged_decode(Tensor q, Tensor pool, Tensor slots, Tensor kv_lens, int num_kv_heads, "
        "float scale, int window, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoflex, CPU, m) { m.impl("paged_decode", paged_decode); }
