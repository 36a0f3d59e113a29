// The sorted SOFT top-k (softops.soft_topk) on the CPU, row by row: the candidate set, its
// semi-dual Newton solve and the implicit backward (docs/math.md §2.2-2.4). The full problem's
// Newton-first solve is softops/_core/_newton_kernel.cpp.
//
// Built ahead of time by `python -m softops._kernels` and registered as the operators
// softops_sorted::*; softops/topk/_sorted.py wraps them in the operators of the kernel layer
// (softops._kernels.define), whose torch references are the torch code of that module. Everything is computed in double, whatever the rows' dtype; the rows
// spread over torch's intra-op threads (at::parallel_for), each task with its own scratch (no
// allocation per row).
//
// The candidate problem of a row (solve_rows): one pass finds its k+1 largest scores (an
// insertion buffer, or by rank in a row of at most 32; their indices are the op's), a second
// bins the gaps below the (k+1)-th in quarters of epsilon and keeps the entries that may be
// candidates; the cut drops the farthest bins while the sum of their bounds
// stays within tau. The candidates are then grouped by their home (their hard rank), and each
// state v of the columns is evaluated without an exponential per entry and target: with the
// centre c, e_i = exp((c - y_i)/eps) once per row and rho_j = exp(v_{j+1} - v_j + (b_j - c)/eps)
// once per state, P_{i,j+1} / P_{ij} = e_i rho_j, a product recurrence from each entry's home
// upward and downward, in registers for a vector of the entries of one home at a time (one pass
// over the entries per state). The rest's entries are sorted by their gap bin, and each state
// bounds, per bin, the plan of the targets far from the rest (log P_(k-r) <= r log(ie) - the
// sum of the r column log-factors next to the rest): an entry's downward recurrence stops at the
// first target where its bin's bound is below delta = min(2^-60, tau 2^-20 / m), and every
// later loop over a column's entries stops at the end of the entries formed there (lim). Rows
// whose factors would leave the range take one exponential per target (eval_general). The
// Newton system is the grounded Laplacian of the couplings, in closed form for three targets or
// fewer, else by the equilibrated Cholesky.
//
// Short rows (4-12 targets, in the recurrence's range, up to kLaneMaxM candidates) are solved
// a vector of rows at a time, one row per at::vec lane (solve_rows_impl's and vjp_rows_impl's
// flush(): newton_lanes, eval_lanes, couplings_lanes, solve_lanes): the same arithmetic over the
// lanes, each lane with its own Newton control; a lane the vector code cannot finish as the
// one-row code would (a state out of range, a system that needs the larger jitter or is
// singular) is handed to the one-row code. The lanes' slots (a row's entries in its grouped
// order) stop the same way: per state, column j is formed at the slots below the largest of the
// lanes' lim[j] (lane_limits) and every later loop over a column's slots stops there.
//
// Rows of k = n entries, 4 to 8 (with AVX-512), are also prepared eight at a time, as vectors of
// rows (ranked_block in the forward, ranked_block_vjp in the backward, both through ranked_lanes:
// the one-row preparation's numbers, bit for bit), and such a group's weights are written at once
// (finish_ranked_lanes); rows that fail a check of the preparation take the one-row code.
//
// Flags: status 0 the row is solved (within tol), 1 the kernel left it above tol (the torch
// code solves it), 2 the row has an entry that is not finite or near the largest finite value
// (the caller solves it in full). The backward (vjp_rows) recomputes the candidate set and the
// plan from the saved states; `safe` false: its system is singular (the torch code redoes it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Rows per task of at::parallel_for: about this many (entries x targets) of work, a millisecond or
// so. A smaller task costs more than it saves where the other threads are not idle: waking them
// (a busy machine's time slice) took 50x a (33, 128) call's whole solve with two threads.
constexpr int64_t kGrainWork = int64_t{1} << 18;
// A row's own work in those units beside its n x targets: its top scores, problem, Newton control
// and output cost about this much whatever its length (a row of 8 entries, k = 8, took as long
// as ~470 units of a long row's entries: 1024 such rows, about 0.4 ms of forward, had been one
// task, and ran on one thread out of the box).
constexpr int64_t kRowWork = 400;

// Rows per task for rows of n entries and big targets.
inline int64_t row_grain(int64_t n, int64_t big) {
  return std::max<int64_t>(1, kGrainWork / (n * big + kRowWork));
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kTiny = std::numeric_limits<double>::min();
constexpr double kEps64 = std::numeric_limits<double>::epsilon();
// |log factor| up to which a state is evaluated by the product recurrence.
constexpr double kFar = 600.0;

// (a + b) / 2 as 0.5 a + 0.5 b with one rounding of the sum (a fused multiply-add): every
// midpoint of the candidate problems (prepare, prepare_ranked), the same in a vector of rows
// (ranked_lanes)
inline double midpoint(double a, double b) { return std::fma(0.5, a, 0.5 * b); }
// Most targets of a candidate problem (k <= 32, plus the rest).
constexpr int64_t kMaxBig = 34;
// Entries per chunk of the loops over a row's candidates.
constexpr int64_t kChunk = 256;
// The plan entries below which an entry's recurrence stops short of the far targets: tau 2^-20
// / m (tau the candidate set's tolerance), so that a column loses at most tau 2^-20 of its mass,
// and at most 2^-60.
constexpr double kLogDropMargin = -20.0 * 0.69314718055994530942;
constexpr double kLogDropMax = -60.0 * 0.69314718055994530942;

// A large output written once through (the weights) on transparent huge pages where the system
// grants them on request: its first touch then takes one page fault per 2 MiB, not per 4 KiB.
// With `touch` (the rows are then written by several threads) the first touch is made here, one
// byte per huge page in the calling thread, before the threads start: with two threads taking
// the huge-page faults in the loop, the advice once made the forward slower (16384 x 128 rows,
// k = 8, on a quiet machine: 134 ms vs 80 ms without; the faults serialise in the system's
// allocation), while one thread faulting alone keeps its gain (118 vs 155 ms on 1 thread). The
// touch costs a page's zeroing, about 0.1-0.25 ms per 2 MiB; where the system declines the
// advice it faults 1 page in 512 (the threads the rest).
void advise_huge_pages(const at::Tensor& t, bool touch) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const size_t bytes = t.nbytes();
  if (bytes < 4 * kHuge) return;
  const auto a = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = (a + kHuge - 1) & ~(kHuge - 1), hi = (a + bytes) & ~(kHuge - 1);
  if (hi <= lo) return;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // (advice only)
  if (!touch) return;
  // (every entry is written afterwards: a 0 written here is overwritten)
  for (uintptr_t p = lo; p < hi; p += kHuge) *reinterpret_cast<volatile char*>(p) = 0;
#else
  (void)t;
  (void)touch;
#endif
}

// bytes from src (a scratch in the cache) to dst (a large output written once) by non-temporal
// stores where the target allows (x86): the output's lines are not read into the cache first, as
// an ordinary store's are. The caller fences (stream_fence) before its writes are read elsewhere.
void stream_bytes(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (bytes >= head + 64) {
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    size_t i = 0;
    for (; i + 16 <= bytes; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    }
    d += i;
    s += i;
    bytes -= i;
  }
#endif
  std::memcpy(d, s, bytes);
}

// Outputs of this many bytes or more are written by stream_bytes (far beyond the caches, where an
// ordinary store reads each line first); smaller ones stay in the cache for the caller. A row's
// weights go through the scratch only where they fit in the cache (at most kScratchBytes): a longer
// row's would make the scratch itself a pass beyond the caches, and its pages faulted per call (a
// row of 1e6 took 3x the time that way).
constexpr int64_t kStreamBytes = int64_t{1} << 23;
constexpr int64_t kScratchBytes = int64_t{1} << 18;

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// --------------------------------------------------------------------------- the Laplacian

// out = K^-1 rhs for the Laplacian K of the couplings w (big x big, row stride kMaxBig) grounded
// at one column (out is 0 there): for big <= 3 by Cramer's rule, grounded for big = 3 at the
// most coupled column (any ground gives the same solution up to a constant, which the callers
// remove; grounded at a column coupled by 1e-100 the other two would come out near 1e90, only
// their difference mattering), returning det K (out NaN where it is not positive). Larger
// systems by the Jacobi-equilibrated Cholesky: without jitter where the least squared pivot is
// at least 1e-2 (returns 2), else with a relative jitter of a few units of rounding, retried
// once larger (returns the least squared pivot, in (0, 1]: the caller may refine), or 0 (out
// NaN). rhs holds every column (the ground's entry is not read).
double laplacian_solve(const double* w, int64_t big, const double* rhs, double* out) {
  for (int64_t j = 0; j < big; ++j) out[j] = 0.0;
  if (big == 2) {
    const double w01 = w[1];
    out[0] = w01 > 0 ? rhs[0] / w01 : kNaN;
    return w01;
  }
  if (big == 3) {
    const double w01 = w[0 * kMaxBig + 1], w02 = w[0 * kMaxBig + 2], w12 = w[1 * kMaxBig + 2];
    const double tot0 = w01 + w02, tot1 = w01 + w12, tot2 = w02 + w12;
    int64_t g = 2;
    if (tot0 > tot1 && tot0 > tot2) {
      g = 0;
    } else if (tot1 > tot2) {
      g = 1;
    }
    const int64_t a = g != 0 ? 0 : 1;
    const int64_t b = g != 2 ? 2 : 1;
    const double wab = w[a * kMaxBig + b], wag = w[a * kMaxBig + g], wbg = w[b * kMaxBig + g];
    const double det = wab * (wag + wbg) + wag * wbg;
    if (!(det > 0)) {
      out[0] = kNaN;
      out[1] = kNaN;
      return det;
    }
    const double ra = rhs[a], rb = rhs[b];
    out[a] = (wab * (ra + rb) + wbg * ra) / det;
    out[b] = (wab * (ra + rb) + wag * rb) / det;
    out[g] = 0.0;
    return det;
  }
  // the Jacobi-scaled grounded Laplacian (its lower triangle, packed rows of stride m1), then
  // its factor with the reciprocals of the pivots kept (one division per pivot, none per entry)
  const int64_t m1 = big - 1;
  double amat[kMaxBig * kMaxBig];
  double chol[kMaxBig * kMaxBig];
  double scale[kMaxBig];
  double inv_piv[kMaxBig];
  double ybuf[kMaxBig];
  for (int64_t j = 0; j < m1; ++j) {
    const double* wj = w + j * kMaxBig;
    double d = 0.0;
    for (int64_t col = 0; col < big; ++col) d += col != j ? wj[col] : 0.0;
    scale[j] = d > 0 ? 1.0 / std::sqrt(d) : 1.0;
    amat[j * m1 + j] = d * scale[j] * scale[j];
  }
  for (int64_t j = 0; j < m1; ++j) {
    const double* wj = w + j * kMaxBig;
    for (int64_t col = 0; col < j; ++col) amat[j * m1 + col] = -wj[col] * scale[j] * scale[col];
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    const double tau =
        attempt == 0 ? 0.0 : (attempt == 1 ? 16.0 * std::max<int64_t>(m1, 4) * kEps64 : 1e-10);
    bool ok = true;
    double least = 1.0;
    for (int64_t j = 0; j < m1 && ok; ++j) {
      double* lj = chol + j * m1;
      const double* aj = amat + j * m1;
      for (int64_t col = 0; col < j; ++col) {
        const double* lc = chol + col * m1;
        double acc = aj[col];
        for (int64_t s = 0; s < col; ++s) acc -= lj[s] * lc[s];
        lj[col] = acc * inv_piv[col];
      }
      double acc = aj[j] + tau;
      for (int64_t s = 0; s < j; ++s) acc -= lj[s] * lj[s];
      if (!(acc > 0)) {
        ok = false;
        break;
      }
      const double piv = std::sqrt(acc);
      lj[j] = piv;
      inv_piv[j] = 1.0 / piv;
      least = std::min(least, acc);
    }
    if (ok && (attempt > 0 || least >= 1e-2)) {
      for (int64_t j = 0; j < m1; ++j) {
        const double* lj = chol + j * m1;
        double acc = rhs[j] * scale[j];
        for (int64_t s = 0; s < j; ++s) acc -= lj[s] * ybuf[s];
        ybuf[j] = acc * inv_piv[j];
      }
      for (int64_t j = m1 - 1; j >= 0; --j) {
        double acc = ybuf[j];
        for (int64_t s = j + 1; s < m1; ++s) acc -= chol[s * m1 + j] * out[s];
        out[j] = acc * inv_piv[j];
      }
      for (int64_t j = 0; j < m1; ++j) out[j] *= scale[j];
      return attempt == 0 ? 2.0 : least;
    }
  }
  for (int64_t j = 0; j < m1; ++j) out[j] = kNaN;
  return 0.0;
}

// sums[r] += sum_i q_i pt[r][i] (i < len) for R targets, U independent partial sums per target
// (vectors of entries in turn): the R x U sums hide the latency of the additions without a sum
// whose result is discarded.
template <int R, int U>
inline void dots(const double* q, const double* const* pt, int64_t len, double* sums) {
  using Vec = at::vec::Vectorized<double>;
  constexpr int64_t L = Vec::size();
  Vec acc[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) acc[r][u] = Vec(0.0);
  }
  int64_t i = 0;
  for (; i + U * L <= len; i += U * L) {
    for (int u = 0; u < U; ++u) {
      const Vec qv = Vec::loadu(q + i + u * L);
      for (int r = 0; r < R; ++r) {
        acc[r][u] = at::vec::fmadd(qv, Vec::loadu(pt[r] + i + u * L), acc[r][u]);
      }
    }
  }
  for (; i + L <= len; i += L) {
    const Vec qv = Vec::loadu(q + i);
    for (int r = 0; r < R; ++r) acc[r][0] = at::vec::fmadd(qv, Vec::loadu(pt[r] + i), acc[r][0]);
  }
  if (i < len) {  // (the partial vector's lanes past len load as 0)
    const int cnt = static_cast<int>(len - i);
    const Vec qv = Vec::loadu(q + i, cnt);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = at::vec::fmadd(qv, Vec::loadu(pt[r] + i, cnt), acc[r][0]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec s = acc[r][0];
    for (int u = 1; u < U; ++u) s = s + acc[r][u];
    double lane[L];
    s.store(lane);
    double tot = 0.0;
    for (int64_t l = 0; l < L; ++l) tot += lane[l];
    sums[r] += tot;
  }
}

// w[j, o] = sum_i a_i P_ji P_oi (j != o; a = 1 where null) for P (big, m) of row stride ld, in
// chunks of entries (every pair of a chunk's targets while it is in the cache), four targets o
// at a time (four independent sums), then the last 1-3 targets each with 4 / 2 / 2 independent
// partial sums over the entries (dots). Column j holds its entries i < lim[j] (the others are 0
// and not read); lim is non-decreasing in j, so a pair j < o has its entries below lim[j].
void couplings(const double* p, int64_t ld, int64_t m, int64_t big, const double* a,
               const int64_t* lim, double* w) {
  for (int64_t j = 0; j < big; ++j) {
    for (int64_t o = 0; o < big; ++o) w[j * kMaxBig + o] = 0.0;
  }
  double paj[kChunk];
  for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
    const int64_t full = std::min(m, i0 + kChunk) - i0;
    for (int64_t j = 0; j + 1 < big; ++j) {
      const int64_t len = std::min(full, std::max<int64_t>(lim[j] - i0, 0));
      if (len == 0) continue;
      const double* pj = p + j * ld + i0;
      const double* q = pj;
      if (a != nullptr) {
        for (int64_t i = 0; i < len; ++i) paj[i] = a[i0 + i] * pj[i];
        q = paj;
      }
      double* wj = w + j * kMaxBig;
      int64_t o = j + 1;
      const double* pt[4];
      for (; o + 4 <= big; o += 4) {
        for (int r = 0; r < 4; ++r) pt[r] = p + (o + r) * ld + i0;
        dots<4, 1>(q, pt, len, wj + o);
      }
      for (int r = 0; o + r < big; ++r) pt[r] = p + (o + r) * ld + i0;
      switch (big - o) {
        case 3:
          dots<3, 2>(q, pt, len, wj + o);
          break;
        case 2:
          dots<2, 2>(q, pt, len, wj + o);
          break;
        case 1:
          dots<1, 4>(q, pt, len, wj + o);
          break;
        default:
          break;
      }
    }
  }
  for (int64_t j = 0; j < big; ++j) {
    for (int64_t o = j + 1; o < big; ++o) w[o * kMaxBig + j] = w[j * kMaxBig + o];
  }
}

// --------------------------------------------------------------------------- the candidate set

// The bytes the vectors vs hold (their capacity).
template <typename... V>
size_t capacity_bytes(const V&... vs) {
  return (size_t{0} + ... + (vs.capacity() * sizeof(typename V::value_type)));
}

// A task's scratch, grown to the largest row it meets (never shrunk).
struct Work {
  std::vector<int64_t> idx, grouped, sup;
  std::vector<int32_t> bin, home, hbuf;
  std::vector<double> yc, ytmp, e, ie, p, p_new, gb, cen, mu, inv_mu, xc, ref, mean, acc_y,
      direct;
  std::vector<uint8_t> far;
  std::vector<int64_t> hist, cnt, nxt;

  size_t bytes() const {
    return capacity_bytes(idx, grouped, sup, bin, home, hbuf, yc, ytmp, e, ie, p, p_new, gb, cen,
                          mu, inv_mu, xc, ref, mean, acc_y, direct, far, hist, cnt, nxt);
  }

  void entries(int64_t m, int64_t big, bool backward) {
    if (static_cast<int64_t>(yc.size()) >= m && static_cast<int64_t>(p.size()) >= big * m &&
        (!backward || static_cast<int64_t>(gb.size()) >= big * m)) {
      return;
    }
    const size_t n = static_cast<size_t>(std::max<int64_t>(m, 1));
    const size_t nb = n * static_cast<size_t>(big);
    for (auto* v : {&yc, &ytmp, &e, &ie}) v->resize(n);
    grouped.resize(n);
    home.resize(n);
    hbuf.resize(n);
    far.resize(n);
    p.resize(nb);
    if (backward) {
      gb.resize(nb);
      cen.resize(nb);
      for (auto* v : {&mu, &inv_mu, &xc, &ref, &mean, &acc_y, &direct}) v->resize(n);
    } else {
      p_new.resize(nb);
    }
  }
};

// The candidate problem of a row: its candidates grouped by home (gs[t] the first of home t),
// their scores yc in the selection's orientation, the factors e = exp((c - y)/eps) and ie = 1/e
// (far: an entry whose factor is out of range), the midpoints bmid of the k+1 largest scores,
// the column masses bcol (1, and m - k for the rest) and bref (bcol less the homes' count).
struct Prob {
  int64_t m = 0, big = 0, k = 0, ld = 0;
  double inv_eps = 0, c = 0;
  bool fast = true;
  const double* yc = nullptr;
  const double* e = nullptr;
  const double* ie = nullptr;
  const uint8_t* far = nullptr;
  const int32_t* home = nullptr;
  int64_t gs[kMaxBig + 1];
  // the rest's entries sorted by their gap bin (0..nb): bend[b] the end of the bins <= b; the
  // bounds of log(ie) = (y - c) / eps in bin 0 (lie0) and in bin b >= 1 (lie1 - (b - 1) / bpu);
  // nb < 0: no order (no rest target, or every recurrence in full)
  const int64_t* bend = nullptr;
  int64_t nb = -1;
  double lie0 = 0, lie1 = 0, bpu = 1;
  double log_drop = 0;  // log of the plan entries left out (see kLogDropMargin)
  double bmid[kMaxBig];
  double bcol[kMaxBig];
  double bref[kMaxBig];
  // (prepare_ranked's problem: m = big = k targets, entry t at home t, columns of mass 1)
  bool ranked = false;
  // (ranked_block's: only what the lanes read is set, its scores in yc and their indices in the
  // work's grouped; prepare_ranked completes it before the one-row code takes the row)
  bool lazy = false;
};

// y (entry i) into the descending buffer top[0..kk) (indices ti) in place of its last, after the
// entries equal to it: the buffer holds equal scores in the order of the row (the lower index
// first, as a stable sort). Called where y > top[kk - 1]. (A loop that stops at the place: in a
// short row every entry comes here, and a fixed kk steps of selects cost more than its branch.)
inline void insert_top(double* top, int64_t* ti, int64_t kk, double y, int64_t i) {
  int64_t t = kk - 1;
  while (t > 0 && top[t - 1] < y) {
    top[t] = top[t - 1];
    ti[t] = ti[t - 1];
    --t;
  }
  top[t] = y;
  ti[t] = i;
}

// L scores sign * x[0..L) as a vector of doubles (L = at::vec's width for double).
template <typename scalar_t>
inline at::vec::Vectorized<double> load_scores(const scalar_t* x, double sign) {
  using Vec = at::vec::Vectorized<double>;
  double buf[Vec::size()];
  for (int64_t l = 0; l < Vec::size(); ++l) buf[l] = static_cast<double>(x[l]);
  return Vec::loadu(buf) * Vec(sign);
}

// Whether any lane of a comparison's mask is set.
inline bool any_lane(const at::vec::Vectorized<double>& mask) {
  using Vec = at::vec::Vectorized<double>;
  return mask.zero_mask() != (1 << Vec::size()) - 1;
}

// Rows up to this long place their k+1 largest by rank (every pair compared, in vectors), not by
// insertion: in a short row most entries enter the buffer, each a branch that mispredicts.
constexpr int64_t kRankMaxN = 32;

// The k+1 largest scores (kk of them; k if k = n) of the row in the orientation `sign`, into top
// (descending; equal scores in the order of the row) and their indices into ti; returns false
// where an entry is not finite or beyond `limit`, or where the span over epsilon is beyond
// span_max (the row is then solved in full by the caller).
template <typename scalar_t>
bool top_scores(const scalar_t* xr, int64_t n, double sign, int64_t kk, double inv_eps,
                double limit, double span_max, double* top, int64_t* ti) {
  for (int64_t t = 0; t < kk; ++t) {
    top[t] = -kInf;
    ti[t] = 0;
  }
  double low = -kInf, ymin = kInf;
  bool ok = true;
  if (n <= kRankMaxN) {
    double y[kRankMaxN + 8];
    for (int64_t i = 0; i < n; ++i) {
      y[i] = sign * static_cast<double>(xr[i]);
      ok &= std::abs(y[i]) <= limit;
      ymin = std::min(ymin, y[i]);
    }
    if (!ok) return false;  // (a NaN has no rank)
    // the rank of entry i: the entries above it, and the equal ones before it, a vector of
    // entries at a time (the lanes past the row at -inf, never above)
    using Vec = at::vec::Vectorized<double>;
    constexpr int64_t L = Vec::size();
    const int64_t nv = (n + L - 1) / L * L;
    for (int64_t i = n; i < nv; ++i) y[i] = -kInf;
    for (int64_t i = 0; i < n; ++i) {
      const double yi = y[i];
      const Vec yv(yi), iv(static_cast<double>(i));
      int64_t r = 0;
      for (int64_t j0 = 0; j0 < nv; j0 += L) {
        const Vec yj = Vec::loadu(y + j0);
        const Vec above = (yj > yv) | ((yj == yv) & (Vec::arange(static_cast<double>(j0), 1.0) < iv));
        r += L - __builtin_popcount(static_cast<unsigned>(above.zero_mask()));
      }
      if (r < kk) {
        top[r] = yi;
        ti[r] = i;
      }
    }
    return (top[0] - ymin) * static_cast<double>(kk) * inv_eps <= span_max;
  }
  // blocks of 16, in two passes. The first (vector operations) checks the range, finds the least
  // score and the kk largest of the blocks' maxima, whose least, floor, no entry below it can
  // pass (kk entries are at or above it); the second inserts into the buffer the entries at or
  // above floor, in the blocks whose maximum reaches it (in a long row, a few of them). Dropping
  // entries that never end in the buffer leaves it as the single pass over every entry would.
  using Vec = at::vec::Vectorized<double>;
  constexpr int64_t L = Vec::size();
  constexpr int64_t kBlock = L >= 16 ? L : 16;
  const int64_t nfull = n / kBlock * kBlock;
  double bm[kMaxBig];
  for (int64_t t = 0; t < kk; ++t) bm[t] = -kInf;
  const Vec vlimit(limit);
  Vec vmin(kInf), vfine(1.0);
  auto block_max = [&](int64_t i) {
    Vec hi = load_scores(xr + i, sign);
    for (int64_t l = L; l < kBlock; l += L) hi = at::vec::maximum(hi, load_scores(xr + i + l, sign));
    return hi;
  };
  for (int64_t i = 0; i < nfull; i += kBlock) {
    Vec hi(-kInf);
    for (int64_t l = 0; l < kBlock; l += L) {
      const Vec y = load_scores(xr + i + l, sign);
      vfine = vfine & (y.abs() <= vlimit);  // (false at a NaN)
      hi = at::vec::maximum(hi, y);
      vmin = at::vec::minimum(vmin, y);
    }
    if (!any_lane(hi > Vec(bm[kk - 1]))) continue;
    double lane[L];
    hi.store(lane);
    double h = lane[0];
    for (int64_t l = 1; l < L; ++l) h = std::max(h, lane[l]);
    int64_t t = kk - 1;
    while (t > 0 && bm[t - 1] < h) {
      bm[t] = bm[t - 1];
      --t;
    }
    bm[t] = h;
  }
  {
    double lane[L];
    vfine.store(lane);
    for (int64_t l = 0; l < L; ++l) ok &= lane[l] != 0.0;
    vmin.store(lane);
    for (int64_t l = 0; l < L; ++l) ymin = std::min(ymin, lane[l]);
  }
  for (int64_t i = nfull; i < n; ++i) {
    const double yi = sign * static_cast<double>(xr[i]);
    ok &= std::abs(yi) <= limit;
    ymin = std::min(ymin, yi);
  }
  if (!ok) return false;
  const double floor = bm[kk - 1];
  for (int64_t i = 0; i < nfull; i += kBlock) {
    const Vec hi = block_max(i);
    if (!any_lane(hi >= Vec(floor)) || !any_lane(hi > Vec(low))) continue;
    for (int64_t l = 0; l < kBlock; ++l) {
      const double yi = sign * static_cast<double>(xr[i + l]);
      if (yi >= floor && yi > low) {
        insert_top(top, ti, kk, yi, i + l);
        low = top[kk - 1];
      }
    }
  }
  for (int64_t i = nfull; i < n; ++i) {
    const double yi = sign * static_cast<double>(xr[i]);
    if (yi > low) {
      insert_top(top, ti, kk, yi, i);
      low = top[kk - 1];
    }
  }
  return (top[0] - ymin) * static_cast<double>(kk) * inv_eps <= span_max;
}

// The entries i < n whose gap bin is below lim (docs/math.md §2.4): for the gap t = (y_(k+1) - y)
// / eps * bpu, bin 0 where t <= 0, else ceil(t) up to nb. Their indices into idx and bins into
// bin, in the order of the row; returns their count. One pass, the bins formed and kept in the
// same loop (one function for the forward and the backward: the same rounding). With AVX-512 a
// vector of entries at a time (the kept lanes compressed) in a row of 64 entries or more, else
// one loop whose stores are unconditional (the next store overwrites an entry not kept; a row of
// 32 was 2-3 % faster that way).
template <typename scalar_t>
__attribute__((noinline)) int64_t keep_gaps(const scalar_t* xr, int64_t n, double sign, double yk,
                                            double inv_eps, double bpu, int64_t nb, int64_t lim,
                                            int64_t* idx, int32_t* bin) {
  int64_t m = 0, i = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
  using Vec = at::vec::Vectorized<double>;
  if constexpr (Vec::size() == 8) {
    const Vec vyk(yk), vie(inv_eps), vbpu(bpu), zero(0.0), last(static_cast<double>(nb));
    const __m512d vlim = _mm512_set1_pd(static_cast<double>(lim));
    __m512i iv = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi64(8);
    for (; n >= 64 && i + 8 <= n; i += 8) {
      const Vec t = ((vyk - load_scores(xr + i, sign)) * vie) * vbpu;
      const __m512d g = at::vec::minimum(at::vec::maximum(t.ceil(), zero), last);
      const __mmask8 keep = _mm512_cmp_pd_mask(g, vlim, _CMP_LT_OQ);
      // (compressed in a register, stored whole: m <= i, so the 8 slots from m lie in the row;
      // a compressed store to memory is microcoded on some processors, 10x slower)
      _mm512_storeu_si512(idx + m, _mm512_maskz_compress_epi64(keep, iv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bin + m),
                          _mm256_maskz_compress_epi32(keep, _mm512_cvttpd_epi32(g)));
      m += __builtin_popcount(static_cast<unsigned>(keep));
      iv = _mm512_add_epi64(iv, step);
    }
  }
#endif
  const double dnb = static_cast<double>(nb);
  for (; i < n; ++i) {
    const double t = ((yk - sign * static_cast<double>(xr[i])) * inv_eps) * bpu;
    const auto b = static_cast<int32_t>(std::min(std::max(std::ceil(t), 0.0), dnb));
    idx[m] = i;
    bin[m] = b;
    m += b < lim ? 1 : 0;
  }
  return m;
}

// The entries j < m of idx, bin (from keep_gaps) whose bin is below lim, in place, in order;
// returns their count (as keep_gaps, a vector of entries at a time with AVX-512: each vector is
// read before the slots it overwrites, which lie at or below it).
inline int64_t keep_kept(int64_t* idx, int32_t* bin, int64_t m, int64_t lim) {
  int64_t out = 0, j = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
  const __m256i vlim = _mm256_set1_epi32(static_cast<int32_t>(lim));
  for (; j + 8 <= m; j += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bin + j));
    const __m512i ix = _mm512_loadu_si512(idx + j);
    const __mmask8 keep = _mm256_cmplt_epi32_mask(b, vlim);
    _mm512_storeu_si512(idx + out, _mm512_maskz_compress_epi64(keep, ix));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bin + out), _mm256_maskz_compress_epi32(keep, b));
    out += __builtin_popcount(static_cast<unsigned>(keep));
  }
#endif
  for (; j < m; ++j) {
    const int32_t b = bin[j];
    idx[out] = idx[j];
    bin[out] = b;
    out += b < lim ? 1 : 0;
  }
  return out;
}

// The candidate set of a row (docs/math.md §2.4) into w.idx (in the order of the row), their gap
// bins into w.bin, and its size; the cut (the first bin dropped) into cut. `weight[b]` bounds
// an entry's weight on the first k targets in bin b (sum_{r=1..k} e^{-r g} at the bin's least g).
template <typename scalar_t>
int64_t candidates(const scalar_t* xr, int64_t n, double sign, int64_t k, const double* top,
                   double inv_eps, double tau, double bpu, const double* weight, int64_t nb,
                   Work& w, int64_t& cut) {
  if (static_cast<int64_t>(w.idx.size()) < n) {
    w.idx.resize(n);
    w.bin.resize(n);
  }
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) w.idx[i] = i;
    std::fill(w.bin.begin(), w.bin.begin() + n, 0);
    cut = nb + 1;
    return n;
  }
  w.hist.assign(nb + 1, 0);
  // the entries below the last bin (the others are never candidates)
  const int64_t kept =
      keep_gaps(xr, n, sign, top[k], inv_eps, bpu, nb, nb, w.idx.data(), w.bin.data());
  // (counted apart: the last bin, often the most of a long row, would chain its increments)
  int64_t* hist = w.hist.data();
  for (int64_t j = 0; j < kept; ++j) hist[w.bin[j]] += 1;
  hist[nb] = n - kept;
  // drop the bins from the farthest while the sum of their bounds stays within tau
  double acc = 0.0;
  int64_t c = nb + 1;
  while (c > 1) {
    const double add = static_cast<double>(w.hist[c - 1]) * weight[c - 1];
    if (acc + add > tau) break;
    acc += add;
    --c;
  }
  cut = c;
  if (c >= nb) return kept;  // (the last bin is never a candidate)
  return keep_kept(w.idx.data(), w.bin.data(), kept, c);
}

// The same candidate set again (the backward), from the saved cut.
template <typename scalar_t>
int64_t candidates_at(const scalar_t* xr, int64_t n, double sign, int64_t k, const double* top,
                      double inv_eps, double bpu, int64_t nb, int64_t cut, Work& w) {
  if (static_cast<int64_t>(w.idx.size()) < n) {
    w.idx.resize(n);
    w.bin.resize(n);
  }
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) w.idx[i] = i;
    std::fill(w.bin.begin(), w.bin.begin() + n, 0);
    return n;
  }
  // (the cut at most nb, as the forward takes it: the last bin is never a candidate)
  return keep_gaps(xr, n, sign, top[k], inv_eps, bpu, nb, std::min(cut, nb), w.idx.data(),
                   w.bin.data());
}

void factors(double top, double ymin, Work& w, Prob& pb);

// The candidate problem of a row (see Prob) from its candidates w.idx[:m] (in the row's order)
// and their gap bins w.bin[:m] (0..nb, bpu bins per epsilon): they are grouped by home into
// w.grouped, the rest's by gap bin (a counting sort, which keeps the order within a key).
template <typename scalar_t>
void prepare(const scalar_t* xr, double sign, const double* top, int64_t k, int64_t big,
             int64_t m, double inv_eps, int64_t nb, double bpu, double log_tau, Work& w,
             Prob& pb) {
  pb.m = m;
  pb.big = big;
  pb.k = k;
  pb.ld = m;
  pb.inv_eps = inv_eps;
  pb.ranked = false;
  pb.lazy = false;
  for (int64_t t = 0; t + 1 < big; ++t) pb.bmid[t] = midpoint(top[t], top[t + 1]);
  for (int64_t t = 0; t <= big; ++t) pb.gs[t] = 0;
  const double last = big > 1 ? pb.bmid[big - 2] : kInf;
  double* ytmp = w.ytmp.data();
  int32_t* hbuf = w.hbuf.data();
  double mids[kMaxBig];
  for (int64_t t = 0; t + 1 < big; ++t) mids[t] = pb.bmid[t];
  const int64_t* idx = w.idx.data();
  double ymin = kInf;
  for (int64_t i = 0; i < m; ++i) {
    const double yi = sign * static_cast<double>(xr[idx[i]]);
    ytmp[i] = yi;
    ymin = std::min(ymin, yi);
    // the home: big - 1 at or below the last midpoint (most candidates of a long row: the rest),
    // else the count of the (descending) midpoints above y, without a branch per midpoint
    int64_t hi = big - 1;
    if (yi > last) {
      hi = 0;
      for (int64_t t = 0; t + 1 < big; ++t) hi += mids[t] > yi ? 1 : 0;
    }
    hbuf[i] = static_cast<int32_t>(hi);
  }
  // the sort keys: the home, the rest's entries (home big - 1) at big - 1 + their bin
  const bool rest = big > k;
  const int64_t nkeys = rest ? big + nb : big;
  w.cnt.assign(static_cast<size_t>(nkeys + 1), 0);
  w.nxt.resize(static_cast<size_t>(nkeys));
  int64_t* cnt = w.cnt.data();
  const int32_t* bin = w.bin.data();
  if (rest) {
    for (int64_t i = 0; i < m; ++i) {
      const int32_t key = hbuf[i] == big - 1 ? static_cast<int32_t>(big - 1) + bin[i] : hbuf[i];
      hbuf[i] = key;
      cnt[key + 1] += 1;
    }
  } else {
    for (int64_t i = 0; i < m; ++i) cnt[hbuf[i] + 1] += 1;
  }
  for (int64_t t = 0; t < nkeys; ++t) cnt[t + 1] += cnt[t];
  for (int64_t t = 0; t < big; ++t) pb.gs[t] = cnt[t];
  pb.gs[big] = m;
  int64_t* next = w.nxt.data();
  for (int64_t t = 0; t < nkeys; ++t) next[t] = cnt[t];
  double* yc = w.yc.data();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t pos = next[hbuf[i]]++;
    w.grouped[pos] = w.idx[i];
    yc[pos] = ytmp[i];
  }
  pb.bend = rest ? cnt + big : nullptr;  // (cnt[big + b]: the start of bin b + 1's key)
  pb.nb = rest ? nb : -1;
  pb.bpu = bpu;
  int32_t* home = w.home.data();
  for (int64_t t = 0; t < big; ++t) {
    for (int64_t i = pb.gs[t]; i < pb.gs[t + 1]; ++i) home[i] = static_cast<int32_t>(t);
  }
  for (int64_t t = 0; t < big; ++t) pb.bcol[t] = 1.0;
  if (big > k) pb.bcol[k] = static_cast<double>(m - k);
  for (int64_t t = 0; t < big; ++t) {
    pb.bref[t] = pb.bcol[t] - static_cast<double>(pb.gs[t + 1] - pb.gs[t]);
  }
  pb.c = midpoint(top[0], ymin);
  if (rest) {
    pb.lie0 = (pb.bmid[big - 2] - pb.c) * inv_eps;  // (an entry of the rest is below it)
    pb.lie1 = (top[k] - pb.c) * inv_eps;
    pb.log_drop =
        std::min(kLogDropMax, log_tau + kLogDropMargin - std::log(static_cast<double>(m)));
  }
  factors(top[0], ymin, w, pb);
}

// The factors e = exp((c - y)/eps) and ie = 1/e of the candidates pb.yc[:m] (far: out of range)
// into w, for top (their largest score) and ymin (their least); sets pb.fast.
void factors(double top, double ymin, Work& w, Prob& pb) {
  const int64_t m = pb.m;
  const double inv_eps = pb.inv_eps;
  const double* yc = w.yc.data();
  double* e = w.e.data();
  double* ie = w.ie.data();
  uint8_t* far = w.far.data();
  // (the largest |z| is at an end of the candidates' range, top or ymin: |z| is monotone in
  // |c - y|)
  const double zmax =
      std::max(std::abs((pb.c - top) * inv_eps), std::abs((pb.c - ymin) * inv_eps));
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) e[i] = (pb.c - yc[i]) * inv_eps;
  pb.fast = zmax <= kFar;
  if (pb.fast) {
    using Vec = at::vec::Vectorized<double>;
    constexpr int64_t L = Vec::size();
    int64_t i = 0;
    for (; i + L <= m; i += L) Vec::loadu(e + i).exp().store(e + i);
    // (the tail by the same vector exponential: an entry's factor does not depend on its place,
    // and ranked_block's factors, a vector of rows at a time, are the same numbers)
    if (i < m) Vec::loadu(e + i, m - i).exp().store(e + i, m - i);
    const Vec one(1.0);
    for (i = 0; i + L <= m; i += L) (one / Vec::loadu(e + i)).store(ie + i);
    for (; i < m; ++i) ie[i] = 1.0 / e[i];
    std::memset(far, 0, static_cast<size_t>(m));
  } else {
    for (int64_t i = 0; i < m; ++i) {
      const double z = e[i];
      if (std::abs(z) <= kFar) {
        const double ez = std::exp(z);
        e[i] = ez;
        ie[i] = 1.0 / ez;
        far[i] = 0;
      } else {
        e[i] = 0.0;
        ie[i] = 0.0;
        far[i] = 1;
      }
    }
  }
  pb.yc = yc;
  pb.e = e;
  pb.ie = ie;
  pb.far = far;
  pb.home = w.home.data();
}

// prepare for k = n (every entry a candidate, no rest target) from the row's ranks: top (n, its
// scores descending) and ti (their indices). Where every midpoint lies strictly between its two
// scores the entry of rank r has r midpoints above it, so its home is r and the grouped order is
// the rank order (prepare's counting sort gives the same). Returns false, having set nothing the
// caller reads, where two neighbours are equal or their midpoint rounds onto one of them (the
// caller takes prepare).
bool prepare_ranked(const double* top, const int64_t* ti, int64_t k, double inv_eps, Work& w,
                    Prob& pb) {
  const int64_t m = k;
  bool strict = true;
  for (int64_t t = 0; t + 1 < m; ++t) {
    const double mid = midpoint(top[t], top[t + 1]);
    pb.bmid[t] = mid;
    strict &= mid < top[t] && mid > top[t + 1];
  }
  if (!strict) return false;
  pb.m = m;
  pb.big = m;
  pb.k = k;
  pb.ld = m;
  pb.inv_eps = inv_eps;
  pb.bend = nullptr;
  pb.nb = -1;
  double* yc = w.yc.data();
  int32_t* home = w.home.data();
  for (int64_t t = 0; t < m; ++t) {
    pb.gs[t] = t;
    pb.bcol[t] = 1.0;
    pb.bref[t] = 0.0;
    w.grouped[t] = ti[t];
    yc[t] = top[t];
    home[t] = static_cast<int32_t>(t);
  }
  pb.gs[m] = m;
  pb.ranked = true;
  pb.lazy = false;
  pb.c = midpoint(top[0], top[m - 1]);
  factors(top[0], top[m - 1], w, pb);
  return true;
}

// The row-normalised plan P (big, m; row stride pb.ld) at the column states v into p, and the
// gap b - c formed relative to each entry's home as sums of small terms; returns sum_j |gap_j|,
// or inf where a column factor is out of range (the caller then takes eval_general). One pass
// over the entries, home by home (the candidates are grouped by home): each entry's plan is the
// recurrence q_(j+1) = q_j e_i rho_j upward from its home and q_(j-1) = q_j ie_i irho_(j-1)
// downward, normalised by its sum, held in registers for a vector of entries at a time (the
// entries of one home share the recurrence's shape), the rest of a home entry by entry.
//
// The rest's entries (sorted by gap bin) stop their downward recurrence at the first target
// whose entries are all below exp(pb.log_drop) there: with a_j = log rho_j, an entry of log(ie) <= L
// has log P_(k-r) <= r L - (a_(k-r) + ... + a_(k-1)), a bound per bin. lim[j] (non-decreasing in
// j) is the end of the entries whose column j is formed; the others are 0 there (not written).
void column_limits(const Prob& pb, const double* a, int64_t* lim) {
  const int64_t big = pb.big, m = pb.m;
  for (int64_t j = 0; j < big; ++j) lim[j] = m;
  if (pb.nb < 0) return;
  const int64_t k = pb.k;  // (the rest is column k = big - 1)
  int64_t bmax[kMaxBig];
  double sum_a = 0.0;
  for (int64_t r = 1; r <= k; ++r) {
    sum_a += a[k - r];
    const double rd = static_cast<double>(r);
    int64_t b = -1;  // the last bin whose bound reaches exp(log_drop)
    const double drop = pb.log_drop;
    if (rd * pb.lie0 - sum_a >= drop) {
      b = 0;
      const double t = pb.bpu * (pb.lie1 - (sum_a + drop) / rd);
      if (rd * pb.lie1 - sum_a >= drop) {
        b = t >= static_cast<double>(pb.nb) ? pb.nb : 1 + static_cast<int64_t>(std::floor(t));
        b = std::min(b, pb.nb);
      }
    }
    bmax[r] = b;
  }
  int64_t run = -1;
  for (int64_t r = k; r >= 1; --r) {
    run = std::max(run, bmax[r]);
    lim[k - r] = run < 0 ? pb.gs[big - 1] : pb.bend[run];
  }
}

template <int64_t BIG = 0>
double eval_fast(const Prob& pb, const double* v, double* p, double* gap, int64_t* lim) {
  using Vec = at::vec::Vectorized<double>;
  constexpr int64_t L = Vec::size();
  const int64_t big = BIG > 0 ? BIG : pb.big, ld = pb.ld;
  double rho[kMaxBig], irho[kMaxBig], q[kMaxBig], g[kMaxBig], av[kMaxBig];
  for (int64_t j = 0; j + 1 < big; ++j) {
    const double a = v[j + 1] - v[j] + (pb.bmid[j] - pb.c) * pb.inv_eps;
    if (!(std::abs(a) <= kFar)) return kInf;
    av[j] = a;
  }
  // the column factors a vector at a time (one call of the vector exponential, not one scalar
  // call per column); irho within a unit of rounding of exp(-a) (|a| <= 600)
  for (int64_t j = 0; j + 1 < big; j += L) {
    const int64_t cnt = std::min<int64_t>(L, big - 1 - j);
    const Vec r = Vec::loadu(av + j, cnt).exp();
    r.store(rho + j, cnt);
    (Vec(1.0) / r).store(irho + j, cnt);
  }
  column_limits(pb, av, lim);
  for (int64_t j = 0; j < big; ++j) g[j] = pb.bref[j];
  const double* e = pb.e;
  const double* ie = pb.ie;
  for (int64_t hi = 0; hi < big; ++hi) {
    int64_t i = pb.gs[hi];
    const int64_t i1 = pb.gs[hi + 1];
    // the first target formed for the entry at i (0 but in the rest: non-decreasing in i)
    int64_t lo = 0;
    if (i1 - i >= L) {
      Vec col[kMaxBig], qv[kMaxBig];
      for (int64_t j = 0; j < big; ++j) col[j] = Vec(0.0);
      Vec offs(0.0);
      const Vec one(1.0);
      for (; i + L <= i1; i += L) {
        while (lo < hi && lim[lo] <= i) ++lo;
        const Vec ei = Vec::loadu(e + i), iei = Vec::loadu(ie + i);
        qv[hi] = one;
        Vec tot = one;
        for (int64_t j = hi; j + 1 < big; ++j) {
          qv[j + 1] = qv[j] * (ei * Vec(rho[j]));
          tot = tot + qv[j + 1];
        }
        for (int64_t j = hi - 1; j >= lo; --j) {
          qv[j] = qv[j + 1] * (iei * Vec(irho[j]));
          tot = tot + qv[j];
        }
        const Vec inv = one / tot;
        Vec off(0.0);
        for (int64_t j = lo; j < big; ++j) {
          const Vec pj = qv[j] * inv;
          pj.store(p + j * ld + i);
          if (j != hi) {
            off = off + pj;
            col[j] = col[j] + pj;
          }
        }
        offs = offs + off;
      }
      double lane[L];
      for (int64_t j = 0; j < big; ++j) {
        if (j == hi) continue;
        col[j].store(lane);
        double acc = 0.0;
        for (int64_t l = 0; l < L; ++l) acc += lane[l];
        g[j] -= acc;
      }
      offs.store(lane);
      double acc = 0.0;
      for (int64_t l = 0; l < L; ++l) acc += lane[l];
      g[hi] += acc;
    }
    for (; i < i1; ++i) {
      while (lo < hi && lim[lo] <= i) ++lo;
      const double ei = e[i], iei = ie[i];
      q[hi] = 1.0;
      double tot = 1.0;
      for (int64_t j = hi; j + 1 < big; ++j) {
        q[j + 1] = q[j] * (ei * rho[j]);
        tot += q[j + 1];
      }
      for (int64_t j = hi - 1; j >= lo; --j) {
        q[j] = q[j + 1] * (iei * irho[j]);
        tot += q[j];
      }
      const double inv = 1.0 / tot;
      double off = 0.0;
      for (int64_t j = lo; j < big; ++j) {
        const double pj = q[j] * inv;
        p[j * ld + i] = pj;
        if (j != hi) {
          off += pj;
          g[j] -= pj;
        }
      }
      g[hi] += off;
    }
  }
  double l1 = 0.0;
  for (int64_t j = 0; j < big; ++j) {
    gap[j] = g[j];
    l1 += std::abs(g[j]);
  }
  return l1;
}

// eval_fast entry by entry: entries far from the centre, and all entries where a column factor
// is out of range, take one exponential per target.
double eval_general(const Prob& pb, const double* v, double* p, double* gap, int64_t* lim) {
  const int64_t big = pb.big, m = pb.m, ld = pb.ld;
  for (int64_t j = 0; j < big; ++j) lim[j] = m;
  double rho[kMaxBig], irho[kMaxBig], q[kMaxBig];
  bool rowexp = false;
  for (int64_t j = 0; j + 1 < big; ++j) {
    const double a = v[j + 1] - v[j] + (pb.bmid[j] - pb.c) * pb.inv_eps;
    if (!(std::abs(a) <= kFar)) {
      rowexp = true;
      rho[j] = 0.0;
      irho[j] = 0.0;
    } else {
      rho[j] = std::exp(a);
      irho[j] = std::exp(-a);
    }
  }
  for (int64_t j = 0; j < big; ++j) gap[j] = pb.bref[j];
  for (int64_t i = 0; i < m; ++i) {
    const int64_t hi = pb.home[i];
    q[hi] = 1.0;
    if (rowexp || pb.far[i]) {
      const double yi = pb.yc[i];
      double t = 0.0;
      for (int64_t j = hi; j + 1 < big; ++j) {
        t += v[j + 1] - v[j] + (pb.bmid[j] - yi) * pb.inv_eps;
        q[j + 1] = std::exp(t);
      }
      t = 0.0;
      for (int64_t j = hi - 1; j >= 0; --j) {
        t -= v[j + 1] - v[j] + (pb.bmid[j] - yi) * pb.inv_eps;
        q[j] = std::exp(t);
      }
    } else {
      const double ei = pb.e[i], iei = pb.ie[i];
      for (int64_t j = hi; j + 1 < big; ++j) q[j + 1] = q[j] * (ei * rho[j]);
      for (int64_t j = hi - 1; j >= 0; --j) q[j] = q[j + 1] * (iei * irho[j]);
    }
    double tot = 0.0;
    for (int64_t j = 0; j < big; ++j) tot += q[j];
    const double inv = 1.0 / tot;
    double off = 0.0;
    for (int64_t j = 0; j < big; ++j) {
      const double pj = q[j] * inv;
      p[j * ld + i] = pj;
      if (j != hi) {
        off += pj;
        gap[j] -= pj;
      }
    }
    gap[hi] += off;
  }
  double l1 = 0.0;
  for (int64_t j = 0; j < big; ++j) l1 += std::abs(gap[j]);
  return l1;
}

// The plan at the state v (eval_fast, else eval_general); column j formed at its entries below
// lim[j].
double eval_state(const Prob& pb, const double* v, double* p, double* gap, int64_t* lim) {
  if (pb.fast) {
    // (9 targets, k = 8 with a rest, the usual long row: the size known to the compiler)
    const double l1 =
        pb.big == 9 ? eval_fast<9>(pb, v, p, gap, lim) : eval_fast(pb, v, p, gap, lim);
    if (l1 < kInf) return l1;
  }
  return eval_general(pb, v, p, gap, lim);
}

// State layout per row: top (big), cut, count, v (big), ratio (b - c)/c (big), centre, log tau;
// for k = n, in place of top, the indices of the ranks (top is x at them: the backward reads
// both from them, the ranks without a second ranking of the row).
struct Layout {
  int64_t big;
  int64_t top() const { return 0; }
  int64_t cut() const { return big; }
  int64_t count() const { return big + 1; }
  int64_t v() const { return big + 2; }
  int64_t ratio() const { return 2 * big + 2; }
  int64_t centre() const { return 3 * big + 2; }
  int64_t log_tau() const { return 3 * big + 3; }
  int64_t size() const { return 3 * big + 4; }
};

// One row's candidate problem, solved: semi-dual Newton from one Sinkhorn column update of v = 0
// (full steps, halved while they do not lower sum_j |b_j - c_j|). Writes the state; returns the
// relative L1 row residual of the column-exact plan; p_out holds the row-normalised plan (column
// j at its entries below lim_out[j], 0 at the others).
double newton_row(const Prob& pb, double tol, int64_t max_steps, int64_t halvings, Work& w,
                  double* st, const Layout& lay, double*& p_out, int64_t* lim_out) {
  const int64_t big = pb.big, m = pb.m, ld = pb.ld;
  double* p = w.p.data();
  double* p_new = w.p_new.data();
  int64_t lim_a[kMaxBig], lim_b[kMaxBig];
  int64_t* lim = lim_a;
  int64_t* lim_new = lim_b;
  double gap_a[kMaxBig], gap_b[kMaxBig], v_a[kMaxBig], v_b[kMaxBig], delta[kMaxBig];
  double wc[kMaxBig * kMaxBig];
  double* gap = gap_a;
  double* gap_new = gap_b;
  double* v = v_a;
  double* v_new = v_b;
  for (int64_t t = 0; t < big; ++t) {
    v_new[t] = 0.0;
    v[t] = 0.0;
    gap[t] = 0.0;
  }
  const double tol_mass = tol * static_cast<double>(m);
  int64_t steps = 0, tries = 0;
  int phase = 0;
  double step = 1.0, l1 = kInf;
  while (true) {
    const double l1_new = eval_state(pb, v_new, p_new, gap_new, lim_new);
    if (phase == 0) {  // the start: one Sinkhorn column update of v = 0 (the hard assignment)
      for (int64_t t = 0; t < big; ++t) {
        // the column's mass is b - gap (the gap is formed against b); summed over the column
        // only where that difference would lose its digits (a column far below its mass)
        double col = pb.bcol[t] - gap_new[t];
        if (!(col >= 1e-3 * pb.bcol[t])) {
          const double* pt = p_new + t * ld;
          const int64_t mt = lim_new[t];
          col = 0.0;
#pragma omp simd reduction(+ : col)
          for (int64_t i = 0; i < mt; ++i) col += pt[i];
        }
        v_new[t] = std::log(pb.bcol[t]) - std::log(std::max(col, kTiny));
      }
      phase = 1;
      continue;
    }
    if (phase == 2 && !(l1_new < l1)) {
      if (++tries > halvings) break;  // no step lowers the bound: the row keeps its state
      step *= 0.5;
      for (int64_t t = 0; t < big; ++t) v_new[t] = v[t] + step * delta[t];
      continue;
    }
    std::swap(p, p_new);
    std::swap(lim, lim_new);
    std::swap(gap, gap_new);
    std::swap(v, v_new);
    l1 = l1_new;
    if (!(l1 > tol_mass) || steps >= max_steps) break;
    couplings(p, ld, m, big, nullptr, lim, wc);
    const double ok = laplacian_solve(wc, big, gap, delta);
    ++steps;
    if (!(ok > 0)) break;
    phase = 2;
    step = 1.0;
    tries = 0;
    for (int64_t t = 0; t < big; ++t) v_new[t] = v[t] + delta[t];
  }
  double* rr = st + lay.ratio();
  for (int64_t t = 0; t < big; ++t) {
    rr[t] = gap[t] / std::max(pb.bcol[t] - gap[t], kTiny);
    st[lay.v() + t] = v[t];
  }
  st[lay.centre()] = pb.c;
  // the row residual of the column-exact plan, sum_i |sum_t P_ti r_t| / m
  double err = 0.0;
  double dev[kChunk];
  for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
    const int64_t len = std::min(m, i0 + kChunk) - i0;
    for (int64_t i = 0; i < len; ++i) dev[i] = 0.0;
    for (int64_t t = 0; t < big; ++t) {
      const double rt = rr[t];
      const double* pt = p + t * ld + i0;
      const int64_t lt = std::min(len, std::max<int64_t>(lim[t] - i0, 0));
#pragma omp simd
      for (int64_t i = 0; i < lt; ++i) dev[i] += pt[i] * rt;
    }
#pragma omp simd reduction(+ : err)
    for (int64_t i = 0; i < len; ++i) err += std::abs(dev[i]);
  }
  p_out = p;
  for (int64_t t = 0; t < big; ++t) lim_out[t] = lim[t];
  return err / static_cast<double>(m);
}

// --------------------------------------------------------------------------- lanes of rows

// Short rows are solved kLanes at a time, one row per lane of an at::vec vector (solve_group):
// the same semi-dual Newton as newton_row, its state evaluation (eval_fast's product
// recurrence from each entry's home), couplings and equilibrated Cholesky (laplacian_solve's
// first attempt) as vector operations over the lanes, entry slot by entry slot (a row's entries
// in its grouped order; the slots past a row's candidates masked out). Each lane keeps its own
// control (steps, halvings, flags); a lane whose state leaves the product's range, or whose
// Cholesky would take the jitter, is handed to the scalar code (the whole row again, or that one
// solve), so every row gets the scalar path's result up to rounding (and up to the plan's entries
// below the drop bound: a slot forms a column wherever one of its lanes' rows does, so a lane
// may form an entry there that its row alone would leave out, within exp(log_drop)).
using VecD = at::vec::Vectorized<double>;
constexpr int64_t kLanes = VecD::size();
// Most candidates of a row solved in the lanes, forward and backward (past them a row costs
// about as much one at a time: the scalar code vectorises over its entries, and its rest's
// entries stop short of the far targets).
constexpr int64_t kLaneMaxM = 128;
// Most targets of a row solved in the lanes.
constexpr int64_t kLaneBig = 12;
// The least squared pivot of the backward's lanes' factor (without jitter) below which the row is
// the scalar code's (laplacian_solve's jitter and refinement): one refinement does not make a
// factor of a smaller pivot accurate (a short row at epsilon 0.01 came out with gradients of 5e3
// and 4e10 against the torch code's 1).
constexpr double kLaneBackwardPivot = 1e-8;

// kLaneBig vectors left uninitialised (a Vectorized zeroes its lanes on construction; these
// arrays are written before they are read).
struct VecArr {
  union {
    VecD v[kLaneBig];
  };
  VecArr() {}
  VecD& operator[](int64_t i) { return v[i]; }
  const VecD& operator[](int64_t i) const { return v[i]; }
};

// A mask of lanes: with AVX-512 the processor's mask (a comparison writes it, a blend or a
// masked addition reads it), else a vector of all-ones lanes (at::vec's comparisons). at::vec's
// comparisons make a vector of the mask and its blendv a mask of the vector again: in a profile of
// the backward's loops over the slots those conversions took about a third of the samples.
#if defined(__AVX512F__)
using LaneMask = __mmask8;
inline LaneMask lanes_gt(const VecD& a, const VecD& b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
inline LaneMask lanes_eq(const VecD& a, const VecD& b) { return _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ); }
// b in the lanes of m, else a
inline VecD select(LaneMask m, const VecD& a, const VecD& b) { return _mm512_mask_blend_pd(m, a, b); }
// acc + x in the lanes of m, else acc
inline VecD add_where(LaneMask m, const VecD& acc, const VecD& x) {
  return _mm512_mask_add_pd(acc, m, acc, x);
}
#else
using LaneMask = VecD;
inline LaneMask lanes_gt(const VecD& a, const VecD& b) { return a > b; }
inline LaneMask lanes_eq(const VecD& a, const VecD& b) { return a == b; }
inline VecD select(const LaneMask& m, const VecD& a, const VecD& b) { return VecD::blendv(a, b, m); }
inline VecD add_where(const LaneMask& m, const VecD& acc, const VecD& x) {
  return VecD::blendv(acc, acc + x, m);
}
#endif

// A group's rows transposed: slot i of lane l at [i * kLanes + l].
struct Lanes {
  int64_t big = 0, slots = 0;
  std::vector<double> e, ie, home, valid, p, p_new, gb, yc, xs, out, kept;
  std::vector<int64_t> shared;  // per slot: the home of every lane's entry, or -1
  double aconst[kMaxBig * kLanes];  // (bmid_j - c) / eps
  double bref[kMaxBig * kLanes];
  double bcol[kMaxBig * kLanes];
  double log_bcol[kMaxBig * kLanes];  // (0 at a column of mass 1: one log per row with a rest)
  // the rows' problems (for column_limits' bins: bend, gs) and, per lane, column_limits' bounds
  // (rest false: no rest target, every column formed at every slot)
  const Prob* pb = nullptr;
  bool rest = false;
  double lie0[kLanes], lie1[kLanes], drop[kLanes], bpu[kLanes], nb[kLanes];

  size_t bytes() const {
    return capacity_bytes(e, ie, home, valid, p, p_new, gb, yc, xs, out, kept, shared);
  }

  void size(int64_t big_in, int64_t slots_in) {
    big = big_in;
    slots = slots_in;
    const size_t ns = static_cast<size_t>(slots * kLanes);
    if (e.size() < ns) {
      for (auto* x : {&e, &ie, &home, &valid}) x->resize(ns);
      shared.resize(static_cast<size_t>(slots));
    }
    if (p.size() < ns * static_cast<size_t>(big)) {
      p.resize(ns * static_cast<size_t>(big));
      p_new.resize(ns * static_cast<size_t>(big));
    }
  }
  // (gb: only for a cotangent of the weights; without it the cotangent is gv_t x_i, formed from
  // xs in the vector code)
  void size_backward(bool with_gb) {
    const size_t ns = static_cast<size_t>(slots * kLanes);
    if (with_gb && gb.size() < ns * static_cast<size_t>(big)) {
      gb.resize(ns * static_cast<size_t>(big));
    }
    if (yc.size() < ns) {
      yc.resize(ns);
      xs.resize(ns);
      out.resize(ns);
    }
    const size_t nk = ns * static_cast<size_t>(big + 2);
    if (kept.size() < nk) kept.resize(nk);
  }
  // the candidate problems pb[0..kLanes) into the lanes (slots past a row's candidates: factors
  // 0, so that their plan is 1 at their home and 0 elsewhere whatever the state, masked out; their
  // home is lane 0's, or the rest's)
  void load(const Prob* pb_in) {
    pb = pb_in;
    rest = pb[0].nb >= 0;
    bool ranked = slots == big;
    for (int64_t l = 0; l < kLanes; ++l) ranked = ranked && pb[l].ranked;
    if (ranked) {
      load_ranked();
      return;
    }
    const int64_t m0 = std::min(pb[0].m, slots);
    for (int64_t l = 0; l < kLanes; ++l) {
      const Prob& pr = pb[l];
      // (each lane's entries, then its slots past them: lane 0's home there, or the rest's)
      const int64_t ml = std::min(pr.m, slots);
      for (int64_t i = 0; i < ml; ++i) {
        e[i * kLanes + l] = pr.e[i];
        ie[i * kLanes + l] = pr.ie[i];
        home[i * kLanes + l] = static_cast<double>(pr.home[i]);
        valid[i * kLanes + l] = 1.0;
      }
      for (int64_t i = ml; i < slots; ++i) {
        e[i * kLanes + l] = 0.0;
        ie[i * kLanes + l] = 0.0;
        home[i * kLanes + l] = static_cast<double>(i < m0 ? pb[0].home[i] : big - 1);
        valid[i * kLanes + l] = 0.0;
      }
      for (int64_t j = 0; j < big; ++j) {
        aconst[j * kLanes + l] = j + 1 < big ? (pr.bmid[j] - pr.c) * pr.inv_eps : 0.0;
        bref[j * kLanes + l] = pr.bref[j];
        bcol[j * kLanes + l] = pr.bcol[j];
        log_bcol[j * kLanes + l] = pr.bcol[j] == 1.0 ? 0.0 : std::log(pr.bcol[j]);
      }
      rest = rest && pr.nb >= 0;
      lie0[l] = pr.lie0;
      lie1[l] = pr.lie1;
      drop[l] = pr.log_drop;
      bpu[l] = pr.bpu;
      nb[l] = static_cast<double>(pr.nb);
    }
    // per slot, the home of every lane's entry where they are at one (else -1)
    for (int64_t i = 0; i < slots; ++i) {
      const VecD h = VecD::loadu(home.data() + i * kLanes);
      const double h0 = home[i * kLanes];
      const bool one = (h - VecD(h0)).zero_mask() == (1 << kLanes) - 1;
      shared[i] = one ? static_cast<int64_t>(h0) : -1;
    }
  }
  // load where every lane's problem is prepare_ranked's (slots = big): what the lanes share (the
  // entry of slot i at home i, columns of mass 1, no rest) set once for all of them, not per lane
  // (the same arrays as the general load; rows of 8, k = 8: forward+backward 580 -> 565 us at
  // B = 1024)
  void load_ranked() {
    set_ranked();
    for (int64_t l = 0; l < kLanes; ++l) {
      const Prob& pr = pb[l];
      for (int64_t i = 0; i < slots; ++i) {
        e[i * kLanes + l] = pr.e[i];
        ie[i * kLanes + l] = pr.ie[i];
      }
      for (int64_t j = 0; j + 1 < big; ++j) {
        aconst[j * kLanes + l] = (pr.bmid[j] - pr.c) * pr.inv_eps;
      }
      aconst[(big - 1) * kLanes + l] = 0.0;
      lie0[l] = pr.lie0;
      lie1[l] = pr.lie1;
      drop[l] = pr.log_drop;
      bpu[l] = pr.bpu;
    }
  }
  // What every lane of ranked problems shares (slots = big): the entry of slot i at home i,
  // columns of mass 1 (bref 0, log 0), no rest.
  void set_ranked() {
    rest = false;
    const VecD one(1.0), zero(0.0);
    for (int64_t i = 0; i < slots; ++i) {
      VecD(static_cast<double>(i)).store(home.data() + i * kLanes);
      one.store(valid.data() + i * kLanes);
      shared[i] = i;
    }
    for (int64_t j = 0; j < big; ++j) {
      zero.store(bref + j * kLanes);
      one.store(bcol + j * kLanes);
      zero.store(log_bcol + j * kLanes);
    }
    for (int64_t l = 0; l < kLanes; ++l) nb[l] = -1.0;
  }
};

// column_limits on every lane at once (a: the lanes' log column factors, in range in the lanes
// of `inrange` 1.0; the others form every column): lim[j] the largest over the lanes of the
// lane's limit of column j, so that a slot below lim[j] has column j formed in every lane (in a
// lane whose own limit is below it, as the one-row code would form it: the same plan, within the
// drop bound), and no lane forms column j at a slot at or past it. The largest of non-decreasing
// limits is non-decreasing in j; lim[big - 1] = slots. An entry at one of the first k homes has
// every column formed (column_limits' limits are at least the start of the rest), so the first
// column formed at a slot is never above the home of a lane's entry there.
void lane_limits(const Lanes& g, const VecArr& a, const VecD& inrange, int64_t* lim) {
  const int64_t big = g.big, ns = g.slots;
  for (int64_t j = 0; j < big; ++j) lim[j] = ns;
  if (!g.rest) return;
  const int64_t k = big - 1;  // (the rest is column k)
  const VecD lie0 = VecD::loadu(g.lie0), lie1 = VecD::loadu(g.lie1), drop = VecD::loadu(g.drop);
  const VecD bpu = VecD::loadu(g.bpu), nb = VecD::loadu(g.nb), none(-1.0), zero(0.0);
  const VecD out = inrange == zero;  // (every column formed: the last bin)
  VecD bmax[kLaneBig + 1];
  VecD sum_a = zero;
  for (int64_t r = 1; r <= k; ++r) {
    sum_a = sum_a + a[k - r];
    const VecD rd(static_cast<double>(r));
    // the last bin whose bound reaches exp(drop), as column_limits (-1: none)
    const VecD t = bpu * (lie1 - (sum_a + drop) / rd);
    const VecD bt = VecD::blendv(at::vec::minimum(VecD(1.0) + t.floor(), nb), nb, t >= nb);
    const VecD b1 = VecD::blendv(zero, bt, (rd * lie1 - sum_a) >= drop);
    bmax[r] = VecD::blendv(VecD::blendv(none, b1, (rd * lie0 - sum_a) >= drop), nb, out);
  }
  VecD run = none;
  double rl[kLanes];
  for (int64_t r = k; r >= 1; --r) {
    run = at::vec::maximum(run, bmax[r]);
    run.store(rl);
    int64_t most = 0;
    for (int64_t l = 0; l < kLanes; ++l) {
      const Prob& pr = g.pb[l];
      const int64_t e = rl[l] < 0 ? pr.gs[big - 1] : pr.bend[static_cast<int64_t>(rl[l])];
      most = std::max(most, e);
    }
    lim[k - r] = most;
  }
}

// eval_fast on every lane at once: the plans (big, slots, lanes) into p, the gaps into gap;
// returns the lanes' sum_j |gap_j|, and in `inrange` 1.0 where every column factor is in range
// (0.0: the lane's row needs eval_general). As eval_fast, the rest's entries stop their downward
// recurrence at the first column formed at their slot (lane_limits, from this state's factors):
// lim[j] the end of the slots at which column j is formed. p's column j is not written at or past
// lim[j], except that with `hw` (in: the slots past which p's column j is already 0; out: lim)
// the slots in [lim[j], hw[j]) are cleared, so that p is 0 wherever a column is not formed.
// CUT false: rows without a rest (every column formed, lim[j] = slots, without lane_limits).
template <int64_t BIG = 0, bool CUT = true>
VecD eval_lanes(const Lanes& g, const double* v, double* p, double* gap, VecD& inrange,
                int64_t* lim, int64_t* hw = nullptr) {
  const int64_t big = BIG > 0 ? BIG : g.big, ns = g.slots;
  const VecD one(1.0), zero(0.0), far(kFar);
  VecArr rho, irho, gv, av;
  inrange = one;
  for (int64_t j = 0; j + 1 < big; ++j) {
    const VecD a = (VecD::loadu(v + (j + 1) * kLanes) - VecD::loadu(v + j * kLanes)) +
                   VecD::loadu(g.aconst + j * kLanes);
    av[j] = a;
    inrange = at::vec::minimum(inrange, a.abs().le(far));
    rho[j] = a.exp();
    irho[j] = one / rho[j];
  }
  const int64_t sj = ns * kLanes;
  if constexpr (CUT) {
    lane_limits(g, av, inrange, lim);
  } else {
    for (int64_t j = 0; j < big; ++j) lim[j] = ns;
  }
  if (hw != nullptr) {
    for (int64_t j = 0; j < big; ++j) {
      if (hw[j] > lim[j]) {
        std::memset(p + j * sj + lim[j] * kLanes, 0,
                    sizeof(double) * static_cast<size_t>((hw[j] - lim[j]) * kLanes));
      }
      hw[j] = lim[j];
    }
  }
  for (int64_t j = 0; j < big; ++j) gv[j] = VecD::loadu(g.bref + j * kLanes);
  VecArr q, eq;
  int64_t lo = 0;  // the first column formed at slot i (non-decreasing in i; lim[big - 1] = ns)
  for (int64_t i = 0; i < ns; ++i) {
    if constexpr (CUT) {
      while (lim[lo] <= i) ++lo;
    }
    const VecD ei = VecD::loadu(g.e.data() + i * kLanes);
    const VecD iei = VecD::loadu(g.ie.data() + i * kLanes);
    const VecD h = VecD::loadu(g.home.data() + i * kLanes);
    const VecD val = VecD::loadu(g.valid.data() + i * kLanes);
    const int64_t hs = g.shared[i];
    if (hs >= 0) {  // every lane's entry at one home: eval_fast's recurrence as it is
      // (the sums above and below the home apart: two chains of additions, each half as long,
      // beside the recurrences; the forward of rows of 8, k = 8, 4 % faster)
      q[hs] = one;
      VecD up = zero, down = zero;
      for (int64_t j = hs; j + 1 < big; ++j) {
        q[j + 1] = q[j] * (ei * rho[j]);
        up = up + q[j + 1];
      }
      for (int64_t j = hs - 1; j >= lo; --j) {
        q[j] = q[j + 1] * (iei * irho[j]);
        down = down + q[j];
      }
      const VecD inv = (one / (one + (up + down))) * val;
      VecD off_down = zero, off_up = zero;
      for (int64_t j = lo; j < hs; ++j) {
        const VecD pj = q[j] * inv;
        pj.store(p + j * sj + i * kLanes);
        off_down = off_down + pj;
        gv[j] = gv[j] - pj;
      }
      (q[hs] * inv).store(p + hs * sj + i * kLanes);
      for (int64_t j = hs + 1; j < big; ++j) {
        const VecD pj = q[j] * inv;
        pj.store(p + j * sj + i * kLanes);
        off_up = off_up + pj;
        gv[j] = gv[j] - pj;
      }
      gv[hs] = gv[hs] + (off_down + off_up);
      continue;
    }
    // upward from the home (1 there, 0 below it), then downward (the slots below the home, to
    // the first column formed)
    VecD qu = zero;
    for (int64_t j = lo; j < big; ++j) {
      const VecD jv(static_cast<double>(j));
      eq[j] = h == jv;
      const VecD nxt = j > lo ? qu * (ei * rho[j - 1]) : zero;
      qu = VecD::blendv(VecD::blendv(nxt, one, eq[j]), zero, h > jv);
      q[j] = qu;
    }
    VecD qd = zero;
    VecD tot = zero;
    for (int64_t j = big - 1; j >= lo; --j) {
      const VecD jv(static_cast<double>(j));
      const VecD nxt = j + 1 < big ? qd * (iei * irho[j]) : zero;
      qd = VecD::blendv(VecD::blendv(nxt, one, eq[j]), zero, h < jv);
      q[j] = VecD::blendv(q[j], qd, h > jv);
      tot = tot + q[j];
    }
    const VecD inv = (one / tot) * val;
    VecD off = zero;
    for (int64_t j = lo; j < big; ++j) {
      const VecD pj = q[j] * inv;
      pj.store(p + j * sj + i * kLanes);
      const VecD po = VecD::blendv(pj, zero, eq[j]);
      off = off + po;
      gv[j] = gv[j] - po;
    }
    for (int64_t j = lo; j < big; ++j) gv[j] = gv[j] + VecD::blendv(zero, off, eq[j]);
  }
  VecD l1 = zero;
  for (int64_t j = 0; j < big; ++j) {
    gv[j].store(gap + j * kLanes);
    l1 = l1 + gv[j].abs();
  }
  return l1;
}

// laplacian_solve's Jacobi-equilibrated Cholesky (big >= 4, grounded at the last column) on
// every lane with the relative jitter tau (per lane), in its square-root-free form L D L^T (the
// same factor: D holds the squared pivots; a pivot's square root and its reciprocal were the
// longest chain of the factorisation): out = K^-1 rhs ([j * kLanes + l]); returns 1.0 in the
// lanes where every squared pivot is positive (else 0.0), their least in least.
// A factor of laplacian_lanes (unit lower triangle, 1 / D and the equilibration), for a second
// right-hand side (the backward's refinement) without factoring again.
struct LaneFactor {
  double unit[kLaneBig * kLaneBig * kLanes];
  double scale[kLaneBig * kLanes];
  double inv_d[kLaneBig * kLanes];
};

// out = K^-1 rhs by the factor f of laplacian_lanes (big targets, grounded at the last).
template <int64_t BIG = 0>
void factor_solve(const LaneFactor& f, int64_t big_in, const double* rhs, double* out) {
  const int64_t big = BIG > 0 ? BIG : big_in;
  const int64_t m1 = big - 1;
  auto at_l = [&](int64_t j, int64_t col) { return VecD::loadu(f.unit + (j * m1 + col) * kLanes); };
  VecArr y, x;
  for (int64_t j = 0; j < m1; ++j) {
    VecD acc = VecD::loadu(rhs + j * kLanes) * VecD::loadu(f.scale + j * kLanes);
    for (int64_t s = 0; s < j; ++s) acc = acc - at_l(j, s) * y[s];
    y[j] = acc;
  }
  for (int64_t j = m1 - 1; j >= 0; --j) {
    VecD acc = y[j] * VecD::loadu(f.inv_d + j * kLanes);
    for (int64_t s = j + 1; s < m1; ++s) acc = acc - at_l(s, j) * x[s];
    x[j] = acc;
  }
  for (int64_t j = 0; j < m1; ++j) (x[j] * VecD::loadu(f.scale + j * kLanes)).store(out + j * kLanes);
  VecD(0.0).store(out + m1 * kLanes);
}

// (the factor into *keep where given)
template <int64_t BIG = 0>
VecD laplacian_lanes(const double* w, int64_t big_in, const double* rhs, double* out,
                     const VecD& tau, VecD& least, LaneFactor* keep = nullptr) {
  const int64_t big = BIG > 0 ? BIG : big_in;
  const int64_t m1 = big - 1;
  const VecD one(1.0), zero(0.0);
  // (the matrices as plain doubles, vector j * m1 + col at [(j * m1 + col) * kLanes]: an array
  // of Vectorized would be zeroed on construction)
  double amat[kLaneBig * kLaneBig * kLanes];
  LaneFactor local;
  LaneFactor& f = keep != nullptr ? *keep : local;
  double* unit = f.unit;
  auto at_w = [&](int64_t j, int64_t col) { return VecD::loadu(w + (j * kLaneBig + col) * kLanes); };
  auto at_a = [&](int64_t j, int64_t col) { return VecD::loadu(amat + (j * m1 + col) * kLanes); };
  auto at_l = [&](int64_t j, int64_t col) { return VecD::loadu(unit + (j * m1 + col) * kLanes); };
  VecArr scale, inv_d, e;
  for (int64_t j = 0; j < m1; ++j) {
    VecD d = zero;
    for (int64_t col = 0; col < big; ++col) {
      if (col != j) d = d + at_w(j, col);
    }
    scale[j] = VecD::blendv(one, one / d.sqrt(), d > zero);
    scale[j].store(f.scale + j * kLanes);
    (d * scale[j] * scale[j]).store(amat + (j * m1 + j) * kLanes);
    for (int64_t col = 0; col < j; ++col) {
      (zero - at_w(j, col) * scale[j] * scale[col]).store(amat + (j * m1 + col) * kLanes);
    }
  }
  least = one;
  VecD okv = one;
  for (int64_t j = 0; j < m1; ++j) {
    // e_c = L_jc D_c, then L_jc = e_c / D_c; D_j = A_jj + tau - sum_c L_jc e_c
    VecD acc = at_a(j, j) + tau;
    for (int64_t col = 0; col < j; ++col) {
      VecD ec = at_a(j, col);
      for (int64_t s = 0; s < col; ++s) ec = ec - e[s] * at_l(col, s);
      e[col] = ec;
      const VecD ljc = ec * inv_d[col];
      ljc.store(unit + (j * m1 + col) * kLanes);
      acc = acc - ljc * ec;
    }
    okv = at::vec::minimum(okv, acc.gt(zero));
    inv_d[j] = one / acc;
    inv_d[j].store(f.inv_d + j * kLanes);
    least = at::vec::minimum(least, acc);
  }
  factor_solve<BIG>(f, big, rhs, out);
  return okv;
}

// laplacian_solve on every lane, its first two attempts, except that a factor without jitter is
// taken wherever its squared pivots are positive, however small (laplacian_solve retries those
// below 1e-2 with the jitter): a chain of couplings of very different sizes, as in a short row
// of distinct entries, has a pivot below 1e-2 in most rows, and one refinement against the
// exactly formed residual (the backward's, where res[l] <= 1) makes either solve accurate to
// rounding. res[l]: 2 where the least squared pivot is at least 1e-2, else the least squared
// pivot of the factor taken (in (0, 1]), or -1 where the lane needs the third attempt (the
// caller takes laplacian_solve); tau the jitter each lane took.
template <int64_t BIG = 0>
void solve_lanes(const double* w, int64_t big_in, const double* rhs, double* out, double* res,
                 VecD& tau, LaneFactor* keep = nullptr) {
  const int64_t big = BIG > 0 ? BIG : big_in;
  const VecD zero(0.0);
  VecD least;
  const VecD ok0 = laplacian_lanes<BIG>(w, big, rhs, out, zero, least, keep);
  double o0[kLanes], l0[kLanes];
  ok0.store(o0);
  least.store(l0);
  bool all = true;
  for (int64_t l = 0; l < kLanes; ++l) {
    all = all && o0[l] > 0;
    res[l] = l0[l] >= 1e-2 ? 2.0 : l0[l];
  }
  tau = zero;
  if (all) return;
  const double m1 = static_cast<double>(big - 1);
  tau = VecD::blendv(VecD(16.0 * std::max(m1, 4.0) * kEps64), zero, ok0 > zero);
  const VecD ok1 = laplacian_lanes<BIG>(w, big, rhs, out, tau, least, keep);
  double o1[kLanes], ll[kLanes];
  ok1.store(o1);
  least.store(ll);
  for (int64_t l = 0; l < kLanes; ++l) {
    if (!(o0[l] > 0)) res[l] = o1[l] > 0 ? ll[l] : -1.0;
  }
}

// u sums sum_i P_ji P_(o+s),i of every lane (s < u) over the first len doubles of the columns
// (pj, po: columns j and o), into both triangles of w.
template <int U>
inline void coupling_sums(const double* pj, const double* po, int64_t sj, int64_t len, int64_t j,
                          int64_t o, double* w) {
  VecD s[U];
  for (int u = 0; u < U; ++u) s[u] = VecD(0.0);
  for (int64_t i = 0; i < len; i += kLanes) {
    const VecD q = VecD::loadu(pj + i);
    for (int u = 0; u < U; ++u) s[u] = at::vec::fmadd(q, VecD::loadu(po + u * sj + i), s[u]);
  }
  for (int u = 0; u < U; ++u) {
    s[u].store(w + (j * kLaneBig + o + u) * kLanes);
    s[u].store(w + ((o + u) * kLaneBig + j) * kLanes);
  }
}

// The couplings w[j, o] = sum_i P_ji P_oi of every lane (j != o; both triangles), four targets o
// at a time (four independent sums; the last one to three apart), the pair j < o over the slots
// below lim[j] (p's column j is 0 past it).
template <int64_t BIG = 0>
void couplings_lanes(const double* p, int64_t big_in, int64_t ns, const int64_t* lim, double* w) {
  const int64_t big = BIG > 0 ? BIG : big_in;
  const int64_t sj = ns * kLanes;
  for (int64_t j = 0; j + 1 < big; ++j) {
    const double* pj = p + j * sj;
    const int64_t len = lim[j] * kLanes;
    int64_t o = j + 1;
    for (; o + 4 <= big; o += 4) coupling_sums<4>(pj, p + o * sj, sj, len, j, o, w);
    const int64_t left = big - o;
    if (left == 3) {
      coupling_sums<3>(pj, p + o * sj, sj, len, j, o, w);
    } else if (left == 2) {
      coupling_sums<2>(pj, p + o * sj, sj, len, j, o, w);
    } else if (left == 1) {
      coupling_sums<1>(pj, p + o * sj, sj, len, j, o, w);
    }
  }
}

// newton_row on the lanes of a group (lanes of rows already prepared in pb[l]), every lane at
// once. Per lane: done 1 where the row is solved here (its state in v, its gaps in gap, its plan
// in g.p, column t 0 at the slots at and past lim_out[t]), 0 where the scalar code must solve the
// row.
template <int64_t BIG = 0, bool CUT = true>
void newton_lanes(Lanes& g, const Prob* pb, double tol, int64_t max_steps, int64_t halvings,
                  double* v, double* gap, bool* done, int64_t* lim_out) {
  const int64_t big = BIG > 0 ? BIG : g.big, ns = g.slots;
  double v_new[kMaxBig * kLanes], gap_new[kMaxBig * kLanes], delta[kMaxBig * kLanes];
  double l1[kLanes], l1n[kLanes], inr[kLanes], step[kLanes], tolm[kLanes], okl[kLanes];
  int64_t steps[kLanes], tries[kLanes];
  bool active[kLanes], phase2[kLanes], accept[kLanes], need[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    tolm[l] = tol * static_cast<double>(pb[l].m);
    l1[l] = kInf;
    steps[l] = 0;
    tries[l] = 0;
    step[l] = 1.0;
    active[l] = true;
    phase2[l] = false;
    done[l] = true;
  }
  for (int64_t t = 0; t < big * kLanes; ++t) {
    v[t] = 0.0;
    v_new[t] = 0.0;
    gap[t] = 0.0;
  }
  double* p = g.p.data();
  double* p_new = g.p_new.data();
  // per buffer and column, the slots past which it is 0 (ns: not known) and, for an evaluation,
  // the end of the slots formed
  int64_t hw_a[kMaxBig], hw_b[kMaxBig], lim_e[kMaxBig];
  int64_t* hw = hw_a;
  int64_t* hw_new = hw_b;
  for (int64_t t = 0; t < big; ++t) {
    hw[t] = ns;
    hw_new[t] = ns;
  }
  VecD inrange;
  // the start: one Sinkhorn column update of v = 0
  eval_lanes<BIG, CUT>(g, v_new, p_new, gap_new, inrange, lim_e, hw_new);
  inrange.store(inr);
  for (int64_t t = 0; t < big; ++t) {
    VecD col(0.0);
    const double* pt = p_new + t * ns * kLanes;
    for (int64_t i = 0; i < hw_new[t]; ++i) col = col + VecD::loadu(pt + i * kLanes);
    const VecD vt =
        VecD::loadu(g.log_bcol + t * kLanes) - at::vec::maximum(col, VecD(kTiny)).log();
    vt.store(v_new + t * kLanes);
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    if (!(inr[l] > 0)) {
      active[l] = false;
      done[l] = false;
    }
  }
  while (true) {
    eval_lanes<BIG, CUT>(g, v_new, p_new, gap_new, inrange, lim_e, hw_new).store(l1n);
    inrange.store(inr);
    bool any_accept = false, any_need = false;
    for (int64_t l = 0; l < kLanes; ++l) {
      accept[l] = false;
      need[l] = false;
      if (!active[l]) continue;
      if (!(inr[l] > 0)) {  // (the scalar code takes eval_general: the row goes there)
        active[l] = false;
        done[l] = false;
        continue;
      }
      if (phase2[l] && !(l1n[l] < l1[l])) {
        if (++tries[l] > halvings) {
          active[l] = false;
          continue;
        }
        step[l] *= 0.5;
        for (int64_t t = 0; t < big; ++t) {
          v_new[t * kLanes + l] = v[t * kLanes + l] + step[l] * delta[t * kLanes + l];
        }
        continue;
      }
      accept[l] = true;
      any_accept = true;
      for (int64_t t = 0; t < big; ++t) {
        gap[t * kLanes + l] = gap_new[t * kLanes + l];
        v[t * kLanes + l] = v_new[t * kLanes + l];
      }
      l1[l] = l1n[l];
      if (!(l1[l] > tolm[l]) || steps[l] >= max_steps) {
        active[l] = false;
        continue;
      }
      need[l] = true;
      any_need = true;
    }
    bool all_accept = true;
    for (int64_t l = 0; l < kLanes; ++l) all_accept = all_accept && accept[l];
    if (all_accept) {  // (every lane takes its new plan: no lane's plan to keep)
      std::swap(p, p_new);
      std::swap(hw, hw_new);
    } else if (any_accept) {  // (both 0 past their limits: the blend 0 past the larger)
      double am[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) am[l] = accept[l] ? 1.0 : 0.0;
      const VecD mask = VecD::loadu(am) > VecD(0.0);
      for (int64_t t = 0; t < big; ++t) {
        hw[t] = std::max(hw[t], hw_new[t]);
        double* pt = p + t * ns * kLanes;
        const double* pnt = p_new + t * ns * kLanes;
        for (int64_t i = 0; i < hw[t] * kLanes; i += kLanes) {
          VecD::blendv(VecD::loadu(pt + i), VecD::loadu(pnt + i), mask).store(pt + i);
        }
      }
    }
    if (any_need) {
      double wc[kLaneBig * kLaneBig * kLanes];
      couplings_lanes<BIG>(p, big, ns, hw, wc);
      VecD tau;
      solve_lanes<BIG>(wc, big, gap, delta, okl, tau);
      for (int64_t l = 0; l < kLanes; ++l) {
        if (!need[l]) continue;
        double ok = okl[l];
        if (ok == -1.0) {  // the larger jitter (or a singular system): the scalar solve
          double wl[kMaxBig * kMaxBig], rl[kMaxBig], dl[kMaxBig];
          for (int64_t j = 0; j < big; ++j) {
            for (int64_t o = 0; o < big; ++o) {
              wl[j * kMaxBig + o] = o == j ? 0.0 : wc[(j * kLaneBig + o) * kLanes + l];
            }
            rl[j] = gap[j * kLanes + l];
          }
          ok = laplacian_solve(wl, big, rl, dl);
          for (int64_t j = 0; j < big; ++j) delta[j * kLanes + l] = dl[j];
        }
        ++steps[l];
        if (!(ok > 0)) {
          active[l] = false;
          continue;
        }
        phase2[l] = true;
        step[l] = 1.0;
        tries[l] = 0;
        for (int64_t t = 0; t < big; ++t) {
          v_new[t * kLanes + l] = v[t * kLanes + l] + delta[t * kLanes + l];
        }
      }
    }
    bool any = false;
    for (int64_t l = 0; l < kLanes; ++l) any = any || active[l];
    if (!any) break;
  }
  if (p != g.p.data()) std::swap(g.p, g.p_new);  // (the plans in g.p)
  for (int64_t t = 0; t < big; ++t) lim_out[t] = hw[t];
}

// The rows gathered for the lanes (count of them, lrow[l] in lw[l], lpb[l]): none, one alone by
// the scalar code, or a group by `group` (a flush_big); count 0 after.
template <typename ScalarRow, typename Group>
void flush_lanes(int64_t& count, const int64_t* lrow, std::vector<Work>& lw, const Prob* lpb,
                 ScalarRow&& scalar_row, Group&& group) {
  if (count == 1) {
    scalar_row(lrow[0], lw[0], lpb[0]);
  } else if (count > 1) {
    group();
  }
  count = 0;
}

// Whether finish_ranked_lanes writes rows of n entries of scalar_t (else: finish, row by row).
template <typename scalar_t>
constexpr bool finish_ranked_lanes_on(int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  return kLanes == 8 && n <= 8 &&
         (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>);
#else
  (void)n;
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
// The 8 x 8 transpose of r[0..8) (vector i, lane l) into c (vector l, lane i): pairs of lanes,
// then their 128-bit quarters, then their halves.
inline void transpose8(const __m512d* r, __m512d* c) {
  __m512d t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);  // r_i,0 r_i+1,0 r_i,2 r_i+1,2 ...
    t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);  // (lanes 1, 3, 5, 7)
  }
  for (int h = 0; h < 8; h += 4) {  // (rows h..h+3: lanes {0, 4}, {2, 6}, {1, 5}, {3, 7})
    u[h] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0x88);
    u[h + 1] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0xDD);
    u[h + 2] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0x88);
    u[h + 3] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0xDD);
  }
  c[0] = _mm512_shuffle_f64x2(u[0], u[4], 0x88);
  c[4] = _mm512_shuffle_f64x2(u[0], u[4], 0xDD);
  c[2] = _mm512_shuffle_f64x2(u[1], u[5], 0x88);
  c[6] = _mm512_shuffle_f64x2(u[1], u[5], 0xDD);
  c[1] = _mm512_shuffle_f64x2(u[2], u[6], 0x88);
  c[5] = _mm512_shuffle_f64x2(u[2], u[6], 0xDD);
  c[3] = _mm512_shuffle_f64x2(u[3], u[7], 0x88);
  c[7] = _mm512_shuffle_f64x2(u[3], u[7], 0xDD);
}
#endif

// The weights and values of the lanes l < count with write[l] of a group whose problems are all
// prepare_ranked's (k = n <= 8 targets and slots, every column formed at every slot; slot i of
// lane l is the row's entry lw[l].grouped[i]), from the plan p (n, n, lanes) and the ratios rl:
// w[t, grouped[i]] = P_ti f_t (f_t = 1 + rl_t; the same bits as finish writes), value_t = sign f_t
// sum_i P_ti y_i (the sum in another order). Per target the slots' vectors are transposed into
// the lanes' rows, each put in the row's order by one permutation and written by one store,
// where finish took a strided load and a scattered store per entry.
template <typename scalar_t>
void finish_ranked_lanes(const double* p, int64_t n, const double* rl, const Prob* lpb,
                         const std::vector<Work>& lw, const int64_t* lrow, const bool* write,
                         int64_t count, double sign, scalar_t* pw, scalar_t* pv) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  if constexpr (kLanes == 8 &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
    const int64_t k = n, sj = n * kLanes;
    alignas(64) int64_t idx[kLanes * 8];
    double yv[8 * kLanes];
    for (int64_t l = 0; l < kLanes; ++l) {
      const bool on = l < count && write[l];
      for (int64_t j = 0; j < 8; ++j) idx[l * 8 + j] = j;  // (past n: not stored)
      for (int64_t i = 0; i < n; ++i) {
        if (on) idx[l * 8 + lw[l].grouped[i]] = i;
        yv[i * kLanes + l] = on ? lpb[l].yc[i] : 0.0;
      }
    }
    const auto mask = static_cast<__mmask8>((1u << n) - 1u);
    const VecD sv(sign), one(1.0);
    __m512d r[8], c[8];
    for (int64_t i = n; i < 8; ++i) r[i] = _mm512_setzero_pd();
    for (int64_t t = 0; t < k; ++t) {
      const double* pt = p + t * sj;
      VecD acc(0.0);
      for (int64_t i = 0; i < n; ++i) {
        r[i] = _mm512_loadu_pd(pt + i * kLanes);
        acc = at::vec::fmadd(VecD(r[i]), VecD::loadu(yv + i * kLanes), acc);
      }
      const VecD fv = one + VecD::loadu(rl + t * kLanes);
      double vals[kLanes], fl[kLanes];
      (sv * (fv * acc)).store(vals);
      fv.store(fl);
      transpose8(r, c);
      for (int64_t l = 0; l < count; ++l) {
        if (!write[l]) continue;
        pv[lrow[l] * k + t] = static_cast<scalar_t>(vals[l]);
        const __m512d w = _mm512_permutexvar_pd(_mm512_load_si512(idx + l * 8),
                                                _mm512_mul_pd(c[l], _mm512_set1_pd(fl[l])));
        scalar_t* dst = pw + lrow[l] * k * n + t * n;
        if constexpr (std::is_same_v<scalar_t, float>) {
          _mm256_mask_storeu_ps(dst, mask, _mm512_cvtpd_ps(w));
        } else {
          _mm512_mask_storeu_pd(dst, mask, w);
        }
      }
    }
    return;
  }
#endif
  (void)p, (void)n, (void)rl, (void)lpb, (void)lw, (void)lrow, (void)write, (void)count,
      (void)sign, (void)pw, (void)pv;
}

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// The lanes' problems of 8 rows of k = n (4..8) entries from their scores sorted descending, y[t]
// the t-th largest of every row (a vector of rows), ix[t] its index (as doubles), and 1 / epsilon:
// false, having written nothing, where two neighbours are not strictly apart (prepare_ranked's
// check: it also fails a row out of order) or a factor is out of range (factors' check); else
// the lanes g loaded (Lanes::load_ranked's arrays), each row's sorted scores and indices in
// lw[l].yc and lw[l].grouped, lpb[l] as far as the lanes read it (lazy: prepare_ranked completes
// it for the one-row code), and each row's indices into rows_ix[l] (a vector per row). The numbers
// are prepare_ranked's and factors' (the same operations, a vector of rows at a time).
bool ranked_lanes(const __m512d* y, const __m512d* ix, __m512d inv, int64_t n, bool backward,
                  Lanes& g, std::vector<Work>& lw, Prob* lpb, __m512d* rows_ix) {
  const auto mask = static_cast<__mmask8>((1u << n) - 1u);
  const __m512d half = _mm512_set1_pd(0.5), low = y[n - 1];
  __mmask8 ok = 0xFF;
  __m512d mid[8];
  for (int64_t t = 0; t + 1 < n; ++t) {
    mid[t] = _mm512_fmadd_pd(half, y[t], _mm512_mul_pd(half, y[t + 1]));
    ok &= _mm512_cmp_pd_mask(mid[t], y[t], _CMP_LT_OQ) &
          _mm512_cmp_pd_mask(mid[t], y[t + 1], _CMP_GT_OQ);
  }
  const __m512d c = _mm512_fmadd_pd(half, y[0], _mm512_mul_pd(half, low));
  const __m512d zmax = _mm512_max_pd(_mm512_abs_pd(_mm512_mul_pd(_mm512_sub_pd(c, y[0]), inv)),
                                     _mm512_abs_pd(_mm512_mul_pd(_mm512_sub_pd(c, low), inv)));
  ok &= _mm512_cmp_pd_mask(zmax, _mm512_set1_pd(kFar), _CMP_LE_OQ);
  if (ok != 0xFF) return false;
  g.size(n, n);
  g.pb = lpb;
  g.set_ranked();
  const VecD one(1.0), zero(0.0);
  for (int64_t i = 0; i < n; ++i) {
    const VecD e = VecD(_mm512_mul_pd(_mm512_sub_pd(c, y[i]), inv)).exp();
    e.store(g.e.data() + i * kLanes);
    (one / e).store(g.ie.data() + i * kLanes);
    const VecD a = i + 1 < n ? VecD(_mm512_mul_pd(_mm512_sub_pd(mid[i], c), inv)) : zero;
    a.store(g.aconst + i * kLanes);
  }
  __m512d ys[8], yt[8], xt[8];
  for (int64_t t = 0; t < 8; ++t) yt[t] = t < n ? y[t] : _mm512_setzero_pd();
  transpose8(yt, ys);
  for (int64_t t = 0; t < 8; ++t) xt[t] = t < n ? ix[t] : _mm512_setzero_pd();
  transpose8(xt, rows_ix);
  double invl[8], cl[8];
  _mm512_storeu_pd(invl, inv);
  _mm512_storeu_pd(cl, c);
  for (int64_t l = 0; l < kLanes; ++l) {
    Work& wk = lw[l];
    wk.entries(n, n, backward);
    _mm512_mask_storeu_pd(wk.yc.data(), mask, ys[l]);
    _mm512_mask_storeu_epi64(wk.grouped.data(), mask, _mm512_cvtpd_epi64(rows_ix[l]));
    Prob& pr = lpb[l];
    pr.m = pr.big = pr.k = pr.ld = n;
    pr.inv_eps = invl[l];
    pr.c = cl[l];
    pr.fast = true;
    pr.yc = wk.yc.data();
    pr.e = pr.ie = nullptr;
    pr.nb = -1;
    pr.bend = nullptr;
    pr.ranked = true;
    pr.lazy = true;
    for (int64_t t = 0; t < n; ++t) {
      pr.gs[t] = t;
      pr.bcol[t] = 1.0;
      pr.bref[t] = 0.0;
    }
    pr.gs[n] = n;
  }
  return true;
}

// 8 rows x[0..8) (stride n) of scalar_t as vectors of doubles (row l in r[l], 0 past n).
template <typename scalar_t>
void load_rows(const scalar_t* px, int64_t n, __m512d* r) {
  const auto mask = static_cast<__mmask8>((1u << n) - 1u);
  for (int64_t l = 0; l < 8; ++l) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      r[l] = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(mask, px + l * n));
    } else {
      r[l] = _mm512_maskz_loadu_pd(mask, px + l * n);
    }
  }
}
#endif

// Whether ranked_block and ranked_block_vjp take rows of k = n entries of scalar_t (kLanes rows
// per group).
template <typename scalar_t>
constexpr bool ranked_block_on(int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return kLanes == 8 && n >= 4 && n <= 8 &&
         (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>);
#else
  (void)n;
  return false;
#endif
}

// The forward's preparation of kLanes (8) rows of k = n (4..8) entries at once, a vector of rows
// at a time (as the lanes solve them), where the one-row code takes each row in turn (top_scores,
// prepare_ranked, factors, Lanes::load: two fifths of the forward of rows of 8 went there). The
// rows x[0..8) (stride n) are transposed into one vector per place, oriented, checked as
// top_scores checks them, sorted by Batcher's network (checked by the 0-1 principle), and given to
// ranked_lanes, whose checks fail a row with equal neighbours or out of order (a network that
// sorted wrongly would cost time, not a wrong number). Returns false, having written nothing,
// where a check fails: the one-row code takes those rows. Else the lanes are loaded (ranked_lanes)
// and each row's indices are in pidx (row-major, n per row) and its state's top (the indices),
// cut, count and log_tau.
template <typename scalar_t>
bool ranked_block(const scalar_t* px, int64_t n, double sign, const double* eps, double limit,
                  double span_max, double cut, double log_tau, const Layout& lay, double* pst,
                  int64_t* pidx, Lanes& g, std::vector<Work>& lw, Prob* lpb) {
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  if constexpr (kLanes == 8 &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
    const auto mask = static_cast<__mmask8>((1u << n) - 1u);
    __m512d r[8], y[8], ix[8];
    load_rows(px, n, r);
    transpose8(r, y);  // (y[j]: entry j of every row)
    const __m512d sv = _mm512_set1_pd(sign), lim = _mm512_set1_pd(limit);
    const __m512d ninf = _mm512_set1_pd(-kInf);
    __mmask8 ok = 0xFF;
    for (int64_t j = 0; j < 8; ++j) {
      if (j < n) {
        y[j] = _mm512_mul_pd(y[j], sv);
        ok &= _mm512_cmp_pd_mask(_mm512_abs_pd(y[j]), lim, _CMP_LE_OQ);  // (false at a NaN)
      } else {
        y[j] = ninf;  // (below every entry: the network leaves them last)
      }
      ix[j] = _mm512_set1_pd(static_cast<double>(j));
    }
    if (ok != 0xFF) return false;
    // descending (equal scores in any order: a row with two is not strictly apart in
    // ranked_lanes, and the one-row code takes it)
    auto exchange = [&](int a, int b) {
      const __mmask8 m = _mm512_cmp_pd_mask(y[b], y[a], _CMP_GT_OQ);
      const __m512d ya = y[a], xa = ix[a];
      y[a] = _mm512_mask_blend_pd(m, ya, y[b]);
      y[b] = _mm512_mask_blend_pd(m, y[b], ya);
      ix[a] = _mm512_mask_blend_pd(m, xa, ix[b]);
      ix[b] = _mm512_mask_blend_pd(m, ix[b], xa);
    };
    // Batcher's odd-even merge sort of 8 (19 comparators)
    static constexpr int kNet[19][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6},
                                        {5, 7}, {1, 2}, {5, 6}, {0, 4}, {1, 5}, {2, 6}, {3, 7},
                                        {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}};
    for (const auto& c : kNet) exchange(c[0], c[1]);
    const __m512d inv = _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_loadu_pd(eps));
    // top_scores' span over epsilon
    ok = _mm512_cmp_pd_mask(
        _mm512_mul_pd(
            _mm512_mul_pd(_mm512_sub_pd(y[0], y[n - 1]), _mm512_set1_pd(static_cast<double>(n))),
            inv),
        _mm512_set1_pd(span_max), _CMP_LE_OQ);
    __m512d rows_ix[8];
    if (ok != 0xFF || !ranked_lanes(y, ix, inv, n, false, g, lw, lpb, rows_ix)) return false;
    for (int64_t l = 0; l < kLanes; ++l) {
      _mm512_mask_storeu_epi64(pidx + l * n, mask, _mm512_cvtpd_epi64(rows_ix[l]));
      double* st = pst + l * lay.size();
      _mm512_mask_storeu_pd(st + lay.top(), mask, rows_ix[l]);  // (k = n: the indices)
      st[lay.cut()] = cut;
      st[lay.count()] = static_cast<double>(n);
      st[lay.log_tau()] = log_tau;
    }
    return true;
  }
#endif
  (void)px, (void)n, (void)sign, (void)eps, (void)limit, (void)span_max, (void)cut,
      (void)log_tau, (void)lay, (void)pst, (void)pidx, (void)g, (void)lw, (void)lpb;
  return false;
}

// The backward's preparation of kLanes (8) rows of k = n (4..8) entries at once, as
// ranked_block's: each row's scores in the forward's order (its indices in the state's top, as
// the one-row code reads them), given to ranked_lanes. Returns false, having written nothing,
// where a row is not of status 0 with every entry a candidate, an index is out of the row, or
// ranked_lanes' checks fail (the one-row code then takes the rows).
template <typename scalar_t>
bool ranked_block_vjp(const scalar_t* px, int64_t n, double sign, const double* eps,
                      const int8_t* ps, const double* pst, const Layout& lay, Lanes& g,
                      std::vector<Work>& lw, Prob* lpb) {
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  if constexpr (kLanes == 8 &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
    const auto mask = static_cast<__mmask8>((1u << n) - 1u);
    const __m512d top = _mm512_set1_pd(static_cast<double>(n)), zero = _mm512_setzero_pd();
    __m512d r[8], q[8], y[8], ix[8];
    load_rows(px, n, r);
    for (int64_t l = 0; l < kLanes; ++l) {
      const double* st = pst + l * lay.size();
      if (ps[l] != 0 || st[lay.count()] != static_cast<double>(n)) return false;
      q[l] = _mm512_maskz_loadu_pd(mask, st + lay.top());
      const __mmask8 in = _mm512_cmp_pd_mask(q[l], zero, _CMP_GE_OQ) &
                          _mm512_cmp_pd_mask(q[l], top, _CMP_LT_OQ) &
                          _mm512_cmp_pd_mask(q[l], _mm512_roundscale_pd(q[l], _MM_FROUND_TO_ZERO),
                                             _CMP_EQ_OQ);
      if ((in & mask) != mask) return false;
      // (the row's scores in the forward's order: x at its indices, oriented)
      r[l] = _mm512_mul_pd(_mm512_permutexvar_pd(_mm512_cvttpd_epi64(q[l]), r[l]),
                           _mm512_set1_pd(sign));
    }
    transpose8(r, y);
    transpose8(q, ix);
    const __m512d inv = _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_loadu_pd(eps));
    __m512d rows_ix[8];
    return ranked_lanes(y, ix, inv, n, true, g, lw, lpb, rows_ix);
  }
#endif
  (void)px, (void)n, (void)sign, (void)eps, (void)ps, (void)pst, (void)lay, (void)g, (void)lw,
      (void)lpb;
  return false;
}

// Scratch a thread keeps between calls, at most this many bytes of it (past it: released): a
// row of up to about 3e5 entries (a row of n with m candidates takes about 20 n + 330 m bytes).
constexpr size_t kKeepScratchBytes = size_t{1} << 24;

// A thread's scratch for the rows of one pass (the forward's or the backward's), kept between
// calls: a call whose rows fit reuses it (no allocation, no zero-filling of new vectors, memory
// the caches may still hold; allocating it per call cost a tenth of a (64, 128) call, and a row
// of 1e5 took 500-1400 page faults per call in some processes, 2-5x its time, where the freed
// scratch went back to the system); a call that leaves it larger than kKeepScratchBytes releases
// it (rows of about 1e6, whose own work dwarfs an allocation).
struct Scratch {
  Work w;
  std::vector<Work> lw;  // (a group of rows in the lanes)
  Lanes g;

  std::vector<Work>& lanes(bool on) {
    if (on && lw.size() < static_cast<size_t>(kLanes)) lw.resize(kLanes);
    return lw;
  }
  void trim() {
    size_t held = w.bytes() + g.bytes();
    for (const Work& u : lw) held += u.bytes();
    if (held > kKeepScratchBytes) {
      w = Work{};
      lw.clear();
      g = Lanes{};
    }
  }
};

template <typename scalar_t>
void solve_rows_impl(const at::Tensor& x, const double* eps, bool largest, int64_t k, double tau,
                     double bpu, double limit, double span_max, const double* weight, int64_t nb,
                     double tol, int64_t max_steps, int64_t halvings, at::Tensor& weights,
                     at::Tensor& values, at::Tensor& err, at::Tensor& status, at::Tensor& state,
                     at::Tensor& indices) {
  const int64_t B = x.size(0), n = x.size(1);
  const int64_t big = k < n ? k + 1 : k;
  const Layout lay{big};
  const double sign = largest ? 1.0 : -1.0;
  const scalar_t* px = x.data_ptr<scalar_t>();
  scalar_t* pw = weights.data_ptr<scalar_t>();
  scalar_t* pv = values.data_ptr<scalar_t>();
  double* pe = err.data_ptr<double>();
  int8_t* ps = status.data_ptr<int8_t>();
  double* pst = state.data_ptr<double>();
  int64_t* pidx = indices.data_ptr<int64_t>();
  const int64_t grain = row_grain(n, big);
  // the lanes: rows of four targets or more (fewer: the closed forms) and few candidates
  const bool lanes_on = big >= 4 && big <= kLaneBig;
  const double log_tau = std::log(tau);
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    static thread_local Scratch scratch;
    Work& w = scratch.w;
    Prob pb;
    std::vector<Work>& lw = scratch.lanes(lanes_on);
    Prob lpb[kLanes];
    int64_t lrow[kLanes];
    int64_t count = 0;
    Lanes& g = scratch.g;
    bool g_ready = false;  // (the lanes loaded by ranked_block)
    const int64_t big_rt = big;
    // a solved row's flags, weights (scattered to the candidates) and values (x = sign y) from
    // its state and its plan P_ti at p[t * sj + i * si] (i < lim[t]; 0 beyond, left as it is)
    // a row with entries off its candidates, where the output is large: its weights formed in
    // `dense` (in the cache; the others 0), then streamed to the output
    const bool stream = static_cast<int64_t>(weights.nbytes()) >= kStreamBytes;
    const int64_t row_bytes = static_cast<int64_t>(sizeof(scalar_t)) * k * n;
    std::vector<scalar_t> dense;
    auto finish = [&](int64_t row, const Prob& pr, const Work& wk, const double* p, int64_t sj,
                      int64_t si, const int64_t* lim, double e) {
      pe[row] = e;
      ps[row] = e <= tol ? 0 : 1;
      const double* rr = pst + row * lay.size() + lay.ratio();
      const bool part = pr.m < n, via = part && stream && row_bytes <= kScratchBytes;
      if (via && static_cast<int64_t>(dense.size()) < k * n) dense.resize(k * n);
      scalar_t* wr = via ? dense.data() : pw + row * k * n;
      if (part) std::memset(wr, 0, sizeof(scalar_t) * static_cast<size_t>(k * n));
      for (int64_t t = 0; t < k; ++t) {
        const double f = 1.0 + rr[t];
        const double* pt = p + t * sj;
        scalar_t* wt = wr + t * n;
        double acc = 0.0;
        const int64_t mt = lim[t];
        const double* yc = pr.yc;
        const int64_t* grouped = wk.grouped.data();
        if (si == 1) {  // (the value's sum apart: a vector reduction, not one chained sum)
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < mt; ++i) acc += pt[i] * yc[i];
          for (int64_t i = 0; i < mt; ++i) wt[grouped[i]] = static_cast<scalar_t>(pt[i] * f);
        } else {  // (a short row in the lanes; the value's sum in four parts, not one chain)
          double part[4] = {0.0, 0.0, 0.0, 0.0};
          int64_t i = 0;
          for (; i + 4 <= mt; i += 4) {
            for (int64_t u = 0; u < 4; ++u) {
              const double pti = pt[(i + u) * si];
              part[u] += pti * yc[i + u];
              wt[grouped[i + u]] = static_cast<scalar_t>(pti * f);
            }
          }
          for (; i < mt; ++i) {
            const double pti = pt[i * si];
            part[0] += pti * yc[i];
            wt[grouped[i]] = static_cast<scalar_t>(pti * f);
          }
          acc = (part[0] + part[1]) + (part[2] + part[3]);
        }
        if (pr.m == n) {  // (a row of candidates only was not cleared)
          for (int64_t i = mt; i < pr.m; ++i) wt[grouped[i]] = scalar_t(0);
        }
        pv[row * k + t] = static_cast<scalar_t>(sign * (f * acc));
      }
      if (via) stream_bytes(pw + row * k * n, wr, sizeof(scalar_t) * static_cast<size_t>(k * n));
    };
    auto scalar_row = [&](int64_t row, Work& wk, const Prob& pr) {
      double* p = nullptr;
      int64_t lim[kMaxBig];
      const double e =
          newton_row(pr, tol, max_steps, halvings, wk, pst + row * lay.size(), lay, p, lim);
      finish(row, pr, wk, p, pr.m, 1, lim, e);
    };
    // the rows gathered in the lanes, solved together (one alone: the scalar code)
    // (CUT: the rows have a rest, as in vjp_rows_impl's flush_big)
    auto flush_big = [&](auto big_c, auto cut_c) {
      constexpr int64_t BIG = decltype(big_c)::value;
      constexpr bool CUT = decltype(cut_c)::value;
      const int64_t big = BIG > 0 ? BIG : big_rt;
      int64_t ns = 0;
      for (int64_t l = 0; l < count; ++l) ns = std::max(ns, lpb[l].m);
      for (int64_t l = count; l < kLanes; ++l) lpb[l] = lpb[0];  // (idle lanes: lane 0 again)
      if (!g_ready) {
        g.size(big, ns);
        g.load(lpb);
      }
      g_ready = false;
      double v[kLaneBig * kLanes], gap[kLaneBig * kLanes];
      bool done[kLanes];
      int64_t glim[kMaxBig];
      newton_lanes<BIG, CUT>(g, lpb, tol, max_steps, halvings, v, gap, done, glim);
      const int64_t sj = ns * kLanes;
      // the ratios (b - c)/c of the lanes solved here (0 in the others), then each row's residual
      // of the column-exact plan, sum_i |sum_t P_ti r_t| / m, every lane at once (the plan is 0
      // in the slots past a row's candidates, and column t at the slots past glim[t])
      double rl[kLaneBig * kLanes], el[kLanes];
      for (int64_t t = 0; t < big; ++t) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const double gt = gap[t * kLanes + l];
          const bool solved = l < count && done[l];
          rl[t * kLanes + l] = solved ? gt / std::max(lpb[l].bcol[t] - gt, kTiny) : 0.0;
        }
      }
      VecD err(0.0);
      int64_t lo = 0;  // (the first column formed at slot i)
      for (int64_t i = 0; i < ns; ++i) {
        if constexpr (CUT) {
          while (glim[lo] <= i) ++lo;
        }
        VecD dev(0.0);
        for (int64_t t = lo; t < big; ++t) {
          dev = dev + VecD::loadu(g.p.data() + t * sj + i * kLanes) * VecD::loadu(rl + t * kLanes);
        }
        err = err + dev.abs();
      }
      err.store(el);
      // (rows of k = n <= 8 entries: their weights and values for the whole group at once)
      bool grouped_out = !CUT && ns == k && k == n && finish_ranked_lanes_on<scalar_t>(n);
      for (int64_t l = 0; l < count; ++l) grouped_out = grouped_out && lpb[l].ranked;
      for (int64_t t = 0; t < big; ++t) grouped_out = grouped_out && glim[t] == ns;
      bool write[kLanes];
      for (int64_t l = 0; l < count; ++l) {
        const int64_t row = lrow[l];
        const Prob& pr = lpb[l];
        write[l] = false;
        if (!done[l]) {
          if (pr.lazy) prepare_ranked(pr.yc, lw[l].grouped.data(), k, pr.inv_eps, lw[l], lpb[l]);
          scalar_row(row, lw[l], pr);
          continue;
        }
        double* st = pst + row * lay.size();
        for (int64_t t = 0; t < big; ++t) {
          st[lay.ratio() + t] = rl[t * kLanes + l];
          st[lay.v() + t] = v[t * kLanes + l];
        }
        st[lay.centre()] = pr.c;
        const double e = el[l] / static_cast<double>(pr.m);
        if (grouped_out) {
          pe[row] = e;
          ps[row] = e <= tol ? 0 : 1;
          write[l] = true;
          continue;
        }
        const double* p = g.p.data() + l;
        int64_t lim[kMaxBig];
        for (int64_t t = 0; t < big; ++t) lim[t] = std::min(pr.m, glim[t]);
        finish(row, pr, lw[l], p, sj, kLanes, lim, e);
      }
      if (grouped_out) {
        finish_ranked_lanes(g.p.data(), n, rl, lpb, lw, lrow, write, count, sign, pw, pv);
      }
      count = 0;
    };
    // (the size of a group not known to the compiler: a forward with 9 targets known to it was
    // within noise of this, 257 vs 262 us at (64, 128); rows without a rest take every column)
    auto flush = [&]() {
      flush_lanes(count, lrow, lw, lpb, scalar_row, [&] {
        if (k == n) {  // (no rest)
          flush_big(std::integral_constant<int64_t, 0>{}, std::false_type{});
        } else {
          flush_big(std::integral_constant<int64_t, 0>{}, std::true_type{});
        }
      });
    };
    // (rows of k = n <= 8: kLanes at a time while they pass ranked_block's checks)
    const bool blocks = lanes_on && k == n && ranked_block_on<scalar_t>(n);
    for (int64_t row = b0; row < b1; ++row) {
      if (blocks && count == 0 && row + kLanes <= b1 &&
          ranked_block(px + row * n, n, sign, eps + row, limit, span_max,
                       static_cast<double>(nb + 1), log_tau, lay, pst + row * lay.size(),
                       pidx + row * k, g, lw, lpb)) {
        for (int64_t l = 0; l < kLanes; ++l) lrow[l] = row + l;
        count = kLanes;
        g_ready = true;
        flush();
        row += kLanes - 1;
        continue;
      }
      const scalar_t* xr = px + row * n;
      double* st = pst + row * lay.size();
      scalar_t* wr = pw + row * k * n;
      const double inv_eps = 1.0 / eps[row];
      double* top = st + lay.top();
      int64_t ti[kMaxBig];
      const bool finite = top_scores(xr, n, sign, big, inv_eps, limit, span_max, top, ti);
      for (int64_t t = 0; t < k; ++t) pidx[row * k + t] = ti[t];
      // (a solved row's state and values are written in full by its solve)
      if (!finite || big < 2) {
        for (int64_t t = 0; t < lay.size(); ++t) st[t] = 0.0;
        for (int64_t t = 0; t < k; ++t) pv[row * k + t] = scalar_t(0);
        std::memset(wr, 0, sizeof(scalar_t) * static_cast<size_t>(k * n));
        ps[row] = 2;
        pe[row] = kInf;
        continue;
      }
      Work& wk = lanes_on ? lw[count] : w;
      Prob& pr = lanes_on ? lpb[count] : pb;
      // (k = n: every entry a candidate, the row grouped by its ranks where it can be)
      int64_t cut = nb + 1, m = n;
      bool ranked = false;
      if (k == n) {
        wk.entries(n, big, false);
        ranked = prepare_ranked(top, ti, k, inv_eps, wk, pr);
      }
      if (!ranked) {
        m = candidates(xr, n, sign, k, top, inv_eps, tau, bpu, weight, nb, wk, cut);
        wk.entries(m, big, false);
        prepare(xr, sign, top, k, big, m, inv_eps, nb, bpu, log_tau, wk, pr);
      }
      st[lay.cut()] = static_cast<double>(cut);
      st[lay.count()] = static_cast<double>(m);
      st[lay.log_tau()] = log_tau;
      if (k == n) {  // (the problem holds its own copies of top from here)
        for (int64_t t = 0; t < k; ++t) top[t] = static_cast<double>(ti[t]);
      }
      if (lanes_on && pr.fast && m <= kLaneMaxM) {
        lrow[count] = row;
        if (++count == kLanes) flush();
      } else {
        scalar_row(row, wk, pr);
      }
    }
    flush();
    stream_fence();
    scratch.trim();
  });
}

// t's values as contiguous doubles: its own data where they are, float32 converted into buf (a
// buffer of the calling thread that persists across calls: no tensor allocated per call, no
// page faults of a fresh one), else torch's conversion kept in hold. (float32 to double is
// exact: the same values as t.to(at::kDouble).)
const double* as_doubles(const at::Tensor& t, std::vector<double>& buf, at::Tensor& hold) {
  if (t.scalar_type() == at::kDouble && t.is_contiguous()) return t.data_ptr<double>();
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) {
    const float* src = t.data_ptr<float>();
    const auto count = static_cast<size_t>(t.numel());
    if (buf.size() < count) buf.resize(count);
    for (size_t i = 0; i < count; ++i) buf[i] = static_cast<double>(src[i]);
    return buf.data();
  }
  hold = t.to(at::kDouble).contiguous();
  return hold.data_ptr<double>();
}

// The calling thread's buffers for as_doubles: epsilon and the values' cotangent.
thread_local std::vector<double> eps_buffer, gv_buffer;

// (x (B, n), eps (B,) float64, largest, k, tau, bins per epsilon, the limit of |x|, the limit of
// the span over epsilon, the bins' bounds (nb + 1,) float64, tol, Newton steps, halvings) ->
// (weights (B, k, n) and values (B, k) in x's dtype (each rounded once from double), err (B,),
// status (B,) int8, state (B, 3 big + 4) float64, indices (B, k) int64: the k largest in order,
// equal scores in the order of the row; not set in the rows of status 2).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> solve_rows(
    const at::Tensor& x_in, const at::Tensor& eps_in, bool largest, int64_t k, double tau,
    double bpu, double limit, double span_max, const at::Tensor& bin_weight, double tol,
    int64_t max_steps, int64_t halvings) {
  TORCH_CHECK(x_in.dim() == 2, "solve_rows: x must be (B, n)");
  const at::Tensor x = x_in.contiguous();
  at::Tensor eps_hold;
  const double* peps = as_doubles(eps_in, eps_buffer, eps_hold);
  const at::Tensor weight = bin_weight.to(at::kDouble).contiguous();
  const int64_t B = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n && k + 1 <= kMaxBig, "solve_rows: k out of range");
  const int64_t big = k < n ? k + 1 : k;
  auto f64 = x.options().dtype(at::kDouble);
  at::Tensor weights = at::empty({B, k, n}, x.options());
  // (more than one task of the row loop: the rows are written by several threads)
  const int64_t grain = row_grain(n, big);
  advise_huge_pages(weights, at::get_num_threads() > 1 && !at::in_parallel_region() && B > grain);
  at::Tensor values = at::empty({B, k}, x.options());
  at::Tensor err = at::empty({B}, f64);
  at::Tensor status = at::empty({B}, x.options().dtype(at::kChar));
  at::Tensor state = at::empty({B, Layout{big}.size()}, f64);
  at::Tensor indices = at::empty({B, k}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "solve_rows", [&] {
    solve_rows_impl<scalar_t>(x, peps, largest, k, tau, bpu, limit, span_max,
                              weight.data_ptr<double>(), weight.numel() - 1, tol, max_steps,
                              halvings, weights, values, err, status, state, indices);
  });
  return {weights, values, err, status, state, indices};
}

// --------------------------------------------------------------------------- the backward

// u_ji - sum_l P_li u_li into out (big, m) for u_ji = sb beta_j + sg gb_ji and the
// row-normalised plan P = gam * inv_mu, each entry first shifted by its value at its home (its
// largest P): without cancellation for nearly one-hot entries. Column j at its entries below
// lim[j] (P is 0 at the others: out is not formed there).
void centred(const double* gam, const double* inv_mu, const double* gb, const double* beta,
             double sb, double sg, const int32_t* home, int64_t m, int64_t big, int64_t ld,
             const int64_t* lim, double* out, double* ref, double* mean) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t hi = home[i];
    ref[i] = sb * beta[hi] + sg * gb[hi * ld + i];
    mean[i] = 0.0;
  }
  for (int64_t j = 0; j < big; ++j) {
    const double bj = sb * beta[j];
    const double* gj = gb + j * ld;
    const double* pj = gam + j * ld;
    double* oj = out + j * ld;
    const int64_t mj = lim[j];
#pragma omp simd
    for (int64_t i = 0; i < mj; ++i) {
      const double d = (bj + sg * gj[i]) - ref[i];
      oj[i] = d;
      mean[i] += pj[i] * d;
    }
  }
  for (int64_t i = 0; i < m; ++i) mean[i] *= inv_mu[i];
  for (int64_t j = 0; j < big; ++j) {
    double* oj = out + j * ld;
    const int64_t mj = lim[j];
#pragma omp simd
    for (int64_t i = 0; i < mj; ++i) oj[i] -= mean[i];
  }
}

// sum_i gam_ti cen_ti for every target into rhs (column t at its entries below lim[t]).
void contract(const double* gam, const double* cen, int64_t big, int64_t ld, const int64_t* lim,
              double* rhs) {
  for (int64_t t = 0; t < big; ++t) {
    const double* gt = gam + t * ld;
    const double* ct = cen + t * ld;
    double acc = 0.0;
    const int64_t mt = lim[t];
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < mt; ++i) acc += gt[i] * ct[i];
    rhs[t] = acc;
  }
}

// The values' cotangent alone, gb_ji = gv_j x_i (gv_j = 0 in the rest), without forming gb or
// centred's out: each u_ji - ref_i formed again where it is read, by the same operations, so that
// it is exactly 0 at the entry's home as in centred (no product contracted into an addition: a
// product rounded in one place and fused in another leaves a unit of its rounding there).
#if defined(__GNUC__) && !defined(__clang__)
#define SOFTOPS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define SOFTOPS_NO_CONTRACT
#endif

// centred's ref (u at each entry's home) and mean (sum_l P_li (u_li - ref_i), times 1 / mu_i).
SOFTOPS_NO_CONTRACT void centred_values(const double* gam, const double* inv_mu, const double* gv, const double* xc,
                    const double* beta, double sb, double sg, const int32_t* home, int64_t m,
                    int64_t big, int64_t ld, const int64_t* lim, double* ref, double* mean) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t hi = home[i];
    ref[i] = sb * beta[hi] + sg * (gv[hi] * xc[i]);
    mean[i] = 0.0;
  }
  for (int64_t j = 0; j < big; ++j) {
    const double bj = sb * beta[j], gj = gv[j];
    const double* pj = gam + j * ld;
    const int64_t mj = lim[j];
#pragma omp simd
    for (int64_t i = 0; i < mj; ++i) mean[i] += pj[i] * ((bj + sg * (gj * xc[i])) - ref[i]);
  }
  for (int64_t i = 0; i < m; ++i) mean[i] *= inv_mu[i];
}

// contract of centred_values' centred cotangent: rhs_t = sum_i gam_ti (u_ti - ref_i - mean_i).
SOFTOPS_NO_CONTRACT void contract_values(const double* gam, const double* gv, const double* xc, const double* beta,
                     double sb, double sg, int64_t big, int64_t ld, const int64_t* lim,
                     const double* ref, const double* mean, double* rhs) {
  for (int64_t t = 0; t < big; ++t) {
    const double bt = sb * beta[t], gt = gv[t];
    const double* pt = gam + t * ld;
    double acc = 0.0;
    const int64_t mt = lim[t];
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < mt; ++i) acc += pt[i] * (((bt + sg * (gt * xc[i])) - ref[i]) - mean[i]);
    rhs[t] = acc;
  }
}

// The gradient's sums over the targets for the values' cotangent alone (u = beta_t - gv_t x_i,
// centred_values' ref and mean): acc_y_i = sum_t t gam_ti (u_ti - ref_i - mean_i) and direct_i =
// sum_t gam_ti gv_t.
SOFTOPS_NO_CONTRACT void gradient_values(const double* gam, const double* gv, const double* xc,
                                         const double* beta, int64_t m, int64_t big, int64_t ld,
                                         const int64_t* lim, const double* ref,
                                         const double* mean, double* acc_y, double* direct) {
  const double sg = -1.0;
  for (int64_t i = 0; i < m; ++i) {
    acc_y[i] = 0.0;
    direct[i] = 0.0;
  }
  for (int64_t t = 0; t < big; ++t) {
    const double ft = static_cast<double>(t);
    const double bt = beta[t], gt = gv[t];
    const double* pt = gam + t * ld;
    const int64_t mt = lim[t];
#pragma omp simd
    for (int64_t i = 0; i < mt; ++i) {
      const double ct = ((bt + sg * (gt * xc[i])) - ref[i]) - mean[i];
      acc_y[i] += ft * pt[i] * ct;
      direct[i] += pt[i] * gt;
    }
  }
}

template <typename scalar_t>
void vjp_rows_impl(const at::Tensor& x, const double* eps, bool largest, int64_t k, double bpu,
                   int64_t nb, const double* pst, const int8_t* ps, const double* pgv,
                   const at::Tensor& gw, bool need_eps, double det_min, at::Tensor& gx,
                   at::Tensor& geps, at::Tensor& safe) {
  const int64_t B = x.size(0), n = x.size(1);
  const int64_t big = k < n ? k + 1 : k;
  const Layout lay{big};
  const double sign = largest ? 1.0 : -1.0;
  const scalar_t* px = x.data_ptr<scalar_t>();
  const bool has_gw = gw.numel() > 0;
  const scalar_t* pgw = has_gw ? gw.data_ptr<scalar_t>() : nullptr;
  const int64_t sw0 = has_gw ? gw.stride(0) : 0, sw1 = has_gw ? gw.stride(1) : 0,
                sw2 = has_gw ? gw.stride(2) : 0;
  scalar_t* pgx = gx.data_ptr<scalar_t>();
  double* pge = geps.data_ptr<double>();
  bool* psafe = safe.data_ptr<bool>();
  const int64_t grain = row_grain(n, big);
  const bool lanes_on = big >= 4 && big <= kLaneBig;
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    static thread_local Scratch scratch;
    Work& w = scratch.w;
    Prob pb;
    std::vector<Work>& lw = scratch.lanes(lanes_on);
    Prob lpb[kLanes];
    int64_t lrow[kLanes];
    int64_t count = 0;
    Lanes& g = scratch.g;
    bool g_ready = false;  // (the lanes loaded by ranked_block_vjp)
    const int64_t big_rt = big;
    // a system the scalar code does not take: det K not above det_min (big <= 3) or not
    // positive, or a solution that is not finite
    auto singular = [&](double det, const double* beta) {
      bool ok = big <= 3 ? det > det_min : det > 0;
      for (int64_t t = 0; t < big; ++t) ok = ok && std::isfinite(beta[t]);
      return !ok;
    };
    // one row (prepared in wk, pr) by the scalar code
    auto scalar_row = [&](int64_t row, Work& wk, const Prob& pr) {
      const int64_t m = pr.m;
      const double* st = pst + row * lay.size();
      const double inv_eps = 1.0 / eps[row];
      scalar_t* gxr = pgx + row * n;
      double gap[kMaxBig];
      double* gam = wk.p.data();
      int64_t lim[kMaxBig];
      eval_state(pr, st + lay.v(), gam, gap, lim);
      const double* rr = st + lay.ratio();
      const double c = st[lay.centre()];
      // the column-exact plan gam (in place of p), its row sums mu and each entry's largest
      // column (home: the centring's reference)
      double* mu = wk.mu.data();
      double* inv_mu = wk.inv_mu.data();
      double* xc = wk.xc.data();
      int32_t* home = wk.hbuf.data();
      double* best = wk.ref.data();
      // (x at the candidates is sign * y, exactly: no gather from the row)
      const double* yc = pr.yc;
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) {
        mu[i] = 0.0;
        xc[i] = sign * yc[i];
        home[i] = 0;
        best[i] = -1.0;
      }
      for (int64_t t = 0; t < big; ++t) {
        const double f = 1.0 + rr[t];
        double* gt = gam + t * m;
        const int64_t mt = lim[t];
        const auto tt = static_cast<int32_t>(t);
#pragma omp simd
        for (int64_t i = 0; i < mt; ++i) {
          const double g = gt[i] * f;
          gt[i] = g;
          mu[i] += g;
          const bool above = g > best[i];  // (the first of equal largest columns)
          best[i] = above ? g : best[i];
          home[i] = above ? tt : home[i];
        }
      }
      for (int64_t i = 0; i < m; ++i) inv_mu[i] = 1.0 / std::max(mu[i], kTiny);
      double beta[kMaxBig], rhs[kMaxBig], stepv[kMaxBig], wc[kMaxBig * kMaxBig];
      for (int64_t t = 0; t < big; ++t) beta[t] = 0.0;
      double* cen = wk.cen.data();
      double* ref = wk.ref.data();
      double* mean = wk.mean.data();
      double* acc_y = wk.acc_y.data();
      double* direct = wk.direct.data();
      double det = 0.0;
      if (!has_gw) {
        // the values' cotangent alone: u_ti = gv_t x_i is formed where it is read (the same
        // arithmetic as the general code below, without its (big, m) arrays)
        double gvv[kMaxBig];
        for (int64_t t = 0; t < big; ++t) {
          gvv[t] = (t < k && pgv != nullptr) ? pgv[row * k + t] : 0.0;
        }
        centred_values(gam, inv_mu, gvv, xc, beta, 0.0, 1.0, home, m, big, m, lim, ref, mean);
        contract_values(gam, gvv, xc, beta, 0.0, 1.0, big, m, lim, ref, mean, rhs);
        couplings(gam, m, m, big, inv_mu, lim, wc);
        det = laplacian_solve(wc, big, rhs, beta);
        if (big > 3 && det > 0 && det <= 1.0) {
          centred_values(gam, inv_mu, gvv, xc, beta, -1.0, 1.0, home, m, big, m, lim, ref, mean);
          contract_values(gam, gvv, xc, beta, -1.0, 1.0, big, m, lim, ref, mean, rhs);
          laplacian_solve(wc, big, rhs, stepv);
          for (int64_t t = 0; t < big; ++t) beta[t] += stepv[t];
        }
        if (!singular(det, beta)) {
          centred_values(gam, inv_mu, gvv, xc, beta, 1.0, -1.0, home, m, big, m, lim, ref, mean);
          gradient_values(gam, gvv, xc, beta, m, big, m, lim, ref, mean, acc_y, direct);
        }
      } else {
        // the cotangent of the plan: gv_t x_i (values) and gw[t, i] (weights), the rest 0
        double* gb = wk.gb.data();
        for (int64_t t = 0; t < big; ++t) {
          double* gt = gb + t * m;
          const int64_t mt = lim[t];
          if (t < k) {
            const double gvt = pgv != nullptr ? pgv[row * k + t] : 0.0;
            for (int64_t i = 0; i < mt; ++i) gt[i] = gvt * xc[i];
            const scalar_t* gwr = pgw + row * sw0 + t * sw1;
            for (int64_t i = 0; i < mt; ++i) {
              gt[i] += static_cast<double>(gwr[wk.grouped[i] * sw2]);
            }
          } else {
            for (int64_t i = 0; i < mt; ++i) gt[i] = 0.0;
          }
        }
        centred(gam, inv_mu, gb, beta, 0.0, 1.0, home, m, big, m, lim, cen, ref, mean);
        contract(gam, cen, big, m, lim, rhs);
        couplings(gam, m, m, big, inv_mu, lim, wc);
        det = laplacian_solve(wc, big, rhs, beta);
        // one refinement against the exactly formed residual where the solve took the jitter
        if (big > 3 && det > 0 && det <= 1.0) {
          centred(gam, inv_mu, gb, beta, -1.0, 1.0, home, m, big, m, lim, cen, ref, mean);
          contract(gam, cen, big, m, lim, rhs);
          laplacian_solve(wc, big, rhs, stepv);
          for (int64_t t = 0; t < big; ++t) beta[t] += stepv[t];
        }
        if (!singular(det, beta)) {
          centred(gam, inv_mu, gb, beta, 1.0, -1.0, home, m, big, m, lim, cen, ref, mean);
          // d values / d y through the plan (slopes t / eps) and directly (the weights)
          for (int64_t i = 0; i < m; ++i) {
            acc_y[i] = 0.0;
            direct[i] = 0.0;
          }
          for (int64_t t = 0; t < big; ++t) {
            const double ft = static_cast<double>(t);
            const double gvt = (t < k && pgv != nullptr) ? pgv[row * k + t] : 0.0;
            const double* gt = gam + t * m;
            const double* ct = cen + t * m;
            const int64_t mt = lim[t];
#pragma omp simd
            for (int64_t i = 0; i < mt; ++i) {
              acc_y[i] += ft * gt[i] * ct[i];
              direct[i] += gt[i] * gvt;
            }
          }
        }
      }
      if (singular(det, beta)) {
        std::memset(gxr, 0, sizeof(scalar_t) * static_cast<size_t>(n));
        psafe[row] = false;
        return;
      }
      // (epsilon's sum apart, and only where it is asked for: a vector reduction, not one chained
      // sum in the scatter's loop)
      for (int64_t i = 0; i < m; ++i) {
        gxr[wk.grouped[i]] = static_cast<scalar_t>(sign * (acc_y[i] * inv_eps) + direct[i]);
      }
      double g_e = 0.0;
      if (need_eps) {
        const double* yc = pr.yc;
#pragma omp simd reduction(+ : g_e)
        for (int64_t i = 0; i < m; ++i) g_e += (yc[i] - c) * (acc_y[i] * inv_eps);
      }
      pge[row] = need_eps ? -g_e * inv_eps : 0.0;
    };
    // the rows gathered in the lanes, every lane at once (docs/math.md §2.3 as in scalar_row:
    // the column-exact plan, its centred cotangent, the grounded Laplacian's solve by the
    // lanes' Cholesky, the gradients); a lane whose state leaves the product's range or whose
    // Cholesky needs the jitter (or is singular) is redone by scalar_row.
    // (CUT: the rows have a rest, whose entries may have columns not formed; without one every
    // column is formed at every slot, and the loops below take every column)
    auto flush_big = [&](auto big_c, auto cut_c) {
      constexpr int64_t BIG = decltype(big_c)::value;
      constexpr bool CUT = decltype(cut_c)::value;
      const int64_t big = BIG > 0 ? BIG : big_rt;
      int64_t ns = 0;
      for (int64_t l = 0; l < count; ++l) ns = std::max(ns, lpb[l].m);
      int64_t rows[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) {
        rows[l] = l < count ? lrow[l] : lrow[0];
        if (l >= count) lpb[l] = lpb[0];  // (idle lanes: lane 0 again)
      }
      if (!g_ready) {
        g.size(big, ns);
        g.load(lpb);
      }
      g_ready = false;
      g.size_backward(has_gw);
      double v[kLaneBig * kLanes], f[kLaneBig * kLanes], gvl[kLaneBig * kLanes],
          gap[kLaneBig * kLanes], ie[kLanes], cl[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t row = rows[l];
        const double* st = pst + row * lay.size();
        for (int64_t t = 0; t < big; ++t) {
          v[t * kLanes + l] = st[lay.v() + t];
          f[t * kLanes + l] = 1.0 + st[lay.ratio() + t];
          gvl[t * kLanes + l] = (t < k && pgv != nullptr) ? pgv[row * k + t] : 0.0;
        }
        ie[l] = 1.0 / eps[row];
        cl[l] = st[lay.centre()];
        // the scores (x at the candidates: sign y, exactly) and the cotangent of the plan
        // (gv_t x_i + gw[t, i]; 0 past the row and in the rest)
        const Prob& pr = lpb[l];
        const Work& wk = lw[l < count ? l : 0];
        const int64_t ml = std::min(pr.m, ns);
        for (int64_t i = 0; i < ml; ++i) {
          g.yc[i * kLanes + l] = pr.yc[i];
          g.xs[i * kLanes + l] = sign * pr.yc[i];
        }
        for (int64_t i = ml; i < ns; ++i) {
          g.yc[i * kLanes + l] = 0.0;
          g.xs[i * kLanes + l] = 0.0;
        }
        if (!has_gw) continue;
        for (int64_t i = 0; i < ns; ++i) {
          const bool in = i < pr.m;
          const double xi = g.xs[i * kLanes + l];
          for (int64_t t = 0; t < big; ++t) {
            double u = 0.0;
            if (in && t < k) {
              u = gvl[t * kLanes + l] * xi +
                  static_cast<double>(pgw[row * sw0 + t * sw1 + wk.grouped[i] * sw2]);
            }
            g.gb[(t * ns + i) * kLanes + l] = u;
          }
        }
      }
      VecD inrange;
      int64_t lim[kMaxBig];  // (column t formed at the slots below lim[t], not written past it)
      eval_lanes<BIG, CUT>(g, v, g.p.data(), gap, inrange, lim);
      double okl[kLanes], inr[kLanes];
      inrange.store(inr);
      const int64_t sj = ns * kLanes;
      const double* gp = g.p.data();
      const double* gbp = g.gb.data();
      const VecD zero(0.0), tiny(kTiny), minus_one(-1.0);
      VecArr fv, gam, gbv, gvv;
      LaneMask eq[kLaneBig];
      for (int64_t t = 0; t < big; ++t) {
        fv[t] = VecD::loadu(f + t * kLanes);
        gvv[t] = VecD::loadu(gvl + t * kLanes);
      }
      // slot i: the column-exact plan gam, 1 / its row sum, each entry's largest column (the
      // centring's reference; the first of equals) and gb; formed in the first pass over the
      // slots (`form`), kept in g.kept for the later ones. Only the columns formed at the slot,
      // lo and above (as the one-row code's loops over a column's entries below its limit: the
      // others are 0 in every lane, and every sum below takes them as 0).
      auto plan_at = [&](int64_t i, int64_t lo, VecD& inv_mu, bool form) {
        double* kept = g.kept.data() + i * (big + 2) * kLanes;  // gam (big), 1 / mu, the home
        const VecD xsv = VecD::loadu(g.xs.data() + i * kLanes);
        VecD hv = zero;
        if (form) {
          VecD mu = zero, best = minus_one;
          for (int64_t t = 0; t < big; ++t) {
            if (t < lo) continue;
            gam[t] = VecD::loadu(gp + t * sj + i * kLanes) * fv[t];
            mu = mu + gam[t];
            const LaneMask gt = lanes_gt(gam[t], best);
            best = select(gt, best, gam[t]);
            hv = select(gt, hv, VecD(static_cast<double>(t)));
            gam[t].store(kept + t * kLanes);
          }
          inv_mu = VecD(1.0) / at::vec::maximum(mu, tiny);
          inv_mu.store(kept + big * kLanes);
          hv.store(kept + (big + 1) * kLanes);
        } else {
          for (int64_t t = 0; t < big; ++t) {
            if (t >= lo) gam[t] = VecD::loadu(kept + t * kLanes);
          }
          inv_mu = VecD::loadu(kept + big * kLanes);
          hv = VecD::loadu(kept + (big + 1) * kLanes);
        }
        for (int64_t t = 0; t < big; ++t) {
          if (t < lo) continue;
          gbv[t] = has_gw ? VecD::loadu(gbp + (t * ns + i) * kLanes) : gvv[t] * xsv;
          eq[t] = lanes_eq(hv, VecD(static_cast<double>(t)));
        }
      };
      // u_t - sum_l P_l u_l for u_t = sb beta_t + sg gb_t, shifted by u at the home, into cen
      VecArr cen;
      auto centre_at = [&](const VecArr& bv, double sb, double sg, const VecD& inv_mu,
                           int64_t lo) {
        VecD ref = zero;
        for (int64_t t = 0; t < big; ++t) {
          if (t < lo) continue;
          cen[t] = VecD(sb) * bv[t] + VecD(sg) * gbv[t];
          ref = add_where(eq[t], ref, cen[t]);
        }
        VecD mean = zero;
        for (int64_t t = 0; t < big; ++t) {
          if (t < lo) continue;
          cen[t] = cen[t] - ref;
          mean = mean + gam[t] * cen[t];
        }
        mean = mean * inv_mu;
        for (int64_t t = 0; t < big; ++t) {
          if (t >= lo) cen[t] = cen[t] - mean;
        }
      };
      VecArr beta, rhs;
      double wc[kLaneBig * kLaneBig * kLanes];
      for (int64_t t = 0; t < big; ++t) {
        beta[t] = zero;
        rhs[t] = zero;
        for (int64_t o = 0; o < big; ++o) zero.store(wc + (t * kLaneBig + o) * kLanes);
      }
      int64_t lo = 0;  // (the first column formed at slot i: non-decreasing in i)
      for (int64_t i = 0; i < ns; ++i) {
        if constexpr (CUT) {
          while (lim[lo] <= i) ++lo;
        }
        VecD inv_mu;
        plan_at(i, lo, inv_mu, true);
        centre_at(beta, 0.0, 1.0, inv_mu, lo);
        for (int64_t t = 0; t < big; ++t) {
          if (t < lo) continue;
          rhs[t] = at::vec::fmadd(gam[t], cen[t], rhs[t]);
          const VecD a = gam[t] * inv_mu;
          for (int64_t o = t + 1; o < big; ++o) {
            double* wto = wc + (t * kLaneBig + o) * kLanes;
            at::vec::fmadd(a, gam[o], VecD::loadu(wto)).store(wto);
          }
        }
      }
      for (int64_t t = 0; t < big; ++t) {
        for (int64_t o = t + 1; o < big; ++o) {
          VecD::loadu(wc + (t * kLaneBig + o) * kLanes).store(wc + (o * kLaneBig + t) * kLanes);
        }
      }
      double rhsl[kLaneBig * kLanes], betal[kLaneBig * kLanes];
      for (int64_t t = 0; t < big; ++t) rhs[t].store(rhsl + t * kLanes);
      VecD tau;
      LaneFactor fac;  // (the factor taken, for the refinement)
      solve_lanes<BIG>(wc, big, rhsl, betal, okl, tau, &fac);
      for (int64_t t = 0; t < big; ++t) beta[t] = VecD::loadu(betal + t * kLanes);
      // one refinement against the exactly formed residual in the lanes of a pivot below 1e-2
      bool refine = false;
      for (int64_t l = 0; l < count; ++l) refine = refine || (okl[l] > 0 && okl[l] <= 1.0);
      if (refine) {
        for (int64_t t = 0; t < big; ++t) rhs[t] = zero;
        lo = 0;
        for (int64_t i = 0; i < ns; ++i) {
          if constexpr (CUT) {
            while (lim[lo] <= i) ++lo;
          }
          VecD inv_mu;
          plan_at(i, lo, inv_mu, false);
          centre_at(beta, -1.0, 1.0, inv_mu, lo);
          for (int64_t t = 0; t < big; ++t) {
            if (t >= lo) rhs[t] = at::vec::fmadd(gam[t], cen[t], rhs[t]);
          }
        }
        for (int64_t t = 0; t < big; ++t) rhs[t].store(rhsl + t * kLanes);
        double stepl[kLaneBig * kLanes], rf[kLanes];
        factor_solve<BIG>(fac, big, rhsl, stepl);
        for (int64_t l = 0; l < kLanes; ++l) rf[l] = okl[l] > 0 && okl[l] <= 1.0 ? 1.0 : 0.0;
        const VecD rv = VecD::loadu(rf) > zero;
        for (int64_t t = 0; t < big; ++t) {
          beta[t] = VecD::blendv(beta[t], beta[t] + VecD::loadu(stepl + t * kLanes), rv);
          beta[t].store(betal + t * kLanes);
        }
      }
      VecD ge = zero;
      const VecD iev = VecD::loadu(ie), cv = VecD::loadu(cl), sv(sign);
      double* outp = g.out.data();
      lo = 0;
      for (int64_t i = 0; i < ns; ++i) {
        if constexpr (CUT) {
          while (lim[lo] <= i) ++lo;
        }
        VecD inv_mu;
        plan_at(i, lo, inv_mu, false);
        centre_at(beta, 1.0, -1.0, inv_mu, lo);
        VecD acc_y = zero, direct = zero;
        for (int64_t t = 0; t < big; ++t) {
          if (t < lo) continue;
          acc_y = acc_y + VecD(static_cast<double>(t)) * gam[t] * cen[t];
          direct = direct + gam[t] * VecD::loadu(gvl + t * kLanes);
        }
        const VecD gy = acc_y * iev;
        ge = ge + (VecD::loadu(g.yc.data() + i * kLanes) - cv) * gy;
        (sv * gy + direct).store(outp + i * kLanes);
      }
      double gel[kLanes];
      ge.store(gel);
      for (int64_t l = 0; l < count; ++l) {
        const int64_t row = lrow[l];
        bool ok = inr[l] > 0 && okl[l] >= kLaneBackwardPivot;
        for (int64_t t = 0; t < big; ++t) ok = ok && std::isfinite(betal[t * kLanes + l]);
        if (!ok) {
          if (lpb[l].lazy) {
            prepare_ranked(lpb[l].yc, lw[l].grouped.data(), k, lpb[l].inv_eps, lw[l], lpb[l]);
          }
          scalar_row(row, lw[l], lpb[l]);
          continue;
        }
        scalar_t* gxr = pgx + row * n;
        const Work& wk = lw[l];
        for (int64_t i = 0; i < lpb[l].m; ++i) {
          gxr[wk.grouped[i]] = static_cast<scalar_t>(outp[i * kLanes + l]);
        }
        pge[row] = need_eps ? -gel[l] * ie[l] : 0.0;
      }
      count = 0;
    };
    // (a group of 8 or 9 targets, the usual short rows, with its size known to the compiler)
    auto flush = [&]() {
      flush_lanes(count, lrow, lw, lpb, scalar_row, [&] {
        if (k == n) {  // (no rest)
          if (big_rt == 8) {
            flush_big(std::integral_constant<int64_t, 8>{}, std::false_type{});
          } else {
            flush_big(std::integral_constant<int64_t, 0>{}, std::false_type{});
          }
        } else if (big_rt == 8) {
          flush_big(std::integral_constant<int64_t, 8>{}, std::true_type{});
        } else if (big_rt == 9) {
          flush_big(std::integral_constant<int64_t, 9>{}, std::true_type{});
        } else {
          flush_big(std::integral_constant<int64_t, 0>{}, std::true_type{});
        }
      });
    };
    // (rows of k = n <= 8: kLanes at a time while they pass ranked_block_vjp's checks)
    const bool blocks = lanes_on && k == n && ranked_block_on<scalar_t>(n);
    for (int64_t row = b0; row < b1; ++row) {
      if (blocks && count == 0 && row + kLanes <= b1 &&
          ranked_block_vjp(px + row * n, n, sign, eps + row, ps + row, pst + row * lay.size(),
                           lay, g, lw, lpb)) {
        for (int64_t l = 0; l < kLanes; ++l) {
          lrow[l] = row + l;
          pge[row + l] = 0.0;
          psafe[row + l] = true;
        }
        count = kLanes;
        g_ready = true;
        flush();
        row += kLanes - 1;
        continue;
      }
      scalar_t* gxr = pgx + row * n;
      pge[row] = 0.0;
      psafe[row] = true;
      // (gx is written at every candidate of a row solved here, 0 elsewhere)
      if (ps[row] != 0) {
        std::memset(gxr, 0, sizeof(scalar_t) * static_cast<size_t>(n));
        psafe[row] = ps[row] != 1;  // (a row the forward's torch code solved: its backward too)
        continue;
      }
      const scalar_t* xr = px + row * n;
      const double* st = pst + row * lay.size();
      const double inv_eps = 1.0 / eps[row];
      const double* top = st + lay.top();
      // k = n: the forward's ranks (indices) and top, x at them
      double ranked_top[kMaxBig];
      int64_t ti[kMaxBig];
      if (k == n) {
        bool valid = true;
        for (int64_t t = 0; t < k; ++t) {
          const double r = top[t];
          valid = valid && r >= 0 && r < static_cast<double>(n);
          ti[t] = valid ? static_cast<int64_t>(r) : 0;
          ranked_top[t] = sign * static_cast<double>(xr[ti[t]]);
        }
        if (!valid) {  // (not the forward's state)
          std::memset(gxr, 0, sizeof(scalar_t) * static_cast<size_t>(n));
          psafe[row] = false;
          continue;
        }
        top = ranked_top;
      }
      const int64_t cut = static_cast<int64_t>(st[lay.cut()]);
      Work& wk = lanes_on ? lw[count] : w;
      Prob& pr = lanes_on ? lpb[count] : pb;
      const auto count_fwd = static_cast<int64_t>(st[lay.count()]);
      int64_t m = n;
      bool ranked = false;
      if (k == n && count_fwd == n) {
        wk.entries(n, big, true);
        ranked = prepare_ranked(top, ti, k, inv_eps, wk, pr);
      }
      if (!ranked) {
        m = candidates_at(xr, n, sign, k, top, inv_eps, bpu, nb, cut, wk);
        if (m < n || m != count_fwd) std::memset(gxr, 0, sizeof(scalar_t) * static_cast<size_t>(n));
        if (m != count_fwd) {  // (not the forward's rows)
          psafe[row] = false;
          continue;
        }
        wk.entries(m, big, true);
        prepare(xr, sign, top, k, big, m, inv_eps, nb, bpu, st[lay.log_tau()], wk, pr);
      }
      if (lanes_on && pr.fast && m <= kLaneMaxM) {
        lrow[count] = row;
        if (++count == kLanes) flush();
      } else {
        scalar_row(row, wk, pr);
      }
    }
    flush();
    scratch.trim();
  });
}

// The implicit VJP (docs/math.md §2.3) of the rows of status 0, for the cotangents gv (B, k)
// float64 of the values (empty: none) and gw (B, k, n) of the weights (empty: none; any
// strides): (gx (B, n) in x's dtype, 0 off the candidates and in the rows not solved; geps (B,)
// float64; safe (B,) bool, false where the torch code must redo the row: its system is
// singular, or the forward left it to the torch code (status 1)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> vjp_rows(
    const at::Tensor& x_in, const at::Tensor& eps_in, bool largest, int64_t k, double bpu,
    int64_t nb, const at::Tensor& state_in, const at::Tensor& status_in, const at::Tensor& gv_in,
    const at::Tensor& gw_in, bool need_eps, double det_min) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor eps_hold, gv_hold;
  const double* peps = as_doubles(eps_in, eps_buffer, eps_hold);
  const at::Tensor state = state_in.to(at::kDouble).contiguous();
  const at::Tensor status = status_in.to(at::kChar).contiguous();
  const int64_t B = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n && k + 1 <= kMaxBig, "vjp_rows: k out of range");
  const double* pgv = gv_in.numel() > 0 ? as_doubles(gv_in, gv_buffer, gv_hold) : nullptr;
  const at::Tensor gw = gw_in.numel() > 0 ? gw_in.to(x.scalar_type()) : gw_in;
  at::Tensor gx = at::empty({B, n}, x.options());
  at::Tensor geps = at::empty({B}, x.options().dtype(at::kDouble));
  at::Tensor safe = at::empty({B}, x.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "vjp_rows", [&] {
    vjp_rows_impl<scalar_t>(x, peps, largest, k, bpu, nb, state.data_ptr<double>(),
                            status.data_ptr<int8_t>(), pgv, gw, need_eps, det_min, gx, geps,
                            safe);
  });
  return {gx, geps, safe};
}

}  // namespace

TORCH_LIBRARY(softops_sorted, m) {
  m.def(
      "solve_rows(Tensor x, Tensor eps, bool largest, int k, float tau, float bpu, float limit, "
      "float span_max, Tensor bin_weight, float tol, int max_steps, int halvings) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "vjp_rows(Tensor x, Tensor eps, bool largest, int k, float bpu, int nb, Tensor state, "
      "Tensor status, Tensor gv, Tensor gw, bool need_eps, float det_min) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(softops_sorted, CPU, m) {
  m.impl("solve_rows", &solve_rows);
  m.impl("vjp_rows", &vjp_rows);
}
