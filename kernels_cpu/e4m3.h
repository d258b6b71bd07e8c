// fp8 e4m3fn codes as floats, for both C++ kernels: the attention's fp8 KV pool and the matmul's fp8 weights.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cbjax_kernels {

// e4m3fn (OCP): bias 7, no infinities, S.1111.111 is NaN; subnormals are m * 2^-9.
inline float e4m3_to_float(uint8_t code) {
  const int exp = (code >> 3) & 0xf, man = code & 0x7;
  const float magnitude = exp == 0xf && man == 0x7 ? NAN
                          : exp == 0               ? std::ldexp((float)man, -9)
                                                   : std::ldexp((float)(8 + man), exp - 10);
  return code & 0x80 ? -magnitude : magnitude;
}

// Every code's value, so a row widens by table lookups.
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int code = 0; code < 256; ++code) value[code] = e4m3_to_float((uint8_t)code);
  }
};

#if defined(__AVX512F__)
// 16 codes as their values times 2^-8, exactly: each code's exponent and mantissa bits moved into an f16's (its
// sign to bit 15) make the f16 of the value times 2^-8 (f16's exponent bias is 15, e4m3's 7), subnormals
// included, and the conversion to f32 is exact. The NaN code S.1111.111 gives +-480 / 256, which no finite code
// gives (the largest is 448).
inline __m512 e4m3x16_over_256(const uint8_t* src) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_cvtph_ps(h);
}

#if defined(__AVX512BW__)
// 32 codes, the same floats for fewer instructions: the codes sign-extended to 16 bits and shifted left by 7 put
// e4m3's exponent and mantissa in f16's and its sign in bit 15, and in bit 14 too (f16's top exponent bit, which
// the value never sets), so clearing bit 14 leaves the f16s. `lo` gets codes 0-15, `hi` 16-31.
inline void e4m3x32_over_256(const uint8_t* src, __m512& lo, __m512& hi) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(static_cast<short>(0xbfff)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#endif
#endif

}  // namespace cbjax_kernels
