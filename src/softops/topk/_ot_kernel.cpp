// The threshold solve of method "ot" on the CPU, row by row: the fused path's CPU kernel.
//
// Built on first use by softops._core.fused.cpp_ops (torch.utils.cpp_extension, the same C++
// toolchain as torch.compile's CPU backend) and registered as the operators
// softops_ot::threshold_rows and softops_ot::vjp_rows. The arithmetic is that of the torch code
// it replaces (softops/topk/_ot.py: _prepare_exact, _evaluate, the polish of rows near the hard
// limit and the update of softops/_core/rootfind.py), in the rows' dtype, with the sums
// accumulated in double; the rows spread over torch's intra-op threads (at::parallel_for).
//
// Two layouts. A row longer than kPackMax entries is one task: an evaluation is one vectorised
// pass over it (at::vec: the sigmoid, its derivative and curvature, five sums; the last, partial
// vector loaded and stored with a lane mask, so that every entry takes the vectorised path) that
// takes its exponentials from the row's (one exp per entry per solve, see evaluate()), and the
// bracket's order statistics come from a few candidates for the largest (or smallest) entries
// instead of a topk call. Rows of at most kPackMax entries (a router's 8 experts, say) are
// solved a vector of rows at a time, one row per lane (solve_group()): a row's own costs (its
// start, its updates, the sums' reductions), which dominate a short row, are then shared by the
// lanes, and each entry of the whole group is one vector operation.
//
// Rows without a NaN or +inf, with epsilon within the scaling limit, are solved (0 < k < n_fin,
// the count of finite entries, converged within the cap), those near the hard limit polished in
// the log domain as the torch code does (polish(), polish_lanes()), or filled at their limit (k
// = 0 or n_fin: fill_limit()). Their -inf entries are masked entries (attention's masked keys):
// selected at no threshold, they weigh exactly 0 in every sum and need no pass of their own, so
// the row is solved on its finite entries, in the same pass. Every other row is flagged and left
// to the torch code, which handles them all.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

// Order statistics of rank at most this many from either end come from a few candidates
// (extremes()), of at most kCandidates; beyond either, nth_element on a copy of the row.
constexpr int64_t kBuffer = 64;
constexpr int64_t kCandidates = 512;
// Float lanes are flushed into the double sums every this many vectors (a float lane then holds
// at most 16 terms: its rounding stays far below the residual's tolerance, 32 ulps).
constexpr int64_t kFlush = 16;
// Evaluations at |t| / eps up to this take exp(-|z|) from the row's exponentials (one exp per
// entry per solve instead of one per evaluation); beyond, each entry's exp is taken anew.
constexpr double kFactorMax = 16;
// Rows of at most this many entries are solved a vector of rows at a time (solve_group()).
constexpr int64_t kPackMax = 128;
// The near-hard limit and the polish (softops.topk._ot: NEAR_HARD, POLISH_STEPS).
constexpr double kNearHard = 32;
constexpr int kPolishSteps = 6;

// The sum of a vector's lanes, in double.
template <typename scalar_t>
double lane_sum(const at::vec::Vectorized<scalar_t>& v) {
  scalar_t lanes[at::vec::Vectorized<scalar_t>::size()];
  v.store(lanes);
  double total = 0;
  for (int64_t l = 0; l < at::vec::Vectorized<scalar_t>::size(); ++l) total += lanes[l];
  return total;
}

// All bits set in the first `count` lanes, clear in the others.
template <typename scalar_t>
at::vec::Vectorized<scalar_t> head(int64_t count) {
  using Vec = at::vec::Vectorized<scalar_t>;
  const Vec zero(0);
  return Vec::set(zero, zero == zero, count);
}

// The `size` largest entries of row (descending), or smallest (ascending) with `largest` false,
// into buf (size <= n). The least of the maxima of `size` disjoint chunks is at most the
// size-th largest entry, so the entries at or above it hold the `size` largest: one pass for
// the bound, one to collect those candidates (usually a few dozen), and a partial sort of them.
// Returns false, leaving buf, when there are more than kCandidates of them (a sorted row, say).
template <typename scalar_t, bool largest>
bool extremes(const scalar_t* row, int64_t n, int64_t size, scalar_t* buf) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = Vec::size();
  auto before = [](scalar_t a, scalar_t b) { return largest ? a > b : a < b; };
  auto extreme = [](const Vec& a, const Vec& b) {
    return largest ? at::vec::maximum(a, b) : at::vec::minimum(a, b);
  };
  scalar_t lanes[L];
  const int64_t chunk = n / size;
  scalar_t edge = largest ? std::numeric_limits<scalar_t>::infinity()
                          : -std::numeric_limits<scalar_t>::infinity();
  for (int64_t c = 0; c < size; ++c) {
    const scalar_t* p = row + c * chunk;
    scalar_t best = p[0];
    int64_t i = 0;
    if (chunk >= L) {
      Vec acc = Vec::loadu(p);
      for (i = L; i + L <= chunk; i += L) acc = extreme(acc, Vec::loadu(p + i));
      acc.store(lanes);
      for (int64_t l = 0; l < L; ++l) best = before(lanes[l], best) ? lanes[l] : best;
    }
    for (; i < chunk; ++i) best = before(p[i], best) ? p[i] : best;
    edge = before(edge, best) ? best : edge;
  }
  // (each entry written, and counted where it is a candidate: no branch on it)
  scalar_t candidates[kCandidates + L];
  int64_t count = 0;
  const Vec vedge(edge);
  const int all = (1 << L) - 1;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    Vec v = Vec::loadu(row + i);
    Vec hit = largest ? (v >= vedge) : (v <= vedge);
    if (hit.zero_mask() == all) continue;  // (the usual case: no candidate here)
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t x = row[i + l];
      candidates[count] = x;
      count += !before(edge, x);
    }
    if (count > kCandidates) return false;
  }
  for (; i < n; ++i) {
    candidates[count] = row[i];
    count += !before(edge, row[i]);
  }
  if (count > kCandidates) return false;
  std::partial_sort(candidates, candidates + size, candidates + count, before);
  std::copy(candidates, candidates + size, buf);
  return true;
}

struct Sums {
  double signed_u = 0, u = 0, d = 0, c_signed = 0, count = 0;
};

// A row's status (threshold_rows' `status`): solved here, left to the torch code, or at a limit
// of k, filled here in closed form: k = 0 (nothing selected) or k = n_fin, the count of finite
// entries (every finite entry selected); a row without a finite entry at k = 0 is at both, as
// in the torch code (_ot._classify).
constexpr int64_t kSolved = 0, kLeft = 1, kNone = 2, kAll = 4;

// The status of a row before its solve (kSolved: to solve) from its k, epsilon, whether it holds
// a NaN or a +inf (`plain` false: left, as are an epsilon out of (0, limit] and a k out of [0,
// n_fin]) and its count of finite entries. Its -inf entries are masked entries: they are not
// selected at any threshold and weigh 0 in every sum, so the row is solved on its finite
// entries.
inline int64_t classify(double kb, double e, double limit, bool plain, int64_t n_fin) {
  if (!(plain && e > 0 && e <= limit && kb >= 0 && kb <= double(n_fin))) return kLeft;
  if (kb == 0) return n_fin == 0 ? (kNone | kAll) : kNone;
  return kb == double(n_fin) ? kAll : kSolved;
}

// A row at a limit of k (status kNone and/or kAll): A is 1 on the finite entries at k = n_fin
// > 0 and 0 elsewhere, s is 0; out[0..5] = m = 0, t = 0, sum s = inf (the backward's weights in
// x are 0), the residual 0, no evaluation, the status (_ot._special_rows' values).
template <typename scalar_t>
void fill_limit(const scalar_t* row, int64_t n, double kb, int64_t status, scalar_t* A,
                scalar_t* s, double* out) {
  const bool all = kb > 0;  // (k = n_fin > 0; with k = 0 nothing is selected)
  for (int64_t j = 0; j < n; ++j) {
    A[j] = (all && row[j] > -std::numeric_limits<scalar_t>::infinity()) ? scalar_t(1) : 0;
    s[j] = 0;
  }
  out[0] = out[1] = out[3] = out[4] = 0;
  out[2] = std::numeric_limits<double>::infinity();
  out[5] = double(status);
}

// One evaluation at t: the five sums, and A and s = A (1 - A) / eps written for the row (each
// evaluation writes them: a pass of its own at the final t cost more than the stores).
//
// E holds the row's exponentials exp(-|x - m| / eps), formed by the first evaluation that has E
// (`fill`): an evaluation at t then needs no exp of its own, since exp(-|z|) = exp(-|(x - m) -
// t| / eps) is E exp(t / eps) (f_up) on the entries above t with x - m >= 0, and E exp(-t / eps)
// (f_down) on those at or below t with x - m <= 0: one exp per entry per solve instead of one per
// evaluation. A vector holding an entry between m and t (x - m and (x - m) - t of opposite
// signs), or one whose E is subnormal (the product would lose the precision the direct exp
// keeps), is evaluated directly, as is every vector without E. The row's last vector is partial:
// loaded and stored for its entries only, its other lanes cleared out of the sums.
template <typename scalar_t>
Sums evaluate(const scalar_t* row, int64_t n, scalar_t m, scalar_t t, scalar_t inv, scalar_t* E,
              bool fill, scalar_t f_up, scalar_t f_down, scalar_t* A, scalar_t* s) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = Vec::size();
  const scalar_t small = std::numeric_limits<scalar_t>::min();
  const Vec vm(m), vt(t), vinv(inv), one(1), two(2), zero(0), vup(f_up), vdown(f_down);
  const Vec vsmall(small), vninf(-std::numeric_limits<scalar_t>::infinity());
  const int all = (1 << L) - 1;
  Sums out;
  Vec a_signed(0), a_u(0), a_d(0), a_c(0), a_count(0);
  auto flush = [&](Vec& acc, double& total) {
    total += lane_sum(acc);
    acc = zero;
  };
  auto step = [&](int64_t i, int64_t count) {
    const bool tail = count < L;
    const Vec live = tail ? head<scalar_t>(count) : zero;
    Vec a = Vec::loadu(row + i, count) - vm;
    Vec off = a - vt;
    Vec pos = off > zero;  // all bits set where z > 0
    Vec w;
    bool direct = E == nullptr;
    if (!direct) {
      Vec e;
      if (fill) {  // the first evaluation forms the row's exponentials
        e = (zero - (a * vinv).abs()).exp();
        e.store(E + i, count);
      } else {
        e = Vec::loadu(E + i, count);
      }
      // the factor's side, and the entries it does not cover (between m and t, or tiny E)
      // (a -inf entry's E is 0 and so is its product: exact, it needs no direct exp)
      Vec mixed = (pos & (a < zero)) | (Vec::blendv(a, zero, pos) > zero) |
                  ((e < vsmall) & (a > vninf));
      if (tail) mixed = mixed & live;
      direct = mixed.zero_mask() != all;
      w = e * Vec::blendv(vdown, vup, pos);
    }
    if (direct) w = (zero - (off * vinv).abs()).exp();
    Vec u = w / (one + w);
    Vec d = u * (one - u);
    Vec c = (one - two * u) * d;
    Vec::blendv(u, one - u, pos).store(A + i, count);
    (d * vinv).store(s + i, count);
    Vec su = Vec::blendv(u, zero - u, pos), sc = Vec::blendv(c, zero - c, pos), sn = pos & one;
    if (tail) u = u & live, d = d & live, su = su & live, sc = sc & live, sn = sn & live;
    a_signed = a_signed + su;
    a_c = a_c + sc;
    a_u = a_u + u;
    a_d = a_d + d;
    a_count = a_count + sn;
  };
  int64_t i = 0, block = 0;
  for (; i + L <= n; i += L) {
    step(i, L);
    if (++block == kFlush) {
      flush(a_signed, out.signed_u), flush(a_u, out.u), flush(a_d, out.d);
      flush(a_c, out.c_signed), flush(a_count, out.count);
      block = 0;
    }
  }
  if (i < n) step(i, n - i);
  flush(a_signed, out.signed_u), flush(a_u, out.u), flush(a_d, out.d);
  flush(a_c, out.c_signed), flush(a_count, out.count);
  return out;
}

// evaluate() on a row of any length: rows longer than 2 kChunk entries in chunks of kChunk, their
// sums added in the chunks' order, the chunks spread over torch's intra-op threads where the row
// has them to itself (one long row, B = 1; in a task of the rows' parallel_for the chunks run in
// turn), so that the sums are the same whatever the count of threads.
constexpr int64_t kChunk = int64_t(1) << 15;

template <typename scalar_t>
Sums evaluate_row(const scalar_t* row, int64_t n, scalar_t m, scalar_t t, scalar_t inv,
                  scalar_t* E, bool fill, scalar_t f_up, scalar_t f_down, scalar_t* A,
                  scalar_t* s) {
  if (n <= 2 * kChunk) return evaluate<scalar_t>(row, n, m, t, inv, E, fill, f_up, f_down, A, s);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<Sums> part(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i = c * kChunk;
      part[c] = evaluate<scalar_t>(row + i, std::min(kChunk, n - i), m, t, inv,
                                   E ? E + i : nullptr, fill, f_up, f_down, A + i, s + i);
    }
  });
  Sums out;
  for (const Sums& p : part) {
    out.signed_u += p.signed_u, out.u += p.u, out.d += p.d;
    out.c_signed += p.c_signed, out.count += p.count;
  }
  return out;
}

// The logs of the bracket's ends for one k and one count of finite entries (rows of one call
// share n, and often k; the parts of k alone are kept while only the count changes).
struct Logs {
  double k = std::nan("");
  int64_t n = -1;
  double j_hi = 0, j_lo = 0, lo = 0, hi = 0, logit = 0;
  double j_top = 0, log_k = 0, log_top = 0, log_hi = 0;

  // n: the row's count of finite entries (its -inf entries are not selected at any t)
  void at(double kb, int64_t n_fin) {
    if (kb == k && n_fin == n) return;
    if (!(kb == k)) {
      k = kb;
      j_hi = std::max(std::ceil(kb), 1.0);
      j_top = std::floor(kb) + 1.0;
      log_k = std::log(kb);
      log_top = std::log(j_top - kb);
      log_hi = std::log(kb - (j_hi - 1.0));
    }
    n = n_fin;
    const double n_d = double(n_fin);
    j_lo = std::max(std::min(j_top, n_d), 1.0);
    lo = log_k - (j_lo == j_top ? log_top : std::log(j_lo - kb));
    const double log_n = std::log(n_d - kb);
    hi = log_hi - log_n;
    logit = log_k - log_n;
  }
};

// The iteration's state of one row (rootfind.SolverState): the iterate, the bracket, its ends'
// residuals (or bounds) and the side that moved last (Illinois' rule).
template <typename scalar_t>
struct Iterate {
  scalar_t t, lo, hi;
  double f_lo, f_hi, side;
};

// The start of a row from its statistics (_prepare_exact): the centre m, the bracket and the
// first iterate (the centre, or the large-epsilon guess where epsilon is large for the row). n,
// total, lo_x and hi_x are the count, sum, least and largest of the row's finite entries.
template <typename scalar_t>
void start(scalar_t x_hi, scalar_t x_lo, double kb, scalar_t e, int64_t n, double total,
           scalar_t lo_x, scalar_t hi_x, const Logs& logs, scalar_t& m, Iterate<scalar_t>& it) {
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t em = fi::epsilon(), big = fi::max();
  m = scalar_t(0.5) * x_hi + scalar_t(0.5) * x_lo;
  const double lo_d = double(x_lo - m) - double(e) * logs.lo;
  const double hi_d = double(x_hi - m) - double(e) * logs.hi;
  const double pad = 4.0 * em * (std::abs(lo_d) + std::abs(hi_d) + e);
  it.lo = scalar_t(std::max(lo_d - pad, -double(big)));
  it.hi = scalar_t(std::min(hi_d + pad, double(big)));
  double t_d = 0;
  if (8.0 * e >= double(hi_x) - double(lo_x)) {  // the large-epsilon start
    t_d = total / n - m - double(e) * logs.logit;
  }
  it.t = scalar_t(std::min(std::max(t_d, double(it.lo)), double(it.hi)));
  it.f_lo = n - kb;
  it.f_hi = -kb;
  it.side = 0;
}

// The update (rootfind._update) from an evaluation at t, whose residual is F: the bracket (lo,
// hi, their residuals or bounds f_lo, f_hi), Illinois' rule (side: the end that moved last),
// Halley then Newton's step. Sets next to the next iterate and done where the row is done, but
// for one test: where `adjacent`, the bracket may be two adjacent subnormal floats, which only
// nextafter tells (see update()). Every operation is made and the choices are selections (no
// branch); update_lanes() is the same on the lanes of a group at once.
template <typename scalar_t>
C10_ALWAYS_INLINE void update_step(scalar_t t, scalar_t& lo, scalar_t& hi, double& f_lo,
                                   double& f_hi, double& side, double F, double d_sum,
                                   double c_signed, double u_sum, double e, double floor,
                                   double flush, double tol, scalar_t& next, bool& done,
                                   bool& adjacent) {
  using fi = std::numeric_limits<scalar_t>;
  const double em = fi::epsilon();
  // (every operation unconditional, the choices selections: & and | on the tests, no branch)
  const double slope = d_sum / e;
  const double bound =
      32.0 * em * std::max(u_sum, floor) + 2.0 * em * slope * std::abs(double(t)) + flush + tol;
  const bool converged = std::abs(F) <= bound;
  const bool up = F > 0, down = F < 0;
  const double half_hi = 0.5 * f_hi, half_lo = 0.5 * f_lo;
  const double fh = down ? F : (up & (side > 0) ? half_hi : f_hi);
  const double fl = up ? F : (down & (side < 0) ? half_lo : f_lo);
  lo = up ? t : lo;
  hi = down ? t : hi;
  f_lo = fl, f_hi = fh;
  side = up ? 1.0 : (down ? -1.0 : 0.0);
  const double raw = F / -slope;
  double newton = slope > 0 ? raw : std::numeric_limits<double>::quiet_NaN();
  const double ratio = newton * (-c_signed / d_sum / e);  // (used where d_sum > 0)
  const double corrected = newton / (1 - 0.5 * ratio);
  newton = (d_sum > 0) & (std::abs(ratio) <= 1) ? corrected : newton;
  const scalar_t halley = scalar_t(double(t) - newton);
  const double secant = double(lo) + (double(hi) - double(lo)) * (fl / (fl - fh));
  const scalar_t secant_t = scalar_t(secant), middle = scalar_t(0.5) * (lo + hi);
  const scalar_t fallback = (secant > lo) & (secant < hi) ? secant_t : middle;
  // (a slope that overflowed, epsilon within n / max of 0 in t's units, gives a step of 0: no
  // step, not the resolution limit below; as rootfind._update)
  next = (halley >= lo) & (halley <= hi) & std::isfinite(slope) ? halley : fallback;
  // two adjacent floats are a few ulps apart, caught by this test, unless both are subnormal
  const scalar_t width = hi - lo;
  const bool collapsed = width <= 4 * scalar_t(em) * std::max(std::abs(lo), std::abs(hi));
  done = converged | (next == t) | collapsed;
  adjacent = !done & !(width > 2 * fi::min());
}

// update_step on a row's state: returns whether the row is done (then it.t stays the evaluated
// iterate; else it is the next one).
template <typename scalar_t>
C10_ALWAYS_INLINE bool update(Iterate<scalar_t>& it, const Sums& sums, double F, double e,
                              double floor, double flush, double tol) {
  scalar_t next;
  bool done, adjacent;
  update_step(it.t, it.lo, it.hi, it.f_lo, it.f_hi, it.side, F, sums.d, sums.c_signed, sums.u,
              e, floor, flush, tol, next, done, adjacent);
  done = done || (adjacent && std::nextafter(it.lo, it.hi) >= it.hi);
  if (!done) it.t = next;
  return done;
}

// Each lane of v rounded to scalar_t (and back to double).
template <typename scalar_t>
C10_ALWAYS_INLINE at::vec::Vectorized<double> rounded(const at::vec::Vectorized<double>& v) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return v;
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<scalar_t, float>) {  // (one conversion each way)
    return _mm512_cvtps_pd(_mm512_cvtpd_ps(v));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_cvtps_pd(_mm256_cvtpd_ps(v));
#endif
  } else {
    using VecD = at::vec::Vectorized<double>;
    alignas(64) double lanes[VecD::size()];
    v.store(lanes);
    for (int64_t i = 0; i < VecD::size(); ++i) lanes[i] = double(scalar_t(lanes[i]));
    return VecD::loadu(lanes);
  }
}

// The lanes' state in solve_group: per lane, the iterate t and the bracket (lo, hi) as doubles
// holding values of scalar_t, the ends' residuals, the side that moved last, k, epsilon, the
// rounding floor of the sums, and whether the lane still iterates (1) or not (0).
template <int64_t L>
struct Lanes {
  alignas(64) double t[L], lo[L], hi[L], f_lo[L], f_hi[L], side[L], kb[L], e[L], floor[L], on[L];
};

// update_step on every lane at once (at::vec, in double; the values of scalar_t rounded as
// update_step rounds them), from the lanes' sums (signed u, u, d, signed c, count). Lanes that
// do not iterate keep their state. Sets next, F, and the bits of `done` and `adjacent` (lane l:
// bit l; see update_step).
template <typename scalar_t, int64_t L>
void update_lanes(Lanes<L>& z, const double (*sums)[L], double flush, double tol, double* next,
                  double* F, int64_t& done, int64_t& adjacent) {
  using VecD = at::vec::Vectorized<double>;
  using fi = std::numeric_limits<scalar_t>;
  constexpr int64_t D = VecD::size();
  const double em = fi::epsilon();
  const VecD zero(0), one(1), half(0.5), nan(std::numeric_limits<double>::quiet_NaN());
  const VecD bound_u(32.0 * em), bound_t(2.0 * em), width_max(4 * scalar_t(em));
  const VecD tiny(2 * double(fi::min())), vflush(flush), vtol(tol);
  done = adjacent = 0;
  for (int64_t i = 0; i < L; i += D) {
    const VecD t = VecD::loadu(z.t + i), lo = VecD::loadu(z.lo + i), hi = VecD::loadu(z.hi + i);
    const VecD f_lo = VecD::loadu(z.f_lo + i), f_hi = VecD::loadu(z.f_hi + i);
    const VecD side = VecD::loadu(z.side + i), e = VecD::loadu(z.e + i);
    const VecD on = VecD::loadu(z.on + i) > zero;
    const VecD d = VecD::loadu(sums[2] + i), c = VecD::loadu(sums[3] + i);
    const VecD f = VecD::loadu(sums[0] + i) + (VecD::loadu(sums[4] + i) - VecD::loadu(z.kb + i));
    f.store(F + i);
    const VecD slope = d / e;
    const VecD u_floor = at::vec::maximum(VecD::loadu(sums[1] + i), VecD::loadu(z.floor + i));
    const VecD bound = ((bound_u * u_floor + bound_t * slope * t.abs()) + vflush) + vtol;
    const VecD converged = f.abs() <= bound;
    const VecD up = f > zero, down = f < zero;
    const VecD fh = VecD::blendv(VecD::blendv(f_hi, half * f_hi, up & (side > zero)), f, down);
    const VecD fl = VecD::blendv(VecD::blendv(f_lo, half * f_lo, down & (side < zero)), f, up);
    const VecD lo2 = VecD::blendv(lo, t, up), hi2 = VecD::blendv(hi, t, down);
    const VecD side2 = VecD::blendv(VecD::blendv(zero, zero - one, down), one, up);
    VecD newton = VecD::blendv(nan, f / (zero - slope), slope > zero);
    const VecD ratio = newton * ((zero - c) / d / e);
    newton = VecD::blendv(newton, newton / (one - half * ratio), (d > zero) & (ratio.abs() <= one));
    const VecD halley = rounded<scalar_t>(t - newton);
    const VecD secant = lo2 + (hi2 - lo2) * (fl / (fl - fh));
    const VecD middle = rounded<scalar_t>(half * rounded<scalar_t>(lo2 + hi2));
    const VecD fallback =
        VecD::blendv(middle, rounded<scalar_t>(secant), (secant > lo2) & (secant < hi2));
    const VecD finite = slope.abs() < VecD(std::numeric_limits<double>::infinity());
    const VecD step = VecD::blendv(fallback, halley, (halley >= lo2) & (halley <= hi2) & finite);
    step.store(next + i);
    const VecD width = rounded<scalar_t>(hi2 - lo2);
    const VecD limit = rounded<scalar_t>(width_max * at::vec::maximum(lo2.abs(), hi2.abs()));
    const VecD stop = converged | (step == t) | (width <= limit);
    const VecD near = VecD::blendv(width <= tiny, zero, stop);
    VecD::blendv(lo, lo2, on).store(z.lo + i);
    VecD::blendv(hi, hi2, on).store(z.hi + i);
    VecD::blendv(f_lo, fl, on).store(z.f_lo + i);
    VecD::blendv(f_hi, fh, on).store(z.f_hi + i);
    VecD::blendv(side, side2, on).store(z.side + i);
    const int64_t all = (int64_t(1) << D) - 1;
    done |= int64_t(all & ~stop.zero_mask()) << i;
    adjacent |= int64_t(all & ~near.zero_mask()) << i;
  }
}

// One vector of balance_parts' sums: for the entries below (above) t, at distance a from it,
// exp(log u + near / eps) and that times (1 - u), added to acc[0..1] (acc[2..3]); near is the
// side's nearest distance (shift_b, shift_a), taken off before dividing by epsilon.
template <typename Vec>
inline void add_balance_terms(const Vec& a, const Vec& below, const Vec& above,
                              const Vec& shift_b, const Vec& shift_a, const Vec& ve, Vec* acc) {
  const Vec zero(0), one(1);
  const Vec side = below | above;
  const Vec shift = Vec::blendv(shift_a, shift_b, below);
  const Vec af = Vec::blendv(shift, a, side);
  // log u + near / eps = -(a - near) / eps - softplus(-a / eps); (1 - u) = sigmoid(a / eps)
  const Vec q = (zero - af / ve).exp();
  const Vec term = ((zero - (af - shift) / ve) - q.log1p()).exp() & side;
  const Vec dterm = term * (one / (one + q));
  acc[0] = acc[0] + (term & below);
  acc[1] = acc[1] + (dterm & below);
  acc[2] = acc[2] + (term & above);
  acc[3] = acc[3] + (dterm & above);
}

// The six sums of _ot.balance_parts for one row at t, in its dtype: for each side of t (the
// entries with (x - m) - t <= 0, then > 0) the distance from t to its nearest entry (inf where
// the side is empty) and the sums of exp(log u + near / eps) and of that times (1 - u).
template <typename scalar_t>
void balance_parts(const scalar_t* row, int64_t n, scalar_t m, scalar_t t, scalar_t eps,
                   scalar_t* parts) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = Vec::size();
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  const Vec vm(m), vt(t), ve(eps), zero(0), one(1), vinf(inf);
  auto sides = [&](int64_t i, int64_t count, Vec& a, Vec& below, Vec& above) {
    Vec off = (Vec::loadu(row + i, count) - vm) - vt;
    a = off.abs();
    Vec fin = a < vinf;
    if (count < L) fin = fin & head<scalar_t>(count);
    below = (off <= zero) & fin;
    above = (off > zero) & fin;
  };
  Vec near_b(inf), near_a(inf), a, below, above;
  int64_t i = 0;
  for (; i < n; i += L) {
    sides(i, std::min(L, n - i), a, below, above);
    near_b = at::vec::minimum(near_b, Vec::blendv(vinf, a, below));
    near_a = at::vec::minimum(near_a, Vec::blendv(vinf, a, above));
  }
  auto least = [](Vec& v) {
    return at::vec::vec_reduce_all<scalar_t>(
        [](Vec& x, Vec& y) { return at::vec::minimum(x, y); }, v);
  };
  const scalar_t nb = least(near_b), na = least(near_a);
  const Vec shift_b(std::isfinite(nb) ? nb : scalar_t(0)), shift_a(std::isfinite(na) ? na : 0);
  double sums[4] = {0, 0, 0, 0};
  Vec acc[4] = {zero, zero, zero, zero};
  int64_t block = 0;
  for (i = 0; i < n; i += L) {
    sides(i, std::min(L, n - i), a, below, above);
    add_balance_terms(a, below, above, shift_b, shift_a, ve, acc);
    if (++block == kFlush) {
      for (int c = 0; c < 4; ++c) sums[c] += lane_sum(acc[c]), acc[c] = zero;
      block = 0;
    }
  }
  for (int c = 0; c < 4; ++c) sums[c] += lane_sum(acc[c]);
  parts[0] = nb, parts[1] = scalar_t(sums[0]), parts[2] = scalar_t(sums[1]);
  parts[3] = na, parts[4] = scalar_t(sums[2]), parts[5] = scalar_t(sums[3]);
}

// torch.logaddexp of two scalars.
template <typename scalar_t>
scalar_t logaddexp(scalar_t a, scalar_t b) {
  if (std::isinf(a) && a == b) return a;
  return std::max(a, b) + std::log1p(std::exp(-std::abs(a - b)));
}

// _ot.polish of one row near the hard limit, in its dtype: Newton steps on the log-domain balance
// of the two sides of t (_ot.balance_step with one shard) inside t's gap and the solver's
// bracket, bisection where a step leaves them, at most kPolishSteps. gap is the count of entries
// above t less k (fixed while t stays in its gap). Returns the new t.
template <typename scalar_t>
scalar_t polish(const scalar_t* row, int64_t n, scalar_t m, scalar_t t, scalar_t lo, scalar_t hi,
                scalar_t eps, scalar_t gap, int steps = kPolishSteps) {
  const scalar_t ulp = std::numeric_limits<scalar_t>::epsilon();
  const scalar_t c_side[2] = {std::max(gap, scalar_t(0)), std::max(-gap, scalar_t(0))};
  scalar_t parts[6];
  for (int k = 0; k < steps; ++k) {
    balance_parts(row, n, m, t, eps, parts);
    scalar_t log_side[2], rate[2];
    for (int side = 0; side < 2; ++side) {
      const scalar_t a = parts[3 * side];
      const bool some = std::isfinite(a);  // (the one shard's factor: 1, or 0 on an empty side)
      const scalar_t u = some ? parts[3 * side + 1] : scalar_t(0);
      const scalar_t d = some ? parts[3 * side + 2] : scalar_t(0);
      const scalar_t c = c_side[side];
      // eps log(u e^{-a/eps} + c), and D / L = d / (u + c e^{a/eps}) (0 once e^{a/eps} overflows)
      if (c > 0) {
        log_side[side] = eps * logaddexp(std::log(u) - a / eps, std::log(c));
        rate[side] = d / (u + c * std::exp(a / eps));
      } else {
        log_side[side] = eps * std::log(u) - a;
        rate[side] = d / u;
      }
    }
    const scalar_t H = log_side[0] - log_side[1];
    const scalar_t step = H / (rate[0] + rate[1]);
    lo = H > 0 ? t : std::max(lo, t - parts[0]);
    hi = H < 0 ? t : std::min(hi, t + parts[3]);
    scalar_t next = t + step;
    if (!(next >= lo && next <= hi)) next = scalar_t(0.5) * lo + scalar_t(0.5) * hi;
    if (!(std::isfinite(next) && H != 0)) break;
    const bool small =
        std::abs(next - t) <= std::max(2 * ulp * std::abs(t), scalar_t(std::ldexp(1.0, -20)) * eps);
    t = next;
    if (small) break;
  }
  return t;
}

// The backward's denominator from a row's sum of u (1 - u): sum s = that over epsilon, in the
// dtype, or inf where it is 0 (_ot._evaluate's den).
template <typename scalar_t>
scalar_t backward_den(double d_sum, scalar_t e) {
  const scalar_t slope = scalar_t(d_sum / e);
  return slope > 0 ? slope : std::numeric_limits<scalar_t>::infinity();
}

// Whether a row whose backward denominator is den is near the hard limit (_ot.near_hard, from
// den as _ot._near_rows forms it: sum u (1 - u) = den eps, 0 where den is inf).
template <typename scalar_t>
bool near_hard(scalar_t den, scalar_t e) {
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t d_sum = den < fi::infinity() ? den * e : scalar_t(0);
  return d_sum < scalar_t(kNearHard * std::sqrt(double(fi::epsilon())));
}

// The end of a row's solve, from its last evaluation (sums, residual F) at it.t: capped rows are
// left (status 1); rows near the hard limit (as _ot._near_rows sees them, from the backward's
// denominator in the dtype) are polished, and A and s evaluated anew at the polished t. Writes
// out[0..5] = m, t, sum s (inf where 0), the residual, the evaluations and the status (0 solved,
// 1 left to the torch code); returns whether A and s were written here.
template <typename scalar_t>
bool finish(const scalar_t* row, int64_t n, scalar_t m, const Iterate<scalar_t>& it, scalar_t e,
            scalar_t k_row, const Sums& sums, double F, int64_t evaluations, bool done,
            scalar_t* A, scalar_t* s, double* out) {
  out[4] = double(evaluations);
  if (!done) return false;
  scalar_t t = it.t;
  scalar_t w_sum = backward_den(sums.d, e);
  const bool near = near_hard(w_sum, e);
  if (near) {
    const scalar_t gap = scalar_t(sums.count) - k_row;
    t = polish(row, n, m, t, it.lo, it.hi, e, gap);
    const Sums again = evaluate_row<scalar_t>(row, n, m, t, scalar_t(1) / e, nullptr, false,
                                              scalar_t(1), scalar_t(1), A, s);
    F = again.signed_u + (again.count - double(k_row));
    w_sum = backward_den(again.d, e);
  }
  out[0] = m;
  out[1] = t;
  out[2] = w_sum;
  out[3] = F;
  out[5] = 0;
  return near;
}

// A work row that grows and is never initialised (a std::vector's resize would write zeros over
// it first, a pass of its own): a row's copy for nth_element, then its exponentials.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> data;
  int64_t size = 0;
  T* get(int64_t n) {
    if (n > size) data.reset(new T[n]), size = n;
    return data.get();
  }
};

// The solve's settings, common to its rows.
struct Settings {
  double tol, limit;
  int64_t max_iter;
};

// Solves one row; writes out[0..5] (see finish()). Its -inf entries before the first and after the
// last that are not (a causal mask's, a padding's) take no part: the row is solved on the window
// between.
template <typename scalar_t>
void solve_row(const scalar_t* row_in, int64_t n_row, scalar_t k_row, scalar_t eps_row,
               const Settings& cfg, scalar_t* A_out, scalar_t* s_out, double* out,
               Scratch<scalar_t>& scratch, Logs& logs) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = Vec::size();
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t big = fi::max();
  const double kb = k_row;
  const scalar_t e = eps_row;
  for (int64_t c = 0; c < 6; ++c) out[c] = 0;
  out[5] = double(kLeft);
  if (!(kb >= 0 && kb <= n_row && e > 0 && e <= cfg.limit)) return;
  // The count of finite entries, their sum, min and max, whether a NaN or +inf is there, and
  // the window [j0, j1) of the entries that are not -inf: one pass (the lanes past the row read
  // as -inf, a masked entry).
  const Vec vinf(fi::infinity()), vninf(-fi::infinity()), one(1);
  Vec v_bad(0), v_count(0), v_sum(0), v_min(vinf), v_max(vninf);
  int64_t j0 = n_row, j1 = 0;
  for (int64_t i = 0; i < n_row; i += L) {
    const int64_t count = std::min(L, n_row - i);
    Vec v = Vec::loadu(row_in + i, count);
    if (count < L) v = Vec::blendv(vninf, v, head<scalar_t>(count));
    const int some = (v == vninf).zero_mask();  // (bit l: entry i + l is not -inf)
    if (some != 0) {
      j0 = std::min(j0, i + __builtin_ctz(some));
      j1 = i + 32 - __builtin_clz(some);
    }
    const Vec fin = v > vninf;  // (and +inf, which flags the row; a NaN is not)
    v_bad = v_bad | (v != v) | (v == vinf);
    v_count = v_count + (fin & one);
    v_sum = v_sum + (v & fin);
    v_min = at::vec::minimum(v_min, Vec::blendv(vinf, v, fin));
    v_max = at::vec::maximum(v_max, v);
  }
  const bool plain = v_bad.zero_mask() == (1 << L) - 1;
  const int64_t n_fin = int64_t(lane_sum(v_count));
  const int64_t status = classify(kb, double(e), cfg.limit, plain, n_fin);
  if (status == kLeft) return;
  if (status != kSolved) return fill_limit(row_in, n_row, kb, status, A_out, s_out, out);
  // The row from here on: the window's n entries (the -inf entries outside it take no part:
  // their A and s are 0).
  const scalar_t* row = row_in + j0;
  const int64_t n = j1 - j0;
  scalar_t* A = A_out + j0;
  scalar_t* s = s_out + j0;
  std::fill(A_out, A, scalar_t(0)), std::fill(s_out, s, scalar_t(0));
  std::fill(A + n, A_out + n_row, scalar_t(0)), std::fill(s + n, s_out + n_row, scalar_t(0));
  const double total = lane_sum(v_sum);
  const scalar_t lo_x = at::vec::vec_reduce_all<scalar_t>(
      [](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, v_min);
  const scalar_t hi_x = at::vec::vec_reduce_all<scalar_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v_max);
  // The bracket's order statistics: the j_hi-th and j_lo-th largest (docs/math.md §1.3), of the
  // finite entries, which are the row's: its -inf entries trail it, and j_lo <= n_fin.
  logs.at(kb, n_fin);
  const int64_t jl = int64_t(logs.j_lo), jh = int64_t(logs.j_hi);
  scalar_t x_hi, x_lo;
  scalar_t buf[kBuffer];
  if (jl <= kBuffer && extremes<scalar_t, true>(row, n, jl, buf)) {
    x_lo = buf[jl - 1];
    x_hi = buf[jh - 1];
  } else if (n - jh + 1 <= kBuffer && extremes<scalar_t, false>(row, n, n - jh + 1, buf)) {
    // the j-th largest is the (n - j + 1)-th smallest
    x_lo = buf[n - jl];
    x_hi = buf[n - jh];
  } else {
    scalar_t* const copy = scratch.get(n);  // (dead before the exponentials fill it)
    std::copy(row, row + n, copy);
    auto desc = [](scalar_t a, scalar_t b) { return a > b; };
    std::nth_element(copy, copy + (jl - 1), copy + n, desc);
    x_lo = copy[jl - 1];
    x_hi = jh == jl ? x_lo : *std::min_element(copy, copy + jl - 1);
  }
  scalar_t m;
  Iterate<scalar_t> it;
  start(x_hi, x_lo, kb, e, n_fin, total, lo_x, hi_x, logs, m, it);
  const scalar_t inv = scalar_t(1) / e;
  // (the whole row's, as in _evaluate)
  const double floor = std::min(std::max(std::min(kb, n_row - kb), 0.0), 1.0);
  const double flush = double(n_row) / double(big);
  bool done = false;
  int64_t evaluations = 0;
  double F = 0;
  Sums sums;
  scalar_t* const exps = scratch.get(n);
  bool filled = false;
  while (evaluations < cfg.max_iter) {
    // the factors exp(+-t / eps), where they are well inside the range (else the direct exp)
    const double tz = double(it.t) * double(inv);
    const bool factor = std::abs(tz) <= kFactorMax;
    scalar_t* E = factor ? exps : nullptr;
    const bool fill = factor && !filled;
    filled = filled || factor;
    const scalar_t f_up = factor ? scalar_t(std::exp(tz)) : scalar_t(1);
    const scalar_t f_down = factor ? scalar_t(std::exp(-tz)) : scalar_t(1);
    sums = evaluate_row<scalar_t>(row, n, m, it.t, inv, E, fill, f_up, f_down, A, s);
    ++evaluations;
    F = sums.signed_u + (sums.count - kb);
    done = update(it, sums, F, double(e), floor, flush, cfg.tol);
    if (done) break;
  }
  finish(row, n, m, it, e, k_row, sums, F, evaluations, done, A, s, out);
}

// _ot.polish on the lanes of a group (solve_group's transposed rows X) whose `on` is set, every
// lane at once in the rows' dtype: polish() with its sums and steps as vector operations over the
// lanes. t (the lanes' iterates) and lo and hi (the solver's brackets) are updated in place; gap
// is the count of entries above t less k. Once only a few lanes go on, they are left to polish()
// (a row at a time is then cheaper): returns the steps taken, and sets on to 1 on the lanes left
// (0 elsewhere).
template <typename scalar_t, int64_t L>
int polish_lanes(const scalar_t* X, int64_t n, const scalar_t* m, scalar_t* t, scalar_t* lo_io,
                 scalar_t* hi_io, const scalar_t* eps, const scalar_t* gap, scalar_t* on) {
  using Vec = at::vec::Vectorized<scalar_t>;
  static_assert(Vec::size() == L);
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t inf = fi::infinity();
  const Vec zero(0), one(1), half(0.5), vinf(inf);
  const Vec ulp2(2 * fi::epsilon()), least(scalar_t(std::ldexp(1.0, -20)));
  const int all = (1 << L) - 1;
  const Vec vm = Vec::loadu(m), ve = Vec::loadu(eps), g = Vec::loadu(gap);
  const Vec c_side[2] = {at::vec::maximum(g, zero), at::vec::maximum(zero - g, zero)};
  const Vec log_c[2] = {c_side[0].log(), c_side[1].log()};
  Vec vt = Vec::loadu(t), lo = Vec::loadu(lo_io), hi = Vec::loadu(hi_io);
  Vec active = Vec::loadu(on) > zero;
  int k = 0;
  auto logaddexp = [&](const Vec& x, const Vec& y) {  // torch.logaddexp
    const Vec r = at::vec::maximum(x, y) + (zero - (x - y).abs()).exp().log1p();
    return Vec::blendv(r, x, (x == y) & (x.abs() == vinf));
  };
  // A step of every lane costs about as much as one of polish() on n / (ceil(n / L) + 1) rows
  // (the transcendental functions of n entries, against those of the row's vectors and the
  // scalar step).
  const int few = int(std::max<int64_t>(1, n / ((n + L - 1) / L + 1)));
  auto going = [&]() { return __builtin_popcount(all & ~active.zero_mask()); };
  while (k < kPolishSteps && going() > few) {
    // balance_parts: each side's nearest distance, then its two sums
    auto sides = [&](int64_t j, Vec& a, Vec& below, Vec& above) {
      const Vec off = (Vec::loadu(X + j * L) - vm) - vt;
      a = off.abs();
      const Vec fin = a < vinf;
      below = (off <= zero) & fin;
      above = (off > zero) & fin;
    };
    Vec near[2] = {vinf, vinf}, a, below, above;
    for (int64_t j = 0; j < n; ++j) {
      sides(j, a, below, above);
      near[0] = at::vec::minimum(near[0], Vec::blendv(vinf, a, below));
      near[1] = at::vec::minimum(near[1], Vec::blendv(vinf, a, above));
    }
    const Vec shift_b = Vec::blendv(zero, near[0], near[0] < vinf);
    const Vec shift_a = Vec::blendv(zero, near[1], near[1] < vinf);
    double sums[4][L];
    for (int c = 0; c < 4; ++c) {
      for (int64_t l = 0; l < L; ++l) sums[c][l] = 0;
    }
    Vec acc[4] = {zero, zero, zero, zero};
    auto flush = [&]() {
      alignas(64) scalar_t lanes[L];
      for (int c = 0; c < 4; ++c) {
        acc[c].store(lanes);
        for (int64_t l = 0; l < L; ++l) sums[c][l] += lanes[l];
        acc[c] = zero;
      }
    };
    for (int64_t j = 0; j < n; ++j) {
      sides(j, a, below, above);
      add_balance_terms(a, below, above, shift_b, shift_a, ve, acc);
      if ((j + 1) % kFlush == 0) flush();
    }
    if (n % kFlush != 0) flush();
    // balance_step
    Vec log_side[2], rate[2];
    for (int side = 0; side < 2; ++side) {
      alignas(64) scalar_t u_l[L], d_l[L];
      for (int64_t l = 0; l < L; ++l) {
        u_l[l] = scalar_t(sums[2 * side][l]), d_l[l] = scalar_t(sums[2 * side + 1][l]);
      }
      const Vec some = near[side] < vinf, c = c_side[side], with = c > zero;
      const Vec u = Vec::loadu(u_l) & some, d = Vec::loadu(d_l) & some, lu = u.log();
      const Vec a_s = near[side];
      const Vec with_c = ve * logaddexp(lu - a_s / ve, log_c[side]);
      log_side[side] = Vec::blendv(ve * lu - a_s, with_c, with);
      const Vec grow = Vec::blendv(zero, c * (Vec::blendv(zero, a_s, with) / ve).exp(), with);
      rate[side] = d / (u + grow);
    }
    const Vec H = log_side[0] - log_side[1];
    const Vec step = H / (rate[0] + rate[1]);
    lo = Vec::blendv(at::vec::maximum(lo, vt - near[0]), vt, H > zero);
    hi = Vec::blendv(at::vec::minimum(hi, vt + near[1]), vt, H < zero);
    Vec next = vt + step;
    next = Vec::blendv(half * lo + half * hi, next, (next >= lo) & (next <= hi));
    const Vec ok = active & ((next - next) == zero) & (H != zero);
    next = Vec::blendv(vt, next, ok);
    const Vec small = (next - vt).abs() <= at::vec::maximum(ulp2 * vt.abs(), least * ve);
    vt = next;
    active = Vec::blendv(ok, zero, small);
    ++k;
  }
  vt.store(t), lo.store(lo_io), hi.store(hi_io);
  (active & one).store(on);
  return k;
}

// Solves the rows b0 .. b0 + rows - 1 (rows <= the vector's size L, each of n <= kPackMax
// entries) one row per lane: the same arithmetic as solve_row, each entry of the group one
// vector operation. The entries are transposed into X (entry j of the lane-l row at X[j L + l];
// lanes past the rows repeat the last row and are not written back), the order statistics come
// from compare-exchanges of whole vectors (insertion into the few ranks needed, or a bitonic
// sort), every exponential exp(-|x - m| / eps) is formed once (E, as solve_row's first factored
// evaluation forms it; a lane whose factor is out of range, or an entry the factor does not
// cover, takes the direct exp), each evaluation updates every active lane's iterate at once
// (update_lanes()) and the lanes near the hard limit are polished at once (polish_lanes()). A
// lane that is done keeps its iterate, so later passes write its A and s again with the same
// values (and its sums, unused, are formed along). The entries -inf in every lane before the
// first and after the last that is not (a causal mask's, a padding's) take no part: their A and
// s are 0, and the group is solved on the window between. Writes out[l][0..5] (see finish()).
template <typename scalar_t>
void solve_group(const scalar_t* px, int64_t n_row, int64_t b0, int64_t rows, const scalar_t* pk,
                 int64_t k_stride, const scalar_t* pe, int64_t eps_stride, const Settings& cfg,
                 scalar_t* pA, scalar_t* ps, double (*out)[6], Logs& logs) {
  using Vec = at::vec::Vectorized<scalar_t>;
  using VecD = at::vec::Vectorized<double>;
  constexpr int64_t L = Vec::size();
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t inf = fi::infinity();
  alignas(64) scalar_t X[kPackMax * L], E[kPackMax * L], At[kPackMax * L], St[kPackMax * L];
  alignas(64) scalar_t S[kPackMax * L];
  for (int64_t l = 0; l < L; ++l) {
    const scalar_t* row = px + (b0 + std::min(l, rows - 1)) * n_row;
    for (int64_t j = 0; j < n_row; ++j) X[j * L + l] = row[j];
  }
  // Per lane: whether a NaN or +inf is there, the count of finite entries, their least and
  // largest (-inf entries are masked ones: see classify()), and their sum; the window [j0, j1)
  // of the entries that are not -inf in every lane.
  const Vec zero(0), one(1), two(2), vinf(inf), vninf(-inf);
  Vec v_bad(0), v_count(0), v_min(inf), v_max(-inf), v_sum(0);
  double total[L];
  alignas(64) scalar_t lanes[L];
  for (int64_t l = 0; l < L; ++l) total[l] = 0;
  auto flush_sum = [&]() {  // (the float lanes into the double totals: see kFlush)
    v_sum.store(lanes);
    for (int64_t l = 0; l < L; ++l) total[l] += lanes[l];
    v_sum = zero;
  };
  int64_t j0 = n_row, j1 = 0;
  for (int64_t j = 0; j < n_row; ++j) {
    const Vec v = Vec::loadu(X + j * L);
    if ((v == vninf).zero_mask() != 0) {  // (some lane is not -inf here)
      j0 = std::min(j0, j);
      j1 = j + 1;
    }
    const Vec fin = v > vninf;
    v_sum = v_sum + (v & fin);
    if ((j + 1) % kFlush == 0) flush_sum();
    v_bad = v_bad | (v != v) | (v == vinf);
    v_count = v_count + (fin & one);
    v_min = at::vec::minimum(v_min, Vec::blendv(vinf, v, fin));
    v_max = at::vec::maximum(v_max, v);
  }
  alignas(64) scalar_t count[L], lo_x[L], hi_x[L];
  v_count.store(count), v_min.store(lo_x), v_max.store(hi_x);
  const int plain = v_bad.zero_mask();  // (bit l clear: lane l holds a NaN or +inf)
  if (n_row % kFlush != 0) flush_sum();
  // the group from here on: the window's n entries, moved to the front of X
  j0 = std::min(j0, j1);
  const int64_t n = j1 - j0;
  if (j0 > 0) std::copy(X + j0 * L, X + j1 * L, X);
  // The lanes to solve (the others left, or filled at their limit of k), and the ranks of their
  // bracket's order statistics (docs/math.md §1.3): the j_hi-th and j_lo-th largest.
  alignas(64) scalar_t m[L], t[L], inv[L], up[L], down[L], direct[L], k_row[L], e_row[L];
  bool solve[L];
  int64_t j_hi[L], j_lo[L], n_fin[L], top = 0, bottom = 0;
  Logs lane_logs[L];
  for (int64_t l = 0; l < L; ++l) {
    const int64_t b = b0 + std::min(l, rows - 1);
    k_row[l] = pk[b * k_stride];
    e_row[l] = pe[b * eps_stride];
    const double kb = k_row[l];
    const scalar_t e = e_row[l];
    n_fin[l] = int64_t(count[l]);
    solve[l] = false;
    if (l >= rows) continue;
    const int64_t status = classify(kb, double(e), cfg.limit, (plain >> l) & 1, n_fin[l]);
    for (int64_t c = 0; c < 6; ++c) out[l][c] = 0;
    out[l][5] = double(kLeft);
    if (status != kSolved) {
      if (status != kLeft) {
        fill_limit(px + b * n_row, n_row, kb, status, pA + b * n_row, ps + b * n_row, out[l]);
      }
      continue;
    }
    solve[l] = true;
    logs.at(kb, n_fin[l]);
    lane_logs[l] = logs;
    j_hi[l] = int64_t(logs.j_hi), j_lo[l] = int64_t(logs.j_lo);
    top = std::max(top, j_lo[l]);
    bottom = std::max(bottom, n - j_hi[l] + 1);
  }
  // The order statistics of every lane at once, into S: the `top` largest (descending) or the
  // `bottom` smallest (ascending) by insertion (a compare-exchange for each entry and each rank
  // kept), or the whole row sorted (descending) by a bitonic network, whichever is the fewer
  // compare-exchanges. (NaN lanes are not solved: comparisons without NaN's order do.)
  int64_t width = 1;  // the sorting network's size: a power of two
  int64_t stages = 0;
  while (width < n) width *= 2, ++stages;
  const int64_t network = width / 2 * (stages * (stages + 1) / 2);
  const bool from_top = top <= bottom;
  const int64_t keep = from_top ? top : bottom;
  const bool insertion = keep * n <= network;
  auto exchange = [](Vec& a, Vec& b) {  // a the larger, b the smaller
    const Vec greater = b > a;
    const Vec larger = Vec::blendv(a, b, greater);
    b = Vec::blendv(b, a, greater);
    a = larger;
  };
  if (keep > 0 && insertion) {
    const Vec edge = from_top ? zero - vinf : vinf;
    for (int64_t r = 0; r < keep; ++r) edge.store(S + r * L);
    for (int64_t j = 0; j < n; ++j) {
      Vec v = Vec::loadu(X + j * L);
      for (int64_t r = 0; r < keep; ++r) {
        Vec kept = Vec::loadu(S + r * L);
        if (from_top) {
          exchange(kept, v);
        } else {
          exchange(v, kept);
        }
        kept.store(S + r * L);
      }
    }
  } else if (keep > 0) {
    for (int64_t j = 0; j < n; ++j) Vec::loadu(X + j * L).store(S + j * L);
    for (int64_t j = n; j < width; ++j) (zero - vinf).store(S + j * L);
    for (int64_t size = 2; size <= width; size *= 2) {
      for (int64_t stride = size / 2; stride > 0; stride /= 2) {
        for (int64_t i = 0; i < width; ++i) {
          const int64_t other = i ^ stride;
          if (other <= i) continue;
          Vec a = Vec::loadu(S + i * L), b = Vec::loadu(S + other * L);
          if ((i & size) == 0) {
            exchange(a, b);  // descending
          } else {
            exchange(b, a);
          }
          a.store(S + i * L);
          b.store(S + other * L);
        }
      }
    }
  }
  // the j-th largest entry of lane l
  auto largest = [&](int64_t j, int64_t l) {
    return S[((insertion && !from_top) ? n - j : j - 1) * L + l];
  };
  // The lanes' starts; lanes not solved keep m = t = 0 and inv = 1 (harmless arithmetic).
  Lanes<L> z;
  bool active[L], done[L];
  int64_t evaluations[L];
  alignas(64) double last[5][L], F_last[L];  // the sums and residual of a lane's last evaluation
  const double flush = double(n_row) / double(fi::max());  // (the whole row's, as in _evaluate)
  int64_t live = 0;
  for (int64_t l = 0; l < L; ++l) {
    m[l] = t[l] = 0;
    inv[l] = 1;
    active[l] = done[l] = false;
    evaluations[l] = 0;
    for (int64_t c = 0; c < 5; ++c) last[c][l] = 0;
    F_last[l] = 0;
    const double kb = z.kb[l] = k_row[l];
    const scalar_t e = e_row[l];
    z.e[l] = e;
    z.t[l] = z.lo[l] = z.hi[l] = z.f_lo[l] = z.f_hi[l] = z.side[l] = z.floor[l] = z.on[l] = 0;
    if (!solve[l]) continue;
    Iterate<scalar_t> it;
    start(largest(j_hi[l], l), largest(j_lo[l], l), kb, e, n_fin[l], total[l], lo_x[l], hi_x[l],
          lane_logs[l], m[l], it);
    t[l] = it.t, z.t[l] = it.t, z.lo[l] = it.lo, z.hi[l] = it.hi;
    z.f_lo[l] = it.f_lo, z.f_hi[l] = it.f_hi, z.side[l] = it.side;
    z.floor[l] = std::min(std::max(std::min(kb, n_row - kb), 0.0), 1.0);
    z.on[l] = 1;
    active[l] = true;
    ++live;
  }
  if (live == 0) return;
  // 1 / eps on the lanes solved (1 on the others)
  for (int64_t l = 0; l < L; ++l) inv[l] = active[l] ? e_row[l] : scalar_t(1);
  const Vec vinv = one / Vec::loadu(inv);
  vinv.store(inv);
  const Vec vm = Vec::loadu(m);
  for (int64_t j = 0; j < n; ++j) {
    const Vec a = Vec::loadu(X + j * L) - vm;
    (zero - (a * vinv).abs()).exp().store(E + j * L);
  }
  const Vec vsmall(fi::min());
  const int all = (1 << L) - 1;
  // One evaluation of every lane at its t: the five sums per lane (signed u, u, d, signed c,
  // count) into sums, A and s into At and St in the lanes of `keep` (all bits set: every lane).
  // The lanes in `unfactored`, and the entries the factors do not cover (between m and t, tiny
  // E), take the direct exp, the others the product of E and the lane's factor (up or down).
  auto evaluate_lanes = [&](const Vec& unfactored, const Vec& keep, double (*sums)[L]) {
    const Vec vt = Vec::loadu(t), vup = Vec::loadu(up), vdown = Vec::loadu(down);
    const bool every = keep.zero_mask() == 0;
    Vec a_signed(0), a_u(0), a_d(0), a_c(0), a_count(0);
    for (int64_t c = 0; c < 5; ++c) {
      for (int64_t l = 0; l < L; ++l) sums[c][l] = 0;
    }
    auto flush_lanes = [&]() {
      const Vec* accs[5] = {&a_signed, &a_u, &a_d, &a_c, &a_count};
      alignas(64) scalar_t lanes[L];
      for (int64_t c = 0; c < 5; ++c) {
        accs[c]->store(lanes);
        for (int64_t l = 0; l < L; ++l) sums[c][l] += lanes[l];
      }
      a_signed = a_u = a_d = a_c = a_count = zero;
    };
    for (int64_t j = 0; j < n; ++j) {
      const Vec a = Vec::loadu(X + j * L) - vm;
      const Vec off = a - vt;
      const Vec pos = off > zero;
      const Vec e = Vec::loadu(E + j * L);
      const Vec mixed = (pos & (a < zero)) | (Vec::blendv(a, zero, pos) > zero) |
                        ((e < vsmall) & (a > vninf)) | unfactored;
      Vec w = e * Vec::blendv(vdown, vup, pos);
      if (mixed.zero_mask() != all) w = Vec::blendv(w, (zero - (off * vinv).abs()).exp(), mixed);
      const Vec u = w / (one + w);
      const Vec d = u * (one - u);
      const Vec c = (one - two * u) * d;
      const Vec A = Vec::blendv(u, one - u, pos), s = d * vinv;
      if (every) {
        A.store(At + j * L);
        s.store(St + j * L);
      } else {
        Vec::blendv(Vec::loadu(At + j * L), A, keep).store(At + j * L);
        Vec::blendv(Vec::loadu(St + j * L), s, keep).store(St + j * L);
      }
      a_signed = a_signed + Vec::blendv(u, zero - u, pos);
      a_c = a_c + Vec::blendv(c, zero - c, pos);
      a_u = a_u + u;
      a_d = a_d + d;
      a_count = a_count + (pos & one);
      if ((j + 1) % kFlush == 0) flush_lanes();
    }
    if (n % kFlush != 0) flush_lanes();
  };
  const Vec every = zero == zero;
  for (int64_t pass = 0; live && pass < cfg.max_iter; ++pass) {
    // the factors exp(+-t / eps) per lane, where they are well inside the range
    alignas(64) double tz[L], f_up[L], f_down[L];
    for (int64_t l = 0; l < L; ++l) tz[l] = double(t[l]) * double(inv[l]);
    for (int64_t l = 0; l < L; l += VecD::size()) {
      const VecD y = VecD::loadu(tz + l);
      y.exp().store(f_up + l);
      (VecD(0) - y).exp().store(f_down + l);
    }
    for (int64_t l = 0; l < L; ++l) {
      const bool factor = std::abs(tz[l]) <= kFactorMax;
      up[l] = factor ? scalar_t(f_up[l]) : scalar_t(1);
      down[l] = factor ? scalar_t(f_down[l]) : scalar_t(1);
      direct[l] = factor ? 0 : 1;
    }
    alignas(64) double sums[5][L];
    evaluate_lanes(Vec::loadu(direct) > zero, every, sums);
    // the lanes' updates (update(), all lanes at once), then nextafter's rare test and the
    // bookkeeping
    alignas(64) double next[L], F[L];
    int64_t stop, adjacent;
    update_lanes<scalar_t, L>(z, sums, flush, cfg.tol, next, F, stop, adjacent);
    for (int64_t l = 0; l < L; ++l) {
      if (!active[l]) continue;
      ++evaluations[l];
      const scalar_t lo = scalar_t(z.lo[l]), hi = scalar_t(z.hi[l]);
      if ((stop >> l & 1) || ((adjacent >> l & 1) && std::nextafter(lo, hi) >= hi)) {
        active[l] = false, done[l] = true, z.on[l] = 0, --live;
        for (int64_t c = 0; c < 5; ++c) last[c][l] = sums[c][l];
        F_last[l] = F[l];
      } else {
        z.t[l] = next[l];
        t[l] = scalar_t(next[l]);
      }
    }
  }
  // The lanes near the hard limit (as _ot._near_rows sees them: finish()), polished and
  // evaluated anew (directly) at their new t.
  alignas(64) scalar_t near[L], lo[L], hi[L], gap[L], den[L];
  bool some = false;
  for (int64_t l = 0; l < L; ++l) {
    near[l] = 0;
    den[l] = backward_den(last[2][l], e_row[l]);
    if (l < rows && done[l] && near_hard(den[l], e_row[l])) {
      near[l] = 1, some = true;
    }
    lo[l] = scalar_t(z.lo[l]), hi[l] = scalar_t(z.hi[l]);
    gap[l] = scalar_t(last[4][l]) - k_row[l];
  }
  if (some) {
    const Vec polished = Vec::loadu(near) > zero;
    alignas(64) scalar_t going[L];
    std::copy(near, near + L, going);
    const int steps = polish_lanes<scalar_t, L>(X, n, m, t, lo, hi, e_row, gap, going);
    for (int64_t l = 0; l < rows; ++l) {
      if (going[l] == 0 || steps >= kPolishSteps) continue;
      t[l] = polish(px + (b0 + l) * n_row + j0, n, m[l], t[l], lo[l], hi[l], e_row[l], gap[l],
                    kPolishSteps - steps);
    }
    alignas(64) double sums[5][L];
    evaluate_lanes(polished, polished, sums);
    for (int64_t l = 0; l < L; ++l) {
      if (near[l] == 0) continue;
      for (int64_t c = 0; c < 5; ++c) last[c][l] = sums[c][l];
      F_last[l] = sums[0][l] + (sums[4][l] - double(k_row[l]));
      den[l] = backward_den(last[2][l], e_row[l]);
    }
  }
  for (int64_t l = 0; l < rows; ++l) {
    out[l][4] = double(evaluations[l]);
    if (!done[l]) continue;  // left: at the start, or capped
    const int64_t b = b0 + l;
    scalar_t* A = pA + b * n_row;
    scalar_t* s = ps + b * n_row;
    std::fill(A, A + j0, scalar_t(0)), std::fill(s, s + j0, scalar_t(0));  // (-inf: 0)
    for (int64_t j = 0; j < n; ++j) A[j0 + j] = At[j * L + l], s[j0 + j] = St[j * L + l];
    std::fill(A + j1, A + n_row, scalar_t(0)), std::fill(s + j1, s + n_row, scalar_t(0));
    out[l][0] = m[l];
    out[l][1] = t[l];
    out[l][2] = den[l];
    out[l][3] = F_last[l];
    out[l][5] = 0;
  }
}

// Returns A and s (B, n); aux (B, 3), the columns m, t and sum s, the backward's (m and t exact
// in x's dtype); the residual (B,); the rows' scale (B,), all 1 (a row that needs scaling is left:
// the operator's output as it is where no row is left); the rows' status (B,) int8 (kSolved, kLeft to the torch code, or filled at
// a limit of k: kNone, kAll or both, see classify()); the most evaluations of a row, the number
// of rows left and the number at a limit, so that the caller reads nothing back. k and eps are
// (B,), any stride (an expanded scalar, say). The outputs are apart so that the caller takes no
// views of them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
           int64_t, int64_t>
threshold_rows(const at::Tensor& x_in, const at::Tensor& k, const at::Tensor& eps, double tol,
               double limit, int64_t max_iter) {
  TORCH_CHECK(x_in.dim() == 2, "threshold_rows: x must be (B, n)");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), n = x.size(1);
  TORCH_CHECK(k.dim() == 1 && eps.dim() == 1 && k.size(0) == B && eps.size(0) == B,
              "threshold_rows: k and eps must be (B,)");
  TORCH_CHECK(k.scalar_type() == x.scalar_type() && eps.scalar_type() == x.scalar_type(),
              "threshold_rows: k and eps must have x's dtype");
  auto A = at::empty_like(x);
  auto s = at::empty_like(x);
  auto aux = at::empty({B, 3}, x.options());
  auto residual = at::empty({B}, x.options());
  auto scale = at::ones({B}, x.options());
  auto status = at::full({B}, kLeft, x.options().dtype(at::kChar));
  if (B == 0 || n == 0) return {A, s, aux, residual, scale, status, 0, B, 0};
  const int64_t k_stride = k.stride(0), eps_stride = eps.stride(0);
  std::vector<int64_t> evaluations(B);
  int8_t* pl = status.data_ptr<int8_t>();
  const Settings cfg{tol, limit, max_iter};
  // A task's least share: rows of about 8192 entries' work, a row's own costs (its start, its
  // updates) counted as 32 entries'.
  const int64_t grain = std::max<int64_t>(1, 8192 / (n + 32));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "threshold_rows", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const scalar_t* pk = k.const_data_ptr<scalar_t>();
    const scalar_t* pe = eps.const_data_ptr<scalar_t>();
    scalar_t* pA = A.data_ptr<scalar_t>();
    scalar_t* ps = s.data_ptr<scalar_t>();
    scalar_t* paux = aux.data_ptr<scalar_t>();
    scalar_t* pr = residual.data_ptr<scalar_t>();
    auto record = [&](int64_t b, const double* row_out) {
      for (int64_t c = 0; c < 3; ++c) paux[b * 3 + c] = scalar_t(row_out[c]);
      pr[b] = scalar_t(row_out[3]);
      evaluations[b] = int64_t(row_out[4]);
      pl[b] = int8_t(row_out[5]);
    };
    constexpr int64_t L = at::vec::Vectorized<scalar_t>::size();
    if (n <= kPackMax) {
      const int64_t groups = (B + L - 1) / L;
      at::parallel_for(0, groups, std::max<int64_t>(1, grain / L), [&](int64_t g0, int64_t g1) {
        Logs logs;
        double group_out[L][6];
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t b0 = g * L, rows = std::min(L, B - b0);
          solve_group<scalar_t>(px, n, b0, rows, pk, k_stride, pe, eps_stride, cfg, pA, ps,
                                group_out, logs);
          for (int64_t l = 0; l < rows; ++l) record(b0 + l, group_out[l]);
        }
      });
      return;
    }
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      Scratch<scalar_t> scratch;
      Logs logs;
      double row_out[6];
      for (int64_t b = b0; b < b1; ++b) {
        solve_row<scalar_t>(px + b * n, n, pk[b * k_stride], pe[b * eps_stride], cfg,
                            pA + b * n, ps + b * n, row_out, scratch, logs);
        record(b, row_out);
      }
    });
  });
  return {A,
          s,
          aux,
          residual,
          scale,
          status,
          *std::max_element(evaluations.begin(), evaluations.end()),
          int64_t(std::count(pl, pl + B, int8_t(kLeft))),
          int64_t(std::count_if(pl, pl + B, [](int8_t c) { return c > kLeft; }))};
}

// s (g - <s, g> / den) per row, one task per block of rows: the backward in x. den is (B,), or
// the last column of a (B, c) tensor (the forward's aux), any stride; g any (B, n) (the expanded
// gradient of a sum is read without a copy). The row's last vector is partial (a lane mask).
at::Tensor vjp_rows(const at::Tensor& s, const at::Tensor& den, const at::Tensor& g_in) {
  TORCH_CHECK(s.dim() == 2 && s.is_contiguous() && den.dim() <= 2 && den.size(0) == s.size(0) &&
                  g_in.sizes() == s.sizes() && g_in.scalar_type() == s.scalar_type() &&
                  den.scalar_type() == s.scalar_type(),
              "vjp_rows: s must be contiguous (B, n), den (B,) or (B, c) and g (B, n), of one dtype");
  const int64_t B = s.size(0), n = s.size(1);
  const bool broadcast = g_in.stride(1) == 0;  // each row of g one value
  const at::Tensor g = broadcast || g_in.stride(1) == 1 ? g_in : g_in.contiguous();
  auto out = at::empty_like(s);
  if (B == 0 || n == 0) return out;
  const int64_t g_row = g.stride(0), den_stride = den.stride(0);
  const int64_t den_offset = den.dim() == 2 ? (den.size(1) - 1) * den.stride(1) : 0;
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "vjp_rows", [&] {
    using Vec = at::vec::Vectorized<scalar_t>;
    constexpr int64_t L = Vec::size();
    const scalar_t* ps = s.const_data_ptr<scalar_t>();
    const scalar_t* pg = g.const_data_ptr<scalar_t>();
    const scalar_t* pd = den.const_data_ptr<scalar_t>() + den_offset;
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / (n + 16));
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* rs = ps + b * n;
        const scalar_t* rg = pg + b * g_row;
        scalar_t* ro = po + b * n;
        // g's entries (one value per row where g is broadcast along it; 0 past the row)
        auto g_vec = [&](int64_t i, int64_t count) {
          if (!broadcast) return Vec::loadu(rg + i, count);
          return count < L ? Vec::set(Vec(0), Vec(rg[0]), count) : Vec(rg[0]);
        };
        Vec acc(0);
        int64_t i = 0;
        for (; i + L <= n; i += L) acc = at::vec::fmadd(Vec::loadu(rs + i), g_vec(i, L), acc);
        if (i < n) {  // (s is 0 past the row)
          acc = at::vec::fmadd(Vec::loadu(rs + i, n - i), g_vec(i, n - i), acc);
        }
        const double dot = lane_sum(acc);
        const scalar_t mean = scalar_t(dot / double(pd[b * den_stride]));  // 0 where den is inf
        const Vec vmean(mean);
        for (i = 0; i + L <= n; i += L) (Vec::loadu(rs + i) * (g_vec(i, L) - vmean)).store(ro + i);
        if (i < n) (Vec::loadu(rs + i, n - i) * (g_vec(i, n - i) - vmean)).store(ro + i, n - i);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(softops_ot, m) {
  m.def(
      "threshold_rows(Tensor x, Tensor k, Tensor eps, float tol, float limit, int max_iter) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int, int)");
  m.def("vjp_rows(Tensor s, Tensor den, Tensor g) -> Tensor");
}

TORCH_LIBRARY_IMPL(softops_ot, CPU, m) {
  m.impl("threshold_rows", &threshold_rows);
  m.impl("vjp_rows", &vjp_rows);
}
