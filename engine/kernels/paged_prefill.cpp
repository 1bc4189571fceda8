// Prefill attention read in place from one layer's KV pool, on the CPU.
//
// Each sequence brings q_len new query tokens after past_len cached ones; query t sees keys
// [0, past_len + t] (the last `window` of them with a sliding window, its own chunk with
// chunked attention; with gpt-oss's sinks, each head's softmax has its sink logit as one more
// column without a value). Its keys and values,
// the new ones already written, lie in the pool's rows at the slots listed for it (a row of
// the keys' width alone holds keys that are the values too, read where the keys are:
// multi-head latent attention's latent, stored once). Torch's
// CPU flash attention runs such a chunk at about a quarter of the GEMM rate on this kind of
// CPU (it multiplies small blocks through a general GEMM call each); this is flash attention
// with its own register-blocked products:
//
// 1. Pack: each (sequence, kv head, tile of 32 keys) is copied once out of the pool into the
//    layout its products read: keys transposed (a key's dims down, 32 keys across, so one
//    vector holds a dim of 32 keys), values row by row; with AVX512-BF16 and bfloat16 rows,
//    as pairs (two dims of a key, or two keys' values of a dim, in 32 bits) for `dpbf16`,
//    which multiplies them exactly and sums in float32.
// 2. Attend: work items are (sequence, kv head, up to 48 query rows): a run of positions
//    times the kv head's query heads (grouped-query attention: they share every key tile).
//    For each key tile the item's scores are one register-blocked product (8 rows x 32 keys
//    of accumulators, a broadcast query value times a vector of 32 keys' dims), masked
//    (causal, window), turned into probabilities with an online softmax (a running max and
//    sum per row, earlier output rescaled when the max grows), and summed into the output
//    rows (6 rows x 64 dims of accumulators, a broadcast probability times a value row).
//    Probabilities are rounded to bfloat16 for the bfloat16 product, as SDPA's CPU kernel
//    rounds them; everything else is float32.
//
// Items are taken by torch's intra-op threads from a shared counter, longest first. Without
// AVX-512, with a head_dim that is not a multiple of 64 up to 256, or with more than 48
// query heads a kv head, each query row runs in plain loops the compiler vectorizes
// (`attend_row`).

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
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_sinks.h"
#include "vector_math.h"

namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// One sequence of the step: its new rows in q and its keys' slots.
struct Seq {
  int64_t q_start, q_len, kv_start, kv_len;
  int64_t past() const { return kv_len - q_len; }
};

// The keys query position p of a sequence sees: [first, last].
struct Span {
  int64_t first, last;
};
// With a sliding window the last `window` of them; with chunked attention (window < 0) those
// of its own chunk of -window positions.
inline Span visible(const Seq& s, int64_t p, int64_t window) {
  const int64_t last = s.past() + p;
  const int64_t first = window > 0   ? std::max<int64_t>(0, last - window + 1)
                        : window < 0 ? last - last % -window
                                     : 0;
  return {first, last};
}

// Plain path: one query row (a position of one query head) over its visible keys, in float32.
template <typename T>
void attend_row(const T* q, const T* pool, int64_t row_stride, const int64_t* slots, Span span,
                int64_t k_at, int64_t v_at, int64_t head_dim, float scale, const float* sink,
                std::vector<float>& buf, T* out) {
  const int64_t n = span.last - span.first + 1;
  buf.resize(n + 2 * head_dim);
  float* scores = buf.data();
  float* qf = scores + n;
  float* acc = qf + head_dim;
  for (int64_t d = 0; d < head_dim; ++d) qf[d] = to_f(q[d]);
  float top = kMinusInf;
  for (int64_t t = 0; t < n; ++t) {
    const T* k = pool + slots[span.first + t] * row_stride + k_at;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += qf[d] * to_f(k[d]);
    scores[t] = dot * scale;
    top = std::max(top, scores[t]);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  std::fill(acc, acc + head_dim, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* v = pool + slots[span.first + t] * row_stride + v_at;
    const float p = scores[t];
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * to_f(v[d]);
  }
  sum += sink_weight(sink, 0, top);
  for (int64_t d = 0; d < head_dim; ++d) out[d] = from_f<T>(acc[d] / sum);
}

#if defined(__AVX512F__)
#ifndef KEYS_A_TILE
#define KEYS_A_TILE 32
#endif
constexpr int KB = KEYS_A_TILE;         // keys a tile
constexpr int NV = KB / 16;    // vectors a row of scores
constexpr int kMaxRows = 48;   // query rows an item
constexpr int kScoreRows = 16 / NV;  // rows a score strip: 16 accumulators
constexpr int kValueRows = 6;  // rows a value strip: 6 x 4 accumulators (64 dims)

#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kPairs = false;
#endif

// A value as the 32 bits a packed float32 tile holds.
template <typename T>
inline uint32_t f32_bits(T x) {
  return __builtin_bit_cast(uint32_t, to_f(x));
}

// Where one (sequence, kv head, key tile) lies packed: keys, then values, each W x KB words.
// W words a key: head_dim float32 values, or head_dim / 2 bfloat16 pairs.
struct Packed {
  std::vector<uint32_t> words;
  int64_t W = 0, num_kv_heads = 0;
  std::vector<int64_t> tile_start;  // per sequence, its first tile's index
  const uint32_t* keys(int64_t b, int64_t h, int64_t t) const {
    return words.data() + ((tile_start[b] + t) * num_kv_heads + h) * 2 * W * KB;
  }
  const uint32_t* values(int64_t b, int64_t h, int64_t t) const { return keys(b, h, t) + W * KB; }
};

// Keys k0.. (n of them) of one kv head, transposed: out[w * KB + j] = word w of key j; zeros
// past n. Values: float32 rows out[j * D + c], or pairs out[(j / 2) * D + c] = (value c of
// key j, of key j + 1); zeros past n.
template <typename T>
void pack_tile(const T* pool, int64_t row_stride, const int64_t* slots, int n, int64_t k_at,
               int64_t v_at, int64_t D, uint32_t* out) {
  constexpr bool pairs = kPairs<T>;
  const int64_t W = pairs ? D / 2 : D;
  uint32_t* keys = out;
  uint32_t* values = out + W * KB;
  for (int j = 0; j < KB; ++j) {
    if (j >= n) {
      for (int64_t w = 0; w < W; ++w) keys[w * KB + j] = 0;
      continue;
    }
    const T* k = pool + slots[j] * row_stride + k_at;
    if constexpr (pairs) {
      const auto* src = reinterpret_cast<const uint32_t*>(k);
      for (int64_t w = 0; w < W; ++w) keys[w * KB + j] = src[w];
    } else {
      for (int64_t w = 0; w < W; ++w) keys[w * KB + j] = f32_bits(k[w]);
    }
  }
  if constexpr (pairs) {
    // (row a, row b) -> 16-bit lanes a0 b0 a1 b1 ...: the first 16 of each, then the rest
    alignas(64) uint16_t order[32];
    for (int i = 0; i < 16; ++i) order[2 * i] = i, order[2 * i + 1] = 32 + i;
    const __m512i lo = _mm512_load_si512(order);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (int j = 0; j < KB; j += 2) {
      const T* a = j < n ? pool + slots[j] * row_stride + v_at : nullptr;
      const T* b = j + 1 < n ? pool + slots[j + 1] * row_stride + v_at : nullptr;
      uint32_t* dst = values + (j / 2) * D;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i va = a ? _mm512_loadu_si512(a + c) : zero;
        const __m512i vb = b ? _mm512_loadu_si512(b + c) : zero;
        _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
  } else {
    for (int j = 0; j < KB; ++j) {
      float* dst = reinterpret_cast<float*>(values) + j * D;
      if (j >= n) {
        std::fill(dst, dst + D, 0.f);
        continue;
      }
      const T* v = pool + slots[j] * row_stride + v_at;
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(dst + c, load16(v + c));
    }
  }
}

// Scores of MR query rows (W words each, `q` rows W apart) against a tile's 32 keys: s[r * KB +
// j] = q_r . k_j, in float32.
template <bool PAIRS, int MR>
void score_strip(const uint32_t* q, int64_t W, const uint32_t* keys, float* s) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NV; ++z) acc[r][z] = _mm512_setzero_ps();
  for (int64_t w = 0; w < W; ++w) {
    __m512i k[NV];
    for (int z = 0; z < NV; ++z) k[z] = _mm512_loadu_si512(keys + w * KB + 16 * z);
    for (int r = 0; r < MR; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[r * W + w]));
      for (int z = 0; z < NV; ++z) {
        if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
          acc[r][z] = _mm512_dpbf16_ps(acc[r][z], (__m512bh)qb, (__m512bh)k[z]);
#endif
        } else {
          acc[r][z] = _mm512_fmadd_ps(_mm512_castsi512_ps(qb), _mm512_castsi512_ps(k[z]), acc[r][z]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NV; ++z) _mm512_storeu_ps(s + r * KB + 16 * z, acc[r][z]);
}

// MR output rows (float32, D apart) times their rescale factors, plus their probabilities
// times the tile's values: 64 dims at a time, in registers across the tile's keys.
// Probabilities: float32 rows KB apart, or bfloat16 pairs (KB / 2 words a row).
template <bool PAIRS, int MR>
void value_strip(const void* p, const float* rescale, int n, const uint32_t* values, int64_t D,
                 float* o) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int z = 0; z < 4; ++z)
        acc[r][z] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + 16 * z),
                                  _mm512_set1_ps(rescale[r]));
    if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
      const auto* pw = static_cast<const uint32_t*>(p);
      for (int jp = 0; jp < (n + 1) / 2; ++jp) {
        __m512bh v[4];
        for (int z = 0; z < 4; ++z)
          v[z] = (__m512bh)_mm512_loadu_si512(values + jp * D + c0 + 16 * z);
        for (int r = 0; r < MR; ++r) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * (KB / 2) + jp]));
          for (int z = 0; z < 4; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], pb, v[z]);
        }
      }
#endif
    } else {
      const auto* pf = static_cast<const float*>(p);
      const auto* vf = reinterpret_cast<const float*>(values);
      for (int j = 0; j < n; ++j) {
        __m512 v[4];
        for (int z = 0; z < 4; ++z) v[z] = _mm512_loadu_ps(vf + j * D + c0 + 16 * z);
        for (int r = 0; r < MR; ++r) {
          const __m512 pb = _mm512_set1_ps(pf[r * KB + j]);
          for (int z = 0; z < 4; ++z) acc[r][z] = _mm512_fmadd_ps(pb, v[z], acc[r][z]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int z = 0; z < 4; ++z) _mm512_storeu_ps(o + r * D + c0 + 16 * z, acc[r][z]);
  }
}

template <bool PAIRS, size_t... I>
constexpr auto score_table(std::index_sequence<I...>) {
  return std::array{&score_strip<PAIRS, static_cast<int>(I) + 1>...};
}
template <bool PAIRS, size_t... I>
constexpr auto value_table(std::index_sequence<I...>) {
  return std::array{&value_strip<PAIRS, static_cast<int>(I) + 1>...};
}

// Per-thread buffers of one item: its query rows as words, scores, probabilities, output.
struct Tiles {
  alignas(64) uint32_t q[kMaxRows * 256];
  alignas(64) float s[kMaxRows * KB];
  alignas(64) float p[kMaxRows * KB];  // float32, or bfloat16 pairs in its first half
  alignas(64) float o[kMaxRows * 256];
  alignas(64) float top[kMaxRows];  // running max of each row's scores
  alignas(64) float next[kMaxRows];  // its max after the current tile
  alignas(64) float rescale[kMaxRows];
  float sum[kMaxRows];
};

// One item: positions [p0, p0 + np) of sequence s, the `group` query heads of kv head h.
// Row r is position p0 + r / group, query head h * group + r % group.
template <typename T>
void attend_item(const T* q, int64_t q_stride, const Packed& packed, const Seq& s, int64_t b,
                 int64_t h, int64_t p0, int64_t np, int64_t group, int64_t D, float scale,
                 int64_t window, const float* sinks, Tiles& w, T* out) {
  constexpr bool pairs = kPairs<T>;
  static constexpr auto scores = score_table<pairs>(std::make_index_sequence<kScoreRows>());
  static constexpr auto values = value_table<pairs>(std::make_index_sequence<kValueRows>());
  const int64_t W = packed.W, rows = np * group;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (s.q_start + p0 + r / group) * q_stride + (h * group + r % group) * D;
    uint32_t* dst = w.q + r * W;
    if constexpr (pairs) {
      std::copy_n(reinterpret_cast<const uint32_t*>(src), W, dst);
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = f32_bits(src[d]);
    }
    std::fill(w.o + r * D, w.o + (r + 1) * D, 0.f);
    w.sum[r] = 0.f;
  }
  std::fill_n(w.top, kMaxRows, kMinusInf);  // rows past `rows` too: they are read 16 at a time
  std::fill_n(w.next, kMaxRows, kMinusInf);
  const int64_t first_tile = visible(s, p0, window).first / KB;
  const int64_t last_tile = visible(s, p0 + np - 1, window).last / KB;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 minus_inf = _mm512_set1_ps(kMinusInf);
  for (int64_t t = first_tile; t <= last_tile; ++t) {
    const int64_t k0 = t * KB;
    const int n = static_cast<int>(std::min<int64_t>(KB, s.kv_len - k0));
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r0));
      scores[mr - 1](w.q + r0 * W, W, packed.keys(b, h, t), w.s + r0 * KB);
    }
    // Scores scaled, and masked where a row may not see a key: only in tiles on the causal
    // diagonal, at the window's edge, or past the sequence's last key.
    const bool whole = n == KB && k0 + KB - 1 <= visible(s, p0, window).last &&
                       k0 >= visible(s, p0 + np - 1, window).first;
    for (int64_t r = 0; r < rows; ++r) {
      __m512 most = minus_inf;
      const Span span = visible(s, p0 + r / group, window);
      for (int z = 0; z < NV; ++z) {
        float* at = w.s + r * KB + 16 * z;
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(at), _mm512_set1_ps(scale));
        if (!whole) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0 + 16 * z)));
          const __mmask16 live =
              _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(span.first))) &
              _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(span.last)));
          x = _mm512_mask_mov_ps(minus_inf, live, x);
        }
        _mm512_storeu_ps(at, x);
        most = _mm512_max_ps(most, x);
      }
      w.next[r] = std::max(w.top[r], _mm512_reduce_max_ps(most));
    }
    // Each row's rescale of its earlier sum and output, 16 rows at a time: exp(old - new max),
    // 0 on its first live tile, 1 while it has seen no key.
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const __m512 next = _mm512_load_ps(w.next + r0);
      const __mmask16 seen = _mm512_cmp_ps_mask(next, minus_inf, _CMP_NEQ_OQ);
      const __m512 shrink = exp16(_mm512_sub_ps(_mm512_load_ps(w.top + r0), next));
      _mm512_store_ps(w.rescale + r0, _mm512_mask_mov_ps(_mm512_set1_ps(1.f), seen, shrink));
      _mm512_store_ps(w.top + r0, next);
    }
    // Probabilities (0 where masked) and running sums.
    for (int64_t r = 0; r < rows; ++r) {
      const float top = w.top[r];
      __m512 e[NV];
      __m512 total = _mm512_setzero_ps();
      for (int z = 0; z < NV; ++z) {
        e[z] = top == kMinusInf ? _mm512_setzero_ps()
                                : exp16(_mm512_sub_ps(_mm512_loadu_ps(w.s + r * KB + 16 * z),
                                                      _mm512_set1_ps(top)));
        total = _mm512_add_ps(total, e[z]);
      }
      w.sum[r] = w.sum[r] * w.rescale[r] + _mm512_reduce_add_ps(total);
      if constexpr (pairs) {
#if defined(__AVX512BF16__)
        auto* dst = reinterpret_cast<__m256i*>(reinterpret_cast<uint32_t*>(w.p) + r * (KB / 2));
        for (int z = 0; z < NV; ++z) _mm256_storeu_si256(dst + z, (__m256i)_mm512_cvtneps_pbh(e[z]));
#endif
      } else {
        for (int z = 0; z < NV; ++z) _mm512_storeu_ps(w.p + r * KB + 16 * z, e[z]);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kValueRows, rows - r0));
      const void* p = pairs ? static_cast<const void*>(reinterpret_cast<const uint32_t*>(w.p) + r0 * (KB / 2))
                            : static_cast<const void*>(w.p + r0 * KB);
      values[mr - 1](p, w.rescale + r0, n, packed.values(b, h, t), D, w.o + r0 * D);
    }
  }
  const int64_t heads = packed.num_kv_heads * group;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((s.q_start + p0 + r / group) * heads + h * group + r % group) * D;
    const float inv = 1.f / (w.sum[r] + sink_weight(sinks, h * group + r % group, w.top[r]));
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(w.o[r * D + d] * inv);
  }
}

template <typename T>
void attend_avx512(const T* q, int64_t q_stride, const T* pool, int64_t row_stride,
                   int64_t v_start, const int64_t* slots, const std::vector<Seq>& seqs, int64_t heads,
                   int64_t kv_heads, int64_t D, float scale, int64_t window,
                   const float* sinks, T* out) {
  const int64_t group = heads / kv_heads;
  Packed packed;
  packed.W = kPairs<T> ? D / 2 : D;
  packed.num_kv_heads = kv_heads;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, tile)
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    packed.tile_start.push_back(static_cast<int64_t>(tiles.size()));
    for (int64_t t = 0; t * KB < seqs[b].kv_len; ++t) tiles.emplace_back(b, t);
  }
  const int64_t tile_words = 2 * packed.W * KB;
  packed.words.resize(tiles.size() * kv_heads * tile_words);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * kv_heads, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto [b, t] = tiles[i / kv_heads];
      const int64_t h = i % kv_heads, k0 = t * KB;
      const int n = static_cast<int>(std::min<int64_t>(KB, seqs[b].kv_len - k0));
      pack_tile(pool, row_stride, slots + seqs[b].kv_start + k0, n, h * D, v_start + h * D, D,
                packed.words.data() + i * tile_words);
    }
  });
  // Items, longest first: (keys their last row sees) x rows is their work.
  const int64_t positions = std::max<int64_t>(1, kMaxRows / group);
  struct Item {
    int64_t b, h, p0, np, cost;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b)
    for (int64_t p0 = 0; p0 < seqs[b].q_len; p0 += positions) {
      const int64_t np = std::min(positions, seqs[b].q_len - p0);
      const Span last = visible(seqs[b], p0 + np - 1, window);
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({b, h, p0, np, np * (last.last - visible(seqs[b], p0, window).first + 1)});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const auto num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto tiles_buf = std::make_unique<Tiles>();
    for (int64_t i = next++; i < num_items; i = next++) {
      const Item& it = items[i];
      attend_item(q, q_stride, packed, seqs[it.b], it.b, it.h, it.p0, it.np, group, D, scale,
                  window, sinks, *tiles_buf, out);
    }
  });
}
#endif

template <typename T>
void attend_plain(const T* q, int64_t q_stride, const T* pool, int64_t row_stride,
                  int64_t v_start, const int64_t* slots, const std::vector<Seq>& seqs, int64_t heads,
                  int64_t kv_heads, int64_t D, float scale, int64_t window,
                  const float* sinks, T* out) {
  const int64_t group = heads / kv_heads;
  std::vector<std::pair<int64_t, int64_t>> rows;  // (sequence, position)
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b)
    for (int64_t p = 0; p < seqs[b].q_len; ++p) rows.emplace_back(b, p);
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t i = lo; i < hi; ++i) {
      const auto [b, p] = rows[i];
      const Seq& s = seqs[b];
      const int64_t row = s.q_start + p;
      for (int64_t qh = 0; qh < heads; ++qh) {
        const int64_t h = qh / group;
        attend_row(q + row * q_stride + qh * D, pool, row_stride, slots + s.kv_start,
                   visible(s, p, window), h * D, v_start + h * D, D, scale,
                   sinks == nullptr ? nullptr : sinks + qh, buf,
                   out + (row * heads + qh) * D);
      }
    }
  });
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                         const at::Tensor& q_starts, const at::Tensor& kv_starts,
                         int64_t num_kv_heads, double scale, int64_t window,
                         const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: (T, num_heads, head_dim), heads adjacent (rows may be strided)");
  const int64_t heads = q.size(1), D = q.size(2);
  TORCH_CHECK(num_kv_heads > 0 && heads % num_kv_heads == 0, "num_heads % num_kv_heads");
  const int64_t kv_dim = num_kv_heads * D;
  TORCH_CHECK(pool.dim() == 2 && pool.stride(1) == 1 && pool.scalar_type() == q.scalar_type() &&
                  (pool.size(1) == 2 * kv_dim || pool.size(1) == kv_dim),
              "pool: (slots, 2 * num_kv_heads * head_dim) rows of q's dtype, or (slots, "
              "num_kv_heads * head_dim) where the values are the keys");
  const int64_t v_start = pool.size(1) == kv_dim ? 0 : kv_dim;  // where a row's values begin
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  q_starts.scalar_type() == at::kLong && q_starts.is_contiguous() &&
                  kv_starts.scalar_type() == at::kLong && kv_starts.is_contiguous() &&
                  q_starts.numel() == kv_starts.numel() && q_starts.numel() >= 1,
              "slots: (sum kv_len,) int64; q_starts, kv_starts: (B + 1,) int64");
  check_sinks(sinks, heads);
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* ks = kv_starts.data_ptr<int64_t>();
  std::vector<Seq> seqs;
  for (int64_t b = 0; b + 1 < q_starts.numel(); ++b) {
    const Seq s{qs[b], qs[b + 1] - qs[b], ks[b], ks[b + 1] - ks[b]};
    TORCH_CHECK(s.q_len >= 0 && s.q_len <= s.kv_len, "each sequence: q_len <= kv_len");
    seqs.push_back(s);
  }
  TORCH_CHECK(qs[q_starts.numel() - 1] == q.size(0) && ks[kv_starts.numel() - 1] == slots.numel(),
              "q_starts ends at q's rows, kv_starts at the slots");
  auto out = at::empty({q.size(0), heads, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "paged_prefill: float64 is not supported");
    } else {
      const auto* qp = q.data_ptr<scalar_t>();
      const auto* pp = pool.data_ptr<scalar_t>();
      auto* op = out.data_ptr<scalar_t>();
      const auto* sp = slots.data_ptr<int64_t>();
      const auto sc = static_cast<float>(scale);
#if defined(__AVX512F__)
      if (D % 64 == 0 && D <= 256 && heads / num_kv_heads <= kMaxRows) {
        attend_avx512(qp, q.stride(0), pp, pool.stride(0), v_start, sp, seqs, heads,
                      num_kv_heads, D, sc, window, sink_ptr, op);
        return;
      }
#endif
      attend_plain(qp, q.stride(0), pp, pool.stride(0), v_start, sp, seqs, heads, num_kv_heads,
                   D, sc, window, sink_ptr, op);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoflex, m) {
  m.def("paged_prefill(Tensor q, Tensor pool, Tensor slots, Tensor q_starts, Tensor kv_starts, "
        "int num_kv_heads, float scale, int window, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoflex, CPU, m) { m.impl("paged_prefill", paged_prefill); }
