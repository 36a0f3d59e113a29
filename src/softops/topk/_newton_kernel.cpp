// The Newton-first solve of softops._core.sinkhorn (newton_first=True, the sorted top-k's full
// problem) and the implicit backward of the sorted top-k's plan (softops.topk._sorted.
// _SortedPlan), row by row on the CPU: the arithmetic of the torch code they replace
// (sinkhorn's _semidual, _newton_state, _newton_direction, _residual, _finalize_state and
// implicit_cost_vjp's closed form and Cholesky), in double, each row on its own. A small problem
// (a beam step's (64, 18, 3)) is a few hundred tensor operations of a few microseconds each in
// torch, one call here.
//
// Built ahead of time by `python -m softops._kernels` and registered as the operators
// softops_newton::*; softops/_core/sinkhorn.py wraps them in the operators of the kernel layer
// (softops._kernels.define), whose torch references are its torch code. Rows the kernels leave
// (a zero mass, not converged, a singular system) are flagged for the torch code.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Rows per task of at::parallel_for: about this many (entries x targets) of work, a millisecond or
// so. A smaller task costs more than it saves where the other threads are not idle: waking them
// (a busy machine's time slice) took 50x a (33, 128) call's whole solve with two threads.
constexpr int64_t kGrainWork = int64_t{1} << 18;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kTiny = std::numeric_limits<double>::min();
constexpr double kEps64 = std::numeric_limits<double>::epsilon();

// K^-1 gap into delta (m,), its last entry 0, for the grounded Laplacian K of the couplings
// w_jl = sum_i a_i P_ij P_il of p (m, n) (the reduced Newton step of sinkhorn's
// _newton_direction; with a = mu the system of the implicit backward): in closed form (Cramer,
// grounded at the last column) for m <= 3, else by the equilibrated Cholesky with a relative
// jitter (retried once, larger). Returns det K for m <= 3 (delta NaN where it is not positive);
// for m > 3, 1 where the factorisation succeeded, else 0 (delta NaN).
double direction(const double* a, const double* p, int64_t m, int64_t n, const double* gap,
                 double* delta, std::vector<double>& kmat, std::vector<double>& chol) {
  const int64_t m1 = m - 1;
  for (int64_t j = 0; j < m; ++j) delta[j] = 0.0;
  auto coupling = [&](int64_t j, int64_t l) {
    const double* pj = p + j * n;
    const double* pl = p + l * n;
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * pj[i] * pl[i];
    return acc;
  };
  if (m == 2) {
    const double w01 = coupling(0, 1);
    delta[0] = w01 > 0 ? gap[0] / w01 : kNaN;
    return w01;
  }
  if (m == 3) {
    const double w01 = coupling(0, 1), w12 = coupling(1, 2), w20 = coupling(2, 0);
    const double det = w01 * (w12 + w20) + w12 * w20;
    if (!(det > 0)) {
      delta[0] = delta[1] = kNaN;
      return det;
    }
    const double r0 = gap[0], r1 = gap[1];
    delta[0] = (w01 * (r0 + r1) + w12 * r0) / det;
    delta[1] = (w01 * (r0 + r1) + w20 * r1) / det;
    return det;
  }
  kmat.assign(static_cast<size_t>(m1 * m1), 0.0);
  chol.resize(static_cast<size_t>(m1 * m1));
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t c = j + 1; c < m; ++c) {
      const double w = coupling(j, c);
      if (j < m1) kmat[j * m1 + j] += w;
      if (c < m1) {
        kmat[c * m1 + c] += w;
        if (j < m1) {
          kmat[j * m1 + c] -= w;
          kmat[c * m1 + j] -= w;
        }
      }
    }
  }
  std::vector<double> scale(static_cast<size_t>(m1)), y(static_cast<size_t>(m1));
  for (int64_t j = 0; j < m1; ++j) {
    const double d = kmat[j * m1 + j];
    scale[j] = d > 0 ? 1.0 / std::sqrt(d) : 1.0;
  }
  for (const double tau : {16.0 * std::max<int64_t>(m1, 4) * kEps64, 1e-10}) {
    bool ok = true;
    for (int64_t j = 0; j < m1 && ok; ++j) {
      for (int64_t c = 0; c <= j; ++c) {
        double acc = kmat[j * m1 + c] * scale[j] * scale[c] + (j == c ? tau : 0.0);
        for (int64_t q = 0; q < c; ++q) acc -= chol[j * m1 + q] * chol[c * m1 + q];
        if (j == c) {
          if (!(acc > 0)) {
            ok = false;
            break;
          }
          chol[j * m1 + j] = std::sqrt(acc);
        } else {
          chol[j * m1 + c] = acc / chol[c * m1 + c];
        }
      }
    }
    if (ok) {
      for (int64_t j = 0; j < m1; ++j) {
        double acc = gap[j] * scale[j];
        for (int64_t q = 0; q < j; ++q) acc -= chol[j * m1 + q] * y[q];
        y[j] = acc / chol[j * m1 + j];
      }
      for (int64_t j = m1 - 1; j >= 0; --j) {
        double acc = y[j];
        for (int64_t q = j + 1; q < m1; ++q) acc -= chol[q * m1 + j] * delta[q];
        delta[j] = acc / chol[j * m1 + j];
      }
      for (int64_t j = 0; j < m1; ++j) delta[j] *= scale[j];
      return 1.0;
    }
  }
  for (int64_t j = 0; j < m1; ++j) delta[j] = kNaN;
  return 0.0;
}

// P = softmax_j(v_j - s_ji) into p (m, n); the gap b - c relative to each entry's reference
// column into gap (m,) (sinkhorn's _newton_state); returns its L1 norm.
double full_state(const double* s, const double* a, const double* b_ref, const int64_t* ref,
                  const double* v, int64_t m, int64_t n, double* p, double* gap) {
  for (int64_t j = 0; j < m; ++j) gap[j] = b_ref[j];
  for (int64_t i = 0; i < n; ++i) {
    double top = -kInf;
    for (int64_t j = 0; j < m; ++j) {
      const double z = v[j] - s[j * n + i];
      p[j * n + i] = z;
      top = std::max(top, z);
    }
    double total = 0.0;
    for (int64_t j = 0; j < m; ++j) {
      const double e = top > -kInf ? std::exp(p[j * n + i] - top) : kNaN;
      p[j * n + i] = e;
      total += e;
    }
    double off = 0.0;
    const int64_t r = ref[i];
    for (int64_t j = 0; j < m; ++j) {
      p[j * n + i] /= total;
      if (j != r) {
        off += p[j * n + i];
        gap[j] -= a[i] * p[j * n + i];
      }
    }
    gap[r] += a[i] * off;
  }
  double l1 = 0.0;
  for (int64_t j = 0; j < m; ++j) l1 += std::abs(gap[j]);
  return l1;
}

// Semi-dual Newton from one Sinkhorn update of v = 0 for every row of s (B, m, n) (cost /
// epsilon), row and column log-masses log_a (B, n) and log_b (B, m): (the column-exact plan
// a_i P_ij (1 + ratio_j) (B, m, n), v (B, m), ratio (b - c)/c (B, m), the relative L1 row error
// (B,), the steps (B,) int64). Full steps while the bound sum_j |b_j - c_j| / sum_i a_i is above
// tol and each step lowers it; a row with a zero (or non-finite) mass is not solved (err NaN).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> newton_first_rows(
    const at::Tensor& s_in, const at::Tensor& log_a_in, const at::Tensor& log_b_in, double tol,
    int64_t max_steps) {
  const at::Tensor s = s_in.to(at::kDouble).contiguous();
  const at::Tensor log_a = log_a_in.to(at::kDouble).contiguous();
  const at::Tensor log_b = log_b_in.to(at::kDouble).contiguous();
  const int64_t B = s.size(0), m = s.size(1), n = s.size(2);
  auto f64 = s.options();
  at::Tensor plan = at::empty({B, m, n}, f64);
  at::Tensor v_out = at::empty({B, m}, f64);
  at::Tensor ratio_out = at::empty({B, m}, f64);
  at::Tensor err_out = at::empty({B}, f64);
  at::Tensor steps_out = at::empty({B}, f64.dtype(at::kLong));
  const double* ps = s.data_ptr<double>();
  const double* pla = log_a.data_ptr<double>();
  const double* plb = log_b.data_ptr<double>();
  double* pplan = plan.data_ptr<double>();
  double* pv = v_out.data_ptr<double>();
  double* pr = ratio_out.data_ptr<double>();
  double* pe = err_out.data_ptr<double>();
  int64_t* pst = steps_out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(n * m, 1));
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    std::vector<double> p(m * n), p_new(m * n), a(n), b(m), b_ref(m), gap(m), gap_new(m), v(m),
        v_new(m), delta(m), kmat, chol;
    std::vector<int64_t> ref(n);
    for (int64_t row = b0; row < b1; ++row) {
      const double* sr = ps + row * m * n;
      bool regular = true;
      double a_sum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        a[i] = std::exp(pla[row * n + i]);
        a_sum += a[i];
        regular = regular && a[i] > 0 && std::isfinite(a[i]);
      }
      for (int64_t j = 0; j < m; ++j) {
        b[j] = std::exp(plb[row * m + j]);
        regular = regular && b[j] > 0 && std::isfinite(b[j]);
      }
      if (!regular) {
        pe[row] = kNaN;
        pst[row] = 0;
        for (int64_t j = 0; j < m; ++j) pv[row * m + j] = pr[row * m + j] = kNaN;
        for (int64_t q = 0; q < m * n; ++q) pplan[row * m * n + q] = kNaN;
        continue;
      }
      // the start: one column update of v = 0; each entry's reference column is its cheapest
      for (int64_t j = 0; j < m; ++j) {
        gap[j] = 0.0;  // c(0)_j = sum_i a_i softmax_j(-s_ij)
        b_ref[j] = b[j];
      }
      for (int64_t i = 0; i < n; ++i) {
        double top = -kInf;
        for (int64_t j = 0; j < m; ++j) top = std::max(top, -sr[j * n + i]);
        double total = 0.0;
        for (int64_t j = 0; j < m; ++j) total += std::exp(-sr[j * n + i] - top);
        for (int64_t j = 0; j < m; ++j) gap[j] += a[i] * std::exp(-sr[j * n + i] - top) / total;
      }
      for (int64_t j = 0; j < m; ++j) v[j] = std::log(b[j]) - std::log(std::max(gap[j], kTiny));
      for (int64_t i = 0; i < n; ++i) {
        int64_t best = 0;
        for (int64_t j = 1; j < m; ++j) {
          if (sr[j * n + i] < sr[best * n + i]) best = j;
        }
        ref[i] = best;
        b_ref[best] -= a[i];
      }
      double l1 = full_state(sr, a.data(), b_ref.data(), ref.data(), v.data(), m, n, p.data(),
                             gap.data());
      const double tol_mass = tol * a_sum;
      int64_t steps = 0;
      while (l1 > tol_mass && steps < max_steps) {
        direction(a.data(), p.data(), m, n, gap.data(), delta.data(), kmat, chol);
        for (int64_t j = 0; j < m; ++j) v_new[j] = v[j] + delta[j];
        const double l1_new = full_state(sr, a.data(), b_ref.data(), ref.data(), v_new.data(),
                                         m, n, p_new.data(), gap_new.data());
        ++steps;
        if (!(l1_new < l1)) break;  // the step did not lower the bound (or is not finite)
        std::swap(p, p_new);
        std::swap(gap, gap_new);
        std::swap(v, v_new);
        l1 = l1_new;
      }
      // the residual of the column-exact plan, and the plan
      double* ratio = pr + row * m;
      for (int64_t j = 0; j < m; ++j) {
        ratio[j] = gap[j] / std::max(b[j] - gap[j], kTiny);
        pv[row * m + j] = v[j];
      }
      double err = 0.0;
      double* out = pplan + row * m * n;
      for (int64_t i = 0; i < n; ++i) {
        double dev = 0.0;
        for (int64_t j = 0; j < m; ++j) {
          dev += ratio[j] * p[j * n + i];
          out[j * n + i] = a[i] * p[j * n + i] * (ratio[j] + 1.0);
        }
        err += a[i] * std::abs(dev);
      }
      pe[row] = err / a_sum;
      pst[row] = steps;
    }
  });
  return {plan, v_out, ratio_out, err_out, steps_out};
}

// u_ji - sum_l P_li u_li into out (m, n), each entry first shifted by its value at the entry's
// home column (its largest P): without cancellation.
void centred_at(const double* p, const double* u, const int64_t* home, int64_t m, int64_t n,
                double* out) {
  for (int64_t i = 0; i < n; ++i) {
    const double r = u[home[i] * n + i];
    double mean = 0.0;
    for (int64_t j = 0; j < m; ++j) {
      out[j * n + i] = u[j * n + i] - r;
      mean += p[j * n + i] * out[j * n + i];
    }
    for (int64_t j = 0; j < m; ++j) out[j * n + i] -= mean;
  }
}

// The implicit VJP of the converged plans (B, m, n) for the cotangents grad (B, m, n), in units
// of epsilon, contracted as the sorted top-k's backward needs it: (grad_s (B, n) = sum_j slopes_j
// G_ji / eps; grad_eps (B,) = -<G, scaled> / eps over the finite entries of scaled (B, m, n),
// 0 where scaled is empty; safe (B,) bool). K is the grounded Laplacian of w_jl = sum_i mu_i P_ij
// P_il (P = Gamma / mu), solved in closed form for m <= 3 (safe where det K > det_min) and by
// the jittered Cholesky with one refinement against the exactly formed residual above.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sorted_vjp_rows(
    const at::Tensor& plan_in, const at::Tensor& grad_in, const at::Tensor& scaled_in,
    const at::Tensor& slopes_in, const at::Tensor& eps_in, double det_min) {
  const at::Tensor plan = plan_in.to(at::kDouble).contiguous();
  const at::Tensor grad = grad_in.to(at::kDouble).contiguous();
  const at::Tensor slopes = slopes_in.to(at::kDouble).contiguous();
  const at::Tensor eps = eps_in.to(at::kDouble).contiguous();
  const int64_t B = plan.size(0), m = plan.size(1), n = plan.size(2);
  const bool with_eps = scaled_in.dim() == 3 && scaled_in.size(0) == B && B > 0;
  const at::Tensor scaled = with_eps ? scaled_in.to(at::kDouble).contiguous() : scaled_in;
  auto f64 = plan.options();
  at::Tensor grad_s = at::empty({B, n}, f64);
  at::Tensor grad_eps = at::zeros({B}, f64);
  at::Tensor safe = at::empty({B}, f64.dtype(at::kBool));
  const double* pplan = plan.data_ptr<double>();
  const double* pgrad = grad.data_ptr<double>();
  const double* psl = slopes.data_ptr<double>();
  const double* peps = eps.data_ptr<double>();
  const double* psc = with_eps ? scaled.data_ptr<double>() : nullptr;
  double* pgs = grad_s.data_ptr<double>();
  double* pge = grad_eps.data_ptr<double>();
  bool* psafe = safe.data_ptr<bool>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(n * m, 1));
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    std::vector<double> mu(n), p(m * n), cen(m * n), u(m * n), rhs(m), beta(m), step(m), kmat,
        chol;
    std::vector<int64_t> home(n);
    for (int64_t row = b0; row < b1; ++row) {
      const double* gam = pplan + row * m * n;
      const double* gb = pgrad + row * m * n;
      for (int64_t i = 0; i < n; ++i) {
        double total = 0.0;
        for (int64_t j = 0; j < m; ++j) total += gam[j * n + i];
        mu[i] = total;
        int64_t best = 0;
        for (int64_t j = 0; j < m; ++j) {
          p[j * n + i] = gam[j * n + i] / std::max(total, kTiny);
          if (p[j * n + i] > p[best * n + i]) best = j;
        }
        home[i] = best;
      }
      auto project = [&](const double* src) {
        centred_at(p.data(), src, home.data(), m, n, cen.data());
        for (int64_t j = 0; j < m; ++j) {
          double acc = 0.0;
          for (int64_t i = 0; i < n; ++i) acc += gam[j * n + i] * cen[j * n + i];
          rhs[j] = acc;
        }
      };
      project(gb);
      const double det = direction(mu.data(), p.data(), m, n, rhs.data(), beta.data(), kmat, chol);
      if (m > 3 && det > 0) {  // one refinement: beta += K^-1 (rhs - K beta), formed exactly
        for (int64_t j = 0; j < m; ++j) {
          for (int64_t i = 0; i < n; ++i) u[j * n + i] = gb[j * n + i] - beta[j];
        }
        project(u.data());
        direction(mu.data(), p.data(), m, n, rhs.data(), step.data(), kmat, chol);
        for (int64_t j = 0; j < m; ++j) beta[j] += step[j];
      }
      bool ok = m <= 3 ? det > det_min : det > 0;
      for (int64_t j = 0; j < m; ++j) ok = ok && std::isfinite(beta[j]);
      psafe[row] = ok;
      if (!ok) {
        for (int64_t i = 0; i < n; ++i) pgs[row * n + i] = 0.0;
        continue;
      }
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t i = 0; i < n; ++i) u[j * n + i] = beta[j] - gb[j * n + i];
      }
      centred_at(p.data(), u.data(), home.data(), m, n, cen.data());
      const double e = peps[row];
      double g_e = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        double acc = 0.0;
        for (int64_t j = 0; j < m; ++j) {
          const double g = gam[j * n + i] * cen[j * n + i];
          acc += psl[j] * g;
          if (psc != nullptr) {
            const double c = psc[row * m * n + j * n + i];
            if (std::isfinite(c)) g_e += g * c;
          }
        }
        pgs[row * n + i] = acc / e;
      }
      if (psc != nullptr) pge[row] = -g_e / e;
    }
  });
  return {grad_s, grad_eps, safe};
}

}  // namespace

TORCH_LIBRARY(softops_newton, m) {
  m.def(
      "newton_first_rows(Tensor s, Tensor log_a, Tensor log_b, float tol, int max_steps) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "sorted_vjp_rows(Tensor plan, Tensor grad, Tensor scaled, Tensor slopes, Tensor eps, "
      "float det_min) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(softops_newton, CPU, m) {
  m.impl("newton_first_rows", &newton_first_rows);
  m.impl("sorted_vjp_rows", &sorted_vjp_rows);
}
