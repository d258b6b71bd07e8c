// A first try at a skinny-matrix dot for decode steps (benchmarks/skinny_dot/run.py builds and
// times it): y[M,N] = x[M,K] @ w[K,N] in float32, w in the model's [in, out] layout, N a multiple
// of 32. Each thread takes a range of 32-column panels; a panel keeps 8 rows x 32 columns of sums
// in AVX-512 registers while it walks down K. Measured slower than XLA's own dots (BENCHMARKS.md):
// walking one panel down an [in, out] matrix reads 128 bytes per row, one row (N x 4 bytes)
// apart, which the hardware prefetchers do not follow.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// row_stride: floats from one k to the next within a panel (N for the [in, out] layout, 32 for
// panels packed one after another, [N / 32][K][32]); panel_stride: floats from one panel to the next.
static void chunk(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
                  int64_t row_stride, int64_t panel_stride) {
  // 32 columns (2 vectors) at a time, rows in passes of 8.
  for (int64_t n = n0; n < n1; n += 32) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t rows = std::min<int64_t>(8, M - m0);
      __m512 acc[8][2];
      for (int r = 0; r < 8; ++r) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
      const float* wp = w + (n / 32) * panel_stride;
      for (int64_t k = 0; k < K; ++k, wp += row_stride) {
        _mm_prefetch((const char*)(wp + 8 * row_stride), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        for (int r = 0; r < 8; ++r) {
          if (r >= rows) break;
          const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k]);
          acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(y + (m0 + r) * N + n, acc[r][0]);
        _mm512_storeu_ps(y + (m0 + r) * N + n + 16, acc[r][1]);
      }
    }
  }
}

static void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int threads,
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
