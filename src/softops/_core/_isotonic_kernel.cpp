// The PAV kernels of softops._core.isotonic on the CPU, row by row: the projections
// P(s, w) = s - v(s, w) onto the permutahedron with the scans that take their non-finite rows, and
// the L2 VJP in one pass.
//
// Built ahead of time by `python -m softops._kernels` (softops._kernels) and registered as the
// operators softops_isotonic::{permutahedron, l2_vjp}, which the operators of
// softops._core.isotonic run on CPU tensors; the torch code there is their reference, and the
// arithmetic here is its arithmetic: the inputs' dtype in and out, every block statistic and
// comparison in double. The rows spread over torch's intra-op threads (at::parallel_for); a row is
// one sequential stack pass, O(n).
//
// No product below is fused with a following sum (the compiler would form a fused multiply-add
// under -mfma, rounding once where the reference rounds twice, and a pooling decision at an exact
// tie could then differ from the reference's): such products go through rounded().

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLn2 = 0.6931471805599453;  // math.log(2.0)

// x as a double that the compiler must have rounded: a product passed through it is not fused
// with the sum that follows (an empty asm: no instruction).
inline double rounded(double x) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(x));
#endif
  return x;
}

// log(e^p + e^q), exact where p == q (also for equal infinities, where p - q is NaN).
inline double logaddexp(double p, double q) {
  if (p == q) return p + kLn2;
  const double m = std::max(p, q);
  return m + std::log1p(std::exp(-std::abs(p - q)));
}

// c ? a : b, a select on the bits, no jump (the compiler keeps some such ternaries as jumps,
// which data-dependent conditions mispredict about half the time).
inline double pick(bool c, double a, double b) {
  uint64_t x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  const uint64_t mask = uint64_t(0) - uint64_t(c);
  x = (x & mask) | (y & ~mask);
  std::memcpy(&a, &x, sizeof a);
  return a;
}

// a - b, and 0 where a == b (equal infinities too).
inline double diff(double a, double b) { return a == b ? 0.0 : a - b; }

// A work row of n entries, uninitialised (a zeroed std::vector would cost a pass over it: 16 MB
// per call at n = 1e6).
template <typename T>
std::unique_ptr<T[]> work(int64_t n) {
  return std::unique_ptr<T[]>(new T[std::max<int64_t>(n, 1)]);
}

// Rows per task: about `entries` entries of work, a row's own costs counted as 16 entries'.
inline int64_t grain_for(int64_t n, int64_t entries = 32768) {
  return std::max<int64_t>(1, entries / (n + 16));
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2, what, ": expected (B, n) tensors");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), what, ": expected a floating dtype");
}

// --------------------------------------------------------- projections P(s, w) = s - v(s, w)
//
// The projection itself, never v: at |s| >> |w| (a rank at small epsilon) or |w| >> |s| (a sort
// at large epsilon) v = s - w is far larger than P, and s - (s - w) cancels. Each block k keeps a
// reference position ref[k] (its first, where s and w are largest) and its statistics relative to
// it, so that every sum is over small numbers: L2: acc[k] = sum_j (y_j - y_ref) with y = s - w;
// KL: acc[k] = log sum_j e^(s_j - s_ref) and aux[k] = log sum_j e^(w_j - w_ref). A singleton's
// output is w_i exactly, and tied inputs give gaps of exactly 0. Blocks are contiguous, so a
// block's count is the distance to the next block's reference. The positions of s are never
// formed, only its gaps (rank_frame, l2_gaps and kl_gaps below).
//
// Infinities: an infinite s_t is a wide gap to every finite neighbour, so it never pools with
// one; equal infinities pool among themselves, and their block's output is the projection's limit
// there, mean(w_B) (L2) or log mean exp(w_B) (KL). For KL an infinite w is taken too. For L2 an
// infinite w pulls the whole row to it, +inf against -inf is NaN, and so is any row holding a
// NaN: such rows are filled without a pass of PAV.
//
// Rows whose finite magnitudes exceed l2_limit(n) (where a sum of gaps, or a cross-multiplied
// comparison, could overflow) are solved scaled by c, a power of two: the projection is
// positively homogeneous, and the scaling is exact down to the subnormals, where it is not: an
// entry that c brings below the smallest normal number loses bits (a row of subnormal w beside
// s = rho / epsilon near the largest float, the sort at epsilon = finfo.tiny: 7.9e-322 came back
// 6.3e-322). So the blocks and their means are found in the scaled frame, and the output is formed
// in the row's own (exact for a singleton block, where the output is w_r itself); where that
// overflows (a row spanning both signs near the largest float), the scaled output divided by c.

// The largest magnitude that the L2 frame takes unscaled in a row of n: its gaps (at most 4 times
// it) times two counts (at most n**2 / 4) and its sums stay below double's largest.
inline double l2_limit(int64_t n) {
  const double m = double(std::max<int64_t>(n, 1));
  return std::numeric_limits<double>::max() / (8.0 * m * m);
}

template <typename scalar_t>
void fill(scalar_t* out, int64_t* block, int64_t n, double value) {
  for (int64_t j = 0; j < n; ++j) out[j] = scalar_t(value), block[j] = 0;
}

// ------------------------------------------------- the whole projection, sorts included

// The modes of permutahedron() (softops._core.isotonic.PERMUTAHEDRON_MODES).
enum Mode : int64_t {
  kModeKL = 1,        // P_E (else P_Q)
  kModeSortZ = 2,     // sort z here (else it is sorted descending already)
  kModeSortW = 4,     // sort w here
  kModeExp = 8,       // exp P_E(z, log w)
  kModeNegate = 16,   // -P(z, -w), formed as 0 - p
  kModeInv = 32,      // z = u * (1 / eps), the sort (else z = u / f, f = +-eps)
  kModeFlip = 64,     // f = -eps (else eps)
};

// The sort of a row, descending with NaN first and ties in index order (as torch.sort(stable=True,
// descending=True)): each key is mapped to an unsigned integer in the reverse order (NaN lowest,
// -0 as +0), and the (key, index) pairs are sorted ascending: by a sorting network up to 8
// entries, by insertion up to 48, by std::sort up to 256 and by a least-significant-digit radix
// sort (stable, passes whose digit is constant skipped) above; a float32 row of up to 256 entries
// with AVX-512 by bitonic_sort, in registers. A float32 key and its index pack
// into one 64-bit word.
template <typename key_t, typename scalar_t>
key_t descending_key(scalar_t v) {
  static_assert(sizeof(key_t) == sizeof(scalar_t));
  constexpr key_t sign = key_t(1) << (8 * sizeof(key_t) - 1);
  if (v != v) return 0;
  if (v == scalar_t(0)) v = scalar_t(0);
  key_t b;
  std::memcpy(&b, &v, sizeof b);
  return (b & sign) ? b : ~(b | sign);
}

struct Item64 {
  uint64_t key;
  int64_t index;
};

inline uint64_t key_of(uint64_t item) { return item; }
inline uint64_t key_of(const Item64& item) { return item.key; }

// Stable LSD radix sort of items[0 .. n) by the bits [lo, hi) of key_of(item), with digits of 8
// bits (11 above 16384 entries); tmp has n items. Returns the array that holds the result.
template <typename item_t>
item_t* radix_sort(item_t* items, item_t* tmp, int64_t n, int lo, int hi) {
  const int bits = n > 16384 ? 11 : 8, buckets = 1 << bits;
  const uint64_t mask = uint64_t(buckets - 1);
  const int passes = (hi - lo + bits - 1) / bits;
  std::vector<int64_t> count(size_t(passes) * buckets, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = key_of(items[i]);
    for (int q = 0; q < passes; ++q) ++count[q * buckets + ((k >> (lo + q * bits)) & mask)];
  }
  for (int q = 0; q < passes; ++q) {
    int64_t* c = count.data() + q * buckets;
    const int shift = lo + q * bits;
    if (c[(key_of(items[0]) >> shift) & mask] == n) continue;  // one digit: nothing moves
    int64_t total = 0;
    for (int d = 0; d < buckets; ++d) {
      const int64_t m = c[d];
      c[d] = total;
      total += m;
    }
    for (int64_t i = 0; i < n; ++i) tmp[c[(key_of(items[i]) >> shift) & mask]++] = items[i];
    std::swap(items, tmp);
  }
  return items;
}

// The compare-exchange of a sorting network, branch-free (a conditional move, not a jump that
// a row of random keys mispredicts half the time): a, b in ascending order. An Item64 compares by
// key, then index (the index order of ties keeps the sort stable); a packed float32 item is
// distinct from every other (its low word is its index).
inline void exchange(uint64_t& a, uint64_t& b) {
  const uint64_t lo = a < b ? a : b, hi = a < b ? b : a;
  a = lo, b = hi;
}

inline void exchange(Item64& a, Item64& b) {
  const bool swap = b.key < a.key || (b.key == a.key && b.index < a.index);
  const Item64 lo = swap ? b : a, hi = swap ? a : b;
  a = lo, b = hi;
}

// items[0 .. n), n <= 8, sorted ascending by the optimal network of 8 inputs (19 compare-exchanges
// in 6 layers; Knuth, TAOCP vol. 3, 5.3.4), the inputs past n set to `pad`, a value above every
// item, which stays past n: the sort of the short rows (many rows of 8: a router's experts), where
// an insertion sort's mispredicted comparisons cost more than the rest of the row's work. The n
// sorted items go to `emit(j, item)` from registers (not stored back and read again: a vector
// load of 8 items just stored one by one waits for every store, at most of the row's time).
constexpr int kNetwork[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6},
                                 {3, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}, {2, 4}, {3, 5},
                                 {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};

template <typename item_t, typename emit_t>
inline void network_sort(const item_t* items, int64_t n, item_t pad, emit_t emit) {
  item_t v[8];
  for (int64_t j = 0; j < 8; ++j) v[j] = j < n ? items[j] : pad;
#pragma GCC unroll 19
  for (int k = 0; k < 19; ++k) exchange(v[kNetwork[k][0]], v[kNetwork[k][1]]);
#pragma GCC unroll 8
  for (int64_t j = 0; j < 8; ++j) {
    if (j < n) emit(j, v[j]);
  }
}

#if defined(__AVX512F__)
// Bitonic sorting in AVX-512 registers of packed float32 items (8 to a vector): each
// compare-exchange a lane-wise min and max of a vector and its partner, kept per lane by a mask.
// v's lanes i and i ^ d (or i ^ 7 with `flip`, the first step of each block size) exchanged: the
// larger to the lane whose `hi` bit is set.
inline __m512i exchange_lanes(__m512i v, __m512i partner_idx, __mmask8 hi) {
  const __m512i p = _mm512_permutexvar_epi64(partner_idx, v);
  return _mm512_mask_blend_epi64(hi, _mm512_min_epu64(v, p), _mm512_max_epu64(v, p));
}

// One vector's 8 lanes sorted ascending (bitonic, each block size's first step against the
// block's mirror, then half-cleaners), or the in-vector steps only (distances 4, 2, 1) where the
// vector is the end of a larger merge (`merge_only`).
inline __m512i sort_lanes8(__m512i v, bool merge_only) {
  const __m512i x1 = _mm512_set_epi64(6, 7, 4, 5, 2, 3, 0, 1);  // i ^ 1
  const __m512i x2 = _mm512_set_epi64(5, 4, 7, 6, 1, 0, 3, 2);  // i ^ 2
  const __m512i x3 = _mm512_set_epi64(4, 5, 6, 7, 0, 1, 2, 3);  // i ^ 3
  const __m512i x4 = _mm512_set_epi64(3, 2, 1, 0, 7, 6, 5, 4);  // i ^ 4
  const __m512i x7 = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);  // i ^ 7
  if (!merge_only) {
    v = exchange_lanes(v, x1, 0xAA);
    v = exchange_lanes(v, x3, 0xCC);
    v = exchange_lanes(v, x1, 0xAA);
    v = exchange_lanes(v, x7, 0xF0);
  } else {
    v = exchange_lanes(v, x4, 0xF0);
  }
  v = exchange_lanes(v, x2, 0xCC);
  return exchange_lanes(v, x1, 0xAA);
}

// items[0 .. n), n <= 8 NV, sorted ascending in registers: the row padded with pad (above every
// item) to NV vectors (a power of two), each sorted (sort_lanes8), then blocks of 2, 4, ... NV
// vectors merged: against the block's mirror (the second half's lanes reversed), then
// half-cleaners across vectors and within each. NV is known to the compiler, so that the loops
// unroll and the vectors live in registers. An insertion sort's or std::sort's comparisons
// mispredict about half the time in a row of random keys: 53 % of the rank's forward kernel at
// (64, 32) was its insertion sort, and std::sort took 2/3 of it at (32, 128).
template <int NV>
inline void bitonic_sort_vectors(uint64_t* items, int64_t n, uint64_t pad) {
  const __m512i rev = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  __m512i v[NV];
#pragma GCC unroll 32
  for (int a = 0; a < NV; ++a) {
    const int64_t left = std::min<int64_t>(8, std::max<int64_t>(0, n - 8 * a));
    const __mmask8 m = static_cast<__mmask8>((1u << left) - 1u);
    v[a] = sort_lanes8(_mm512_mask_loadu_epi64(_mm512_set1_epi64(static_cast<int64_t>(pad)), m,
                                               items + 8 * a),
                       false);
  }
#pragma GCC unroll 8
  for (int k = 2; k <= NV; k *= 2) {  // (blocks of k vectors)
#pragma GCC unroll 32
    for (int a = 0; a < NV; a += k) {  // the mirror step: vector a + j against a + k - 1 - j
#pragma GCC unroll 32
      for (int j = 0; j < k / 2; ++j) {
        __m512i& lo = v[a + j];
        __m512i& hi = v[a + k - 1 - j];
        const __m512i r = _mm512_permutexvar_epi64(rev, hi);
        const __m512i mn = _mm512_min_epu64(lo, r), mx = _mm512_max_epu64(lo, r);
        lo = mn;
        hi = _mm512_permutexvar_epi64(rev, mx);
      }
    }
#pragma GCC unroll 8
    for (int d = k / 4; d >= 1; d /= 2) {  // half-cleaners across vectors
#pragma GCC unroll 32
      for (int a = 0; a < NV; ++a) {
        if (a & d) continue;
        const __m512i mn = _mm512_min_epu64(v[a], v[a + d]);
        v[a + d] = _mm512_max_epu64(v[a], v[a + d]);
        v[a] = mn;
      }
    }
#pragma GCC unroll 32
    for (int a = 0; a < NV; ++a) v[a] = sort_lanes8(v[a], true);
  }
#pragma GCC unroll 32
  for (int a = 0; a < NV; ++a) {
    const int64_t left = std::min<int64_t>(8, std::max<int64_t>(0, n - 8 * a));
    if (left <= 0) break;
    _mm512_mask_storeu_epi64(items + 8 * a, static_cast<__mmask8>((1u << left) - 1u), v[a]);
  }
}

// items[0 .. n), 8 < n <= 256, sorted ascending (bitonic_sort_vectors, the fewest vectors).
inline void bitonic_sort(uint64_t* items, int64_t n, uint64_t pad) {
  if (n <= 16) {
    bitonic_sort_vectors<2>(items, n, pad);
  } else if (n <= 32) {
    bitonic_sort_vectors<4>(items, n, pad);
  } else if (n <= 64) {
    bitonic_sort_vectors<8>(items, n, pad);
  } else if (n <= 128) {
    bitonic_sort_vectors<16>(items, n, pad);
  } else {
    bitonic_sort_vectors<32>(items, n, pad);
  }
}
#endif

// idx[0 .. n) that sorts key (-key with `neg`: the negation folded into the keys, no pass of its
// own) descending (NaN first, ties by index); work holds max(4 n, 16) words.
inline void sort_descending(const float* key, int64_t n, int64_t* idx, uint64_t* work,
                            bool neg = false) {
  uint64_t* items = work;
  for (int64_t j = 0; j < n; ++j) {
    const float v = neg ? -key[j] : key[j];
    items[j] = (uint64_t(descending_key<uint32_t>(v)) << 32) | uint64_t(j);
  }
  if (n <= 8) {
    network_sort(items, n, ~uint64_t(0),
                 [idx](int64_t j, uint64_t v) { idx[j] = int64_t(v & 0xFFFFFFFFull); });
    return;
  }
#if defined(__AVX512F__)
  if (n <= 256) {  // (the words are distinct: the order is the stable one)
    bitonic_sort(items, n, ~uint64_t(0));
  } else
#endif
  if (n <= 48) {
    for (int64_t j = 1; j < n; ++j) {
      const uint64_t v = items[j];
      int64_t i = j;
      while (i > 0 && v < items[i - 1]) items[i] = items[i - 1], --i;
      items[i] = v;
    }
  } else if (n <= 256) {
    std::sort(items, items + n);
  } else {
    items = radix_sort(items, work + n, n, 32, 64);
  }
  for (int64_t j = 0; j < n; ++j) idx[j] = int64_t(items[j] & 0xFFFFFFFFull);
}

inline void sort_descending(const double* key, int64_t n, int64_t* idx, uint64_t* work,
                            bool neg = false) {
  Item64* items = reinterpret_cast<Item64*>(work);
  for (int64_t j = 0; j < n; ++j) items[j] = {descending_key<uint64_t>(neg ? -key[j] : key[j]), j};
  if (n <= 8) {
    network_sort(items, n, Item64{~uint64_t(0), std::numeric_limits<int64_t>::max()},
                 [idx](int64_t j, const Item64& v) { idx[j] = v.index; });
    return;
  }
  if (n <= 48) {
    for (int64_t j = 1; j < n; ++j) {
      const Item64 v = items[j];
      int64_t i = j;
      while (i > 0 && v.key < items[i - 1].key) items[i] = items[i - 1], --i;
      items[i] = v;
    }
  } else if (n <= 256) {
    std::sort(items, items + n, [](const Item64& a, const Item64& b) {
      return a.key < b.key || (a.key == b.key && a.index < b.index);
    });
  } else {
    items = radix_sort(items, reinterpret_cast<Item64*>(work) + n, n, 0, 64);
  }
  for (int64_t j = 0; j < n; ++j) idx[j] = items[j].index;
}

// The gaps of z = u / f (f = +-eps) in sorted order, d[i] = z[i - 1] - z[i] >= 0 (d[0] = 0), as
// doubles that cannot overflow: the rank's x / eps and the sort's rho / eps are beyond the dtype's
// range at a tiny epsilon (their entries would tie at +-inf), and a cap on 1 / eps pools entries
// that a gap of x near the cap keeps apart (KD24). P(z, t) depends on z only through its gaps, and
// a gap between consecutive sorted entries wider than the span of t (plus 2 log n for KL) is never
// pooled across: for blocks P above T, mean(y_P) - mean(y_T) (y = z - t) is at least that gap less
// the span of t (L2), less 2 log n more for the block values logsumexp(z_B) - logsumexp(t_B) (KL).
// So each gap is cut to G = 2 (t_0 - t_{n-1}) + 2 n (twice the span, so that rounding at the scale
// of a huge span cannot eat the margin): d[i] = min((q[i - 1] - q[i]) / f, G), q the sorted u (the
// difference times 1 / f), 0 between equal entries (equal infinities too), and the gap to an
// infinite entry is infinite, so cut to G like any other wide gap. No position is formed, only
// gaps: the projection below works on them (the blocks never span a cut gap), so nothing is beyond
// max, at any epsilon and any span of t. Returns the largest finite gap (for the L2 scaling) and
// whether q holds a NaN or an infinity. (The reference: _rank_frame in isotonic.py, the same
// operations in the same order.)
struct Frame {
  double dmax;
  bool nan;
  bool finite;
};

template <bool ordered, typename scalar_t>
Frame rank_frame(const scalar_t* q, const int64_t* order, double f, const double* t, int64_t n,
                 double* d) {
  // (q read in the order `order` where `ordered`: the sorted u without a pass of its own)
  const double G = 2.0 * (t[0] - t[n - 1]) + 2.0 * double(n);
  const double r = 1.0 / f;  // (differences times 1 / f: a product per entry, not a division)
  double dmax = 0.0;
  double prev = double(ordered ? q[order[0]] : q[0]);
  bool nan = prev != prev, finite = std::isfinite(prev);
  d[0] = 0.0;
  for (int64_t i = 1; i < n; ++i) {
    const double qi = double(ordered ? q[order[i]] : q[i]);
    double g = prev == qi ? 0.0 : rounded((prev - qi) * r);
    g = g > G ? G : g;
    d[i] = g;
    dmax = g > dmax && g != kInf ? g : dmax;
    nan |= qi != qi;
    finite &= std::isfinite(qi);
    prev = qi;
  }
  return {dmax, nan, finite};
}

// PAV on the gaps of z (the projection of permutahedron()), in the frame above,
// with the position of an entry never formed. Each block keeps, besides its statistics relative to its first
// entry, its z-span D (z at its first entry less z at its last); the first entries of adjacent
// blocks P and T are z_P - z_T = D_P + d[first of T] apart, and pooling them gives
// D = (D_P + d[first of T]) + D_T. The output at j is shift - (the sum of the gaps from the block's
// first entry to j), formed as (0 - off) + shift (as (z_j - z_ref) + shift was). A block's z-span
// never exceeds the span of t (plus 2 log n for KL): its first entry's y = z - t is at most the
// block's mean and its last entry's at least. With `inf_t` (KL rows whose t holds infinities) the
// differences of t are formed by diff(), else by a plain subtraction. Rows of huge magnitude are
// solved on c d, c t (c from project_gaps_row, with d0, t0 the unscaled row where c != 1), so that
// no sum of gaps overflows even where the span of t is beyond double; the output
// is formed in the row's own frame, and scaled where that is not finite.
void l2_gaps(const double* d, const double* t, int64_t n, double c, double* out, int64_t* block,
             int64_t* ref, double* acc, double* span, const double* d0 = nullptr,
             const double* t0 = nullptr) {
  int64_t depth = 0, cr = 0, pr = 0;
  double ca = 0.0, cd = 0.0, pa = 0.0, pd = 0.0;
  for (int64_t i = 1; i < n; ++i) {
    if (depth > 0) ref[depth - 1] = pr, acc[depth - 1] = pa, span[depth - 1] = pd;
    pr = cr, pa = ca, pd = cd, ++depth;
    cr = i, ca = 0.0, cd = 0.0;
    while (true) {
      const double cp = double(cr - pr), ct = double(i + 1 - cr);
      const double zg = pd + d[cr];  // z_P - z_T, at the blocks' first entries
      const double gap = zg - (t[pr] - t[cr]);
      // pool while mean(prev) <= mean(top), i.e. gap + acc_P / cP - acc_T / cT <= 0
      if (rounded(rounded(gap * cp) * ct) + rounded(pa * ct) - rounded(ca * cp) > 0.0) break;
      ca = pa + (ca - rounded(ct * gap));
      cd = zg + cd;
      cr = pr;
      if (--depth == 0) break;
      pr = ref[depth - 1], pa = acc[depth - 1], pd = span[depth - 1];
    }
  }
  if (depth > 0) ref[depth - 1] = pr, acc[depth - 1] = pa;
  ref[depth] = cr, acc[depth] = ca;
  ref[depth + 1] = n;  // (ref has n + 1 entries)
  if (c == 1.0 && n <= 16) {
    // short rows: acc[k] := the shift of block k, then the entries in one branch-free pass (a
    // loop per block ends at a data-dependent jump, mispredicted about once a block; in long
    // rows, where blocks are long, the chain through ref[k] costs more)
    for (int64_t k = 0; k <= depth; ++k) {
      const double mean = acc[k] / double(ref[k + 1] - ref[k]);
      acc[k] = t[ref[k]] - mean;  // mean(t_B) - mean(z_B) + z_r
    }
    out[0] = (0.0 - 0.0) + acc[0], block[0] = 0;
    int64_t k = 0;
    double off = 0.0;
    for (int64_t j = 1; j < n; ++j) {
      const bool next = j == ref[k + 1];
      k += next;
      off = pick(next, 0.0, off + d[j]);  // (0 at a block's first entry)
      out[j] = (0.0 - off) + acc[k];
      block[j] = k;
    }
    return;
  }
  for (int64_t k = 0; k <= depth; ++k) {
    const int64_t r = ref[k], end = ref[k + 1];
    const double mean = acc[k] / double(end - r);
    const double shift = t[r] - mean;  // mean(t_B) - mean(z_B) + z_r
    double off = 0.0;
    if (c == 1.0) {
      for (int64_t j = r; j < end; ++j) {
        if (j > r) off += d[j];
        out[j] = (0.0 - off) + shift;
        block[j] = k;
      }
      continue;
    }
    // in the row's own frame (exact where c d or c t lost bits); scaled where that overflows
    const double wr0 = t0[r], mean0 = mean / c;
    double off0 = 0.0;
    for (int64_t j = r; j < end; ++j) {
      if (j > r) off += d[j], off0 += d0[j];
      const double own = ((0.0 - off0) - mean0) + wr0;
      out[j] = std::isfinite(own) ? own : ((0.0 - off) + shift) / c;
      block[j] = k;
    }
  }
}

// The KL projection on the gaps, as l2_gaps: rows solved on c d, c t (c != 1: rows of huge
// magnitude) compare blocks in that frame, score times c (exact: c is a power of two), and keep
// their log-sums in the row's own units (ds / c, dw / c: a gap that overflows there is -inf, which
// adds e^-inf = 0, as any gap beyond ~745 does); the output is formed in the row's own frame, and
// scaled where that is not finite (a block whose sum of gaps overflows, or whose shift is +-inf).
template <bool inf_t>
void kl_gaps(const double* d, const double* t, int64_t n, double c, double* out, int64_t* block,
             int64_t* ref, double* acc, double* aux, double* span, const double* d0 = nullptr,
             const double* t0 = nullptr) {
  const double inv = 1.0 / c;
  int64_t depth = 0, cr = 0, pr = 0;
  double ca = 0.0, cx = 0.0, cd = 0.0, pa = 0.0, px = 0.0, pd = 0.0;
  for (int64_t i = 1; i < n; ++i) {
    if (depth > 0) {
      ref[depth - 1] = pr, acc[depth - 1] = pa, aux[depth - 1] = px, span[depth - 1] = pd;
    }
    pr = cr, pa = ca, px = cx, pd = cd, ++depth;
    cr = i, ca = 0.0, cx = 0.0, cd = 0.0;
    while (true) {
      const double zg = pd + d[cr];
      const double ds = -zg;  // z_T - z_P
      const double dw = inf_t ? diff(t[cr], t[pr]) : t[cr] - t[pr];
      // value(B) = z_ref + acc - t_ref - aux; pool while value(prev) <= value(top)
      if (rounded(((cx - px) - (ca - pa)) * c) + dw - ds > 0.0) break;
      ca = logaddexp(pa, ca + rounded(ds * inv));
      cx = logaddexp(px, cx + rounded(dw * inv));
      cd = zg + cd;
      cr = pr;
      if (--depth == 0) break;
      pr = ref[depth - 1], pa = acc[depth - 1], px = aux[depth - 1], pd = span[depth - 1];
    }
  }
  if (depth > 0) ref[depth - 1] = pr, acc[depth - 1] = pa, aux[depth - 1] = px;
  ref[depth] = cr, acc[depth] = ca, aux[depth] = cx;
  for (int64_t k = 0; k <= depth; ++k) {
    const int64_t r = ref[k], end = k < depth ? ref[k + 1] : n;
    const double rel = aux[k] - acc[k];
    double off = 0.0;
    if (c == 1.0) {
      const double shift = rel + t[r];
      for (int64_t j = r; j < end; ++j) {
        if (j > r) off += d[j];
        out[j] = (0.0 - off) + shift;
        block[j] = k;
      }
      continue;
    }
    const double shift0 = rel + t0[r], shift = rounded(rel * c) + t[r];
    double off0 = 0.0;
    for (int64_t j = r; j < end; ++j) {
      if (j > r) off += d[j], off0 += d0[j];
      const double own = (0.0 - off0) + shift0;
      out[j] = std::isfinite(own) ? own : ((0.0 - off) + shift) * inv;
      block[j] = k;
    }
  }
}

// One row of P(z, t) from the frame's gaps d of z (fr: what rank_frame saw in q) and the sorted t,
// into out and block: rows holding a NaN (in q or t), and L2 rows with an infinite t, are filled
// with their limits (above); rows whose largest finite magnitude
// (of t, and of the gaps) exceeds l2_limit(n) are solved scaled by a power of two (`scaled`: a work
// row of 2 n doubles); KL rows alike (kl_gaps), so that no sum of gaps overflows. t_finite: whether
// every entry of t is finite (the caller reads t anyway). Returns whether q and t were finite.
bool project_gaps_row(const double* d, const double* t, bool t_finite, int64_t n,
                      const Frame& fr, bool kl, double* out, int64_t* block, int64_t* ref,
                      double* acc, double* aux, double* span, std::vector<double>& scaled) {
  bool t_pos = false, t_neg = false, t_nan = false;
  double big = fr.dmax;
  if (t_finite) {
    big = std::max(big, std::max(std::abs(t[0]), std::abs(t[n - 1])));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double b = t[i];
      if (b != b) {
        t_nan = true;
      } else if (b == kInf) {
        t_pos = true;
      } else if (b == -kInf) {
        t_neg = true;
      } else if (std::abs(b) > big) {
        big = std::abs(b);
      }
    }
  }
  const bool finite = t_finite && fr.finite;
  if (fr.nan || t_nan || (!kl && t_pos && t_neg)) {
    fill(out, block, n, kNaN);
    return false;
  }
  if (!kl && !t_finite) {  // L2: an infinite t pulls the whole row to it
    fill(out, block, n, t_pos ? kInf : -kInf);
    return false;
  }
  const double limit = l2_limit(n);
  if (!(big > limit)) {
    if (!kl) {
      l2_gaps(d, t, n, 1.0, out, block, ref, acc, span);
    } else if (t_finite) {
      kl_gaps<false>(d, t, n, 1.0, out, block, ref, acc, aux, span);
    } else {
      kl_gaps<true>(d, t, n, 1.0, out, block, ref, acc, aux, span);
    }
    return finite;
  }
  int e_limit = 0, e_big = 0;
  std::frexp(limit, &e_limit);
  std::frexp(big, &e_big);
  const double c = std::ldexp(1.0, e_limit - e_big - 1);
  scaled.resize(2 * n);
  double* cd = scaled.data();
  double* ct = cd + n;
  for (int64_t j = 0; j < n; ++j) cd[j] = d[j] * c, ct[j] = t[j] * c;
  if (!kl) {
    l2_gaps(cd, ct, n, c, out, block, ref, acc, span, d, t);
  } else if (t_finite) {
    kl_gaps<false>(cd, ct, n, c, out, block, ref, acc, aux, span, d, t);
  } else {
    kl_gaps<true>(cd, ct, n, c, out, block, ref, acc, aux, span, d, t);
  }
  return finite;
}

// td[j] = the row rw (read in the order idx, where given; negated with `neg`) in double; returns
// whether every entry is finite.
template <typename scalar_t>
bool load_t(const scalar_t* rw, const int64_t* idx, int64_t n, bool neg, double* td) {
  if (idx && neg) {
    for (int64_t j = 0; j < n; ++j) td[j] = double(-rw[idx[j]]);
  } else if (idx) {
    for (int64_t j = 0; j < n; ++j) td[j] = double(rw[idx[j]]);
  } else if (neg) {
    for (int64_t j = 0; j < n; ++j) td[j] = double(-rw[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) td[j] = double(rw[j]);
  }
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) finite &= std::isfinite(td[j]);
  return finite;
}

// -------------------- short rows, eight at a time (AVX-512 and AVX2 builds: one row per lane)
//
// L2 rows of n <= 8 (a router's experts: B rows of 8) are solved eight rows at a time, one row per
// lane of a vector of doubles (lanes_group()): the rows are transposed (entry j of the eight rows
// in one vector), sorted on the lanes by network_sort()'s network (a float32 item packs its key
// and index into one 64-bit lane, as in sort_descending(); a double's key and index take two
// vectors, compared as exchange() compares them), their values read back from the sorted keys
// (descending_key()'s map is its own inverse; only -0 comes back +0, which changes no output:
// every sum that meets it adds +0 or a nonzero number to it), and solved by l2_gaps()'s PAV with
// every lane's stack in vectors: the blocks below the top two as a shift register (a push shifts
// every lane up, a pop shifts down the lanes that pooled), each block with its length, its
// statistics and the t and d at its first entry (no lane indexes an array by its own position).
// Every operation is the scalar path's, in its order, on each lane, products unfused (vrounded()),
// so the results are the scalar path's bit for bit (tests/core compares a batch with its rows one
// at a time). A row that is not finite, or that needs the scaled frame, is left to the scalar path
// (its bit of the mask returned).
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define SOFTOPS_LANES 512
#elif defined(__AVX2__)
#define SOFTOPS_LANES 256
#endif

#ifdef SOFTOPS_LANES
// (inlined: the lanes of a group stay in registers, not in arrays passed through memory)
#define SOFTOPS_INLINE inline __attribute__((always_inline))

// The operations of the lanes, per instruction set: VD eight doubles, VI eight int64, VM a mask
// of the eight lanes (AVX-512: a mask register; AVX2: two halves of four lanes each, the mask a
// vector of all-ones lanes, a select a blend). Named as their arithmetic: dadd (doubles), iadd
// (int64); dsel(m, a, b) = m ? b : a, dkeep(m, x) = m ? x : 0.
#if SOFTOPS_LANES == 512
using VD = __m512d;
using VI = __m512i;
using VM = __mmask8;

SOFTOPS_INLINE int bits(VM m) { return m; }
SOFTOPS_INLINE VM mask_of(int b) { return VM(b); }
SOFTOPS_INLINE VM mand(VM a, VM b) { return VM(a & b); }
SOFTOPS_INLINE VM mor(VM a, VM b) { return VM(a | b); }
SOFTOPS_INLINE VM mnot(VM a) { return VM(~a); }
SOFTOPS_INLINE VD dset1(double x) { return _mm512_set1_pd(x); }
SOFTOPS_INLINE VI iset1(int64_t x) { return _mm512_set1_epi64(x); }
SOFTOPS_INLINE VD dadd(VD a, VD b) { return _mm512_add_pd(a, b); }
SOFTOPS_INLINE VD dsub(VD a, VD b) { return _mm512_sub_pd(a, b); }
SOFTOPS_INLINE VD dmul(VD a, VD b) { return _mm512_mul_pd(a, b); }
SOFTOPS_INLINE VD ddiv(VD a, VD b) { return _mm512_div_pd(a, b); }
SOFTOPS_INLINE VD dxor(VD a, VD b) { return _mm512_xor_pd(a, b); }
SOFTOPS_INLINE VD dand(VD a, VD b) { return _mm512_and_pd(a, b); }
SOFTOPS_INLINE VD dmax(VD a, VD b) { return _mm512_max_pd(a, b); }
template <int P>
SOFTOPS_INLINE VM dcmp(VD a, VD b) {
  return _mm512_cmp_pd_mask(a, b, P);
}
SOFTOPS_INLINE VM nonfinite(VD x) { return _mm512_fpclass_pd_mask(x, 0x01 | 0x08 | 0x10 | 0x80); }
SOFTOPS_INLINE VD dsel(VM m, VD a, VD b) { return _mm512_mask_mov_pd(a, m, b); }
SOFTOPS_INLINE VD dkeep(VM m, VD x) { return _mm512_maskz_mov_pd(m, x); }
SOFTOPS_INLINE VI isel(VM m, VI a, VI b) { return _mm512_mask_blend_epi64(m, a, b); }
SOFTOPS_INLINE VI iadd(VI a, VI b) { return _mm512_add_epi64(a, b); }
SOFTOPS_INLINE VI isub(VI a, VI b) { return _mm512_sub_epi64(a, b); }
SOFTOPS_INLINE VI iand(VI a, VI b) { return _mm512_and_si512(a, b); }
SOFTOPS_INLINE VI ior(VI a, VI b) { return _mm512_or_si512(a, b); }
template <int K>
SOFTOPS_INLINE VI ishl(VI a) {
  return _mm512_slli_epi64(a, K);
}
template <int K>
SOFTOPS_INLINE VI ishr(VI a) {
  return _mm512_srli_epi64(a, K);
}
SOFTOPS_INLINE VI ishlv(VI a, VI k) { return _mm512_sllv_epi64(a, k); }  // (0 past 63)
SOFTOPS_INLINE VM ieq(VI a, VI b) { return _mm512_cmpeq_epi64_mask(a, b); }
SOFTOPS_INLINE VM igt(VI a, VI b) { return _mm512_cmpgt_epi64_mask(a, b); }
SOFTOPS_INLINE VM iltu(VI a, VI b) { return _mm512_cmplt_epu64_mask(a, b); }  // (unsigned)
SOFTOPS_INLINE VI iminu(VI a, VI b) { return _mm512_min_epu64(a, b); }
SOFTOPS_INLINE VI imaxu(VI a, VI b) { return _mm512_max_epu64(a, b); }
SOFTOPS_INLINE VD as_d(VI x) { return _mm512_castsi512_pd(x); }
SOFTOPS_INLINE VI as_i(VD x) { return _mm512_castpd_si512(x); }
SOFTOPS_INLINE VD vrounded(VD x) {  // (rounded() on a vector)
  asm("" : "+v"(x));
  return x;
}
// x[idx[j] & 7] at j: a permutation within a row
SOFTOPS_INLINE VD permute_row(VI idx, VD x) { return _mm512_permutexvar_pd(idx, x); }
// eight floats and back
SOFTOPS_INLINE __m256 to_f32(VD x) { return _mm512_cvtpd_ps(x); }
SOFTOPS_INLINE VD from_f32(__m256 x) { return _mm512_cvtps_pd(x); }
// the unsigned 32-bit lanes as int64, and the high halves of int64 lanes as 32-bit lanes
SOFTOPS_INLINE VI widen_u32(__m256i x) { return _mm512_cvtepu32_epi64(x); }
SOFTOPS_INLINE __m256i high_u32(VI x) { return _mm512_cvtepi64_epi32(_mm512_srli_epi64(x, 32)); }

// The 8 x 8 transpose of r[0 .. 8) (int64 lanes go through casts).
SOFTOPS_INLINE void transpose8(VD* r) {
  VD a[8], c[8];
#pragma GCC unroll 8
  for (int p = 0; p < 4; ++p) {
    a[2 * p] = _mm512_unpacklo_pd(r[2 * p], r[2 * p + 1]);      // entries 0 2 4 6 of two rows
    a[2 * p + 1] = _mm512_unpackhi_pd(r[2 * p], r[2 * p + 1]);  // entries 1 3 5 7
  }
  const VI lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const VI hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) {  // c[4 h + k]: entries k and k + 4 of rows 4 h .. 4 h + 4
#pragma GCC unroll 8
    for (int e = 0; e < 2; ++e) {
      const VD x = a[4 * h + e], y = a[4 * h + 2 + e];
      c[4 * h + e] = _mm512_permutex2var_pd(x, lo, y);
      c[4 * h + 2 + e] = _mm512_permutex2var_pd(x, hi, y);
    }
  }
  const VI first = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
  const VI second = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
#pragma GCC unroll 8
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_permutex2var_pd(c[k], first, c[4 + k]);
    r[k + 4] = _mm512_permutex2var_pd(c[k], second, c[4 + k]);
  }
}

// The first N entries of a row, in double (zeros past N), and a row's first N entries stored
// (int64 ones as their bits).
template <int N, typename scalar_t>
SOFTOPS_INLINE VD load_row(const scalar_t* p) {
  const __mmask8 m = __mmask8((1u << N) - 1);
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, p));
  } else {
    return _mm512_maskz_loadu_pd(m, p);
  }
}

template <int N, typename scalar_t>
SOFTOPS_INLINE void store_row(scalar_t* p, VD x) {
  const __mmask8 m = __mmask8((1u << N) - 1);
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_mask_storeu_ps(p, m, _mm512_cvtpd_ps(x));
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    _mm512_mask_storeu_pd(p, m, x);
  } else {
    _mm512_mask_storeu_epi64(p, m, as_i(x));
  }
}

// descending_key() on int64 lanes, its own inverse (0 where not `keep`, as a NaN's; -0 as +0): a
// negative value's bits as they are, a positive one's with all bits but the sign flipped.
SOFTOPS_INLINE VI key64(VI b, VM keep) {
  const VI sign = _mm512_set1_epi64(int64_t(0x8000000000000000ull));
  const VI magnitude = _mm512_andnot_si512(sign, b);
  b = _mm512_mask_blend_epi64(_mm512_cmpeq_epi64_mask(magnitude, _mm512_setzero_si512()), b,
                              _mm512_setzero_si512());
  const VI flip =
      _mm512_andnot_si512(_mm512_srai_epi64(b, 63), _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll));
  return _mm512_maskz_xor_epi64(keep, b, flip);
}

// The same on eight 32-bit lanes, and the mask of the lanes of f that are not NaN.
SOFTOPS_INLINE __m256i key32(__m256i b, __mmask8 keep) {
  const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
  const __m256i magnitude = _mm256_andnot_si256(sign, b);
  b = _mm256_mask_blend_epi32(_mm256_cmpeq_epi32_mask(magnitude, _mm256_setzero_si256()), b,
                              _mm256_setzero_si256());
  const __m256i flip = _mm256_andnot_si256(_mm256_srai_epi32(b, 31), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_maskz_xor_epi32(keep, b, flip);
}
SOFTOPS_INLINE __mmask8 ordered32(__m256 f) { return _mm256_cmp_ps_mask(f, f, _CMP_ORD_Q); }
SOFTOPS_INLINE __mmask8 all32() { return 0xFF; }
// m ? x - 1 : x
SOFTOPS_INLINE VI idec(VM m, VI x) { return _mm512_mask_sub_epi64(x, m, x, _mm512_set1_epi64(1)); }

#else  // AVX2: two halves
struct VD {
  __m256d h[2];
};
struct VI {
  __m256i h[2];
};
struct VM {
  __m256i h[2];
};
#define SOFTOPS_BINARY(R, name, T, intrinsic)            \
  SOFTOPS_INLINE R name(T a, T b) {                      \
    return R{{intrinsic(a.h[0], b.h[0]), intrinsic(a.h[1], b.h[1])}}; \
  }
SOFTOPS_INLINE __m256d cd(__m256i x) { return _mm256_castsi256_pd(x); }
SOFTOPS_INLINE __m256i ci(__m256d x) { return _mm256_castpd_si256(x); }

SOFTOPS_INLINE int bits(VM m) {
  return _mm256_movemask_pd(cd(m.h[0])) | _mm256_movemask_pd(cd(m.h[1])) << 4;
}
SOFTOPS_INLINE VM mask_of(int b) {
  const __m256i x = _mm256_set1_epi64x(b);
  const __m256i lo = _mm256_setr_epi64x(1, 2, 4, 8), hi = _mm256_setr_epi64x(16, 32, 64, 128);
  return VM{{_mm256_cmpeq_epi64(_mm256_and_si256(x, lo), lo),
             _mm256_cmpeq_epi64(_mm256_and_si256(x, hi), hi)}};
}
SOFTOPS_BINARY(VM, mand, VM, _mm256_and_si256)
SOFTOPS_BINARY(VM, mor, VM, _mm256_or_si256)
SOFTOPS_INLINE VM mnot(VM a) {
  const __m256i ones = _mm256_set1_epi64x(-1);
  return VM{{_mm256_xor_si256(a.h[0], ones), _mm256_xor_si256(a.h[1], ones)}};
}
SOFTOPS_INLINE VD dset1(double x) { return VD{{_mm256_set1_pd(x), _mm256_set1_pd(x)}}; }
SOFTOPS_INLINE VI iset1(int64_t x) { return VI{{_mm256_set1_epi64x(x), _mm256_set1_epi64x(x)}}; }
SOFTOPS_BINARY(VD, dadd, VD, _mm256_add_pd)
SOFTOPS_BINARY(VD, dsub, VD, _mm256_sub_pd)
SOFTOPS_BINARY(VD, dmul, VD, _mm256_mul_pd)
SOFTOPS_BINARY(VD, ddiv, VD, _mm256_div_pd)
SOFTOPS_BINARY(VD, dxor, VD, _mm256_xor_pd)
SOFTOPS_BINARY(VD, dand, VD, _mm256_and_pd)
SOFTOPS_BINARY(VD, dmax, VD, _mm256_max_pd)
template <int P>
SOFTOPS_INLINE VM dcmp(VD a, VD b) {
  return VM{{ci(_mm256_cmp_pd(a.h[0], b.h[0], P)), ci(_mm256_cmp_pd(a.h[1], b.h[1], P))}};
}
SOFTOPS_INLINE VM nonfinite(VD x) {  // (|x| not below inf: infinite, or NaN)
  const VD magnitude = dand(x, VD{{cd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll)),
                                   cd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll))}});
  return dcmp<_CMP_NLT_UQ>(magnitude, dset1(kInf));
}
SOFTOPS_INLINE VD dsel(VM m, VD a, VD b) {
  return VD{{_mm256_blendv_pd(a.h[0], b.h[0], cd(m.h[0])),
             _mm256_blendv_pd(a.h[1], b.h[1], cd(m.h[1]))}};
}
SOFTOPS_INLINE VD dkeep(VM m, VD x) {
  return VD{{_mm256_and_pd(cd(m.h[0]), x.h[0]), _mm256_and_pd(cd(m.h[1]), x.h[1])}};
}
SOFTOPS_INLINE VI isel(VM m, VI a, VI b) {
  return VI{{ci(_mm256_blendv_pd(cd(a.h[0]), cd(b.h[0]), cd(m.h[0]))),
             ci(_mm256_blendv_pd(cd(a.h[1]), cd(b.h[1]), cd(m.h[1])))}};
}
SOFTOPS_BINARY(VI, iadd, VI, _mm256_add_epi64)
SOFTOPS_BINARY(VI, isub, VI, _mm256_sub_epi64)
SOFTOPS_BINARY(VI, iand, VI, _mm256_and_si256)
SOFTOPS_BINARY(VI, ior, VI, _mm256_or_si256)
template <int K>
SOFTOPS_INLINE VI ishl(VI a) {
  return VI{{_mm256_slli_epi64(a.h[0], K), _mm256_slli_epi64(a.h[1], K)}};
}
template <int K>
SOFTOPS_INLINE VI ishr(VI a) {
  return VI{{_mm256_srli_epi64(a.h[0], K), _mm256_srli_epi64(a.h[1], K)}};
}
SOFTOPS_BINARY(VI, ishlv, VI, _mm256_sllv_epi64)  // (0 past 63)
SOFTOPS_BINARY(VM, ieq, VI, _mm256_cmpeq_epi64)
SOFTOPS_BINARY(VM, igt, VI, _mm256_cmpgt_epi64)
SOFTOPS_INLINE VM iltu(VI a, VI b) {  // (unsigned: signed, the sign bits flipped)
  const __m256i s = _mm256_set1_epi64x(int64_t(0x8000000000000000ull));
  return VM{{_mm256_cmpgt_epi64(_mm256_xor_si256(b.h[0], s), _mm256_xor_si256(a.h[0], s)),
             _mm256_cmpgt_epi64(_mm256_xor_si256(b.h[1], s), _mm256_xor_si256(a.h[1], s))}};
}
SOFTOPS_INLINE VI iminu(VI a, VI b) { return isel(iltu(b, a), a, b); }
SOFTOPS_INLINE VI imaxu(VI a, VI b) { return isel(iltu(a, b), a, b); }
SOFTOPS_INLINE VD as_d(VI x) { return VD{{cd(x.h[0]), cd(x.h[1])}}; }
SOFTOPS_INLINE VI as_i(VD x) { return VI{{ci(x.h[0]), ci(x.h[1])}}; }
SOFTOPS_INLINE VD vrounded(VD x) {  // (rounded() on a vector)
  asm("" : "+x"(x.h[0]), "+x"(x.h[1]));
  return x;
}
// x[idx[j] & 7] at j: each half's entries from both halves (as pairs of 32-bit lanes), the half
// chosen by bit 2
SOFTOPS_INLINE VD permute_row(VI idx, VD x) {
  VD r;
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    const __m256i q = _mm256_slli_epi64(_mm256_and_si256(idx.h[k], _mm256_set1_epi64x(3)), 1);
    const __m256i pair =
        _mm256_add_epi64(_mm256_or_si256(q, _mm256_slli_epi64(q, 32)),
                         _mm256_set1_epi64x(int64_t(1) << 32));
    const __m256d lo = _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_castpd_ps(x.h[0]), pair));
    const __m256d hi = _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_castpd_ps(x.h[1]), pair));
    r.h[k] = _mm256_blendv_pd(lo, hi, cd(_mm256_slli_epi64(idx.h[k], 61)));
  }
  return r;
}
SOFTOPS_INLINE __m256 to_f32(VD x) {
  return _mm256_set_m128(_mm256_cvtpd_ps(x.h[1]), _mm256_cvtpd_ps(x.h[0]));
}
SOFTOPS_INLINE VD from_f32(__m256 x) {
  return VD{{_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
             _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))}};
}
SOFTOPS_INLINE VI widen_u32(__m256i x) {
  return VI{{_mm256_cvtepu32_epi64(_mm256_castsi256_si128(x)),
             _mm256_cvtepu32_epi64(_mm256_extracti128_si256(x, 1))}};
}
SOFTOPS_INLINE __m256i high_u32(VI x) {
  const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
  return _mm256_set_m128i(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x.h[1], odd)),
                          _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x.h[0], odd)));
}

// The 4 x 4 transpose of a[0 .. 4).
SOFTOPS_INLINE void transpose4(__m256d* a) {
  const __m256d t0 = _mm256_unpacklo_pd(a[0], a[1]), t1 = _mm256_unpackhi_pd(a[0], a[1]);
  const __m256d t2 = _mm256_unpacklo_pd(a[2], a[3]), t3 = _mm256_unpackhi_pd(a[2], a[3]);
  a[0] = _mm256_permute2f128_pd(t0, t2, 0x20), a[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
  a[2] = _mm256_permute2f128_pd(t0, t2, 0x31), a[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
}

// The 8 x 8 transpose of r[0 .. 8): four of 4 x 4 (rows 4 R .. 4 R + 4, entries 4 E .. 4 E + 4
// to entries 4 E .. of half R).
SOFTOPS_INLINE void transpose8(VD* r) {
  __m256d a[2][2][4];
#pragma GCC unroll 8
  for (int R = 0; R < 2; ++R) {
#pragma GCC unroll 8
    for (int E = 0; E < 2; ++E) {
#pragma GCC unroll 8
      for (int k = 0; k < 4; ++k) a[R][E][k] = r[4 * R + k].h[E];
      transpose4(a[R][E]);
    }
  }
#pragma GCC unroll 8
  for (int E = 0; E < 2; ++E) {
#pragma GCC unroll 8
    for (int k = 0; k < 4; ++k) r[4 * E + k] = VD{{a[0][E][k], a[1][E][k]}};
  }
}

// The lanes of half `half` among the first N of eight 64-bit entries.
template <int N>
SOFTOPS_INLINE __m256i first_lanes(int half) {
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(N - 4 * half), _mm256_setr_epi64x(0, 1, 2, 3));
}

// The lanes of the first N of eight 32-bit entries.
template <int N>
SOFTOPS_INLINE __m256i first_floats() {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(N), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int N, typename scalar_t>
SOFTOPS_INLINE VD load_row(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m256i m = first_floats<N>();
    return from_f32(N == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m));
  } else {
    const double* q = reinterpret_cast<const double*>(p);
    VD x;
    x.h[0] = N >= 4 ? _mm256_loadu_pd(q) : _mm256_maskload_pd(q, first_lanes<N>(0));
    x.h[1] = N <= 4   ? _mm256_setzero_pd()
             : N == 8 ? _mm256_loadu_pd(q + 4)
                      : _mm256_maskload_pd(q + 4, first_lanes<N>(1));
    return x;
  }
}

template <int N, typename scalar_t>
SOFTOPS_INLINE void store_row(scalar_t* p, VD x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m256i m = first_floats<N>();
    if (N == 8) {
      _mm256_storeu_ps(p, to_f32(x));
    } else {
      _mm256_maskstore_ps(p, m, to_f32(x));
    }
  } else {
    double* q = reinterpret_cast<double*>(p);
    if (N >= 4) {
      _mm256_storeu_pd(q, x.h[0]);
    } else {
      _mm256_maskstore_pd(q, first_lanes<N>(0), x.h[0]);
    }
    if (N == 8) {
      _mm256_storeu_pd(q + 4, x.h[1]);
    } else if (N > 4) {
      _mm256_maskstore_pd(q + 4, first_lanes<N>(1), x.h[1]);
    }
  }
}

SOFTOPS_INLINE VI key64(VI b, VM keep) {
  const __m256i sign = _mm256_set1_epi64x(int64_t(0x8000000000000000ull));
  const __m256i rest = _mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll), zero = _mm256_setzero_si256();
  VI r;
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    __m256i x = b.h[k];
    x = _mm256_andnot_si256(_mm256_cmpeq_epi64(_mm256_andnot_si256(sign, x), zero), x);
    const __m256i flip = _mm256_andnot_si256(_mm256_cmpgt_epi64(zero, x), rest);
    r.h[k] = _mm256_and_si256(keep.h[k], _mm256_xor_si256(x, flip));
  }
  return r;
}
// descending_key() on eight 32-bit lanes (as key64(); `keep` all-ones lanes), and
// the lanes of f that are not NaN.
SOFTOPS_INLINE __m256i key32(__m256i b, __m256i keep) {
  const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u)), zero = _mm256_setzero_si256();
  b = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_andnot_si256(sign, b), zero), b);  // (-0)
  const __m256i flip = _mm256_andnot_si256(_mm256_srai_epi32(b, 31), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_and_si256(keep, _mm256_xor_si256(b, flip));
}
SOFTOPS_INLINE __m256i ordered32(__m256 f) {
  return _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_ORD_Q));
}
SOFTOPS_INLINE __m256i all32() { return _mm256_set1_epi32(-1); }
// m ? x - 1 : x (m's lanes -1 or 0)
SOFTOPS_INLINE VI idec(VM m, VI x) {
  return VI{{_mm256_add_epi64(x.h[0], m.h[0]), _mm256_add_epi64(x.h[1], m.h[1])}};
}
#undef SOFTOPS_BINARY
#endif  // AVX2

SOFTOPS_INLINE VD dzero() { return dset1(0.0); }
SOFTOPS_INLINE VI izero() { return iset1(0); }

// x[j] (j < N): entry j of the rows base + l * stride, l = 0 .. 8, in double (stride 0: one
// row for all).
template <int N, typename scalar_t>
SOFTOPS_INLINE void load_lanes(const scalar_t* base, int64_t stride, VD* x) {
  if (stride == 0) {
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) x[j] = dset1(double(base[j]));
    return;
  }
  VD r[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) r[l] = load_row<N>(base + l * stride);
  transpose8(r);
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) x[j] = r[j];
}

// Rows base + l * N (l = 0 .. 8, the bits of `rows`) set to the lanes x[j] (j < N): transposed
// back.
template <int N, typename scalar_t>
SOFTOPS_INLINE void store_lanes(const VD* x, scalar_t* base, int rows = 0xFF) {
  VD r[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) r[j] = j < N ? x[j] : dzero();
  transpose8(r);
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    if (rows >> l & 1) store_row<N>(base + l * N, r[l]);
  }
}

// The lanes x[j] (j < N; negated with `neg`) sorted descending as sort_descending() sorts a row:
// idx[j] the index of the j-th, and v[j] its value (from its key: as x[j], but -0 as +0, NaN
// as some NaN).
template <int N, typename scalar_t>
SOFTOPS_INLINE void sort_lanes(const VD* x, bool neg, VI* idx, VD* v) {
  const VD sign = dset1(-0.0);
  if constexpr (std::is_same_v<scalar_t, float>) {
    VI items[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (j >= N) {
        items[j] = iset1(-1);  // (past n: above every item)
        continue;
      }
      const __m256 f = to_f32(neg ? dxor(x[j], sign) : x[j]);
      const __m256i key = key32(_mm256_castps_si256(f), ordered32(f));
      items[j] = ior(ishl<32>(widen_u32(key)), iset1(j));
    }
#pragma GCC unroll 19
    for (int k = 0; k < 19; ++k) {
      VI& a = items[kNetwork[k][0]];
      VI& b = items[kNetwork[k][1]];
      const VI lo = iminu(a, b);
      b = imaxu(a, b), a = lo;
    }
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      idx[j] = iand(items[j], iset1(0xFFFFFFFFll));
      const __m256i key = key32(high_u32(items[j]), all32());
      v[j] = from_f32(_mm256_castsi256_ps(key));
    }
  } else {
    VI keys[8], ids[8];
    const VM all = mask_of(0xFF);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      ids[j] = iset1(j < N ? j : std::numeric_limits<int64_t>::max());
      if (j >= N) {
        keys[j] = iset1(-1);
        continue;
      }
      const VD f = neg ? dxor(x[j], sign) : x[j];
      keys[j] = key64(as_i(f), dcmp<_CMP_ORD_Q>(f, f));
    }
#pragma GCC unroll 19
    for (int k = 0; k < 19; ++k) {
      const int p = kNetwork[k][0], q = kNetwork[k][1];
      const VM swap =
          mor(iltu(keys[q], keys[p]), mand(ieq(keys[q], keys[p]), igt(ids[p], ids[q])));
      const VI kp = keys[p], ip = ids[p];
      keys[p] = isel(swap, kp, keys[q]);
      keys[q] = isel(swap, keys[q], kp);
      ids[p] = isel(swap, ip, ids[q]);
      ids[q] = isel(swap, ids[q], ip);
    }
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) idx[j] = ids[j], v[j] = as_d(key64(keys[j], all));
  }
}

// A block of the lanes' PAV stacks: its length, acc and span (l2_gaps()), and t and d at its first
// entry.
struct LaneBlock {
  VD len, acc, span, t, d;
};

// c ? b : a, lane by lane.
SOFTOPS_INLINE LaneBlock pick_lanes(VM c, const LaneBlock& a, const LaneBlock& b) {
  return {dsel(c, a.len, b.len), dsel(c, a.acc, b.acc), dsel(c, a.span, b.span),
          dsel(c, a.t, b.t), dsel(c, a.d, b.d)};
}

// Eight rows of permutahedron() for L2 and n = N <= 8 (its arguments as there, the pointers at the
// group's first row; td and t_finite: the one row of t, load_t()'s, where w_row is 0). Returns the
// mask of the lanes left to the row path (whose outputs it has not written).
template <int N, typename scalar_t>
int lanes_group(const scalar_t* ru, int64_t u_row, const scalar_t* rw, int64_t w_row,
                const scalar_t* pe, bool flip, bool sort_z, bool sort_w, bool negate_w,
                bool negate, const double* td, bool t_finite, scalar_t* ro, int64_t* rb,
                int64_t* rz, int64_t* rpw) {
  const VD zero = dzero(), inf = dset1(kInf), sign = dset1(-0.0);
  VM bad = mask_of(t_finite ? 0 : 0xFF);
  VD t[N], q[N], d[N];
  VI iz[N], iw[N];
  if (w_row == 0) {
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) t[j] = dset1(td[j]);
  } else {
    VD x[N];
    load_lanes<N>(rw, w_row, x);
    if (sort_w) {
      sort_lanes<N, scalar_t>(x, negate_w, iw, t);
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) t[j] = negate_w ? dxor(x[j], sign) : x[j];
    }
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) bad = mor(bad, nonfinite(t[j]));
  }
  {
    VD x[N];
    load_lanes<N>(ru, u_row, x);
    if (sort_z) {
      sort_lanes<N, scalar_t>(x, flip, iz, q);
      if (flip) {
#pragma GCC unroll 8
        for (int j = 0; j < N; ++j) q[j] = dxor(q[j], sign);
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) q[j] = x[j];
    }
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) bad = mor(bad, nonfinite(q[j]));
  }
  // rank_frame()
  VD f = load_row<8>(pe);
  f = flip ? dxor(f, sign) : f;  // (-eps in the dtype, exactly)
  const VD G = dadd(vrounded(dmul(dset1(2.0), dsub(t[0], t[N - 1]))), dset1(2.0 * double(N)));
  const VD r = ddiv(dset1(1.0), f);
  VD dmax_ = zero;
  d[0] = zero;
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) {
    const VM same = dcmp<_CMP_EQ_OQ>(q[i - 1], q[i]);
    VD g = dkeep(mnot(same), vrounded(dmul(dsub(q[i - 1], q[i]), r)));
    g = dsel(dcmp<_CMP_GT_OQ>(g, G), g, G);
    d[i] = g;
    const VM up = mand(dcmp<_CMP_GT_OQ>(g, dmax_), dcmp<_CMP_NEQ_UQ>(g, inf));
    dmax_ = dsel(up, dmax_, g);
  }
  // project_gaps_row(): rows beyond l2_limit() are scaled, on the scalar path
  const VD abs_mask = as_d(iset1(0x7FFFFFFFFFFFFFFFll));
  const VD big = dmax(dmax_, dmax(dand(t[0], abs_mask), dand(t[N - 1], abs_mask)));
  bad = mor(bad, dcmp<_CMP_GT_OQ>(big, dset1(l2_limit(N))));
  const int bad_rows = bits(bad);
  if (bad_rows == 0xFF) return bad_rows;
  // l2_gaps(): top (the current block), prev and the shift register below them
  const VD one = dset1(1.0);
  LaneBlock top{one, zero, zero, t[0], d[0]}, prev = top, below[N > 2 ? N - 2 : 1];
  VI depth = izero();
  const VI ione = iset1(1);
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) {
#pragma GCC unroll 8
    for (int m = i - 2; m >= 1; --m) below[m] = below[m - 1];
    if (i >= 2) below[0] = prev;
    prev = top, top = {one, zero, zero, t[i], d[i]};
    depth = iadd(depth, ione);
    // at most i pools: a round per pool of the lane that pools most, the first on every lane
    VM active = mnot(bad);  // (the lanes left to the row path take no part)
    for (int round = 0; round < i; ++round) {
      const VD cp = prev.len, ct = top.len;
      const VD zg = dadd(prev.span, top.d);
      const VD gap = dsub(zg, dsub(prev.t, top.t));
      // (the first round's top is the singleton i: ct = 1 and acc 0, whose products are exact,
      // ((gap cp) + pa) - 0 the same sum: two products fewer on the chain from step to step)
      const VD lhs = round == 0 ? dadd(vrounded(dmul(gap, cp)), prev.acc)
                                : dsub(dadd(vrounded(dmul(vrounded(dmul(gap, cp)), ct)),
                                            vrounded(dmul(prev.acc, ct))),
                                       vrounded(dmul(top.acc, cp)));
      const VM pool = mand(active, mnot(dcmp<_CMP_GT_OQ>(lhs, zero)));
      const VD ct_gap = round == 0 ? gap : vrounded(dmul(ct, gap));
      const LaneBlock merged{dadd(cp, ct), dadd(prev.acc, dsub(top.acc, ct_gap)),
                             dadd(zg, top.span), prev.t, prev.d};
      top = pick_lanes(pool, top, merged);
      depth = idec(pool, depth);
      active = mand(pool, igt(depth, izero()));
      if (!bits(active)) break;
      prev = pick_lanes(active, prev, below[0]);
#pragma GCC unroll 8
      for (int m = 0; m + 1 <= i - 2; ++m) below[m] = pick_lanes(active, below[m], below[m + 1]);
    }
  }
  // the shifts and block ids from the last entry back (a block's entries: its length; its shift
  // t_ref - acc / length), then the outputs forwards, as l2_gaps()'s short rows form them
  const auto shift_of = [](const LaneBlock& k) { return dsub(k.t, ddiv(k.acc, k.len)); };
  VD shift[N], lens[N > 2 ? N - 2 : 1], shifts[N > 2 ? N - 2 : 1];
  VI block[N];
  VM start[N];
  {
#pragma GCC unroll 8
    for (int m = 0; m < N - 2; ++m) lens[m] = below[m].len, shifts[m] = shift_of(below[m]);
    VD len = top.len, s = shift_of(top), next_len = prev.len, next_shift = shift_of(prev);
    VI k = depth;
#pragma GCC unroll 8
    for (int j = N - 1; j >= 0; --j) {
      shift[j] = s, block[j] = k;
      len = dsub(len, one);
      start[j] = dcmp<_CMP_EQ_OQ>(len, zero);
      if (j == 0) break;
      const VM pop = start[j];
      len = dsel(pop, len, next_len);
      s = dsel(pop, s, next_shift);
      k = idec(pop, k);
      if (N > 2) {
        next_len = dsel(pop, next_len, lens[0]);
        next_shift = dsel(pop, next_shift, shifts[0]);
      }
#pragma GCC unroll 8
      for (int m = 0; m + 1 < N - 2; ++m) {
        lens[m] = dsel(pop, lens[m], lens[m + 1]);
        shifts[m] = dsel(pop, shifts[m], shifts[m + 1]);
      }
    }
  }
  VD out[8];
  VD off = zero;
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if (j >= N) {
      out[j] = zero;
      continue;
    }
    off = dkeep(mnot(start[j]), dadd(off, d[j]));
    VD v = dadd(dsub(zero, off), shift[j]);
    if constexpr (std::is_same_v<scalar_t, float>) v = from_f32(to_f32(v));
    out[j] = negate ? dsub(zero, v) : v;  // (0 - v: exact in the dtype too)
  }
  // the integer outputs in 16-bit fields of one word, one transpose for all: the block id, the
  // permutations of w and z, and the inverse of z's (where z's entry p is: the un-sort)
  VD ints[8];
  if (sort_z) {  // the inverse of iz: the items (iz[j], j) sorted
    VI inv[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) inv[j] = j < N ? ior(ishl<32>(iz[j]), iset1(j)) : iset1(-1);
#pragma GCC unroll 19
    for (int k = 0; k < 19; ++k) {
      VI& a = inv[kNetwork[k][0]];
      VI& b = inv[kNetwork[k][1]];
      const VI lo = iminu(a, b);
      b = imaxu(a, b), a = lo;
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) ints[j] = as_d(iand(inv[j], iset1(7)));
  }
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
    VI word = ishl<48>(block[j]);
    if (sort_z) word = ior(word, ior(as_i(ints[j]), ishl<16>(iz[j])));
    if (w_row != 0 && sort_w) word = ior(word, ishl<32>(iw[j]));
    ints[j] = as_d(word);
  }
  transpose8(out);
  transpose8(ints);
  const VI field = iset1(0xFFFF);
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    if (bad_rows >> l & 1) continue;  // (the row path's)
    const VI word = as_i(ints[l]);
    // (the permutation reads the low 3 bits of each index: the inverse's field)
    store_row<N>(ro + l * N, sort_z ? permute_row(word, out[l]) : out[l]);
    store_row<N>(rb + l * N, as_d(ishr<48>(word)));
    if (sort_z) store_row<N>(rz + l * N, as_d(iand(ishr<16>(word), field)));
    if (w_row != 0 && sort_w) store_row<N>(rpw + l * N, as_d(iand(ishr<32>(word), field)));
  }
  return bad_rows;
}

// lanes_group() for n = 2 .. 8 (its arguments).
template <typename scalar_t, typename... Args>
int lanes_rows(int64_t n, Args... args) {
  switch (n) {
    case 2: return lanes_group<2, scalar_t>(args...);
    case 3: return lanes_group<3, scalar_t>(args...);
    case 4: return lanes_group<4, scalar_t>(args...);
    case 5: return lanes_group<5, scalar_t>(args...);
    case 6: return lanes_group<6, scalar_t>(args...);
    case 7: return lanes_group<7, scalar_t>(args...);
    case 8: return lanes_group<8, scalar_t>(args...);
    default: return 0xFF;
  }
}
#endif  // SOFTOPS_LANES

// P(z, w) with the sorts, the scaling of z and the un-sort in one pass per row (the forward of
// softops.sort._pav's projection node; the torch code of softops._core.isotonic is its
// reference): u (B or 1, n), w (B or 1, n) and eps (B,), one dtype; `mode` a sum of Mode bits.
// z = u / eps (u / -eps with kModeFlip; kModeInv, the sort's u * (1 / eps), is the same z: eps > 0)
// is sorted by u (by -u with the flip) and taken as its gaps, from rank_frame in double (z itself
// may be beyond double: rho / eps at a tiny epsilon beside a huge span of x), the projection solved
// on them (project_gaps_row) and cast back.
// Returns (p (B, n) in z's order, pz (B, n) or (B, 0), pw (Bw, n) or (Bw, 0), block (B, n) in sorted
// coordinates, bad: the number of rows that held a non-finite entry, an int: no tensor to make
// and read back on the host, a fixed cost of every call).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> permutahedron(
    const at::Tensor& u_in, const at::Tensor& w_in, const at::Tensor& eps_in, int64_t mode) {
  check_rows(u_in, "permutahedron");
  check_rows(w_in, "permutahedron");
  TORCH_CHECK(eps_in.dim() == 1, "permutahedron: eps must be (B,)");
  TORCH_CHECK(w_in.scalar_type() == u_in.scalar_type() &&
                  eps_in.scalar_type() == u_in.scalar_type(),
              "permutahedron: u, w and eps must have one dtype");
  const int64_t B = eps_in.size(0), n = u_in.size(1), Bu = u_in.size(0), Bw = w_in.size(0);
  TORCH_CHECK(w_in.size(1) == n && (Bu == B || Bu == 1) && (Bw == B || Bw == 1),
              "permutahedron: u and w must be (B, n) or (1, n), eps (B,)");
  const bool kl = mode & kModeKL, sort_z = mode & kModeSortZ, sort_w = mode & kModeSortW;
  const bool negate = mode & kModeNegate, flip = mode & kModeFlip;
  TORCH_CHECK(!(negate && (mode & kModeExp)), "permutahedron: exp space takes no negation");
  const at::Tensor u = u_in.contiguous(), eps = eps_in.contiguous();
  // w as the projection takes it, before its sort (elementwise maps commute with the sort): the
  // log of exp space by torch's own kernel (as the reference takes it); the negation row by row
  // below, or here for a single row of w
  at::Tensor w = w_in.contiguous();
  if (mode & kModeExp) w = w.log();
  const auto opts = u.options();
  auto out = at::empty({B, n}, opts);
  auto block = at::empty({B, n}, opts.dtype(at::kLong));
  auto pz = at::empty({B, sort_z ? n : 0}, opts.dtype(at::kLong));
  auto pw = at::empty({Bw, sort_w ? n : 0}, opts.dtype(at::kLong));
  if (B == 0 || n == 0) {
    return {out, pz, pw, block, 0};
  }
  const int64_t u_row = Bu == 1 ? 0 : n, w_row = Bw == 1 ? 0 : n;
  // one row of w for several rows: negated and sorted once, by torch's ops (a single row, B = 1,
  // takes the row path: two ops cost more than its sort)
  const bool shared = Bw == 1 && B > 1;
  const bool negate_rows = negate && !shared;
  if (negate && shared) w = w.neg();
  if (sort_w && shared) {
    auto sorted = at::sort(w, /*stable=*/true, /*dim=*/1, /*descending=*/true);
    w = std::get<0>(sorted).contiguous();
    pw.copy_(std::get<1>(sorted));
  }
  const bool sort_rows_w = sort_w && !shared;
  std::atomic<int64_t> bad{0};
#ifdef SOFTOPS_LANES
  // short L2 rows: lanes_group() (t as the rows take it: per row, or the one row load_t() reads)
  const bool lanes = !kl && n >= 2 && n <= 8 && (w_row != 0 || !(negate_rows || sort_rows_w));
#endif
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "permutahedron", [&] {
    const scalar_t* pu = u.const_data_ptr<scalar_t>();
    const scalar_t* pwv = w.const_data_ptr<scalar_t>();
    const scalar_t* pe = eps.const_data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    int64_t* pb = block.data_ptr<int64_t>();
    int64_t* ppz = pz.data_ptr<int64_t>();
    int64_t* ppw = pw.data_ptr<int64_t>();
    at::parallel_for(0, B, grain_for(n), [&](int64_t b0, int64_t b1) {
      auto ref = work<int64_t>(n + 1);  // (l2_gaps' sentinel)
      auto keys = work<uint64_t>(std::max<int64_t>(4 * n, 16));  // (sort_descending)
      auto acc = work<double>(n), aux = work<double>(kl ? n : 0), span = work<double>(n);
      auto frame = work<double>(3 * n);
      std::vector<double> scaled;
      int64_t rows_bad = 0;
      // in double: the gaps of z from rank_frame, t cast, the output cast back
      double* dd = frame.get();
      double* td = dd + n;
      double* pd = td + n;
      // t as the projection takes it (negated, sorted), cast, and whether it is finite: once
      // for one row of w taken as it is, else per row below
      const bool t_rows = w_row != 0 || negate_rows || sort_rows_w;
      bool t_finite = t_rows || load_t(pwv, nullptr, n, false, td);
      // groups of eight rows that the lanes take whole, then the row path on a group they leave
      // rows of (all eight again: the same values) and on the rest
      int64_t b = b0;
      while (b < b1) {
        int64_t end = b1;
#ifdef SOFTOPS_LANES
        if (lanes) {
          while (b + 8 <= b1 &&
                 lanes_rows<scalar_t>(n, pu + b * u_row, u_row, pwv + b * w_row, w_row, pe + b,
                                      flip, sort_z, sort_rows_w, negate_rows, negate, td,
                                      t_finite, po + b * n, pb + b * n, ppz + b * n,
                                      ppw + b * n) == 0) {
            b += 8;
          }
          end = std::min(b1, b + 8);
        }
#endif
        for (; b < end; ++b) {
          const scalar_t* ru = pu + b * u_row;
          const scalar_t* rw = pwv + b * w_row;
          const scalar_t f = flip ? -pe[b] : pe[b];  // z = u / f (the sort's u * (1 / eps) too)
          // the order of z is that of u (of -u with the flip: folded into the sort's keys), and
          // its gaps are formed by rank_frame, from u read in that order
          const int64_t* iz = nullptr;
          if (sort_z) {
            int64_t* idx = ppz + b * n;
            sort_descending(ru, n, idx, keys.get(), flip);
            iz = idx;
          }
          if (t_rows) {
            const int64_t* iw = nullptr;
            if (sort_rows_w) {  // (the sort of -w with the negation: its keys negated)
              int64_t* idx = ppw + b * n;
              sort_descending(rw, n, idx, keys.get(), negate_rows);
              iw = idx;
            }
            t_finite = load_t(rw, iw, n, negate_rows, td);
          }
          const Frame fr = iz ? rank_frame<true>(ru, iz, double(f), td, n, dd)
                              : rank_frame<false>(ru, iz, double(f), td, n, dd);
          const bool finite = project_gaps_row(dd, td, t_finite, n, fr, kl, pd, pb + b * n,
                                               ref.get(), acc.get(), aux.get(), span.get(), scaled);
          rows_bad += !finite;
          // cast back (negated as 0 - p in the dtype), un-sorted where z was sorted here
          // (a loop per case: a conditional index inside one loop is vectorised as masked loads
          // through the null pointer, each a microcode assist)
          // (and entry by entry in short rows: a vector load of pd, just stored entry by entry,
          // would wait for every store; kept scalar by an empty asm per entry)
          scalar_t* ro = po + b * n;
          if (n <= 16) {
            for (int64_t j = 0; j < n; ++j) {
              const scalar_t v = scalar_t(rounded(pd[j]));
              ro[iz ? iz[j] : j] = negate ? scalar_t(0) - v : v;
            }
          } else if (iz && negate) {
            for (int64_t j = 0; j < n; ++j) ro[iz[j]] = scalar_t(0) - scalar_t(pd[j]);
          } else if (iz) {
            for (int64_t j = 0; j < n; ++j) ro[iz[j]] = scalar_t(pd[j]);
          } else if (negate) {
            for (int64_t j = 0; j < n; ++j) ro[j] = scalar_t(0) - scalar_t(pd[j]);
          } else {
            for (int64_t j = 0; j < n; ++j) ro[j] = scalar_t(pd[j]);
          }
        }
      }
      bad += rows_bad;
    });
  });
  if (mode & kModeExp) out.exp_();  // torch's exp, as the reference's (after the un-sort)
  return {out, pz, pw, block, bad.load()};
}

#ifdef SOFTOPS_LANES
// (key[j], payload[j]) (j < N) sorted by the keys, distinct integers below N: the payload of
// key p lands in lane position p (an un-sort, where the keys are a permutation).
template <int N>
SOFTOPS_INLINE void unsort_lanes(const VI* key, VD* payload) {
  VI k[8];
  VD v[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    k[j] = j < N ? key[j] : iset1(j);  // (past n: already in place)
    v[j] = j < N ? payload[j] : dzero();
  }
#pragma GCC unroll 19
  for (int e = 0; e < 19; ++e) {
    const int p = kNetwork[e][0], q = kNetwork[e][1];
    const VM swap = igt(k[p], k[q]);
    const VI kp = k[p];
    const VD vp = v[p];
    k[p] = isel(swap, kp, k[q]), k[q] = isel(swap, k[q], kp);
    v[p] = dsel(swap, vp, v[q]), v[q] = dsel(swap, v[q], vp);
  }
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) payload[j] = v[j];
}

// The lanes x[j] (j < N) of rows base + (b + l) * stride as int64 (transposed), and whether each
// lane's row is a permutation of 0 .. N.
template <int N>
SOFTOPS_INLINE VM load_perm_lanes(const int64_t* base, VI* x) {
  VD r[N];
  load_lanes<N>(reinterpret_cast<const double*>(base), N, r);
  VI seen = izero();
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) x[j] = as_i(r[j]), seen = ior(seen, ishlv(iset1(1), x[j]));
  return ieq(seen, iset1((int64_t(1) << N) - 1));
}

// Eight rows of l2_vjp() for n = N <= 8 without the epsilon term, g's rows contiguous (its
// arguments as there, the pointers at the group's first row; e: its eight epsilons). The same
// passes on the lanes: runs numbered in order are checked (a lane whose rows are not, or whose
// permutations are not permutations, is left to the row path, which takes them or raises: its bit
// of the mask returned; its outputs not written here), the sorted cotangent read through pz in each
// row, the running sums and the means backwards, and the outputs un-sorted by a sort on the
// permutation's entries.
template <int N, typename scalar_t>
int vjp_lanes(const scalar_t* rg, int64_t g0, const int64_t* rb, const int64_t* rz,
              const int64_t* rw, const scalar_t* e, bool scaled, bool inv, bool flip, bool negate,
              scalar_t* rgz, scalar_t* rgw) {
  const VD zero = dzero(), one = dset1(1.0);
  VI block[N], iz[N], iw[N];
  {
    VD r[N];
    load_lanes<N>(reinterpret_cast<const double*>(rb), N, r);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) block[j] = as_i(r[j]);
  }
  VM start[N];
  VM ok = ieq(block[0], izero());
  start[0] = mask_of(0xFF);
#pragma GCC unroll 8
  for (int j = 1; j < N; ++j) {
    const VI step = isub(block[j], block[j - 1]);
    start[j] = mnot(ieq(step, izero()));
    ok = mand(ok, mor(mnot(start[j]), ieq(step, iset1(1))));
  }
  VD gs[N];
  {  // the rows of g, read through pz in each row (its low 3 bits)
    VD rows[8];
    if (rz) ok = mand(ok, load_perm_lanes<N>(rz, iz));
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      rows[l] = load_row<N>(rg + l * g0);
      if (rz) rows[l] = permute_row(as_i(load_row<N>(rz + l * N)), rows[l]);
    }
    transpose8(rows);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) gs[j] = rows[j];
  }
  if (rw) ok = mand(ok, load_perm_lanes<N>(rw, iw));
  const int ok_rows = bits(ok);
  if (ok_rows == 0) return 0xFF;
  // the running sums of each run, then its mean from its last entry backwards
  VD acc[N], cnt[N];
  {
    VD sum = zero, count = zero;
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      sum = dadd(dkeep(mnot(start[j]), sum), gs[j]);
      count = dadd(dkeep(mnot(start[j]), count), one);
      acc[j] = sum, cnt[j] = count;
    }
  }
  VD gz[N], gw[N];
  {
    VD mean = zero;
#pragma GCC unroll 8
    for (int j = N - 1; j >= 0; --j) {
      const VD m = ddiv(acc[j], cnt[j]);
      mean = j == N - 1 ? m : dsel(start[j + 1], mean, m);
      gw[j] = mean;
      gz[j] = dsub(gs[j], mean);
    }
  }
  // in the dtype: gz through z's scaling (-v; v * f or v / f, f as the forward's), gw cast
  if constexpr (std::is_same_v<scalar_t, float>) {
    __m256 f = _mm256_loadu_ps(e);
    f = inv    ? _mm256_div_ps(_mm256_set1_ps(1.0f), f)
        : flip ? _mm256_xor_ps(f, _mm256_set1_ps(-0.0f))
               : f;
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      __m256 v = to_f32(gz[j]);
      if (scaled) {
        v = negate ? _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)) : v;
        v = inv ? _mm256_mul_ps(v, f) : _mm256_div_ps(v, f);
      }
      gz[j] = from_f32(v);
      gw[j] = from_f32(to_f32(gw[j]));
    }
  } else {
    VD f = load_row<8>(e);
    f = inv ? ddiv(one, f) : flip ? dxor(f, dset1(-0.0)) : f;
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      if (!scaled) continue;
      VD v = negate ? dxor(gz[j], dset1(-0.0)) : gz[j];
      gz[j] = inv ? dmul(v, f) : ddiv(v, f);
    }
  }
  if (rgz) {
    if (rz) unsort_lanes<N>(iz, gz);
    store_lanes<N>(gz, rgz, ok_rows);
  }
  if (rgw) {
    if (rw) unsort_lanes<N>(iw, gw);
    store_lanes<N>(gw, rgw, ok_rows);
  }
  return ~ok_rows & 0xFF;
}

// vjp_lanes() for n = 2 .. 8 (its arguments).
template <typename scalar_t, typename... Args>
int vjp_rows(int64_t n, Args... args) {
  switch (n) {
    case 2: return vjp_lanes<2, scalar_t>(args...);
    case 3: return vjp_lanes<3, scalar_t>(args...);
    case 4: return vjp_lanes<4, scalar_t>(args...);
    case 5: return vjp_lanes<5, scalar_t>(args...);
    case 6: return vjp_lanes<6, scalar_t>(args...);
    case 7: return vjp_lanes<7, scalar_t>(args...);
    case 8: return vjp_lanes<8, scalar_t>(args...);
    default: return 0xFF;
  }
}
#endif

// ----------------------------------------------------------------- the L2 VJP, in one pass

// The VJP of P_Q(z, w) = z - v(z_sorted, w_sorted) for a cotangent g (B, n) in z's order, any
// strides. pz / pw (B, n) sort z / w descending (absent: already sorted); block (B, n) the block
// ids in sorted coordinates. With m the block mean of the sorted cotangent gs = g[pz]:
// gz[pz] = gs - m and gw[pw] = m, each (B, n) where wanted, else (B, 0). With eps (B,), z is the
// scaled u of permutahedron() (`mode` as there: z = u * f or u / f, f from eps), and gz is taken
// through it (times f, or over f; negated with kModeNegate, where the output is -P(z, -w)). With u
// too (B or 1 rows, in z's order, finite, g's dtype) also the gradient in eps, ge (B,):
// <J_z^T g, z - z_ref> / -eps (over +eps with kModeNegate), z_ref the first entry of each block
// (sorted coordinates), taken on the block-relative differences of u. ge is (0,) without u.
std::tuple<at::Tensor, at::Tensor, at::Tensor> l2_vjp(
    const at::Tensor& g, const std::optional<at::Tensor>& pz_in,
    const std::optional<at::Tensor>& pw_in, const at::Tensor& block_in, bool want_z,
    bool want_w, const std::optional<at::Tensor>& u_in, const std::optional<at::Tensor>& eps_in,
    int64_t mode) {
  check_rows(g, "l2_vjp");
  const int64_t B = g.size(0), n = g.size(1);
  auto rows_of = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == B && t.size(1) == n &&
                    t.scalar_type() == at::kLong,
                "l2_vjp: ", what, " must be (B, n), int64");
    return t.contiguous();
  };
  const at::Tensor block = rows_of(block_in, "block");
  const std::optional<at::Tensor> pz =
      pz_in.has_value() ? std::optional<at::Tensor>(rows_of(*pz_in, "pz")) : std::nullopt;
  const std::optional<at::Tensor> pw =
      pw_in.has_value() ? std::optional<at::Tensor>(rows_of(*pw_in, "pw")) : std::nullopt;
  const bool scaled = eps_in.has_value();
  const bool want_r = u_in.has_value() && scaled;
  const bool inv = mode & kModeInv, flip = mode & kModeFlip, negate = mode & kModeNegate;
  at::Tensor u, eps;
  if (scaled) {
    TORCH_CHECK(eps_in->dim() == 1 && eps_in->size(0) == B &&
                    eps_in->scalar_type() == g.scalar_type(),
                "l2_vjp: eps must be (B,), in g's dtype");
    eps = *eps_in;
  }
  if (want_r) {
    TORCH_CHECK(u_in->dim() == 2 && (u_in->size(0) == B || u_in->size(0) == 1) &&
                    u_in->size(1) == n && u_in->scalar_type() == g.scalar_type(),
                "l2_vjp: u must be (B, n) or (1, n), in g's dtype");
    u = *u_in;
  }
  auto gz = at::empty({B, want_z ? n : 0}, g.options());
  auto gw = at::empty({B, want_w ? n : 0}, g.options());
  auto r = at::empty({want_r ? B : 0}, g.options());
  if (B == 0 || n == 0) {
    if (want_r) r.zero_();
    return {gz, gw, r};
  }
  const int64_t g0 = g.stride(0), g1 = g.stride(1);
  const int64_t u0 = want_r ? (u.size(0) == 1 ? 0 : u.stride(0)) : 0;
  const int64_t u1 = want_r ? u.stride(1) : 0;
  const int64_t e0 = scaled ? eps.stride(0) : 0;
#ifdef SOFTOPS_LANES
  // short rows without the epsilon term, g's rows contiguous: vjp_lanes()
  const bool lanes = !want_r && n >= 2 && n <= 8 && g1 == 1 && (want_z || want_w);
#endif
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "l2_vjp", [&] {
    const scalar_t* pg = g.const_data_ptr<scalar_t>();
    const int64_t* pb = block.const_data_ptr<int64_t>();
    const int64_t* ppz = pz ? pz->const_data_ptr<int64_t>() : nullptr;
    const int64_t* ppw = pw ? pw->const_data_ptr<int64_t>() : nullptr;
    const scalar_t* pu = want_r ? u.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* pe = scaled ? eps.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* pgz = want_z ? gz.data_ptr<scalar_t>() : nullptr;
    scalar_t* pgw = want_w ? gw.data_ptr<scalar_t>() : nullptr;
    scalar_t* pr = want_r ? r.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B, grain_for(n, 65536), [&](int64_t b0, int64_t b1) {
      auto acc = work<double>(n);
      auto cnt = work<int64_t>(n);
      auto ident = work<int64_t>(n);
      for (int64_t j = 0; j < n; ++j) ident[j] = j;
      // the last row in which each position of z and of w was met (a repeated index is an error:
      // the entry it misses would never be written)
      auto seen = work<int64_t>(2 * n);
      for (int64_t j = 0; j < 2 * n; ++j) seen[j] = -1;
      // groups of eight rows that the lanes take whole, then the row path on a group they leave
      // rows of (all eight again: the same values) and on the rest
      scalar_t e8[8];
      int64_t b = b0;
      while (b < b1) {
        int64_t end = b1;
#ifdef SOFTOPS_LANES
        if (lanes) {
          for (; b + 8 <= b1; b += 8) {
            for (int l = 0; l < 8; ++l) e8[l] = scaled ? pe[(b + l) * e0] : scalar_t(1);
            const int left = vjp_rows<scalar_t>(
                n, pg + b * g0, g0, pb + b * n, ppz ? ppz + b * n : nullptr,
                ppw ? ppw + b * n : nullptr, static_cast<const scalar_t*>(e8), scaled, inv, flip,
                negate, pgz ? pgz + b * n : nullptr, pgw ? pgw + b * n : nullptr);
            if (left) break;
          }
          end = std::min(b1, b + 8);
        }
#endif
        for (; b < end; ++b) {
          const scalar_t* rg = pg + b * g0;
          const int64_t* rb = pb + b * n;
          const int64_t* rz = ppz ? ppz + b * n : nullptr;
          const int64_t* rw = ppw ? ppw + b * n : nullptr;
          // z = u * f or u / f (the forward's f); gz is written as the sorted cotangent less its
          // mean, and taken through z's scaling in a pass of its own over the row (see below)
          scalar_t f = scalar_t(1);
          if (scaled) {
            const scalar_t e = pe[b * e0];
            f = inv ? scalar_t(1) / e : flip ? -e : e;
          }
          scalar_t* const out_z = pgz ? pgz + b * n : nullptr;
          scalar_t* const out_w = pgw ? pgw + b * n : nullptr;
          // (indices checked as they are read: a malformed one is an error, not a stray write)
          const auto outside = [n](int64_t i) { return uint64_t(i) >= uint64_t(n); };
          double total = 0.0;
          // (the identity where a permutation is absent: no conditional index in the loops, which
          // the compiler may vectorise as masked loads through the null pointer)
          const int64_t* iz = rz ? rz : ident.get();
          const int64_t* iw = rw ? rw : ident.get();
          // The blocks of a projection are runs numbered 0, 1, ... in sorted order (the usual case,
          // and the only one the projections give): branch-free passes, each run's sum restarted
          // at its first entry (a sum from 0, in order) and kept at the run's number, then one
          // division per run for its mean, read back by the entries' block ids (a division per
          // entry, or a loop per run, which ends at a data-dependent jump, mispredicted about once
          // a run, cost more than the rest of the pass); any other labelling takes the general
          // pass below, by label.
          bool runs = rb[0] == 0;
          double sum = 0.0;
          int64_t count = 0, run = -1;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t i = iz[j];
            TORCH_CHECK(!outside(i) && !outside(iw[j]), "l2_vjp: permutations out of range");
            TORCH_CHECK(seen[i] != b && seen[n + iw[j]] != b,
                        "l2_vjp: pz and pw rows must be permutations (an index repeats)");
            seen[i] = rz ? b : -1, seen[n + iw[j]] = rw ? b : -1;
            const int64_t step = j == 0 ? 0 : rb[j] - rb[j - 1];
            runs &= step == 0 || step == 1;
            const bool start = j == 0 || step != 0;
            run += start;  // (<= j: in range whatever rb holds)
            sum = (start ? 0.0 : sum) + double(rg[i * g1]);
            count = (start ? 0 : count) + 1;
            acc[run] = sum, cnt[run] = count;
          }
          if (runs) {  // rb[j] is j's run: the means, then the outputs
            for (int64_t k = 0; k <= run; ++k) acc[k] /= double(cnt[k]);
            double ur = 0.0;
            for (int64_t j = 0; j < n; ++j) {
              const int64_t i = iz[j];
              const double gi = double(rg[i * g1]), mean = acc[rb[j]];
              if (out_z) out_z[i] = scalar_t(gi - mean);
              if (out_w) out_w[iw[j]] = scalar_t(mean);
              if (pr) {
                const double uj = double(pu[b * u0 + i * u1]);
                ur = j == 0 || rb[j] != rb[j - 1] ? uj : ur;  // the first entry of its run
                total += rounded((gi - mean) * (uj - ur));
              }
            }
          } else {  // not runs numbered in order: by label
            const int64_t blocks = rb[n - 1] + 1;
            TORCH_CHECK(!outside(blocks - 1), "l2_vjp: block ids out of range");
            for (int64_t k = 0; k < blocks; ++k) acc[k] = 0.0, cnt[k] = 0;
            for (int64_t j = 0; j < n; ++j) {
              const int64_t k = rb[j], i = rz ? rz[j] : j;
              TORCH_CHECK(uint64_t(k) < uint64_t(blocks) && !outside(i) && (!rw || !outside(rw[j])),
                          "l2_vjp: block ids or permutations out of range");
              acc[k] += double(rg[i * g1]);
              cnt[k] += 1;
            }
            for (int64_t k = 0; k < blocks; ++k) acc[k] /= double(cnt[k]);  // the block means
            double ur = 0.0;
            int64_t last = -1;
            total = 0.0;
            for (int64_t j = 0; j < n; ++j) {
              const int64_t k = rb[j];
              const double mean = acc[k];
              const int64_t i = rz ? rz[j] : j;
              const double gi = double(rg[i * g1]);
              if (out_z) out_z[i] = scalar_t(gi - mean);
              if (out_w) out_w[rw ? rw[j] : j] = scalar_t(mean);
              if (pr) {
                const double uj = double(pu[b * u0 + i * u1]);
                if (k != last) ur = uj, last = k;  // the first entry of its run
                total += rounded((gi - mean) * (uj - ur));
              }
            }
          }
          if (out_z && scaled) {  // gz through z = u * f or u / f (negated with kModeNegate), in
            // the dtype, in order (a division per entry in the scattered loop above cost more)
            for (int64_t i = 0; i < n; ++i) {
              const scalar_t v = negate ? -out_z[i] : out_z[i];
              out_z[i] = inv ? v * f : v / f;
            }
          }
          if (pr) {  // <J_z^T g, z - z_ref> = total * f (or / f), then d z / d eps = -z / eps
            const scalar_t rel = scalar_t(inv ? total * double(f) : total / double(f));
            const scalar_t e = pe[b * e0];
            const scalar_t ge = rel / (negate ? e : -e);
            pr[b] = ge;
          }
        }
      }
    });
  });
  return {gz, gw, r};
}

}  // namespace

TORCH_LIBRARY(softops_isotonic, m) {
  m.def(
      "permutahedron(Tensor u, Tensor w, Tensor eps, int mode) -> "
      "(Tensor, Tensor, Tensor, Tensor, int)");
  m.def(
      "l2_vjp(Tensor g, Tensor? pz, Tensor? pw, Tensor block, bool want_z, bool want_w, "
      "Tensor? u, Tensor? eps, int mode) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(softops_isotonic, CPU, m) {
  m.impl("permutahedron", &permutahedron);
  m.impl("l2_vjp", &l2_vjp);
}
