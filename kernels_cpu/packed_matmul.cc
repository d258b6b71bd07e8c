// y = x @ w for XLA:CPU (an XLA FFI custom call), with w packed in 32-column panels.
//
//   x  f32 [rows, K]           (any leading dims: all but the last are rows)
//   w  f32 [N / 32, K, 32]     panel p holds columns 32p..32p+31 of the [K, N] weight, row by row
//      or bf16 [N / 32, ceil(K / 2), 64]: the same with rows k and k+1 interleaved per column
//      (column c's pair at 2c, 2c+1; a zero row pads an odd K), as the bf16 dot instruction reads them
//      or s8 [ceil(N / 32), K, 32] with f32 scales [K / G, N] (w[k, n] = q[k, n] * scales[k / G, n]) or
//      [N] (one group, G = K): int8 weights, zero columns padding N up to a panel; each group's sum of
//      x * q is multiplied by its scales once, at the group's end (and, CbjaxPackedMatmulI8Mins, with f32
//      mins [K / G, N] too: w[k, n] = q[k, n] * scales[k / G, n] + mins[k / G, n])
//      or f8e4m3fn [ceil(N / 32), K, 32] with f32 scales [K / G, N] or [N] (CbjaxPackedMatmulF8): fp8 weights,
//      w[k, n] = q[k, n] * scales[k / G, n], read as the int8 ones are (a checkpoint's fp8 weights as stored)
//      or u8 [ceil(N / 32), K / 2, 32] with f32 scales and mins [K / G, N] or [ceil(N / 32), K / G, 32]: 4-bit
//      nibbles (see below), standing for 0..15 or (CbjaxPackedMatmulQ4Grid) for a given f32 grid [16]
//   y  f32 [rows, N]
// With bf16 weights x is rounded to bf16 first (to nearest even) and the products summed in
// f32: what XLA computes for a bf16 x bf16 -> f32 dot of x.astype(bf16). int8 and 4-bit weights are
// widened to f32 in registers and never stored as floats: the stream is a quarter (an eighth) of float32's bytes.
//
// Why: in a decode step the projections are skinny (8-64 rows against K x N weights), so they
// are a stream over the weights. XLA:CPU's dots read them at about half the rate a plain sum
// does (`python -m benchmarks.decode_dots_bandwidth`); with each panel contiguous the loop below streams them.
// A pass keeps R rows x 32 columns of sums in registers while it walks down K, so each weight
// is loaded once per R rows. Panels are claimed from a shared counter by the calling thread
// and by helper tasks on XLA's intra-op threads (work_sharing.h), as the attention kernel's items are.
//
// Every pass over a quantized panel widens it again, in registers. Widening each panel (or a chunk
// of it) once into a float32 scratch that all passes read gives the same bits but measured slower at
// 16-64 rows (`python -m benchmarks.quant_kernels`): the widening in registers hides behind the
// multiply-adds, while storing the floats and reading them back costs time of its own.
//
// Every output row is the same sum in the same order (k = 0, 1, ...; a quantized group's epilogue
// at the same k), whatever the number of rows or the row's place in the batch: a request's result
// does not depend on its neighbours (speculative decoding's greedy exactness relies on it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CBJAX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "e4m3.h"
#include "work_sharing.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel

// A group's scales (and 4-bit mins) are one row of [K / G, N]: a panel's 32 of them sit N floats after the
// last group's, a stride the hardware prefetcher does not follow, so each group's row would be a cache miss
// at one or a few rows, where the group's multiply-adds are too few to hide it. They are fetched
// kGroupsAhead groups early (benchmarks/quant_kernels.py).
constexpr int64_t kGroupsAhead = 2;

// int8 and 4-bit panels are prefetched 4 KiB ahead (128 steps of 32 bytes): with a quarter (an eighth) of float32's
// bytes per weight a step goes by in a few cycles, and 8-16 steps ahead, the distance float32's panels use, left
// the streams waiting on memory (`python -m benchmarks.quant_kernels --kernels float32 int8 int8-g32 int4-g32`).
constexpr int64_t kQuantizedAhead = 4096;

inline void prefetch_group_row(const float* row) {  // a panel's 32 floats: two cache lines
  __builtin_prefetch(row, 0, 3);
  __builtin_prefetch(row + 16, 0, 3);
}

// The weights' element type: float32, one k per step; or bf16, a pair of k per step, x given as
// bf16 pairs (one uint32 per pair, the lower k in the low half).
struct PanelF32 {
  using W = float;
  using X = float;
  static constexpr int64_t kPerStep = 1;
};
struct PanelBF16 {
  using W = uint16_t;
  using X = uint32_t;
  static constexpr int64_t kPerStep = 2;
};

inline float bf16_to_float(uint32_t half) {
  const uint32_t bits = half << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t float_to_bf16(float f) {  // round to nearest even, as XLA's convert; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

struct E4M3 {  // an fp8 (e4m3fn) weight's code: fp8 panels are read as int8 ones are, through widen16 / weight_value
  uint8_t bits;
};

#if defined(__AVX512F__)
constexpr int kRows = 8;  // rows of sums a pass keeps in registers: 2 x 8 of the 32 vector registers
// int8 and fp8 passes without mins, over more than 16 rows: 2 x 12 sums beside the two widened weight vectors, so
// each widening serves 12 rows (with mins, the group's scales and mins take registers too: 8). BENCHMARKS.md,
// "Quantized weights on the CPU".
constexpr int kRowsI8 = 12;

// A step's first or second 16 columns as floats: loaded, or int8 sign-extended and converted (exact).
inline __m512 widen16(const float* wp) { return _mm512_loadu_ps(wp); }
inline __m512 widen16(const int8_t* wp) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))));
}

// 16 fp8 weights as their values times 2^-8 (e4m3.h: exact, two shifts and a conversion), so a group's sums are
// multiplied by its scales times 2^8 (kFp8Unbias): the same products, a power of two apart. The NaN codes read as
// +-480 here, not NaN: quantizers saturate, so checkpoints hold none.
constexpr float kFp8Unbias = 256.0f;
inline __m512 widen16(const E4M3* wp) { return cbjax_kernels::e4m3x16_over_256(&wp->bits); }
// A step's 32 columns as two vectors of floats.
template <typename W>
inline void widen32(const W* wp, __m512& w0, __m512& w1) {
  w0 = widen16(wp);
  w1 = widen16(wp + 16);
}
#if defined(__AVX512BW__)
template <>
inline void widen32(const E4M3* wp, __m512& w0, __m512& w1) {
  cbjax_kernels::e4m3x32_over_256(&wp->bits, w0, w1);
}
#endif

// The first `width` of 32 columns (two vectors of 16) as masks for loads and stores.
inline __mmask16 low_mask(int64_t width) { return width >= 16 ? 0xffff : (1u << width) - 1; }
inline __mmask16 high_mask(int64_t width) { return width >= 32 ? 0xffff : width <= 16 ? 0 : (1u << (width - 16)) - 1; }

// R rows of x (rows `steps` X apart) times one panel (steps x 32 columns, contiguous) -> R x 32
// sums, all 32 stored at y (rows ldy floats apart).
template <int R, typename Tag>
void pass(const typename Tag::X* x, const typename Tag::W* panel, float* y, int64_t steps, int64_t ldy) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  constexpr int64_t stride = kPanel * Tag::kPerStep;  // weights per step of a panel
  const typename Tag::W* wp = panel;
  for (int64_t k = 0; k < steps; ++k, wp += stride) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + 8 * stride), _MM_HINT_T0);
    if constexpr (std::is_same_v<Tag, PanelF32>) {
      const __m512 w0 = widen16(wp), w1 = widen16(wp + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * steps + k]);
        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      }
    } else {
#if defined(__AVX512BF16__)
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * steps + k]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      }
#else  // widen the pairs to f32: even k in the high half of each 32-bit lane after a shift
      const __m512i both0 = _mm512_loadu_si512(wp), both1 = _mm512_loadu_si512(wp + 32);
      const __m512 lo0 = _mm512_castsi512_ps(_mm512_slli_epi32(both0, 16));
      const __m512 hi0 = _mm512_castsi512_ps(_mm512_and_si512(both0, _mm512_set1_epi32((int)0xffff0000u)));
      const __m512 lo1 = _mm512_castsi512_ps(_mm512_slli_epi32(both1, 16));
      const __m512 hi1 = _mm512_castsi512_ps(_mm512_and_si512(both1, _mm512_set1_epi32((int)0xffff0000u)));
      for (int r = 0; r < R; ++r) {
        const uint32_t pair = x[r * steps + k];
        const __m512 x0 = _mm512_set1_ps(bf16_to_float(pair & 0xffffu)), x1 = _mm512_set1_ps(bf16_to_float(pair >> 16));
        acc[r][0] = _mm512_fmadd_ps(x1, hi0, _mm512_fmadd_ps(x0, lo0, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(x1, hi1, _mm512_fmadd_ps(x0, lo1, acc[r][1]));
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}
#else
constexpr int kRows = 4;  // without AVX-512: fewer rows, the compiler's own vectors
constexpr int kRowsI8 = kRows;

template <int R, typename Tag>
void pass(const typename Tag::X* x, const typename Tag::W* panel, float* y, int64_t steps, int64_t ldy) {
  float acc[R][kPanel] = {};
  constexpr int64_t stride = kPanel * Tag::kPerStep;
  const typename Tag::W* wp = panel;
  for (int64_t k = 0; k < steps; ++k, wp += stride)
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<Tag, PanelF32>) {
        const float xv = x[r * steps + k];
        for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * static_cast<float>(wp[c]);
      } else {
        const uint32_t pair = x[r * steps + k];
        const float x0 = bf16_to_float(pair & 0xffffu), x1 = bf16_to_float(pair >> 16);
        for (int c = 0; c < kPanel; ++c) acc[r][c] += x0 * bf16_to_float(wp[2 * c]) + x1 * bf16_to_float(wp[2 * c + 1]);
      }
    }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], kPanel * sizeof(float));
}
#endif

// fn(std::integral_constant<int, r>) for the rows left after the full passes: one pass of exactly
// that many (each count its own unrolled loop).
template <int R, typename Fn>
void with_rows(int64_t rows, Fn fn) {
  if constexpr (R > 0) {
    if (rows == R) return fn(std::integral_constant<int, R>{});
    with_rows<R - 1>(rows, fn);
  }
}

// pass(m, std::integral_constant<int, R>) over rows m..m+R-1 for every row: passes of kRows, then one of the rest.
template <typename Pass>
void row_passes(int64_t rows, Pass pass) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) pass(m, std::integral_constant<int, kRows>{});
  if (m < rows) with_rows<kRows>(rows - m, [&](auto r) { pass(m, r); });
}

// The same over passes of at most MaxRows rows, as even as they can be (28 rows at 12: 10, 9 and 9, not 12, 12 and
// 4). A row's sums are the same in any pass, so the split sets only the speed.
template <int MaxRows, typename Pass>
void even_row_passes(int64_t rows, Pass pass) {
  const int64_t passes = (rows + MaxRows - 1) / MaxRows;
  for (int64_t i = 0, m = 0; i < passes; ++i) {
    const int64_t n = rows / passes + (i < rows % passes ? 1 : 0);
    with_rows<MaxRows>(n, [&](auto r) { pass(m, r); });
    m += n;
  }
}

// Panel p's 32 columns of every row: y[:, 32p : 32p + 32].
template <typename Tag>
void panel_product(const typename Tag::X* x, const typename Tag::W* w, float* y, int64_t rows, int64_t steps,
                   int64_t N, int64_t p) {
  const typename Tag::W* panel = w + p * steps * kPanel * Tag::kPerStep;
  row_passes(rows, [&](int64_t m, auto r) { pass<r.value, Tag>(x + m * steps, panel, y + m * N + p * kPanel, steps, N); });
}

// Panels shared out between the calling thread and XLA's intra-op threads.
template <typename Tag>
void multiply(ffi::ThreadPool& pool, const typename Tag::X* x, const typename Tag::W* w, float* y, int64_t rows,
              int64_t steps, int64_t panels, int64_t N) {
  cbjax_kernels::share_out(pool, panels, [=](int64_t p) { panel_product<Tag>(x, w, y, rows, steps, N, p); });
}

// Checks x's, w's (k_per_step k per step of a panel, N columns) and y's shapes; sets rows and K.
ffi::Error shapes(const ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> wd, int64_t k_per_step, int64_t N,
                  int64_t y_elements, int64_t& rows, int64_t& K) {
  const auto xd = x.dimensions();
  if (xd.size() < 1 || wd.size() != 3 || wd[2] != kPanel * k_per_step || (N + kPanel - 1) / kPanel != wd[0])
    return ffi::Error::InvalidArgument(
        "cbjax packed matmul: w must be [N / 32, K, 32] (bf16: [N / 32, ceil(K / 2), 64]; int8: [ceil(N / 32), K, 32] "
        "with scales [N] or [K / G, N])");
  K = xd.back();
  if ((K + k_per_step - 1) / k_per_step != wd[1] || y_elements * K != x.element_count() * N)
    return ffi::Error::InvalidArgument("cbjax packed matmul: x's last dim must be w's K and y must be [rows, N]");
  rows = K == 0 ? 0 : x.element_count() / K;
  return ffi::Error::Success();
}

ffi::Error matmul_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  int64_t rows, K;
  const int64_t panels = w.dimensions().size() == 3 ? w.dimensions()[0] : 0;
  if (auto error = shapes(x, w.dimensions(), 1, panels * kPanel, y->element_count(), rows, K); error.failure())
    return error;
  if (K == 0) std::fill(y->typed_data(), y->typed_data() + y->element_count(), 0.0f);
  if (rows == 0 || panels == 0 || K == 0) return ffi::Error::Success();
  multiply<PanelF32>(pool, x.typed_data(), w.typed_data(), y->typed_data(), rows, K, panels, panels * kPanel);
  return ffi::Error::Success();
}

// ---- bf16 weights on AMX tiles: 16 rows of x times 32 pairs of k per tile multiply ----
// Where the CPU has AMX (and Linux grants the process its tile state), every bf16 product runs here,
// whatever its rows: one path for every batch keeps a row's sums independent of its neighbours. A
// pass is 32 rows (16 where no more remain; x's padded rows are zeros) by a panel's 32 columns, four
// accumulator tiles walking down K 16 pairs at a time; pairs past the last whole tile (K not a multiple
// of 32) are added with the bf16 dot instruction. At a prompt step's hundreds of rows the tiles do 16x the
// multiply-adds of vdpbf16ps per instruction; at a decode step's few rows the pass streams the panel as the
// others do (`python -m benchmarks.decode_dots_bandwidth --packed --dtype bfloat16`).
#if defined(CBJAX_AMX)
constexpr int64_t kTile = 16;  // rows of x per pass, and pairs of k per tile multiply

// Whether the kernel may use AMX tiles: Linux hands them to a process that asks (arch_prctl), and
// CBJAX_CPU_AMX=0 keeps them off (the vdpbf16ps path, as on a CPU without AMX).
bool amx_granted() {
  static const bool granted = [] {
    const char* setting = std::getenv("CBJAX_CPU_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums of two 16-row blocks x the panel's columns 0-15 and 16-31 (16 rows x 16 floats each);
// 4, 5: the two blocks of x (16 rows x 16 pairs); 6, 7: the panel's 16 pairs of k for columns 0-15 and 16-31.
// Each loaded tile of x serves both column halves and each tile of the panel both row blocks.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// The sums of tile `t` (16 rows x 16 columns), plus the tail pairs s = whole..steps-1 by vdpbf16ps, for the
// first `rows` rows: x rows `steps` pairs apart, as the panel's rows, y rows ldy floats apart.
template <int T>
void store_sums(const uint32_t* x, const uint16_t* panel, int64_t whole, int64_t steps, float* y, int64_t rows,
                int64_t ldy) {
  alignas(64) float sums[kTile][16];
  if constexpr (T == 0) _tile_stored(0, sums, 64);  // (the tile number is part of the instruction)
  else if constexpr (T == 1) _tile_stored(1, sums, 64);
  else if constexpr (T == 2) _tile_stored(2, sums, 64);
  else _tile_stored(3, sums, 64);
  const int64_t half = (T % 2) * 16;  // this tile's columns within the panel
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc = _mm512_load_ps(sums[r]);
    for (int64_t s = whole; s < steps; ++s)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x[r * steps + s]),
                             (__m512bh)_mm512_loadu_si512(panel + s * 2 * kPanel + 2 * half));
    _mm512_storeu_ps(y + r * ldy + half, acc);
  }
}

// R = 1 or 2 blocks of 16 rows of x (bf16 pairs, `steps` pairs a row) times one panel (`steps` pairs of
// k x 64 bf16) -> the sums of the first `rows` of them at y (rows ldy floats apart).
template <int R>
void amx_pass(const uint32_t* x, const uint16_t* panel, int64_t steps, float* y, int64_t rows, int64_t ldy) {
  const int64_t whole = steps / kTile * kTile;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < whole; s += kTile) {
    _tile_loadd(6, panel + s * 2 * kPanel, 4 * kPanel);
    _tile_loadd(7, panel + s * 2 * kPanel + kPanel, 4 * kPanel);
    _tile_loadd(4, x + s, steps * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, x + kTile * steps + s, steps * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t first = std::min(kTile, rows);
  store_sums<0>(x, panel, whole, steps, y, first, ldy);
  store_sums<1>(x, panel, whole, steps, y, first, ldy);
  if constexpr (R == 2) {
    store_sums<2>(x + kTile * steps, panel, whole, steps, y + kTile * ldy, rows - kTile, ldy);
    store_sums<3>(x + kTile * steps, panel, whole, steps, y + kTile * ldy, rows - kTile, ldy);
  }
}

// Panel p's 32 columns of every row, 32 rows a pass (16 in the last where 16 or fewer remain); x has a
// multiple of 16 rows.
void amx_panel_product(const uint32_t* x, const uint16_t* w, float* y, int64_t rows, int64_t steps, int64_t N, int64_t p) {
  configure_tiles();  // per item: a thread of XLA's pool may have run anything since its last one
  const uint16_t* panel = w + p * steps * 2 * kPanel;
  for (int64_t m = 0; m < rows; m += 2 * kTile) {
    float* out = y + m * N + p * kPanel;
    if (rows - m > kTile)
      amx_pass<2>(x + m * steps, panel, steps, out, std::min(2 * kTile, rows - m), N);
    else
      amx_pass<1>(x + m * steps, panel, steps, out, rows - m, N);
  }
  _tile_release();
}
#endif

// Which bf16 path this build takes on this machine: "amx", "avx512-bf16" (vdpbf16ps), "avx512" (pairs
// widened to float32) or "portable" (plain loops). The engine names it in its start-up log.
extern "C" const char* CbjaxBf16MatmulPath() {
#if defined(CBJAX_AMX)
  if (amx_granted()) return "amx";
#endif
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

// x rounded to bf16 (to nearest even), two k per uint32 (the lower k in the low half), `steps` pairs a
// row and a zero after an odd K; `padded_rows` rows, the ones past x's zeros.
std::vector<uint32_t> bf16_pairs(const float* x, int64_t rows, int64_t K, int64_t steps, int64_t padded_rows) {
  std::vector<uint32_t> pairs(padded_rows * steps, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    uint32_t* out = pairs.data() + r * steps;
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 32 <= K; k += 32)  // 32 floats -> 16 pairs, in order
      _mm512_storeu_si512(out + k / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k)));
#endif
    for (; k < K; k += 2) {
      const uint32_t hi = k + 1 < K ? float_to_bf16(xr[k + 1]) : 0u;
      out[k / 2] = float_to_bf16(xr[k]) | (hi << 16);
    }
  }
  return pairs;
}

ffi::Error matmul_bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  int64_t rows, K;
  const int64_t panels = w.dimensions().size() == 3 ? w.dimensions()[0] : 0;
  if (auto error = shapes(x, w.dimensions(), 2, panels * kPanel, y->element_count(), rows, K); error.failure())
    return error;
  const int64_t steps = (K + 1) / 2;
  if (K == 0) std::fill(y->typed_data(), y->typed_data() + y->element_count(), 0.0f);
  if (rows == 0 || panels == 0 || K == 0) return ffi::Error::Success();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t N = panels * kPanel;
  // (The caller waits for every panel, so the pairs outlive the helpers' reads.)
#if defined(CBJAX_AMX)
  if (amx_granted()) {
    const std::vector<uint32_t> pairs = bf16_pairs(x.typed_data(), rows, K, steps, (rows + kTile - 1) / kTile * kTile);
    const uint32_t* xp = pairs.data();
    cbjax_kernels::share_out(pool, panels, [=](int64_t p) { amx_panel_product(xp, wp, yp, rows, steps, N, p); });
    return ffi::Error::Success();
  }
#endif
  const std::vector<uint32_t> pairs = bf16_pairs(x.typed_data(), rows, K, steps, rows);
  multiply<PanelBF16>(pool, pairs.data(), wp, yp, rows, steps, panels, N);
  return ffi::Error::Success();
}

// ---- int8 groups: w[k, n] = q[k, n] * scales[g, n] (+ mins[g, n]), g = k / G; scales [N] is one group (G = K) ----
// q as int8 panels [ceil(N / 32), K, 32], zero columns padding N up to a panel. Per row and group the
// kernel sums x_k * q (q widened to f32) in registers and multiplies the sum by the group's scales at its
// end: y = scales[0] * sum_0, then y = scales[g] * sum_g + y for each further group (one FMA). With mins
// [K / G, N] (GGUF's Q5_1, Q5_K, Q2_K, and fused kernels whose 4-bit parts were widened to int8: gguf_forms.py)
// each group then adds mins * (the group's sum of x), as the 4-bit kernel does.

// Each row's sum of x over each group of G inputs, [rows, K / G], summed in double: the mins' factor.
std::vector<float> group_sums(const float* x, int64_t rows, int64_t K, int64_t groups) {
  std::vector<float> sums(rows * groups);
  const int64_t group = K / groups;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      double sum = 0.0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x[r * K + k];
      sums[r * groups + g] = static_cast<float>(sum);
    }
  return sums;
}

#if defined(__AVX512F__)
// R rows of x (K apart) times one int8 panel -> R x 32 outputs, the first `width` at y (rows ldy apart),
// where a group's sums are added at its end. scales (and mins) point at the panel's first column (groups N
// apart); x_sums (kMins only) at the first row's group sums (rows `groups` apart).
template <int R, bool kMins, typename W>
void pass_i8(const float* x, const float* x_sums, const W* panel, const float* scales, const float* mins, float* y,
             int64_t K, int64_t group, int64_t N, int64_t ldy, int64_t width) {
  const int64_t groups = K / group;
  const __mmask16 low = low_mask(width), high = high_mask(width);
  const W* wp = panel;
  for (int64_t g = 0; g < groups; ++g) {
    if (g + kGroupsAhead < groups) {
      prefetch_group_row(scales + (g + kGroupsAhead) * N);
      if constexpr (kMins) prefetch_group_row(mins + (g + kGroupsAhead) * N);
    }
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; ++k, wp += kPanel) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kQuantizedAhead), _MM_HINT_T0);
      __m512 w0, w1;
      widen32(wp, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * K + k]);
        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    __m512 s0 = _mm512_maskz_loadu_ps(low, scales + g * N), s1 = _mm512_maskz_loadu_ps(high, scales + g * N + 16);
    if constexpr (std::is_same_v<W, E4M3>) {
      s0 = _mm512_mul_ps(s0, _mm512_set1_ps(kFp8Unbias));
      s1 = _mm512_mul_ps(s1, _mm512_set1_ps(kFp8Unbias));
    }
    __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    if constexpr (kMins) {
      m0 = _mm512_maskz_loadu_ps(low, mins + g * N);
      m1 = _mm512_maskz_loadu_ps(high, mins + g * N + 16);
    }
    for (int r = 0; r < R; ++r) {
      float* out = y + r * ldy;
      __m512 y0, y1;
      if (g == 0) {
        y0 = _mm512_mul_ps(acc[r][0], s0);
        y1 = _mm512_mul_ps(acc[r][1], s1);
      } else {
        y0 = _mm512_fmadd_ps(acc[r][0], s0, _mm512_maskz_loadu_ps(low, out));
        y1 = _mm512_fmadd_ps(acc[r][1], s1, _mm512_maskz_loadu_ps(high, out + 16));
      }
      if constexpr (kMins) {
        const __m512 sum = _mm512_set1_ps(x_sums[r * groups + g]);
        y0 = _mm512_fmadd_ps(sum, m0, y0);
        y1 = _mm512_fmadd_ps(sum, m1, y1);
      }
      _mm512_mask_storeu_ps(out, low, y0);
      _mm512_mask_storeu_ps(out + 16, high, y1);
    }
  }
}
#else
inline float weight_value(int8_t q) { return static_cast<float>(q); }
inline float weight_value(E4M3 q) {
  static const cbjax_kernels::E4M3Table table;
  return table.value[q.bits];
}

template <int R, bool kMins, typename W>
void pass_i8(const float* x, const float* x_sums, const W* panel, const float* scales, const float* mins, float* y,
             int64_t K, int64_t group, int64_t N, int64_t ldy, int64_t width) {
  const int64_t groups = K / group;
  float total[R][kPanel] = {};
  const W* wp = panel;
  for (int64_t g = 0; g < groups; ++g) {
    float acc[R][kPanel] = {};
    for (int64_t k = g * group; k < (g + 1) * group; ++k, wp += kPanel)
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * K + k];
        for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * weight_value(wp[c]);
      }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < width; ++c) {
        total[r][c] = g == 0 ? acc[r][c] * scales[c] : acc[r][c] * scales[g * N + c] + total[r][c];
        if constexpr (kMins) total[r][c] += x_sums[r * groups + g] * mins[g * N + c];
      }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, total[r], width * sizeof(float));
}
#endif

// int8 (or fp8) panels with scales [N] or [K / G, N], and with kMins mins [K / G, N] beside them.
template <bool kMins, typename W, typename WeightBuffer>
ffi::Error multiply_i8(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, const WeightBuffer& w,
                       const ffi::Buffer<ffi::F32>& scales, const float* mins, ffi::ResultBuffer<ffi::F32>& y) {
  const auto sd = scales.dimensions();
  if (sd.size() != 1 && sd.size() != 2)
    return ffi::Error::InvalidArgument("cbjax packed matmul: int8 scales must be [N] or [K / G, N]");
  const int64_t groups = sd.size() == 2 ? sd[0] : 1, N = sd.back();
  int64_t rows, K;
  if (auto error = shapes(x, w.dimensions(), 1, N, y->element_count(), rows, K); error.failure()) return error;
  if (groups == 0 || K % groups != 0)
    return ffi::Error::InvalidArgument("cbjax packed matmul: int8 scales [K / G, N] need a group count dividing K");
  if (K == 0) std::fill(y->typed_data(), y->typed_data() + y->element_count(), 0.0f);
  if (rows == 0 || N == 0 || K == 0) return ffi::Error::Success();
  const int64_t group = K / groups;
  const float* xp = x.typed_data();
  // Outlives the helpers' reads: the caller waits for every panel.
  const std::vector<float> x_sums = kMins ? group_sums(xp, rows, K, groups) : std::vector<float>();
  const float* xs = x_sums.data();
  const W* q = static_cast<const W*>(w.untyped_data());
  const float* s = scales.typed_data();
  float* out = y->typed_data();
  cbjax_kernels::share_out(pool, w.dimensions()[0], [=](int64_t p) {
    const int64_t width = std::min(kPanel, N - p * kPanel), c = p * kPanel;
    const auto one = [&](int64_t m, auto r) {
      pass_i8<r.value, kMins>(xp + m * K, kMins ? xs + m * groups : nullptr, q + p * K * kPanel, s + c,
                              kMins ? mins + c : nullptr, out + m * N + c, K, group, N, N, width);
    };
    if constexpr (kMins) {
      row_passes(rows, one);
    } else if (rows <= 2 * kRows) {
      row_passes(rows, one);  // up to 16 rows passes of 8 measured a little faster
    } else {
      even_row_passes<kRowsI8>(rows, one);
    }
  });
  return ffi::Error::Success();
}

ffi::Error matmul_i8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                     ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  return multiply_i8<false, int8_t>(pool, x, w, scales, nullptr, y);
}

// (XLA's FFI has no typed buffer of fp8: the weights come untyped and their type is checked here.)
ffi::Error matmul_f8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::F8E4M3FN)
    return ffi::Error::InvalidArgument("cbjax packed matmul: CbjaxPackedMatmulF8 takes float8_e4m3fn panels");
  return multiply_i8<false, E4M3>(pool, x, w, scales, nullptr, y);
}

ffi::Error matmul_i8_mins(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto sd = scales.dimensions(), md = mins.dimensions();
  if (sd.size() != 2 || md.size() != 2 || sd[0] != md[0] || sd[1] != md[1])
    return ffi::Error::InvalidArgument("cbjax packed matmul: int8 scales and mins must both be [K / G, N]");
  return multiply_i8<true, int8_t>(pool, x, w, scales, mins.typed_data(), y);
}

// ---- 4-bit groups: w[k, n] = scales[g, n] * grid[q[k, n]] + mins[g, n], q in 0..15, g = k / G ----
// q as nibble panels u8 [ceil(N / 32), K / 2, 32]: byte (p, s, c) holds column 32p + c's q at k = 2s
// (low nibble) and 2s + 1 (high nibble); zero columns pad N up to a panel. scales and mins [K / G, N], or by
// panel [ceil(N / 32), K / G, 32] (each panel's groups one after another). Per row and group the kernel
// sums x_k * q (q widened to f32 in registers) and adds scales * that sum + mins * (the group's sum of
// x), so weights never exist as floats. The group sums of x are made once per call, in double.
// At 16-64 rows a pass is bound by float32 multiply-adds. AMX tiles were tried for them and not kept: x cut
// into three bf16 parts that sum to x exactly, q widened to bf16 pairs by a table lookup, each 32-k group's
// tile sums stored and finished by the vector units, the three stages pipelined over k-tiles. It ran about
// as fast as these passes at 16 and 64 rows and at half their speed at 1 (`python -m benchmarks.quant_kernels`):
// every group costs tile loads of x's three parts and tile stores of its sums, which did not overlap the
// vector work. A second design (x's parts as tile rows, five rows of x a tile) was slower at 1-512 rows, and
// passes over half a panel with 16 or 24 rows slower than these 8-row ones (BENCHMARKS.md, "Quantized weights").

constexpr int kRowsQ4 = 8;  // rows of a group's sums in registers (2 x 8), beside 4 weight vectors
// What each nibble q stands for in w = scales * grid[q] + mins: q itself (Q4_0, Q4_1, Q4_K, int4), unless the
// caller gives its own 16 values (CbjaxPackedMatmulQ4Grid: GGUF's IQ4_NL and IQ4_XS, a non-linear grid).
constexpr float kNibbleValues[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#if defined(__AVX512F__)
// Columns 16h..16h+15 of a step: their bytes widened to 32-bit lanes, the low nibbles (k = 2s) and the high ones
// (2s + 1) as the grid's floats (`values`: grid[0..15]).
inline void load_nibbles(const uint8_t* wp, const __m512 values, __m512& lo, __m512& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
  lo = _mm512_permutexvar_ps(bytes, values);  // vpermps reads each index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
}

// R rows of x (K apart; their group sums `groups` apart) times one nibble panel -> R x 32 outputs,
// the first `width` at y (rows ldy apart), which holds the sum over the groups done so far: a group's
// sums stay in registers and are added to y at its end. scales/mins point at the panel's first group's 32
// (a group's `stride` floats after the last one's); grid holds the 16 values the nibbles index.
template <int R>
void pass_q4(const float* x, const float* x_sums, const uint8_t* panel, const float* scales, const float* mins,
             const float* grid, float* y, int64_t K, int64_t group, int64_t stride, int64_t ldy, int64_t width) {
  const int64_t groups = K / group;
  const __m512 values = _mm512_loadu_ps(grid);
  const __mmask16 low = width >= 16 ? 0xffff : (1u << width) - 1;
  const __mmask16 high = width >= 32 ? 0xffff : width <= 16 ? 0 : (1u << (width - 16)) - 1;
  const uint8_t* wp = panel;
  for (int64_t g = 0; g < groups; ++g) {
    if (g + kGroupsAhead < groups) {
      prefetch_group_row(scales + (g + kGroupsAhead) * stride);
      prefetch_group_row(mins + (g + kGroupsAhead) * stride);
    }
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2, wp += kPanel) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + kQuantizedAhead), _MM_HINT_T0);
      __m512 lo0, hi0, lo1, hi1;
      load_nibbles(wp, values, lo0, hi0);
      load_nibbles(wp + 16, values, lo1, hi1);
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * K + k]), x1 = _mm512_set1_ps(x[r * K + k + 1]);
        acc[r][0] = _mm512_fmadd_ps(x1, hi0, _mm512_fmadd_ps(x0, lo0, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(x1, hi1, _mm512_fmadd_ps(x0, lo1, acc[r][1]));
      }
    }
    const float *group_scales = scales + g * stride, *group_mins = mins + g * stride;
    const __m512 s0 = _mm512_maskz_loadu_ps(low, group_scales), s1 = _mm512_maskz_loadu_ps(high, group_scales + 16);
    const __m512 m0 = _mm512_maskz_loadu_ps(low, group_mins), m1 = _mm512_maskz_loadu_ps(high, group_mins + 16);
    for (int r = 0; r < R; ++r) {
      float* out = y + r * ldy;
      const __m512 sum = _mm512_set1_ps(x_sums[r * groups + g]);
      const __m512 t0 = g == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(low, out);
      const __m512 t1 = g == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(high, out + 16);
      _mm512_mask_storeu_ps(out, low, _mm512_fmadd_ps(sum, m0, _mm512_fmadd_ps(acc[r][0], s0, t0)));
      _mm512_mask_storeu_ps(out + 16, high, _mm512_fmadd_ps(sum, m1, _mm512_fmadd_ps(acc[r][1], s1, t1)));
    }
  }
}
#else
template <int R>
void pass_q4(const float* x, const float* x_sums, const uint8_t* panel, const float* scales, const float* mins,
             const float* grid, float* y, int64_t K, int64_t group, int64_t stride, int64_t ldy, int64_t width) {
  const int64_t groups = K / group;
  float total[R][kPanel] = {};
  const uint8_t* wp = panel;
  for (int64_t g = 0; g < groups; ++g) {
    float acc[R][kPanel] = {};
    for (int64_t k = g * group; k < (g + 1) * group; k += 2, wp += kPanel)
      for (int r = 0; r < R; ++r) {
        const float x0 = x[r * K + k], x1 = x[r * K + k + 1];
        for (int c = 0; c < kPanel; ++c) acc[r][c] += x0 * grid[wp[c] & 0x0f] + x1 * grid[wp[c] >> 4];
      }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < width; ++c)
        total[r][c] += acc[r][c] * scales[g * stride + c] + x_sums[r * groups + g] * mins[g * stride + c];
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, total[r], width * sizeof(float));
}
#endif

// Nibble panels with scales and mins, the nibbles standing for grid[q] (16 floats).
ffi::Error multiply_q4(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::U8>& w,
                       const ffi::Buffer<ffi::F32>& scales, const ffi::Buffer<ffi::F32>& mins, const float* grid,
                       ffi::ResultBuffer<ffi::F32>& y) {
  const auto sd = scales.dimensions(), md = mins.dimensions(), wd = w.dimensions(), xd = x.dimensions();
  const bool panel_major = sd.size() == 3;  // [ceil(N / 32), K / G, 32] rather than [K / G, N]
  if ((sd.size() != 2 && !panel_major) || md.size() != sd.size() || !std::equal(sd.begin(), sd.end(), md.begin()) ||
      (panel_major && sd[2] != kPanel) || xd.size() < 1)
    return ffi::Error::InvalidArgument(
        "cbjax packed matmul: 4-bit scales and mins must both be [K / G, N] or [ceil(N / 32), K / G, 32]");
  const int64_t K = xd.back(), groups = panel_major ? sd[1] : sd[0];
  const int64_t N = panel_major ? (y->dimensions().size() == 0 ? 0 : y->dimensions().back()) : sd[1];
  if (wd.size() != 3 || wd[2] != kPanel || wd[0] != (N + kPanel - 1) / kPanel || (panel_major && sd[0] != wd[0]))
    return ffi::Error::InvalidArgument("cbjax packed matmul: 4-bit w must be u8 [ceil(N / 32), K / 2, 32]");
  if (2 * wd[1] != K || groups == 0 || K % groups != 0 || (K / groups) % 2 != 0 ||
      y->element_count() * K != x.element_count() * N)
    return ffi::Error::InvalidArgument(
        "cbjax packed matmul: 4-bit x's last dim must be 2 x w's K / 2, an even group size G = K / groups, y [rows, N]");
  // Panel p's scales (and mins) start `panel_scales` floats after panel p - 1's, and a group's 32 `scale_stride`
  // floats after the last group's: rows of [K / G, N], or one after another by panel (matmul.py's pack_group_rows).
  const int64_t scale_stride = panel_major ? kPanel : N, panel_scales = panel_major ? groups * kPanel : kPanel;
  const int64_t rows = K == 0 ? 0 : x.element_count() / K, group = K / groups;
  if (rows == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const std::vector<float> x_sums = group_sums(xp, rows, K, groups);  // outlives the helpers' reads: the caller waits
  const uint8_t* q = w.typed_data();
  const float *s = scales.typed_data(), *m = mins.typed_data(), *xs = x_sums.data();
  float* out = y->typed_data();
  cbjax_kernels::share_out(pool, wd[0], [=](int64_t p) {
    const uint8_t* panel = q + p * (K / 2) * kPanel;
    const int64_t width = std::min(kPanel, N - p * kPanel), c = p * kPanel;
    const float *sp = s + p * panel_scales, *mp = m + p * panel_scales;
    int64_t r = 0;
    for (; r + kRowsQ4 <= rows; r += kRowsQ4)
      pass_q4<kRowsQ4>(xp + r * K, xs + r * groups, panel, sp, mp, grid, out + r * N + c, K, group, scale_stride, N,
                       width);
    if (r < rows)
      with_rows<kRowsQ4>(rows - r, [&](auto n) {
        pass_q4<n.value>(xp + r * K, xs + r * groups, panel, sp, mp, grid, out + r * N + c, K, group, scale_stride, N,
                         width);
      });
  });
  return ffi::Error::Success();
}

ffi::Error matmul_q4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                     ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  return multiply_q4(pool, x, w, scales, mins, kNibbleValues, y);
}

ffi::Error matmul_q4_grid(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::F32> grid,
                          ffi::ResultBuffer<ffi::F32> y) {
  if (grid.element_count() != 16)
    return ffi::Error::InvalidArgument("cbjax packed matmul: a 4-bit grid must be 16 floats, one per nibble value");
  return multiply_q4(pool, x, w, scales, mins, grid.typed_data(), y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulF32, matmul_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulBF16, matmul_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulI8, matmul_i8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulF8, matmul_f8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulI8Mins, matmul_i8_mins,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulQ4, matmul_q4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulQ4Grid, matmul_q4_grid,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
