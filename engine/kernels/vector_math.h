// Vector math shared by the kernels: conversions the compiler vectorizes, exp over float32
// lanes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

// Element conversions to and from float32, branch-free for bfloat16 (c10's own conversion
// checks for NaN with a branch, which keeps loops scalar).
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float x) {
  // Round to nearest even, as torch does; a NaN stays a (quiet) NaN.
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
template <>
inline c10::Half from_f<c10::Half>(float x) {
  return static_cast<c10::Half>(x);
}

// x rounded to T and back: what a torch op with a T output stores.
template <typename T>
inline float round_to(float x) {
  return to_f(from_f<T>(x));
}

#if defined(__AVX512F__)
#include <immintrin.h>

// Lanes [0, min(n, 16)) of a 16-lane mask.
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// 16 values at p as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x): 2^k exp(r), k = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by its Taylor series to
// r^7 (relative error under 3e-9, below float32's rounding); 0 from x = -104 down, inf
// above 88.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp(-104) is 0 in float32 after scalef
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

#endif

// x[i] = exp(x[i]) for i < n, in AVX-512 lanes where the CPU has them.
inline void exp_in_place(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}
