// A mixture-of-experts layer past its router in one call (models/moe.py's grouped GEMMs):
//
//   inferd_moe_layer  x [T, H], each token's top-k experts and routing weights, every expert's
//                     gate/up and down weights packed in panels (gemv.py's PanelWeight: [2I] x [H]
//                     and [H] x [I]) -> y [T, H] = sum over a token's experts, ascending, of
//                     weight * down(silu(gate(x)) * up(x)); the rows each expert received. One
//                     dtype throughout: float32, or bfloat16 on AVX512_BF16. Or, with the int8
//                     kernel, every expert's gemv.py Int8Weight copies (x float32 or bfloat16).
//
// The assignments are counting-sorted by expert (stable), each active expert runs over its rows
// in that order (gathered into a contiguous copy, or read in place through the order), and the
// outputs are weighted and summed back per token in ascending expert order, rounding where
// torch's `out *= w` and `index_add_` round (the product to the dtype; the sum in float32,
// rounded once: index_add_ on a bfloat16 tensor sums in float32): the same steps, in the same
// order, as the per-expert path in PyTorch.
//
// Why: from Python a decode step's MoE layer was an argsort, a bincount, a gather, then a panel
// GEMM, a SiLU * up and a panel GEMM for each of its top-k experts (24 native calls at top 8,
// each an OpenMP fork and join), then a multiply and an index_add_, at 1 row each, for weights
// that stream from memory in a few microseconds; on a busy machine every fork and join waited
// for a descheduled thread. Here the layer is one parallel region, in one of two forms:
// - a decode step's few assignments (under kFusedAssignments; `moe_experts`), two barriers: the
//   threads split the (expert, panel) pairs of all gate/up weights, the rows' SiLU * up and the
//   (expert, panel) pairs of all down weights, each thread a contiguous range (its own
//   sequential stream of weights), balanced by the row tiles each pair runs; the gather before
//   the region and the weighted sums after it, on one thread. (So do more assignments where
//   gate/up's halves are not whole panels, from kSplitAssignments the gather and the sums shared
//   inside.)
// - more (`moe_fused`: decode steps from 8 tokens at top 8, prefill chunks), one barrier: the
//   (expert, gate panel q) items, each running gate panel q and up panel q + I / 64 over x's
//   rows in place (the panel tile reads each row at its own address: no gathered copy) and
//   writing SiLU * up from the two panels' sums (the [T * k, 2I] gate/up output never goes to
//   memory); then each thread a contiguous range of down's output panels over every expert in
//   ascending order, adding each row's weighted output into its token's float32 sums in that
//   epilogue (no [T * k, H] output, no pass to sum it back; the threads own disjoint columns, so
//   each token's sum runs in ascending expert order as torch's does). bench/NOTES.md ("MoE
//   prefill: ...") has what each step saved.
// The sums are panel.h's, in the same order as Gemv.panel's, so an expert's output is bit for bit
// what its two Linear layers give (tests/integration/test_families_vs_hf.py); SiLU * up is
// simd.h's store_silu_mul, which fused_ops.cpp's SiLU * up runs too. Panels run on the AVX-512
// loop, not AMX tiles: the layers it serves are a few rows per expert.
//
// Int8 experts (`--quantization int8`) run here only where every active expert received at most
// `max_rows` rows (the int8 GEMV's share of their plans, 1-2 rows; the one-call decode step's
// 1-8); more rows return 1 with nothing computed (Python then runs the experts, larger batches
// on fbgemm). They take the steps their two Linear layers take from Python, each value computed
// as there: the rows quantized one by one, the int8 GEMV's block loop (gemv_int8.h),
// fused_ops.cpp's SiLU * up, the same for down, so the output is theirs bit for bit; but in one
// parallel region with three barriers, the threads splitting all active experts' blocks, where
// one GEMV call per projection was 2 x top-k regions a layer (measured 1.11x a single stream of
// the qwen3-moe shape, bench/NOTES.md).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "gemv_int8.h"
#include "panel.h"

extern "C" int inferd_silu_mul(void* out, const void* gate_up, int dtype, int64_t rows,
                               int64_t inter);

namespace {

// The experts' kernel: the panel GEMM on one PanelWeight address per expert, or the int8 GEMV on
// four per expert (an Int8Weight's q, scale, row_sum and bias, null for none).
enum MoeKernel : int { kMoePanel = 0, kMoeGemvInt8 = 1 };
constexpr int64_t kInt8Addresses = 4;

// Assignments (tokens x k) from which the threads share the gather and the weighted sums in
// `moe_experts`: a prefill chunk's (a 512-token chunk at top 8 copies 16 MB of rows, then sums
// 16 MB back, which one thread did while the other waited), not a decode step's (under 64 rows
// at top 8).
constexpr int64_t kSplitAssignments = 512;

// Assignments from which the panel experts run as `moe_fused` (where gate/up's halves are whole
// panels): 8 tokens at top 8. bench/moe_kernel.py, qwen3-moe, against `moe_experts`: 1.00-1.02x
// at 8 tokens, 1.02-1.03x at 16, 1.08-1.15x at 32, 1.2-1.26x at 48, 1.2-1.3x at 128-512; at 1-4
// tokens 0.98-1.00x (one row an expert: the weights' stream is the call), so those keep it.
constexpr int64_t kFusedAssignments = 64;

// One (expert, panel) pair of a phase: its weight panel, its rows, where they start.
struct Item {
  int64_t expert;
  int64_t panel;
};

// The range [i0, i1) of `items` thread t of nt takes: contiguous, near-equal in `cost`.
void share(const std::vector<int64_t>& cost_prefix, int64_t t, int64_t nt, int64_t* i0,
           int64_t* i1) {
  const int64_t n = static_cast<int64_t>(cost_prefix.size()) - 1;
  const int64_t total = cost_prefix[n];
  auto first_at = [&](int64_t c) {
    return std::lower_bound(cost_prefix.begin(), cost_prefix.end(), c) - cost_prefix.begin();
  };
  *i0 = t == 0 ? 0 : std::min(n, first_at(total * t / nt));
  *i1 = t == nt - 1 ? n : std::min(n, first_at(total * (t + 1) / nt));
}

// y[r0 .. r0 + rows) of each item's expert = x rows . its panel, for items [i0, i1).
// `bias`: each expert's bias ([n], the dtype's) or null; null: none for any.
template <class S>
void run_items(const std::vector<Item>& items, int64_t i0, int64_t i1, const int64_t* rows,
               const int64_t* row0, const void* x, int64_t x_stride, const void* const* w,
               int64_t n, int64_t k, void* y, int64_t y_stride, float* acc,
               const void* const* bias = nullptr) {
  using W = typename S::W;
  const int64_t steps = k / S::kInputsPerStep;
  const int64_t panel_values = steps * kPanel * S::kInputsPerStep;
  for (int64_t i = i0; i < i1; ++i) {
    const Item& it = items[i];
    const W* wj = static_cast<const W*>(w[it.expert]);
    // Prefetch stops at the end of this thread's panels of this expert (the next expert's
    // weights are elsewhere in memory).
    const int64_t last = (i1 - 1 >= i && items[i1 - 1].expert == it.expert)
                             ? items[i1 - 1].panel
                             : it.panel;
    const W* w_end = wj + (last + 1) * panel_values;
    for (int64_t r = 0; r < rows[it.expert]; r += kMaxRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, rows[it.expert] - r));
      const int64_t at = row0[it.expert] + r;
      panel_sums<S>(static_cast<const W*>(x) + at * x_stride, nr, x_stride, wj, steps, it.panel,
                    acc, w_end);
      const W* b = bias == nullptr ? nullptr : static_cast<const W*>(bias[it.expert]);
      store_panel<S>(acc, nr, b, n, static_cast<W*>(y) + at * y_stride, y_stride, it.panel);
    }
  }
}

// Where each expert's rows start in the grouped rows (rows[e] each, in expert order), and the
// total at [experts].
std::vector<int64_t> row_starts(const int64_t* rows, int64_t experts) {
  std::vector<int64_t> row0(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) row0[e + 1] = row0[e] + rows[e];
  return row0;
}

// The items of a phase (every active expert's panels of an n-column weight) and their costs'
// prefix sums: a pair costs the row tiles it runs, at least one.
void phase_items(const int64_t* rows, int64_t experts, int64_t n, std::vector<Item>* items,
                 std::vector<int64_t>* prefix) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  prefix->assign(1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t cost = std::max<int64_t>(1, (rows[e] + kTileRows - 1) / kTileRows);
    for (int64_t p = 0; rows[e] > 0 && p < panels; ++p) {
      items->push_back({e, p});
      prefix->push_back(prefix->back() + cost);
    }
  }
}

// With `split`, `gather(t, nt)` and `combine(t, nt)` are thread t of nt's share of filling xs
// before the experts run and of reading out after them, in the same parallel region.
template <class S, class Gather, class Combine>
int moe_experts(const void* xs, const int64_t* rows, int64_t experts, const void* const* w13,
                const void* const* w2, int64_t hidden, int64_t inter, void* gate_up, void* act,
                void* out, int dtype, bool split, const Gather& gather, const Combine& combine) {
  const std::vector<int64_t> row0 = row_starts(rows, experts);
  const int64_t total = row0[experts];
  std::vector<Item> up_items, down_items;
  std::vector<int64_t> up_cost, down_cost;
  phase_items(rows, experts, 2 * inter, &up_items, &up_cost);
  phase_items(rows, experts, hidden, &down_items, &down_cost);
  const int64_t esz = dtype == kF32 ? 4 : 2;
#pragma omp parallel
  {
    alignas(64) float acc[kMaxRows * kPanel];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (split) {
      gather(t, nt);
#pragma omp barrier
    }
    int64_t i0, i1;
    share(up_cost, t, nt, &i0, &i1);
    run_items<S>(up_items, i0, i1, rows, row0.data(), xs, hidden, w13, 2 * inter, hidden,
                 gate_up, 2 * inter, acc);
#pragma omp barrier
    // SiLU * up of this thread's rows (a nested region: serial here).
    const int64_t r0 = total * t / nt, r1 = total * (t + 1) / nt;
    if (r1 > r0)
      inferd_silu_mul(static_cast<char*>(act) + r0 * inter * esz,
                      static_cast<const char*>(gate_up) + r0 * 2 * inter * esz, dtype, r1 - r0,
                      inter);
#pragma omp barrier
    share(down_cost, t, nt, &i0, &i1);
    run_items<S>(down_items, i0, i1, rows, row0.data(), act, inter, w2, hidden, inter, out,
                 hidden, acc);
    if (split) {
#pragma omp barrier
      combine(t, nt);
    }
  }
  return 0;
}

// 16 panel sums as store_panel stores them without a bias (+ 0, rounded to the dtype).
inline __m512 stored_value(const float* acc, int dtype) {
  return as_dtype(_mm512_add_ps(_mm512_load_ps(acc), _mm512_setzero_ps()), dtype);
}

// Assignment a's routing weight (weights in the dtype) as a float.
inline float routing_weight(const void* weights, int64_t a, int dtype) {
  const char* w = static_cast<const char*>(weights) + a * (dtype == kF32 ? 4 : 2);
  return dtype == kF32 ? *reinterpret_cast<const float*>(w)
                       : _mm512_cvtss_f32(load16m(w, dtype, 1));
}

// sum + w * o as torch's `out *= w` and `index_add_` compute it: the product rounded to the
// dtype, the sum kept in float32 (index_add_ on a bfloat16 tensor sums each row's sources in
// float32 and rounds once, at the end). The product is kept from contracting into an FMA with
// the add (GCC contracts vector ops).
inline __m512 add_product(__m512 sum, __m512 o, float w, int dtype) {
  __m512 prod = as_dtype(_mm512_mul_ps(o, _mm512_set1_ps(w)), dtype);
  __asm__("" : "+v"(prod));
  return _mm512_add_ps(sum, prod);
}

// y[t] = sum over token t's assignments, in ascending expert order, of w * out[its row], from
// zero (add_product's sums, rounded to the dtype once). Tokens [t0, t1).
void combine(const void* out, const int64_t* pos, const int64_t* experts, const void* weights,
             int64_t t0, int64_t t1, int64_t k, int64_t hidden, void* y, int dtype) {
  const int64_t esz = dtype == kF32 ? 4 : 2;
  std::vector<int64_t> a(k);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < k; ++j) a[j] = t * k + j;
    std::sort(a.begin(), a.end(), [&](int64_t u, int64_t v) { return experts[u] < experts[v]; });
    char* yt = static_cast<char*>(y) + t * hidden * esz;
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const char* o = static_cast<const char*>(out) + (pos[a[j]] * hidden + i) * esz;
        sum = add_product(sum, load16m(o, dtype, m), routing_weight(weights, a[j], dtype), dtype);
      }
      store16m(yt + i * esz, sum, dtype, m);
    }
  }
}

// sums[token of row j][64p, 64p + 64) += w * row j of panel p's down output (acc, as
// store_panel would store it), for each row j of `rows` (assignments src[j]): add_product, so
// that from zero, in ascending expert order, the sums are combine's bit for bit.
void add_weighted(const float* acc, int rows, const int64_t* src, const void* weights, int64_t k,
                  int64_t hidden, int64_t p, float* sums, int dtype) {
  const int64_t c0 = p * kPanel;
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, hidden - c0));
  for (int j = 0; j < rows; ++j) {
    const float w = routing_weight(weights, src[j], dtype);
    float* st = sums + (src[j] / k) * hidden + c0;
    for (int v = 0; v * 16 < cols; ++v) {
      const __mmask16 m = tail_mask(cols - v * 16);
      const __m512 o = stored_value(acc + j * kPanel + v * 16, dtype);
      const __m512 sum = _mm512_maskz_loadu_ps(m, st + v * 16);
      _mm512_mask_storeu_ps(st + v * 16, m, add_product(sum, o, w, dtype));
    }
  }
}

// Row chunks of an expert's rows for the panel loop: ceil(rows / kMaxRows) near-equal ones (130
// rows: 65 and 65, not 128 and a 2-row chunk that streams the panel again for little work).
struct Chunks {
  int64_t rows, count;
  explicit Chunks(int64_t r) : rows(r), count((r + kMaxRows - 1) / kMaxRows) {}
  int64_t start(int64_t c) const { return rows * c / count; }
};

// The experts of at least kFusedAssignments assignments where gate/up's halves are whole panels
// (inter % kPanel == 0), in one parallel region with one barrier: gate/up over x's rows in
// place, with SiLU * up in its epilogue (an item is an expert's gate panel q and up panel q +
// inter / 64, so the gate/up product never goes to memory); then down with the weighted sum in
// its epilogue, each thread a contiguous range of output panels over all experts in ascending
// order, adding each expert's weighted rows into the float32 sums of the columns it owns: per
// token, ascending expert order, each product and sum rounded as `combine` rounds them, so y is
// combine's bit for bit. `src[s]`: the assignment (token * k + j) at sorted row s.
template <class S>
void moe_fused(const void* x, int64_t x_stride, const int64_t* rows, int64_t experts,
                 const void* const* w13, const void* const* w2, int64_t hidden, int64_t inter,
                 void* act, const int64_t* src, const void* weights, int64_t tokens, int64_t k,
                 float* sums, void* y, int dtype) {
  using W = typename S::W;
  constexpr int64_t kStepValues = kPanel * S::kInputsPerStep;
  const std::vector<int64_t> row0 = row_starts(rows, experts);
  // x's row of each sorted row, read in place (no gathered copy).
  std::vector<const W*> x_rows(row0[experts]);
  for (int64_t s = 0; s < row0[experts]; ++s)
    x_rows[s] = static_cast<const W*>(x) + (src[s] / k) * x_stride;
  const int64_t pairs = inter / kPanel;
  const int64_t out_panels = (hidden + kPanel - 1) / kPanel;
  std::vector<Item> up_items;
  std::vector<int64_t> up_cost;
  phase_items(rows, experts, inter, &up_items, &up_cost);
  const int64_t esz = dtype == kF32 ? 4 : 2;
#pragma omp parallel
  {
    alignas(64) float gate[kMaxRows * kPanel];
    alignas(64) float up[kMaxRows * kPanel];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // gate/up and SiLU * up: act rows = silu(x . gate panel q) * (x . up panel q + pairs).
    int64_t i0, i1;
    share(up_cost, t, nt, &i0, &i1);
    const int64_t steps_up = hidden / S::kInputsPerStep, values_up = steps_up * kStepValues;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = up_items[i];
      const W* wj = static_cast<const W*>(w13[it.expert]);
      const W* gate_w = wj + it.panel * values_up;
      const W* up_w = wj + (it.panel + pairs) * values_up;
      // Each panel's last block prefetches the first of the one the thread runs next: the up
      // panel, then the next item's gate panel (none past the thread's last).
      const W* next_w = nullptr;
      if (i + 1 < i1)
        next_w = static_cast<const W*>(w13[up_items[i + 1].expert]) +
                 up_items[i + 1].panel * values_up;
      const Chunks ch(rows[it.expert]);
      for (int64_t c = 0; c < ch.count; ++c) {
        const int64_t r = ch.start(c);
        const int nr = static_cast<int>(ch.start(c + 1) - r);
        const IndexedRows<W> xr{x_rows.data() + row0[it.expert] + r, 0};
        panel_sums_of<S>(xr, nr, gate_w, steps_up, 0, gate, gate_w + values_up, up_w);
        panel_sums_of<S>(xr, nr, up_w, steps_up, 0, up, up_w + values_up, next_w);
        char* out = static_cast<char*>(act) +
                    ((row0[it.expert] + r) * inter + it.panel * kPanel) * esz;
        for (int j = 0; j < nr; ++j)
          for (int v = 0; v < kPanel / 16; ++v)
            store_silu_mul(out + (j * inter + v * 16) * esz,
                           stored_value(gate + j * kPanel + v * 16, dtype),
                           stored_value(up + j * kPanel + v * 16, dtype), dtype, 0xffff);
      }
    }
#pragma omp barrier
    // down and the weighted sums: this thread's output panels [p0, p1) of every expert.
    const int64_t p0 = out_panels * t / nt, p1 = out_panels * (t + 1) / nt;
    const int64_t c0 = p0 * kPanel, c1 = std::min(hidden, p1 * kPanel);
    for (int64_t tok = 0; tok < tokens && c1 > c0; ++tok)
      std::fill(sums + tok * hidden + c0, sums + tok * hidden + c1, 0.0f);
    const int64_t steps_down = inter / S::kInputsPerStep, values_down = steps_down * kStepValues;
    for (int64_t e = 0; e < experts && p1 > p0; ++e) {
      const W* wj = static_cast<const W*>(w2[e]);
      const Chunks ch(rows[e]);
      for (int64_t c = 0; c < ch.count; ++c) {
        const int64_t r = ch.start(c), s0 = row0[e] + r;
        const int nr = static_cast<int>(ch.start(c + 1) - r);
        const W* xr = static_cast<const W*>(act) + s0 * inter;
        for (int64_t p = p0; p < p1; ++p) {
          // The expert's last panel prefetches the next expert's first (its own range's end).
          const W* after = p + 1 == p1 && e + 1 < experts
                               ? static_cast<const W*>(w2[e + 1]) + p0 * values_down
                               : nullptr;
          panel_sums<S>(xr, nr, inter, wj, steps_down, p, gate, wj + p1 * values_down, after);
          add_weighted(gate, nr, src + s0, weights, k, hidden, p, sums, dtype);
        }
      }
    }
    // bfloat16: the float32 sums rounded once.
    for (int64_t tok = 0; sums != y && tok < tokens; ++tok)
      for (int64_t i = c0; i < c1; i += 16)
        store16m(static_cast<char*>(y) + (tok * hidden + i) * esz,
                 _mm512_maskz_loadu_ps(tail_mask(c1 - i), sums + tok * hidden + i), dtype,
                 tail_mask(c1 - i));
  }
}

// One block of an int8 projection: `nb` output values from `n0` of an active expert's rows.
struct Int8Item {
  int64_t expert, n0, nb;
};

// An n-output projection's blocks over the active experts: gemv.cpp's blocking (kBlockRows of the
// expert's row count, the last n % B outputs one at a time).
std::vector<Int8Item> int8_items(const int64_t* rows, int64_t experts, int64_t n) {
  std::vector<Int8Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t b = rows[e] <= 4 ? gemv8::kBlockRows<4> : gemv8::kBlockRows<8>;
    int64_t n0 = 0;
    for (; n0 + b <= n; n0 += b) items.push_back({e, n0, b});
    for (; n0 < n; ++n0) items.push_back({e, n0, 1});
  }
  return items;
}

// The rows of one int8 projection's input, quantized per row as gemv.cpp quantizes them.
struct QuantRows {
  int64_t kpad;
  std::vector<uint8_t> q;  // [rows, kpad]
  std::vector<float> scale;
  std::vector<int32_t> zero;
  QuantRows(int64_t rows, int64_t k)
      : kpad((k + 63) / 64 * 64), q(rows * kpad), scale(rows), zero(rows) {}
  void quantize(const char* x, int64_t r0, int64_t r1, int64_t k, int dtype) {
    const int64_t esz = dtype == kF32 ? 4 : 2;
    for (int64_t r = r0; r < r1; ++r)
      quantize_u8(x + r * k * esz, dtype, k, kpad, q.data() + r * kpad, &scale[r], &zero[r]);
  }
};

// Item `it` of a projection: y rows of its expert (from row0) = its quantized rows . its int8
// weight (kInt8Addresses at w), as gemv.cpp's block loop computes them.
template <int DT>
void run_int8(const Int8Item& it, const int64_t* rows, const int64_t* row0, const QuantRows& x,
              const void* const* w, int64_t n, int64_t k, char* y) {
  const int64_t r0 = row0[it.expert], esz = DT == kF32 ? 4 : 2;
  gemv8::Int8Rows xr{x.q.data() + r0 * x.kpad, x.kpad, {}, {}};
  for (int64_t r = 0; r < rows[it.expert]; ++r)
    xr.scale[r] = x.scale[r0 + r], xr.zero[r] = x.zero[r0 + r];
  const void* const* wa = w + kInt8Addresses * it.expert;
  const auto* q = static_cast<const int8_t*>(wa[0]);
  const auto* scale = static_cast<const float*>(wa[1]);
  const auto* sum = static_cast<const int32_t*>(wa[2]);
  const auto* bias = static_cast<const float*>(wa[3]);
  char* yr = y + r0 * n * esz;
  gemv8::with_rows(rows[it.expert], [&](auto rr) {
    constexpr int R = decltype(rr)::value;
    if (it.nb == 1)
      gemv8::block_int8<R, 1, DT>(xr, q, k, scale, sum, bias, yr, n, it.n0);
    else
      gemv8::block_int8<R, gemv8::kBlockRows<R>, DT>(xr, q, k, scale, sum, bias, yr, n, it.n0);
  });
}

// Each active expert's contiguous rows of xs (at most gemv8::kMaxRows) through its int8 gate/up,
// SiLU * up and int8 down (w13, w2: kInt8Addresses per active expert) in one parallel region with
// three barriers: the rows quantized, the gate/up blocks of all experts split over the threads,
// SiLU * up and its rows quantized, the down blocks. Each value is computed as the int8 GEMV
// computes it (gemv_int8.h), so the output is the per-expert calls' bit for bit.
template <int DT>
void int8_experts(const char* xs, const int64_t* rows, int64_t experts, const void* const* w13,
                  const void* const* w2, int64_t hidden, int64_t inter, char* gate_up, char* act,
                  char* out) {
  const int64_t esz = DT == kF32 ? 4 : 2;
  const std::vector<int64_t> row0 = row_starts(rows, experts);
  const int64_t total = row0[experts];
  QuantRows qx(total, hidden), qa(total, inter);
  const std::vector<Int8Item> up = int8_items(rows, experts, 2 * inter);
  const std::vector<Int8Item> down = int8_items(rows, experts, hidden);
  const int64_t nu = static_cast<int64_t>(up.size()), nd = static_cast<int64_t>(down.size());
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = total * t / nt, r1 = total * (t + 1) / nt;
    qx.quantize(xs, r0, r1, hidden, DT);
#pragma omp barrier
    for (int64_t i = nu * t / nt; i < nu * (t + 1) / nt; ++i)
      run_int8<DT>(up[i], rows, row0.data(), qx, w13, 2 * inter, hidden, gate_up);
#pragma omp barrier
    // SiLU * up of this thread's rows (a nested region: serial here), then their quantization.
    if (r1 > r0)
      inferd_silu_mul(act + r0 * inter * esz, gate_up + r0 * 2 * inter * esz, DT, r1 - r0, inter);
    qa.quantize(act, r0, r1, inter, DT);
#pragma omp barrier
    for (int64_t i = nd * t / nt; i < nd * (t + 1) / nt; ++i)
      run_int8<DT>(down[i], rows, row0.data(), qa, w2, hidden, inter, out);
  }
}

int moe_layer(const void* x, int64_t x_stride, int64_t tokens, const int64_t* experts,
              const void* weights, int64_t num_experts, int64_t k, const void* const* w13,
              const void* const* w2, int kernel, int64_t max_rows, int64_t hidden, int64_t inter,
              int64_t* counts, void* scratch, void* y, int dtype) {
  const int64_t n = tokens * k, esz = dtype == kF32 ? 4 : 2;
  for (int64_t a = 0; a < n; ++a)
    if (experts[a] < 0 || experts[a] >= num_experts) return -2;
  // Counting sort of the assignments by expert (stable: token order within an expert).
  std::vector<int64_t> start(num_experts + 1, 0), pos(n);
  for (int64_t e = 0; e < num_experts; ++e) counts[e] = 0;
  for (int64_t a = 0; a < n; ++a) ++counts[experts[a]];
  for (int64_t e = 0; e < num_experts; ++e)
    if (counts[e] > max_rows) return 1;
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] = start[e] + counts[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < n; ++a) pos[a] = fill[experts[a]]++;
  // Scratch: xs [n, H] (the rows grouped), gate_up [n, 2I], act [n, I], out [n, H].
  char* xs = static_cast<char*>(scratch);
  char* gate_up = xs + n * hidden * esz;
  char* act = gate_up + n * 2 * inter * esz;
  char* out = act + n * inter * esz;
  // Where the assignments are many (a prefill chunk's), the gather and the sums are the threads'
  // inside the experts' parallel region (moe_fused: no gather, the sums in down's epilogue;
  // moe_experts: each thread a share); a decode step's few are gathered before it and summed
  // after it, which spares the threads two barriers.
  const bool split = kernel == kMoePanel && n >= kSplitAssignments;
  auto gather = [&](int64_t t, int64_t nt) {
    for (int64_t a = n * t / nt; a < n * (t + 1) / nt; ++a)
      std::memcpy(xs + pos[a] * hidden * esz,
                  static_cast<const char*>(x) + (a / k) * x_stride * esz, hidden * esz);
  };
  auto sum = [&](int64_t t, int64_t nt) {
    combine(out, pos.data(), experts, weights, tokens * t / nt, tokens * (t + 1) / nt, k, hidden,
            y, dtype);
  };
  if (!split) gather(0, 1);
  // The active experts' rows and weight addresses.
  const int64_t per = kernel == kMoeGemvInt8 ? kInt8Addresses : 1;
  std::vector<int64_t> rows;
  std::vector<const void*> up, down;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (counts[e] == 0) continue;
    rows.push_back(counts[e]);
    up.insert(up.end(), w13 + e * per, w13 + (e + 1) * per);
    down.insert(down.end(), w2 + e * per, w2 + (e + 1) * per);
  }
  const int64_t active = static_cast<int64_t>(rows.size());
  // moe_fused: its weighted sums in down's epilogue read the assignment at each sorted row.
  const bool fused = kernel == kMoePanel && n >= kFusedAssignments && inter % kPanel == 0;
  std::vector<int64_t> src(fused ? n : 0);
  for (int64_t a = 0; fused && a < n; ++a) src[pos[a]] = a;
  // bfloat16: the weighted sums' float32 buffer (each thread zeroes the columns it owns).
  const std::unique_ptr<float[]> bf16_sums(fused && dtype != kF32 ? new float[tokens * hidden]
                                                                    : nullptr);
  int rc = 0;
  if (kernel == kMoeGemvInt8 && dtype == kF32)
    int8_experts<kF32>(xs, rows.data(), active, up.data(), down.data(), hidden, inter, gate_up,
                       act, out);
  else if (kernel == kMoeGemvInt8)
    int8_experts<kBF16>(xs, rows.data(), active, up.data(), down.data(), hidden, inter, gate_up,
                        act, out);
  else if (fused && dtype == kF32)
    moe_fused<StepF32>(x, x_stride, rows.data(), active, up.data(), down.data(), hidden, inter,
                       act, src.data(), weights, tokens, k, static_cast<float*>(y), y, dtype);
  else if (fused)
    moe_fused<StepBF16>(x, x_stride, rows.data(), active, up.data(), down.data(), hidden, inter,
                        act, src.data(), weights, tokens, k, bf16_sums.get(), y, dtype);
  else if (dtype == kF32)
    rc = moe_experts<StepF32>(xs, rows.data(), active, up.data(), down.data(), hidden, inter,
                              gate_up, act, out, dtype, split, gather, sum);
  else
    rc = moe_experts<StepBF16>(xs, rows.data(), active, up.data(), down.data(), hidden, inter,
                               gate_up, act, out, dtype, split, gather, sum);
  if (rc == 0 && !split && !fused) sum(0, 1);  // moe_fused summed inside
  return rc;
}

// Every expert's rows through its own weight and bias (grouped_panels below).
template <class S>
void grouped_panels(const void* x, const int64_t* rows, int64_t experts, const void* const* w,
                    const void* const* bias, int64_t n, int64_t k, void* y) {
  const std::vector<int64_t> row0 = row_starts(rows, experts);
  std::vector<Item> items;
  std::vector<int64_t> cost;
  phase_items(rows, experts, n, &items, &cost);
#pragma omp parallel
  {
    alignas(64) float acc[kMaxRows * kPanel];
    int64_t i0, i1;
    share(cost, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
    run_items<S>(items, i0, i1, rows, row0.data(), x, k, w, n, k, y, n, acc, bias);
  }
}

}  // namespace

extern "C" {

// x [sum(rows), k], grouped by expert (rows[e] each, in expert order), through each expert's
// panel-packed weight w[e] ([n] x [k], gemv.py's PanelWeight) and bias[e] ([n] or null) -> y
// [sum(rows), n]: one parallel region, the threads splitting the (expert, panel) pairs as
// moe_experts does; each row's values are Gemv.panel's bit for bit. For experts whose
// activation is not the native call's (gpt-oss's clamped SwiGLU runs in torch between two of
// these). Returns -1 for a dtype the CPU has no panel kernel for, or an odd k in bfloat16.
int inferd_grouped_panels(const void* x, const int64_t* rows, int64_t experts, const void* const* w,
                          const void* const* bias, int64_t n, int64_t k, void* y, int dtype) {
  if ((dtype != kF32 && dtype != kBF16) || panel_rows(dtype) == 0) return -1;
  if (dtype == kBF16 && k % 2 != 0) return -1;
  if (dtype == kF32)
    grouped_panels<StepF32>(x, rows, experts, w, bias, n, k, y);
  else
    grouped_panels<StepBF16>(x, rows, experts, w, bias, n, k, y);
  return 0;
}

// The whole layer past the router: x [T, H] (rows x_stride apart), each token's k experts and
// routing weights ([T, k], weights in the dtype) and every expert's weights by expert id (kernel
// kMoePanel: its packed panels; kMoeGemvInt8: kInt8Addresses each) -> y [T, H]; counts [E] <- rows
// each expert received. scratch: T * k * (2H + 3I) values. Returns 1, with only counts written,
// where an expert received more than max_rows rows; -2 for an expert id out of range.
int inferd_moe_layer(const void* x, int64_t x_stride, int64_t tokens, const int64_t* experts,
                     const void* weights, int64_t num_experts, int64_t k, const void* const* w13,
                     const void* const* w2, int kernel, int64_t max_rows, int64_t hidden,
                     int64_t inter, int64_t* counts, void* scratch, void* y, int dtype) {
  if (dtype != kF32 && dtype != kBF16) return -1;
  if (kernel == kMoePanel) {
    if (panel_rows(dtype) == 0) return -1;
    if (dtype == kBF16 && (hidden % 2 != 0 || inter % 2 != 0)) return -1;
  } else if (kernel != kMoeGemvInt8 || max_rows > gemv8::kMaxRows) {
    return -1;
  }
  return moe_layer(x, x_stride, tokens, experts, weights, num_experts, k, w13, w2, kernel,
                   max_rows, hidden, inter, counts, scratch, y, dtype);
}

}  // extern "C"
