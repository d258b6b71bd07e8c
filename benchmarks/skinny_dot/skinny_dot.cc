// A first try at a skinny-matrix dot for decode steps (benchmarks/skinny_dot/run.py builds and
// times it): y[M,N] = x[M,K] @ w[K,N] in float32, N a multiple of 32. Each thread takes a range of
// 32-column panels; a pass keeps 8 (or 12) rows x 32 columns of sums in AVX-512 registers while it
// walks down K. On the model's [in, out] layout it is slower than XLA's own dots (BENCHMARKS.md):
// a panel is 128 bytes of each row, rows N x 4 bytes apart, which the hardware prefetchers do not
// follow. With each panel packed contiguous ([N / 32][K][32]) it streams the weights.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// row_stride: floats from one k to the next within a panel (N for the [in, out] layout, 32 for
// panels packed one after another, [N / 32][K][32]); panel_stride: floats from one panel to the next.
// R rows x 32 columns of sums stay in registers while a pass walks down K (2R + 3 of the 32).
// 32 weights of one row of a panel, as two vectors of float32.
static inline void load32(const float* wp, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(wp);
  w1 = _mm512_loadu_ps(wp + 16);
}
static inline void load32(const uint16_t* wp, __m512& w0, __m512& w1) {  // bfloat16: the high half of a float32
  const __m512i both = _mm512_loadu_si512(wp);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(both)), 16));
  w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1)), 16));
}

template <int R, typename W>
static void pass(const float* x, const W* wp, float* y, int64_t rows, int64_t K, int64_t N, int64_t n,
                 int64_t row_stride) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, wp += row_stride) {
    _mm_prefetch((const char*)(wp + 8 * row_stride), _MM_HINT_T0);
    __m512 w0, w1;
    load32(wp, w0, w1);
    for (int r = 0; r < R; ++r) {  // a full pass unrolls; the last one reads padding rows it never stores
      const __m512 xv = _mm512_set1_ps(x[std::min<int64_t>(r, rows - 1) * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    _mm512_storeu_ps(y + r * N + n, acc[r][0]);
    _mm512_storeu_ps(y + r * N + n + 16, acc[r][1]);
  }
}

static int tile_rows = 8;  // set by set_tile_rows: 8 or 12

template <typename W>
static void chunk(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
                  int64_t row_stride, int64_t panel_stride) {
  for (int64_t n = n0; n < n1; n += 32) {
    const W* wp = w + (n / 32) * panel_stride;
    for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
      const int64_t rows = std::min<int64_t>(tile_rows, M - m0);
      if (tile_rows == 12)
        pass<12>(x + m0 * K, wp, y + m0 * N, rows, K, N, n, row_stride);
      else
        pass<8>(x + m0 * K, wp, y + m0 * N, rows, K, N, n, row_stride);
    }
  }
}

extern "C" void set_tile_rows(int rows) { tile_rows = rows; }

template <typename W>
static void run(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int threads,
                int64_t row_stride, int64_t panel_stride) {
  const int64_t blocks = N / 32;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; ++t) {
    const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
    chunk(x, w, y, M, K, N, b0 * 32, b1 * 32, row_stride, panel_stride);
  }
}

extern "C" void skinny_matmul(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  run(x, w, y, M, K, N, threads, N, 32);
}

// The same with w packed as [N / 32][K][32]: each panel is contiguous.
extern "C" void skinny_matmul_packed(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  run(x, w, y, M, K, N, threads, 32, 32 * K);
}

// Packed as above, the weights in bfloat16 (widened to float32 in registers; x and the sums float32).
extern "C" void skinny_matmul_packed_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                                          int threads) {
  run(x, w, y, M, K, N, threads, 32, 32 * K);
}
