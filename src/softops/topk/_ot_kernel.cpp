// The threshold solve of method "ot" on the CPU, row by row: the fused path's CPU kernel.
//
// Built on first use by softops._core.fused.cpp_ops (torch.utils.cpp_extension, the same C++
// toolchain as torch.compile's CPU backend) and registered as the operators
// softops_ot::threshold_rows and softops_ot::vjp_rows. The arithmetic is that of the torch code
// it replaces (softops/topk/_ot.py: _prepare_exact, _evaluate and the update of
// softops/_core/rootfind.py), in the rows' dtype, with the sums accumulated in double; one row
// per task, the rows spread over torch's intra-op threads (at::parallel_for). An evaluation is
// one vectorised pass (at::vec: the sigmoid, its derivative and curvature, five sums) that takes
// its exponentials from the row's (one exp per entry per solve, see evaluate()), and the
// bracket's order statistics come from a few candidates for the largest (or smallest) entries
// instead of a topk call. Only regular rows are solved: every entry finite, 0 < k < n, epsilon
// within the scaling limit, converged within the cap and not near the hard limit. Every other
// row is flagged and left to the torch code, which handles them all.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

// The sum of a vector's lanes, in double.
template <typename scalar_t>
double lane_sum(const at::vec::Vectorized<scalar_t>& v) {
  scalar_t lanes[at::vec::Vectorized<scalar_t>::size()];
  v.store(lanes);
  double total = 0;
  for (int64_t l = 0; l < at::vec::Vectorized<scalar_t>::size(); ++l) total += lanes[l];
  return total;
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
  scalar_t candidates[kCandidates];
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
      if (!before(edge, x)) {
        if (count == kCandidates) return false;
        candidates[count++] = x;
      }
    }
  }
  for (; i < n; ++i) {
    if (!before(edge, row[i])) {
      if (count == kCandidates) return false;
      candidates[count++] = row[i];
    }
  }
  std::partial_sort(candidates, candidates + size, candidates + count, before);
  std::copy(candidates, candidates + size, buf);
  return true;
}

struct Sums {
  double signed_u = 0, u = 0, d = 0, c_signed = 0, count = 0;
};

// One evaluation at t: the five sums, and A and s = A (1 - A) / eps written for the row.
//
// E holds the row's exponentials exp(-|x - m| / eps), formed by the first evaluation that has E
// (`fill`): an evaluation at t then needs no exp of its own, since exp(-|z|) = exp(-|(x - m) -
// t| / eps) is E exp(t / eps) (f_up) on the entries above t with x - m >= 0, and E exp(-t / eps)
// (f_down) on those at or below t with x - m <= 0: one exp per entry per solve instead of one per
// evaluation. A vector holding an entry between m and t (x - m and (x - m) - t of opposite
// signs), or one whose E is subnormal (the product would lose the precision the direct exp
// keeps), is evaluated directly, as is every vector without E.
template <typename scalar_t>
Sums evaluate(const scalar_t* row, int64_t n, scalar_t m, scalar_t t, scalar_t inv, scalar_t* E,
              bool fill, scalar_t f_up, scalar_t f_down, scalar_t* A, scalar_t* s) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = Vec::size();
  const scalar_t small = std::numeric_limits<scalar_t>::min();
  const Vec vm(m), vt(t), vinv(inv), one(1), two(2), zero(0), vup(f_up), vdown(f_down);
  const Vec vsmall(small);
  const int all = (1 << L) - 1;
  Sums out;
  Vec a_signed(0), a_u(0), a_d(0), a_c(0), a_count(0);
  auto flush = [&](Vec& acc, double& total) {
    total += lane_sum(acc);
    acc = zero;
  };
  int64_t i = 0, block = 0;
  for (; i + L <= n; i += L) {
    Vec a = Vec::loadu(row + i) - vm;
    Vec off = a - vt;
    Vec pos = off > zero;  // all bits set where z > 0
    Vec w;
    bool direct = E == nullptr;
    if (!direct) {
      Vec e;
      if (fill) {  // the first evaluation forms the row's exponentials
        e = (zero - (a * vinv).abs()).exp();
        e.store(E + i);
      } else {
        e = Vec::loadu(E + i);
      }
      // the factor's side, and the entries it does not cover (between m and t, or tiny E)
      Vec mixed = (pos & (a < zero)) | (Vec::blendv(a, zero, pos) > zero) | (e < vsmall);
      direct = mixed.zero_mask() != all;
      w = e * Vec::blendv(vdown, vup, pos);
    }
    if (direct) w = (zero - (off * vinv).abs()).exp();
    Vec u = w / (one + w);
    Vec d = u * (one - u);
    Vec c = (one - two * u) * d;
    Vec::blendv(u, one - u, pos).store(A + i);
    (d * vinv).store(s + i);
    a_signed = a_signed + Vec::blendv(u, zero - u, pos);
    a_c = a_c + Vec::blendv(c, zero - c, pos);
    a_u = a_u + u;
    a_d = a_d + d;
    a_count = a_count + (pos & one);
    if (++block == kFlush) {
      flush(a_signed, out.signed_u), flush(a_u, out.u), flush(a_d, out.d);
      flush(a_c, out.c_signed), flush(a_count, out.count);
      block = 0;
    }
  }
  flush(a_signed, out.signed_u), flush(a_u, out.u), flush(a_d, out.d);
  flush(a_c, out.c_signed), flush(a_count, out.count);
  for (; i < n; ++i) {
    scalar_t off = (row[i] - m) - t;
    scalar_t w = std::exp(-std::abs(off * inv));
    if (E != nullptr && fill) E[i] = std::exp(-std::abs((row[i] - m) * inv));
    scalar_t u = w / (scalar_t(1) + w);
    scalar_t d = u * (scalar_t(1) - u);
    scalar_t c = (scalar_t(1) - scalar_t(2) * u) * d;
    bool pos = off > 0;
    A[i] = pos ? scalar_t(1) - u : u;
    s[i] = d * inv;
    out.signed_u += pos ? -u : u;
    out.c_signed += pos ? -c : c;
    out.u += u;
    out.d += d;
    out.count += pos ? 1 : 0;
  }
  return out;
}

// Solves one row; writes out[0..5] = m, t, sum s (inf where 0), the residual, the evaluations
// and the status (0 solved, 1 left to the torch code).
template <typename scalar_t>
void solve_row(const scalar_t* row, int64_t n, scalar_t k_row, scalar_t eps_row, double tol,
               double limit, int64_t max_iter, scalar_t* A, scalar_t* s, double* out,
               std::vector<scalar_t>& work) {
  using Vec = at::vec::Vectorized<scalar_t>;
  using fi = std::numeric_limits<scalar_t>;
  const scalar_t em = fi::epsilon(), big = fi::max();
  const double kb = k_row;
  const scalar_t e = eps_row;
  for (int64_t c = 0; c < 6; ++c) out[c] = 0;
  out[5] = 1;
  if (!(kb > 0 && kb < n && e > 0 && e <= limit)) return;
  // Finite entries, their sum, min and max: one pass (inf - inf and NaN - NaN are NaN).
  Vec v_fin(0), v_sum(0), v_min(fi::infinity()), v_max(-fi::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec v = Vec::loadu(row + i);
    v_fin = v_fin + (v - v);
    v_sum = v_sum + v;
    v_min = at::vec::minimum(v_min, v);
    v_max = at::vec::maximum(v_max, v);
  }
  double fin = lane_sum(v_fin), total = lane_sum(v_sum);
  scalar_t lo_x = at::vec::vec_reduce_all<scalar_t>(
      [](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, v_min);
  scalar_t hi_x = at::vec::vec_reduce_all<scalar_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v_max);
  for (; i < n; ++i) {
    fin += row[i] - row[i];
    total += row[i];
    lo_x = std::min(lo_x, row[i]);
    hi_x = std::max(hi_x, row[i]);
  }
  if (!(fin == 0)) return;  // an infinity or a NaN
  // The bracket's order statistics: the j_hi-th and j_lo-th largest (docs/math.md §1.3).
  const double j_hi = std::max(std::ceil(kb), 1.0);
  const double j_lo = std::max(std::min(std::floor(kb) + 1.0, double(n)), 1.0);
  const int64_t jl = int64_t(j_lo), jh = int64_t(j_hi);
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
    work.assign(row, row + n);
    auto desc = [](scalar_t a, scalar_t b) { return a > b; };
    std::nth_element(work.begin(), work.begin() + (jl - 1), work.end(), desc);
    x_lo = work[jl - 1];
    x_hi = jh == jl ? x_lo : *std::min_element(work.begin(), work.begin() + jl - 1);
  }
  const scalar_t m = scalar_t(0.5) * x_hi + scalar_t(0.5) * x_lo;
  double lo_d = double(x_lo - m) - double(e) * (std::log(kb) - std::log(j_lo - kb));
  double hi_d = double(x_hi - m) - double(e) * (std::log(kb - (j_hi - 1.0)) - std::log(n - kb));
  const double pad = 4.0 * em * (std::abs(lo_d) + std::abs(hi_d) + e);
  scalar_t lo = scalar_t(std::max(lo_d - pad, -double(big)));
  scalar_t hi = scalar_t(std::min(hi_d + pad, double(big)));
  double t_d = 0;
  if (8.0 * e >= double(hi_x) - double(lo_x)) {  // the large-epsilon start
    t_d = total / n - m - double(e) * (std::log(kb) - std::log(n - kb));
  }
  scalar_t t = scalar_t(std::min(std::max(t_d, double(lo)), double(hi)));
  double f_lo = n - kb, f_hi = -kb, side = 0;
  const scalar_t inv = scalar_t(1) / e;
  const double floor = std::min(std::max(std::min(kb, n - kb), 0.0), 1.0);
  const double flush = double(n) / double(big);
  bool done = false;
  int64_t evaluations = 0;
  double F = 0, d_sum = 0;
  work.resize(n);
  bool filled = false;
  while (evaluations < max_iter) {
    // the factors exp(+-t / eps), where they are well inside the range (else the direct exp)
    const double tz = double(t) * double(inv);
    const bool factor = std::abs(tz) <= kFactorMax;
    scalar_t* E = factor ? work.data() : nullptr;
    const bool fill = factor && !filled;
    filled = filled || factor;
    const scalar_t f_up = factor ? scalar_t(std::exp(tz)) : scalar_t(1);
    const scalar_t f_down = factor ? scalar_t(std::exp(-tz)) : scalar_t(1);
    Sums sums = evaluate(row, n, m, t, inv, E, fill, f_up, f_down, A, s);
    ++evaluations;
    d_sum = sums.d;
    F = sums.signed_u + (sums.count - kb);
    const double slope = d_sum / e;
    const double bound = 32.0 * em * std::max(sums.u, floor) +
                         2.0 * em * slope * std::abs(double(t)) + flush + tol;
    // the update (rootfind._update): the bracket, Illinois' rule, Halley then Newton's step
    done = std::abs(F) <= bound;
    const bool up = F > 0, down = F < 0;
    if (up && side > 0) f_hi *= 0.5;
    if (down && side < 0) f_lo *= 0.5;
    if (up) lo = t, f_lo = F;
    if (down) hi = t, f_hi = F;
    side = up ? 1.0 : (down ? -1.0 : 0.0);
    double newton = slope > 0 ? F / -slope : std::nan("");
    if (d_sum > 0) {
      const double ratio = newton * (-sums.c_signed / d_sum / e);
      if (std::abs(ratio) <= 1) newton = newton / (1 - 0.5 * ratio);
    }
    scalar_t step = scalar_t(double(t) - newton);
    if (!(step >= lo && step <= hi)) {
      const double secant = double(lo) + (double(hi) - double(lo)) * (f_lo / (f_lo - f_hi));
      step = (secant > lo && secant < hi) ? scalar_t(secant) : scalar_t(0.5) * (lo + hi);
    }
    const scalar_t width = hi - lo;
    const bool collapsed = width <= 4 * em * std::max(std::abs(lo), std::abs(hi)) ||
                           std::nextafter(lo, hi) >= hi;
    done = done || step == t || collapsed;
    if (done) break;
    t = step;
  }
  // capped, or near the hard limit (where t must be placed in its gap: the torch code polishes)
  if (!done || d_sum < 32.0 * std::sqrt(double(em))) return;
  out[0] = m;
  out[1] = t;
  out[2] = d_sum > 0 ? d_sum / e : std::numeric_limits<double>::infinity();
  out[3] = F;
  out[4] = double(evaluations);
  out[5] = 0;
}

// Returns A and s (B, n); aux (B, 3), the columns m, t and sum s, the backward's (m and t exact
// in x's dtype); the residual (B,); the rows' convergence (B,), all true (a row that would not
// converge is left); the rows left to the torch code (B,); the most evaluations of a row and the
// number of rows left, so that the caller reads nothing back. k and eps are (B,), any stride (an
// expanded scalar, say). The outputs are apart so that the caller takes no views of them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
           int64_t>
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
  auto converged = at::ones({B}, x.options().dtype(at::kBool));
  auto left_rows = at::empty({B}, x.options().dtype(at::kBool));
  if (B == 0 || n == 0) return {A, s, aux, residual, converged, left_rows, 0, 0};
  const int64_t k_stride = k.stride(0), eps_stride = eps.stride(0);
  std::vector<int64_t> evaluations(B);
  bool* pl = left_rows.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "threshold_rows", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const scalar_t* pk = k.const_data_ptr<scalar_t>();
    const scalar_t* pe = eps.const_data_ptr<scalar_t>();
    scalar_t* pA = A.data_ptr<scalar_t>();
    scalar_t* ps = s.data_ptr<scalar_t>();
    scalar_t* paux = aux.data_ptr<scalar_t>();
    scalar_t* pr = residual.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 8192 / n);
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      std::vector<scalar_t> work;
      double row_out[6];
      for (int64_t b = b0; b < b1; ++b) {
        solve_row<scalar_t>(px + b * n, n, pk[b * k_stride], pe[b * eps_stride], tol, limit,
                            max_iter, pA + b * n, ps + b * n, row_out, work);
        for (int64_t c = 0; c < 3; ++c) paux[b * 3 + c] = scalar_t(row_out[c]);
        pr[b] = scalar_t(row_out[3]);
        evaluations[b] = int64_t(row_out[4]);
        pl[b] = row_out[5] != 0;
      }
    });
  });
  return {A,
          s,
          aux,
          residual,
          converged,
          left_rows,
          *std::max_element(evaluations.begin(), evaluations.end()),
          int64_t(std::count(pl, pl + B, true))};
}

// s (g - <s, g> / den) per row, one task per block of rows: the backward in x. den is (B,), or
// the last column of a (B, c) tensor (the forward's aux), any stride; g any (B, n) (the expanded
// gradient of a sum is read without a copy).
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
    const int64_t grain = std::max<int64_t>(1, 16384 / n);
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* rs = ps + b * n;
        const scalar_t* rg = pg + b * g_row;
        scalar_t* ro = po + b * n;
        // g's entries (one value per row where g is broadcast along it)
        auto g_vec = [&](int64_t i) { return broadcast ? Vec(rg[0]) : Vec::loadu(rg + i); };
        auto g_at = [&](int64_t i) { return broadcast ? rg[0] : rg[i]; };
        Vec acc(0);
        int64_t i = 0;
        for (; i + L <= n; i += L) acc = at::vec::fmadd(Vec::loadu(rs + i), g_vec(i), acc);
        double dot = lane_sum(acc);
        for (; i < n; ++i) dot += double(rs[i]) * double(g_at(i));
        const scalar_t mean = scalar_t(dot / double(pd[b * den_stride]));  // 0 where den is inf
        const Vec vmean(mean);
        for (i = 0; i + L <= n; i += L) (Vec::loadu(rs + i) * (g_vec(i) - vmean)).store(ro + i);
        for (; i < n; ++i) ro[i] = rs[i] * (g_at(i) - mean);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(softops_ot, m) {
  m.def(
      "threshold_rows(Tensor x, Tensor k, Tensor eps, float tol, float limit, int max_iter) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int)");
  m.def("vjp_rows(Tensor s, Tensor den, Tensor g) -> Tensor");
}

TORCH_LIBRARY_IMPL(softops_ot, CPU, m) {
  m.impl("threshold_rows", &threshold_rows);
  m.impl("vjp_rows", &vjp_rows);
}
