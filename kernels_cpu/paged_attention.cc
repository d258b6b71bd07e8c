// Ragged paged attention over the KV block pool, for XLA:CPU (an XLA FFI custom call).
//
// The contract is kernels_pallas/reference.py's `ragged_paged_attention_reference`:
//   q            f32 [tokens, q_heads, dim]       the step's new tokens, requests back to back
//   k/v_new      f32 [new, kv_heads, dim]         K/V to write first (kernels_pallas write_kv's)
//   slots        s32 [new]                        their pool slots (block * block_size + offset)
//   k/v_pages    T   [kv_heads, blocks, block_size, dim]   T = f32, f16, bf16 or f8e4m3fn; in and out
//   query_start  s32 [reqs + 1]                   cumulative q lengths
//   seq_lens     s32 [reqs]                       KV length after the step (cached + new)
//   block_tables s32 [reqs, max_blocks]
//   out          f32 [tokens, q_heads, dim]; rows of padding tokens are 0.
// Token i of request r sits at position seq_lens[r] - q_len + i and attends causally to the
// positions 0..its own. With a sliding window W (the `sliding_window` attribute, 0: none) it sees
// only the positions p - W + 1..p (transformers' semantics), and keys before every row's window
// are never loaded, so a windowed layer's work stops growing with the context. Unlike the
// fixed-shape jnp path this loop visits only real tokens and real keys, so padding rows and unused
// pages (NaN in the tests) are never read.
//
// An f8e4m3fn pool holds K/V divided by their scales (the `k_scale` and `v_scale` attributes, 1 for
// other pools): the write divides the new K/V before it saturates and rounds them, k_scale joins
// sm_scale and v_scale the output's normalisation. Inside the call, not in XLA around it: XLA:CPU
// compiled each layer's scaling as fusions of their own, which took start-up 26 -> 42-62 s for SmolLM2.
//
// The same call first writes the step's new K/V into the pool (in place: the pools are aliased
// from input to output), which saves XLA two scatters per layer.
//
// Work items are (request, kv head, tile of up to kTileRows query tokens); the rows of a tile
// and their group of query heads share every key and value row they read. Wide items (prompt
// chunks) convert each to f32 once, into a scratch chunk; narrow ones (decodes) read f32, f16 and
// bf16 pools in place and widen in registers. Items are shared out between the calling thread
// and XLA's intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "e4m3.h"
#include "work_sharing.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileRows = 16;  // query tokens of one request per work item
constexpr int kChunk = 64;     // keys per online-softmax chunk

struct F16Tag {};
struct BF16Tag {};
struct F8E4M3Tag {};

inline float half_to_float(uint16_t h) {
  // IEEE half -> float, subnormals, inf and NaN included (no F16C needed).
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of `dim` pool elements -> f32.
inline void load_row(const float* src, float* dst, int dim) { std::memcpy(dst, src, dim * sizeof(float)); }

inline void load_row(const uint16_t* src, float* dst, int dim, F16Tag) {
  int d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= dim; d += 16)
    _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
#endif
#if defined(__F16C__)
  for (; d + 8 <= dim; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
#endif
  for (; d < dim; ++d) dst[d] = half_to_float(src[d]);
}

inline void load_row(const uint16_t* src, float* dst, int dim, BF16Tag) {
  for (int d = 0; d < dim; ++d) {
    uint32_t bits = (uint32_t)src[d] << 16;
    std::memcpy(dst + d, &bits, 4);
  }
}

inline uint16_t float_to_half(float f) {
  // Round to nearest even, like XLA's convert: overflow -> inf, NaN stays NaN, subnormals kept.
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
  if (abs >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  if (abs >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds past the largest half
  if (abs < 0x38800000) {  // half subnormal (or zero): scale into the 10-bit mantissa
    const uint32_t shift = 126 - (abs >> 23);
    if (shift > 24) return (uint16_t)sign;
    const uint32_t man = (abs & 0x7fffff) | 0x800000;
    const uint32_t half = man >> shift;
    const uint32_t rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    return (uint16_t)(sign | (half + (rest > mid || (rest == mid && (half & 1)))));
  }
  const uint32_t rounded = abs - 0x38000000 + 0xfff + ((abs >> 13) & 1);
  return (uint16_t)(sign | (rounded >> 13));
}

inline void store_row(const float* src, float* dst, int dim) { std::memcpy(dst, src, dim * sizeof(float)); }

inline void store_row(const float* src, uint16_t* dst, int dim, F16Tag) {
  int d = 0;
#if defined(__F16C__)
  for (; d + 8 <= dim; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < dim; ++d) dst[d] = float_to_half(src[d]);
}

inline void store_row(const float* src, uint16_t* dst, int dim, BF16Tag) {
  for (int d = 0; d < dim; ++d) {
    uint32_t x;
    std::memcpy(&x, src + d, 4);
    if ((x & 0x7fffffff) > 0x7f800000) {
      dst[d] = (uint16_t)((x >> 16) | 0x40);  // NaN stays a quiet NaN
    } else {
      dst[d] = (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);  // round to nearest even
    }
  }
}

using cbjax_kernels::E4M3Table;
using cbjax_kernels::e4m3_to_float;

#if defined(__F16C__)
// e4m3fn by way of f16: a code's exponent and mantissa bits moved into f16's (its sign to bit 15) make the f16
// of the value times 2^-8 (f16's exponent bias is 15, e4m3's 7), subnormals included; F16C widens that exactly and
// the product by 256 is exact too. The NaN code S.1111.111 comes out as +-480, which no finite code gives (the
// largest is 448): those lanes are made NaN.
#if defined(__AVX512F__)
// 16 codes in one register (PoolRows' widen returns it: two 8-float halves stored and read back as one 16-float
// load would stall).
inline __m512 e4m3x16_to_floats(const uint8_t* src) {
  const __m512 f = _mm512_mul_ps(cbjax_kernels::e4m3x16_over_256(src), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(480.0f), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(NAN));
}
#else
inline __m256 e4m3_times_256_to_float8(__m128i x16) {  // 8 codes, zero-extended to 16-bit lanes
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x16, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(x16, _mm_set1_epi16(0x7f)), 7));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), f);
  return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_cmp_ps(magnitude, _mm256_set1_ps(480.0f), _CMP_EQ_OQ));
}
#endif

inline void widen_e4m3x16(const uint8_t* src, float* dst) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(dst, e4m3x16_to_floats(src));
#else
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  _mm256_storeu_ps(dst, e4m3_times_256_to_float8(_mm_cvtepu8_epi16(codes)));
  _mm256_storeu_ps(dst + 8, e4m3_times_256_to_float8(_mm_cvtepu8_epi16(_mm_srli_si128(codes, 8))));
#endif
}
#endif

inline void load_row(const uint8_t* src, float* dst, int dim, F8E4M3Tag) {
  static const E4M3Table table;
  int d = 0;
#if defined(__F16C__)
  for (; d + 16 <= dim; d += 16) widen_e4m3x16(src + d, dst + d);
#endif
  for (; d < dim; ++d) dst[d] = table.value[src[d]];
}

// Round to nearest even like XLA's convert, saturating at +-448 like kernels_pallas' to_pool (an overflow
// would otherwise be NaN: e4m3fn has no infinity); NaN stays NaN.
inline uint8_t float_to_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint8_t sign = (uint8_t)((x >> 24) & 0x80);
  const uint32_t abs = x & 0x7fffffff;
  if (abs > 0x7f800000) return sign | 0x7f;
  if (abs >= 0x43e00000) return sign | 0x7e;  // >= 448 (infinity included): the largest finite
  if (abs < 0x3c800000) {                     // below 2^-6: a subnormal m * 2^-9 (m = 8 is 2^-6, code 8)
    float magnitude;
    std::memcpy(&magnitude, &abs, 4);
    return sign | (uint8_t)std::nearbyint(magnitude * 512.0f);
  }
  const uint32_t rounded = abs + 0x7ffff + ((abs >> 20) & 1);  // keep 3 mantissa bits, ties to even
  return sign | (uint8_t)((rounded >> 20) - (120u << 3));        // rebias the exponent 127 -> 7
}

#if defined(__AVX2__)
// float_to_e4m3 of 8 floats at once, by the same integer steps: the same codes, bit for bit.
inline void store_e4m3x8(const float* src, uint8_t* dst) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(x, 24), _mm256_set1_epi32(0x80));
  const __m256i abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));  // below 2^31: compares as signed
  // Below 2^-6 a subnormal m * 2^-9: m is the magnitude times 512, rounded as nearbyint rounds (MXCSR: to even).
  const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(abs), _mm256_set1_ps(512.0f)));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(abs, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(abs, _mm256_set1_epi32(0x7ffff)), odd);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
  __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), abs));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7e), _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x43e00000 - 1)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000)));
  code = _mm256_or_si256(code, sign);  // every lane below 256: the packs keep it
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
}
#endif

inline void store_row(const float* src, uint8_t* dst, int dim, F8E4M3Tag) {
  int d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= dim; d += 8) store_e4m3x8(src + d, dst + d);
#endif
  for (; d < dim; ++d) dst[d] = float_to_e4m3(src[d]);
}

template <typename Tag>
struct Pool;
template <>
struct Pool<float> {
  using T = float;
  static void load(const T* src, float* dst, int dim) { load_row(src, dst, dim); }
  static void store(const float* src, T* dst, int dim) { store_row(src, dst, dim); }
};
template <>
struct Pool<F16Tag> {
  using T = uint16_t;
  static void load(const T* src, float* dst, int dim) { load_row(src, dst, dim, F16Tag{}); }
  static void store(const float* src, T* dst, int dim) { store_row(src, dst, dim, F16Tag{}); }
};
template <>
struct Pool<BF16Tag> {
  using T = uint16_t;
  static void load(const T* src, float* dst, int dim) { load_row(src, dst, dim, BF16Tag{}); }
  static void store(const float* src, T* dst, int dim) { store_row(src, dst, dim, BF16Tag{}); }
};
template <>
struct Pool<F8E4M3Tag> {
  using T = uint8_t;
  static void load(const T* src, float* dst, int dim) { load_row(src, dst, dim, F8E4M3Tag{}); }
  static void store(const float* src, T* dst, int dim) { store_row(src, dst, dim, F8E4M3Tag{}); }
};

// exp(x) for x <= 0 (scores minus their running max) as 2^n * e^r, n = round(x / ln 2),
// |r| <= ln 2 / 2, |rel err| < 2e-7. exp_reduced is the shared part: r from x and n (ln 2 in
// two pieces), then e^r by its polynomial; T is float or a vector of floats.
template <typename T>
inline T exp_reduced(T x, T n) {
  const T r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return exp_reduced(x, n) * scale;
}

// ---- tiles of many rows (prompt chunks): rows in vector lanes ------------------------------
// With 8+ rows (tokens x query heads of the group) per item, scores are computed 16 rows at a
// time against one key: the query tile is stored transposed (dim x rows), so no dot product
// ends in a horizontal sum, and the softmax runs across the same 16-row lanes.

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u16v __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;
constexpr int kWideRows = 8;

inline v16 splat(float x) { return v16{} + x; }

inline v16 exp_nonpos(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 t = x * 1.44269504088896341f - 0.5f;  // x <= 0: truncation rounds t + 0.5 to nearest
  const v16 n = __builtin_convertvector(__builtin_convertvector(t, i16v), v16);
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return exp_reduced(x, n) * (v16)bits;
}

// Keys per register block of a wide chunk: that many score accumulators share each query load,
// and a chunk's keys are padded with zero rows to a multiple of it (masked like causal keys).
constexpr int kKeyBlock = 8;
static_assert(kChunk % kKeyBlock == 0, "a padded chunk must fit the key scratch");
// Output dims per register block of the P.V product: their accumulators stay in registers over
// all of a chunk's keys instead of being loaded and stored once per key.
constexpr int kDimBlock = 8;

// One chunk of keys for a wide item. qt: [dim][padded] scaled queries; st: [kChunk][padded]
// scores; limit: [padded] first key position each row may NOT see (padding rows: 0); start:
// [padded] first key position each row may see (its window's). nk is a multiple of kKeyBlock;
// keys past the real ones are zero rows beyond every row's limit.
inline void wide_chunk(int padded, int dim, int nk, int64_t c0, const float* qt, const float* kc, const float* vc,
                       const float* limit, const float* start, float* st, float* m, float* l, float* acc_t) {
  // Scores, kKeyBlock keys at a time: independent accumulators hide the FMA latency, and each
  // query vector loaded serves all of them.
  for (int r0 = 0; r0 < padded; r0 += kLanes) {
    const v16 lim = *(const v16*)(limit + r0), first = *(const v16*)(start + r0);
    for (int j0 = 0; j0 < nk; j0 += kKeyBlock) {
      v16 sum[kKeyBlock];
      for (int b = 0; b < kKeyBlock; ++b) sum[b] = splat(0.0f);
      const float* kb = kc + j0 * dim;
      for (int d = 0; d < dim; ++d) {
        const v16 qd = *(const v16*)(qt + d * padded + r0);
        for (int b = 0; b < kKeyBlock; ++b) sum[b] += qd * kb[b * dim + d];
      }
      for (int b = 0; b < kKeyBlock; ++b) {
        const v16 pos = splat((float)(c0 + j0 + b));
        *(v16*)(st + (j0 + b) * padded + r0) = (pos < lim) & (pos >= first) ? sum[b] : splat(-INFINITY);
      }
    }
  }
  for (int r0 = 0; r0 < padded; r0 += kLanes) {
    v16 cmax = splat(-INFINITY);
    for (int j = 0; j < nk; ++j) {
      const v16 sj = *(const v16*)(st + j * padded + r0);
      cmax = sj > cmax ? sj : cmax;
    }
    const v16 m_old = *(const v16*)(m + r0);
    const v16 m_new = cmax > m_old ? cmax : m_old;
    const v16 m_safe = m_new == splat(-INFINITY) ? splat(0.0f) : m_new;
    const v16 alpha = m_old == splat(-INFINITY) ? splat(0.0f) : exp_nonpos(m_old - m_safe);
    v16 sum = splat(0.0f);
    for (int j = 0; j < nk; ++j) {
      v16* sj = (v16*)(st + j * padded + r0);
      const v16 p = *sj == splat(-INFINITY) ? splat(0.0f) : exp_nonpos(*sj - m_safe);
      *sj = p;
      sum += p;
    }
    *(v16*)(l + r0) = alpha * *(const v16*)(l + r0) + sum;
    *(v16*)(m + r0) = m_new;
    // acc_t[d][r] = alpha[r] * acc_t[d][r] + sum_j p[j][r] * v[j][d]: rows in lanes, kDimBlock
    // dims' accumulators held in registers across the chunk's keys.
    int d0 = 0;
    for (; d0 + kDimBlock <= dim; d0 += kDimBlock) {
      v16 acc[kDimBlock];
      for (int b = 0; b < kDimBlock; ++b) acc[b] = alpha * *(const v16*)(acc_t + (d0 + b) * padded + r0);
      for (int j = 0; j < nk; ++j) {
        const v16 p = *(const v16*)(st + j * padded + r0);
        const float* vj = vc + j * dim + d0;
        for (int b = 0; b < kDimBlock; ++b) acc[b] += p * vj[b];
      }
      for (int b = 0; b < kDimBlock; ++b) *(v16*)(acc_t + (d0 + b) * padded + r0) = acc[b];
    }
    for (; d0 < dim; ++d0) {
      v16 acc = alpha * *(const v16*)(acc_t + d0 * padded + r0);
      for (int j = 0; j < nk; ++j) acc += *(const v16*)(st + j * padded + r0) * vc[j * dim + d0];
      *(v16*)(acc_t + d0 * padded + r0) = acc;
    }
  }
}

// ---- tiles of few rows (decodes): head dims in vector lanes --------------------------------
// A row's score against a key is a dot product over dim: its partial sums are one vector per
// key, and 16 keys' vectors are summed together by a shuffle tree into one vector of 16 scores
// (no horizontal sum per key); the softmax then runs over 16 keys per vector, and P.V keeps
// the row's dim / 16 accumulators in registers. For head_dim 64 and 128; others take
// narrow_chunk_scalar.

#if defined(__clang__)
#define CBJAX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CBJAX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16v{__VA_ARGS__})
#endif

// Lane b of the result is the sum of x[b]'s 16 lanes (x is overwritten).
inline v16 sum_lanes_of_16(v16* x) {
  for (int i = 0; i < 8; ++i)  // lanes 0-7: x[2i]'s partial sums, 8-15: x[2i+1]'s
    x[i] = CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes each of x[4i..4i+3]
    x[i] = CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes each of x[8i..8i+7]
    x[i] = CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           CBJAX_SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return CBJAX_SHUFFLE(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         CBJAX_SHUFFLE(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline float max_of_lanes(v16 x) {
  float best = x[0];
  for (int i = 1; i < kLanes; ++i) best = std::max(best, x[i]);
  return best;
}

inline float sum_of_lanes(v16 x) {
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += x[i];
  return sum;
}

// The chunk's keys row r sees, [j_lo, j_hi): from its window's start to its own position.
struct KeyRange {
  int j_lo, j_hi;
};

inline KeyRange visible_keys(int r, int nk, int64_t c0, const float* limit, const float* start) {
  const int j_hi = (int)std::clamp<int64_t>((int64_t)limit[r] - c0, 0, nk);
  return {(int)std::clamp<int64_t>((int64_t)start[r] - c0, 0, j_hi), j_hi};
}

// The next chunk's cache lines, fetched a few per key while this chunk's arithmetic runs. Fetched all at once
// they would queue behind the core's few outstanding misses and be done before the arithmetic began, leaving
// memory idle while it ran (`python -m benchmarks.profile_long_steps --packed`, the decode cases).
struct Lines {
  const char** at = nullptr;
  int count = 0, next = 0, per_key = 0;
  void pace(int keys) { per_key = keys > 0 ? (count + keys - 1) / keys : count; }
  void fetch() {
    for (const int end = std::min(count, next + per_key); next < end; ++next) __builtin_prefetch(at[next], 0, 3);
  }
  void rest() {
    per_key = count;
    fetch();
  }
};

// Where a narrow chunk's keys and values are read: f32 rows in the scratch, [key][dim] ...
struct ScratchRows {  // kChunk rows, the first nk this chunk's keys (the rest stale but finite)
  const float *kc, *vc;
  int dim;
  v16 k(int j, int i) const { return *(const v16*)(kc + j * dim + i * kLanes); }
  v16 v(int j, int i) const { return *(const v16*)(vc + j * dim + i * kLanes); }
};

// ... or the pool's own rows, one pointer per key, widened as they are loaded (no f32 copy of the chunk: a decode
// item's keys are each used by only its few rows, and the copy cost as much as their arithmetic).
template <typename Tag>
struct PoolRows {
  using T = typename Pool<Tag>::T;
  const T *const *k_rows, *const *v_rows;
  static v16 widen(const T* p);
  v16 k(int j, int i) const { return widen(k_rows[j] + i * kLanes); }
  v16 v(int j, int i) const { return widen(v_rows[j] + i * kLanes); }
};
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
template <>
inline v16 PoolRows<float>::widen(const float* p) { return *(const v16*)p; }
template <>
inline v16 PoolRows<BF16Tag>::widen(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  return (v16)(__builtin_convertvector(*(const h16*)p, u16v) << 16);
#endif
}
#if defined(__F16C__)
template <>
inline v16 PoolRows<F16Tag>::widen(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  v16 out;
  _mm256_storeu_ps((float*)&out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  _mm256_storeu_ps((float*)&out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
  return out;
#endif
}
template <>
inline v16 PoolRows<F8E4M3Tag>::widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (v16)e4m3x16_to_floats(p);
#else
  v16 out;
  widen_e4m3x16(p, (float*)&out);
  return out;
#endif
}
#endif
// The pool types whose rows a narrow chunk reads in place (f16 and e4m3 need F16C).
template <typename Tag>
constexpr bool kReadsInPlace = std::is_same_v<Tag, float> || std::is_same_v<Tag, BF16Tag>
#if defined(__F16C__)
                               || std::is_same_v<Tag, F16Tag> || std::is_same_v<Tag, F8E4M3Tag>
#endif
    ;

// R rows of a narrow item, r0..r0 + R - 1, over one chunk of keys, NV = dim / 16. They share every key and
// value row they read: each is widened once for all R (rows are a token's query heads of one group). qs,
// acc: [rows][dim]; sc: [rows][kChunk]. Keys a row does not see score -inf, so each row's probabilities are 0
// outside its range and the P.V product runs over the rows' joint range.
template <int NV, int R, typename Rows>
void narrow_rows(int r0, int nk, int64_t c0, const float* qs, const Rows& kv, const float* limit, const float* start,
                 float* sc, float* m, float* l, float* acc, Lines& lines) {
  constexpr int dim = NV * kLanes;
  int lo[R], hi[R], j_lo = nk, j_hi = 0;
  for (int r = 0; r < R; ++r) {
    const auto [first, end] = visible_keys(r0 + r, nk, c0, limit, start);
    lo[r] = first, hi[r] = end;
    if (first < end) j_lo = std::min(j_lo, first), j_hi = std::max(j_hi, end);
  }
  if (j_lo >= j_hi) return;
  // Whole vectors of 16 keys from the one holding j_lo.
  const int j_first = j_lo / kLanes * kLanes;
  v16 q[R][NV], vmax[R];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) q[r][i] = *(const v16*)(qs + (r0 + r) * dim + i * kLanes);
    vmax[r] = splat(-INFINITY);
  }
  const u16v lane = u16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int j0 = j_first; j0 < j_hi; j0 += kLanes) {
    v16 part[R][kLanes];
    for (int b = 0; b < kLanes; ++b) {
      lines.fetch();
      v16 k[NV];
      for (int i = 0; i < NV; ++i) k[i] = kv.k(j0 + b, i);
      for (int r = 0; r < R; ++r) {
        v16 dot = q[r][0] * k[0];
        for (int i = 1; i < NV; ++i) dot += q[r][i] * k[i];
        part[r][b] = dot;
      }
    }
    for (int r = 0; r < R; ++r) {
      // lo <= j < hi in one unsigned compare: keys before lo wrap around to huge offsets.
      const u16v offset = lane + (uint32_t)(j0 - lo[r]);
      const v16 scores = offset < (uint32_t)(hi[r] - lo[r]) ? sum_lanes_of_16(part[r]) : splat(-INFINITY);
      *(v16*)(sc + (r0 + r) * kChunk + j0) = scores;
      vmax[r] = scores > vmax[r] ? scores : vmax[r];
    }
  }
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    float* sr = sc + (r0 + r) * kChunk;
    if (lo[r] == hi[r]) {  // no key of this chunk: the row's state is left as it is
      alpha[r] = 1.0f;
      for (int j0 = j_first; j0 < j_hi; j0 += kLanes) *(v16*)(sr + j0) = splat(0.0f);
      continue;
    }
    const float m_new = std::max(m[r0 + r], max_of_lanes(vmax[r]));
    alpha[r] = m[r0 + r] == -INFINITY ? 0.0f : exp_nonpos(m[r0 + r] - m_new);
    v16 vsum = splat(0.0f);
    for (int j0 = j_first; j0 < j_hi; j0 += kLanes) {
      v16* s = (v16*)(sr + j0);
      const v16 p = *s == splat(-INFINITY) ? splat(0.0f) : exp_nonpos(*s - splat(m_new));
      *s = p;
      vsum += p;
    }
    l[r0 + r] = alpha[r] * l[r0 + r] + sum_of_lanes(vsum);
    m[r0 + r] = m_new;
  }
  v16 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = *(const v16*)(acc + (r0 + r) * dim + i * kLanes) * alpha[r];
  int j = j_lo;
  if constexpr (R * NV <= 8) {
    // Few accumulators: even and odd keys into separate ones, so a key's products need not wait for the last
    // key's (the multiply-add's latency, not its rate, would bound each chain).
    v16 odd[R][NV] = {};
    for (; j + 1 < j_hi; j += 2) {
      v16 v0[NV], v1[NV];
      for (int i = 0; i < NV; ++i) v0[i] = kv.v(j, i), v1[i] = kv.v(j + 1, i);
      for (int r = 0; r < R; ++r) {
        const float p0 = sc[(r0 + r) * kChunk + j], p1 = sc[(r0 + r) * kChunk + j + 1];
        for (int i = 0; i < NV; ++i) a[r][i] += p0 * v0[i], odd[r][i] += p1 * v1[i];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) a[r][i] += odd[r][i];
  }
  for (; j < j_hi; ++j) {
    v16 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = kv.v(j, i);
    for (int r = 0; r < R; ++r) {
      const float p = sc[(r0 + r) * kChunk + j];
      for (int i = 0; i < NV; ++i) a[r][i] += p * v[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) *(v16*)(acc + (r0 + r) * dim + i * kLanes) = a[r][i];
}

// One chunk of keys for a narrow item (rows < kWideRows), its rows taken up to kBlock at a time: as many as
// keep the P.V accumulators (kBlock * NV vectors) in registers.
template <int NV, typename Rows>
void narrow_chunk_vec(int rows, int nk, int64_t c0, const float* qs, const Rows& kv, const float* limit,
                      const float* start, float* sc, float* m, float* l, float* acc, Lines& lines) {
  constexpr int kBlock = 16 / NV;
  lines.pace((rows + kBlock - 1) / kBlock * nk);
  int r0 = 0;
  for (; r0 + kBlock <= rows; r0 += kBlock)
    narrow_rows<NV, kBlock>(r0, nk, c0, qs, kv, limit, start, sc, m, l, acc, lines);
  switch (rows - r0) {
    case 1:
      narrow_rows<NV, 1>(r0, nk, c0, qs, kv, limit, start, sc, m, l, acc, lines);
      break;
    case 2:
      narrow_rows<NV, std::min(2, kBlock)>(r0, nk, c0, qs, kv, limit, start, sc, m, l, acc, lines);
      break;
    case 3:
      narrow_rows<NV, std::min(3, kBlock)>(r0, nk, c0, qs, kv, limit, start, sc, m, l, acc, lines);
      break;
  }
}

// The same for any dim, one row and one key at a time.
inline void narrow_chunk_scalar(int rows, int dim, int nk, int64_t c0, const float* qs, const float* kc,
                                const float* vc, const float* limit, const float* start, float* sc, float* m, float* l,
                                float* acc) {
  for (int r = 0; r < rows; ++r) {
    const auto [j_lo, nk_r] = visible_keys(r, nk, c0, limit, start);
    if (j_lo == nk_r) continue;
    const float* qr = qs + r * dim;
    float* sr = sc + r * kChunk;
    float chunk_max = -INFINITY;
    for (int j = j_lo; j < nk_r; ++j) {
      const float* kj = kc + j * dim;
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += qr[d] * kj[d];
      sr[j] = dot;
      chunk_max = std::max(chunk_max, dot);
    }
    const float m_new = std::max(m[r], chunk_max);
    const float alpha = m[r] == -INFINITY ? 0.0f : exp_nonpos(m[r] - m_new);
    float sum = 0.0f;
    for (int j = j_lo; j < nk_r; ++j) {
      sr[j] = exp_nonpos(sr[j] - m_new);
      sum += sr[j];
    }
    l[r] = alpha * l[r] + sum;
    m[r] = m_new;
    float* ar = acc + r * dim;
    for (int d = 0; d < dim; ++d) ar[d] *= alpha;
    for (int j = j_lo; j < nk_r; ++j) {
      const float p = sr[j];
      const float* vj = vc + j * dim;
      for (int d = 0; d < dim; ++d) ar[d] += p * vj[d];
    }
  }
}

struct Shapes {
  int64_t tokens, q_heads, dim, kv_heads, blocks, block_size, reqs, max_blocks;
};

struct Item {
  int32_t req, kv_head, first_token, num_tokens;
};

// One work item's buffers: queries, accumulators, running max and sum, causal limits, window
// starts, the current chunk's keys, values and scores.
struct Scratch {
  std::vector<float> qs, acc, m, l, limit, start, kc, vc, sc;
  std::vector<const char*> lines;
};

// Appends the cache lines of keys [first, end) of one head (its K and V planes) to `lines`, walking their pages.
template <typename T>
inline void collect_lines(const T* k_head, const T* v_head, const int32_t* table, const Shapes& s, int64_t first,
                          int64_t end, Lines& lines) {
  const int64_t bs = s.block_size, page_stride = s.block_size * s.dim;
  while (first < end) {
    const int64_t page_index = first / bs, row = first - page_index * bs;
    if (page_index >= s.max_blocks) return;
    const int64_t rows = std::min(bs - row, end - first);
    const int64_t offset = std::clamp<int64_t>(table[page_index], 0, s.blocks - 1) * page_stride + row * s.dim;
    const char* k = reinterpret_cast<const char*>(k_head + offset);
    const char* v = reinterpret_cast<const char*>(v_head + offset);
    const int64_t bytes = rows * s.dim * (int64_t)sizeof(T);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      lines.at[lines.count++] = k + byte;
      lines.at[lines.count++] = v + byte;
    }
    first += rows;
  }
}

template <typename Tag>
void run_item(const Item& item, const Shapes& s, const float* q, const typename Pool<Tag>::T* k_pages,
              const typename Pool<Tag>::T* v_pages, const int32_t* query_start, const int32_t* seq_lens,
              const int32_t* block_tables, float sm_scale, float v_scale, int32_t window, float* out) {
  const int group = (int)(s.q_heads / s.kv_heads), dim = (int)s.dim, bs = (int)s.block_size;
  const int rows = item.num_tokens * group;  // row = token * group + head within the group
  const int32_t q_len = query_start[item.req + 1] - query_start[item.req];
  const int64_t first_pos = (int64_t)seq_lens[item.req] - q_len + (item.first_token - query_start[item.req]);
  if (first_pos < 0) return;  // inconsistent metadata: leave the rows at 0
  const int64_t kv_end = first_pos + item.num_tokens;  // the last row attends to kv_end - 1
  // The first row's window starts earliest: no row sees a key before kv_begin.
  const int64_t kv_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int32_t* table = block_tables + (int64_t)item.req * s.max_blocks;
  const int64_t page_stride = s.block_size * s.dim, head_stride = s.blocks * page_stride;

  const bool wide = rows >= kWideRows;
  const int padded = wide ? (rows + kLanes - 1) / kLanes * kLanes : rows;
  // Narrow items keep rows row-major ([row][dim]); wide ones transposed ([dim][padded]). The
  // buffers are this thread's, reused across items: a decode step runs thousands of items, and
  // allocating and zeroing the key/value chunks for each was work for nothing (they are
  // written before they are read).
  thread_local Scratch scratch;
  auto& [qs, acc, m, l, limit, start, kc, vc, sc, line_buffer] = scratch;
  qs.assign(padded * dim, 0.0f);
  acc.assign(padded * dim, 0.0f);
  m.assign(padded, -INFINITY);
  l.assign(padded, 0.0f);
  limit.assign(padded, 0.0f);
  start.assign(padded, 0.0f);
  for (auto* chunk : {&kc, &vc}) chunk->resize(std::max<size_t>(chunk->size(), kChunk * dim));
  sc.resize(std::max<size_t>(sc.size(), (size_t)padded * kChunk));
  for (int t = 0; t < item.num_tokens; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = t * group + g;
      const float* src = q + ((int64_t)(item.first_token + t) * s.q_heads + item.kv_head * group + g) * dim;
      for (int d = 0; d < dim; ++d) qs[wide ? d * padded + r : r * dim + d] = src[d] * sm_scale;
      limit[r] = (float)(first_pos + t + 1);  // keys at positions >= limit are causal-masked
      if (window > 0) start[r] = (float)std::max<int64_t>(0, first_pos + t + 1 - window);  // and those < start
    }

  // The chunks' keys and values, widened to f32, live in this thread's scratch; a chunk is filled a page's run of
  // rows at a time (no division or scratch lookup per key).
  float* const kcp = kc.data();
  float* const vcp = vc.data();
  using T = typename Pool<Tag>::T;
  const T* const k_head = k_pages + item.kv_head * head_stride;
  const T* const v_head = v_pages + item.kv_head * head_stride;
  line_buffer.resize(std::max<size_t>(line_buffer.size(), 2 * (kChunk * dim * sizeof(T) / 64 + kChunk + 2)));
  Lines lines;
  lines.at = line_buffer.data();
  // Decode items read the pool in place through one row pointer per key; the chunk's last vector of 16 keys is
  // padded with a row of zeros.
  const bool in_place = kReadsInPlace<Tag> && !wide && (dim == 64 || dim == 128);
  static const T zero_row[128] = {};
  const T* k_rows[kChunk];
  const T* v_rows[kChunk];
  for (int64_t c0 = kv_begin; c0 < kv_end; c0 += kChunk) {
    const int nk = (int)std::min<int64_t>(kChunk, kv_end - c0);
    for (int j = 0; j < nk;) {
      const int64_t pos = c0 + j, page_index = pos / bs, row = pos - page_index * bs;
      if (page_index >= s.max_blocks) return;  // seq_len beyond the block table: metadata bug
      const int run = (int)std::min<int64_t>(bs - row, nk - j);
      const int64_t offset = std::clamp<int64_t>(table[page_index], 0, s.blocks - 1) * page_stride + row * s.dim;
      if (in_place) {
        for (int t = 0; t < run; ++t) {
          k_rows[j + t] = k_head + offset + t * dim;
          v_rows[j + t] = v_head + offset + t * dim;
        }
      } else {
        Pool<Tag>::load(k_head + offset, kcp + (int64_t)j * dim, run * dim);
        Pool<Tag>::load(v_head + offset, vcp + (int64_t)j * dim, run * dim);
      }
      j += run;
    }
    // The next chunk's keys are fetched while this one's are scored: pages lie anywhere in the pool and the
    // hardware prefetcher stops at each page's end.
    lines.count = lines.next = 0;
    collect_lines(k_head, v_head, table, s, c0 + kChunk, std::min<int64_t>(c0 + 2 * kChunk, kv_end), lines);
    if (wide) {
      lines.rest();
      const int nk_padded = (nk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;  // <= kChunk
      std::fill(kcp + nk * dim, kcp + nk_padded * dim, 0.0f);
      std::fill(vcp + nk * dim, vcp + nk_padded * dim, 0.0f);
      wide_chunk(padded, dim, nk_padded, c0, qs.data(), kcp, vcp, limit.data(), start.data(), sc.data(),
                 m.data(), l.data(), acc.data());
      continue;
    }
    auto narrow = [&](const auto& kv) {  // dim 64 or 128: vectors of 16 keys
      if (dim == 64)
        narrow_chunk_vec<4>(rows, nk, c0, qs.data(), kv, limit.data(), start.data(), sc.data(), m.data(), l.data(),
                            acc.data(), lines);
      else
        narrow_chunk_vec<8>(rows, nk, c0, qs.data(), kv, limit.data(), start.data(), sc.data(), m.data(), l.data(),
                            acc.data(), lines);
    };
    if (in_place) {
      if constexpr (kReadsInPlace<Tag>) {  // (in_place is false otherwise)
        for (int j = nk; j % kLanes; ++j) k_rows[j] = v_rows[j] = zero_row;
        narrow(PoolRows<Tag>{k_rows, v_rows});
      }
    } else if (dim == 64 || dim == 128) {
      narrow(ScratchRows{kcp, vcp, dim});
    } else {
      lines.rest();
      narrow_chunk_scalar(rows, dim, nk, c0, qs.data(), kcp, vcp, limit.data(), start.data(), sc.data(), m.data(),
                          l.data(), acc.data());
    }
    lines.rest();
  }
  for (int t = 0; t < item.num_tokens; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = t * group + g;
      const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
      float* dst = out + ((int64_t)(item.first_token + t) * s.q_heads + item.kv_head * group + g) * dim;
      for (int d = 0; d < dim; ++d) dst[d] = acc[wide ? d * padded + r : r * dim + d] * inv;
    }
}

// Scatter the step's new K/V rows (f32 [new_tokens, kv_heads, dim]) into their pool slots, converted to
// the pool's type like XLA's convert (round to nearest even), divided by the pool's scales first (as
// kernels_pallas' to_pool divides). Slots outside the pool are skipped.
template <typename Tag>
void write_new_kv(const Shapes& s, const float* k_new, const float* v_new, const int32_t* slots, int64_t new_tokens,
                  float k_scale, float v_scale, typename Pool<Tag>::T* k_pages, typename Pool<Tag>::T* v_pages) {
  const int64_t page_stride = s.block_size * s.dim, head_stride = s.blocks * page_stride;
  std::vector<float> scaled(k_scale != 1.0f || v_scale != 1.0f ? s.dim : 0);
  auto divided = [&](const float* x, float scale) {
    if (scale == 1.0f) return x;
    for (int64_t d = 0; d < s.dim; ++d) scaled[d] = x[d] / scale;
    return (const float*)scaled.data();
  };
  for (int64_t t = 0; t < new_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= s.blocks * s.block_size) continue;
    const int64_t base = (slot / s.block_size) * page_stride + (slot % s.block_size) * s.dim;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t src = (t * s.kv_heads + h) * s.dim;
      Pool<Tag>::store(divided(k_new + src, k_scale), k_pages + h * head_stride + base, (int)s.dim);
      Pool<Tag>::store(divided(v_new + src, v_scale), v_pages + h * head_stride + base, (int)s.dim);
    }
  }
}

// Attention of every real token over the pool (the reference's contract), work shared out
// between the calling thread and XLA's intra-op threads.
template <typename Tag>
void attend(ffi::ThreadPool& pool, const Shapes& s, const float* q, const typename Pool<Tag>::T* kp,
            const typename Pool<Tag>::T* vp, const int32_t* qsl, const int32_t* seq_lens, const int32_t* block_tables,
            float sm_scale, float v_scale, int32_t window, float* out) {
  std::fill(out, out + s.tokens * s.q_heads * s.dim, 0.0f);
  std::vector<Item> items;
  for (int32_t r = 0; r < s.reqs; ++r) {
    const int32_t start = std::max(0, qsl[r]), end = std::min<int32_t>(qsl[r + 1], (int32_t)s.tokens);
    for (int32_t t = start; t < end; t += kTileRows)
      for (int32_t h = 0; h < s.kv_heads; ++h)
        items.push_back({r, h, t, std::min(kTileRows, end - t)});
  }
  const int64_t n = (int64_t)items.size();
  cbjax_kernels::share_out(pool, n, [=, items = std::move(items)](int64_t i) {
    run_item<Tag>(items[i], s, q, kp, vp, qsl, seq_lens, block_tables, sm_scale, v_scale, window, out);
  });
}

ffi::Error check_shapes(const Shapes& s, int64_t pool_dims, int64_t pool_dim, int64_t query_starts,
                        int32_t window) {
  if (pool_dims != 4 || pool_dim != s.dim || s.kv_heads == 0 || s.q_heads % s.kv_heads != 0 ||
      query_starts != s.reqs + 1)
    return ffi::Error::InvalidArgument("cbjax attention: the shapes of q, the pools, query_start and seq_lens disagree");
  if (window < 0)
    return ffi::Error::InvalidArgument("cbjax attention: sliding_window must be >= 0 (0: no window), got " +
                                       std::to_string(window));
  return ffi::Error::Success();
}

// Attention only: the pools are read, never written.
template <typename Tag>
ffi::Error attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> block_tables, ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                          float k_scale, float v_scale, int32_t window) {
  using T = typename Pool<Tag>::T;
  auto qd = q.dimensions(), kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cbjax attention: q must be 3-d, the pools 4-d, block_tables 2-d");
  Shapes s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], seq_lens.dimensions()[0], block_tables.dimensions()[1]};
  if (auto error = check_shapes(s, kd.size(), kd[3], query_start.dimensions()[0], window); error.failure())
    return error;
  attend<Tag>(pool, s, q.typed_data(), reinterpret_cast<const T*>(k_pages.untyped_data()),
              reinterpret_cast<const T*>(v_pages.untyped_data()), query_start.typed_data(), seq_lens.typed_data(),
              block_tables.typed_data(), sm_scale * k_scale, v_scale, window, out->typed_data());
  return ffi::Error::Success();
}

// The step's KV write, then attention. The pools come in and go out, aliased by the caller.
template <typename Tag>
ffi::Error write_attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                                ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> slot_mapping,
                                ffi::AnyBuffer k_pages_in, ffi::AnyBuffer v_pages_in, ffi::Buffer<ffi::S32> query_start,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                                ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_pages,
                                ffi::Result<ffi::AnyBuffer> v_pages, float sm_scale, float k_scale, float v_scale,
                                int32_t window) {
  using T = typename Pool<Tag>::T;
  auto qd = q.dimensions(), kd = k_pages->dimensions(), nd = k_new.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || nd.size() != 3 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cbjax attention: q and new K/V must be 3-d, the pools 4-d, block_tables 2-d");
  Shapes s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], seq_lens.dimensions()[0], block_tables.dimensions()[1]};
  if (auto error = check_shapes(s, kd.size(), kd[3], query_start.dimensions()[0], window); error.failure())
    return error;
  if (nd[1] != s.kv_heads || nd[2] != s.dim || slot_mapping.dimensions()[0] != nd[0] ||
      v_new.dimensions()[0] != nd[0] || k_pages_in.element_count() != k_pages->element_count())
    return ffi::Error::InvalidArgument("cbjax attention: the shapes of the new K/V, their slots and the pools disagree");
  T* kp = reinterpret_cast<T*>(k_pages->untyped_data());
  T* vp = reinterpret_cast<T*>(v_pages->untyped_data());
  // Aliased buffers are one; if XLA gave fresh outputs, start them from the inputs.
  if (kp != k_pages_in.untyped_data()) std::memcpy(kp, k_pages_in.untyped_data(), k_pages_in.size_bytes());
  if (vp != v_pages_in.untyped_data()) std::memcpy(vp, v_pages_in.untyped_data(), v_pages_in.size_bytes());
  write_new_kv<Tag>(s, k_new.typed_data(), v_new.typed_data(), slot_mapping.typed_data(), nd[0], k_scale, v_scale, kp,
                    vp);
  attend<Tag>(pool, s, q.typed_data(), kp, vp, query_start.typed_data(), seq_lens.typed_data(),
              block_tables.typed_data(), sm_scale * k_scale, v_scale, window, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// Both entries end alike: k_pages, v_pages, query_start, seq_lens, block_tables -> out.
#define CBJAX_POOLS_METADATA_OUT                                                            \
  .Arg<ffi::AnyBuffer>()                                                                    \
      .Arg<ffi::AnyBuffer>()                                                                \
      .Arg<ffi::Buffer<ffi::S32>>()                                                         \
      .Arg<ffi::Buffer<ffi::S32>>()                                                         \
      .Arg<ffi::Buffer<ffi::S32>>()                                                         \
      .Ret<ffi::Buffer<ffi::F32>>()

#define CBJAX_ATTENTION_BIND \
  ffi::Ffi::Bind()           \
      .Ctx<ffi::ThreadPool>()  \
      .Arg<ffi::Buffer<ffi::F32>>() CBJAX_POOLS_METADATA_OUT.Attr<float>("sm_scale").Attr<float>("k_scale") \
          .Attr<float>("v_scale").Attr<int32_t>("sliding_window")

// q, k_new, v_new, slots, then the common part, then the pools out (aliased to the pools in).
#define CBJAX_WRITE_ATTENTION_BIND                                                          \
  ffi::Ffi::Bind()                                                                          \
      .Ctx<ffi::ThreadPool>()                                                               \
      .Arg<ffi::Buffer<ffi::F32>>()                                                         \
      .Arg<ffi::Buffer<ffi::F32>>()                                                         \
      .Arg<ffi::Buffer<ffi::F32>>()                                                         \
      .Arg<ffi::Buffer<ffi::S32>>() CBJAX_POOLS_METADATA_OUT                                \
      .Ret<ffi::AnyBuffer>()                                                                \
      .Ret<ffi::AnyBuffer>()                                                                \
      .Attr<float>("sm_scale")                                                              \
      .Attr<float>("k_scale")                                                               \
      .Attr<float>("v_scale")                                                               \
      .Attr<int32_t>("sliding_window")

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPagedAttentionF32, attention_impl<float>, CBJAX_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPagedAttentionF16, attention_impl<F16Tag>, CBJAX_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPagedAttentionBF16, attention_impl<BF16Tag>, CBJAX_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxWriteKvAttentionF32, write_attention_impl<float>, CBJAX_WRITE_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxWriteKvAttentionF16, write_attention_impl<F16Tag>, CBJAX_WRITE_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxWriteKvAttentionBF16, write_attention_impl<BF16Tag>, CBJAX_WRITE_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPagedAttentionF8E4M3, attention_impl<F8E4M3Tag>, CBJAX_ATTENTION_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxWriteKvAttentionF8E4M3, write_attention_impl<F8E4M3Tag>, CBJAX_WRITE_ATTENTION_BIND);
