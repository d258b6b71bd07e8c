// y = x @ w for XLA:CPU (an XLA FFI custom call), with w packed in 32-column panels.
//
//   x  f32 [rows, K]        (any leading dims: all but the last are rows)
//   w  f32 [N / 32, K, 32]  panel p holds columns 32p..32p+31 of the [K, N] weight, row by row
//   y  f32 [rows, N]
//
// Why: in a decode step the projections are skinny (8-64 rows against K x N weights), so they
// are a stream over the weights. XLA:CPU's dots read them at about half the rate a plain sum
// does (BENCHMARKS.md, section 15); with each panel contiguous the loop below streams them.
// A pass keeps R rows x 32 columns of sums in registers while it walks down K, so each weight
// is loaded once per R rows. Panels are claimed from a shared counter by the calling thread
// and by helper tasks on XLA's intra-op threads, as the attention kernel's work items are.
//
// Every output row is the same sum in the same order (k = 0, 1, ...) whatever the number of
// rows or the row's place in the batch: a request's result does not depend on its neighbours.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel

#if defined(__AVX512F__)
constexpr int kRows = 8;  // rows of sums a pass keeps in registers: 2 x 8 of the 32 vector registers

// R rows of x (rows K floats apart) times one panel (K x 32, contiguous) -> R x 32 sums, stored at y
// (rows ldy floats apart).
template <int R>
void pass(const float* x, const float* panel, float* y, int64_t K, int64_t ldy) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* wp = panel;
  for (int64_t k = 0; k < K; ++k, wp += kPanel) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + 8 * kPanel), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}
#else
constexpr int kRows = 4;  // without AVX-512: fewer rows, the compiler's own vectors

template <int R>
void pass(const float* x, const float* panel, float* y, int64_t K, int64_t ldy) {
  float acc[R][kPanel] = {};
  const float* wp = panel;
  for (int64_t k = 0; k < K; ++k, wp += kPanel)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * wp[c];
    }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(acc[r]));
}
#endif

// Passes of kRows rows, then one pass of the rows left (each row count its own unrolled loop).
template <int R = kRows>
void tail(const float* x, const float* panel, float* y, int64_t K, int64_t ldy, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return pass<R>(x, panel, y, K, ldy);
    tail<R - 1>(x, panel, y, K, ldy, rows);
  }
}

void panel_product(const float* x, const float* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t p) {
  const float* panel = w + p * K * kPanel;
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) pass<kRows>(x + m * K, panel, y + m * N + p * kPanel, K, N);
  if (m < rows) tail(x + m * K, panel, y + m * N + p * kPanel, K, N, rows - m);
}

struct PanelWork {
  std::atomic<int64_t> next{0}, done{0};
};

ffi::Error packed_matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 3 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("cbjax packed matmul: w must be [N / 32, K, 32] and x at least 1-d");
  const int64_t K = wd[1], panels = wd[0], N = panels * kPanel;
  if (xd.back() != K || y->element_count() * K != x.element_count() * N)
    return ffi::Error::InvalidArgument("cbjax packed matmul: x's last dim must be w's K and y must be [rows, N]");
  const int64_t rows = K == 0 ? 0 : x.element_count() / K;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (rows == 0 || panels == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(yp, yp + rows * N, 0.0f);
    return ffi::Error::Success();
  }
  // Helpers hold the counter by shared_ptr: one that starts after the call returned finds no
  // panel left and touches nothing else.
  auto work = std::make_shared<PanelWork>();
  auto drain = [=](PanelWork& state) {
    for (int64_t p; (p = state.next.fetch_add(1)) < panels;) {
      panel_product(xp, wp, yp, rows, K, N, p);
      state.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, panels - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, drain] { drain(*work); });
  drain(*work);
  while (work->done.load(std::memory_order_acquire) < panels) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxPackedMatmulF32, packed_matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
