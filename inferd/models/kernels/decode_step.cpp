// A decode step through every decoder layer of a Llama-family model in one call: up to 128 rows
// on the weights' panel copies, 1-8 on int8 GEMV copies, each sequence 1 or more query rows
// (a decode row, or a verify step's last known token and its drafts, causal among themselves).
//
//   inferd_decode_layers(model, step)
//
// The same kernels, in the same order, on the same buffers' values as the Python fused path
// (models/llama.py): add + RMSNorm, qkv projection, q/k norm + RoPE + KV write, paged attention,
// o projection, add + RMSNorm, gate/up projection, SiLU * up, down projection, and the final
// add + RMSNorm, so its output is bit-for-bit the Python path's where that path's linear layers
// run the same kernel (each layer's kernel is its dispatch plan's, models/linear.py: the panel
// GEMM at every row count, as the Python path runs it; the int8 GEMV at 3-8 rows too, where the
// Python path's plan sends them to fbgemm).
// What it removes is the Python between them: a single stream of the 8-layer llama-32m made ~100
// kernel calls a step from Python (argument checks, data_ptr() reads, output allocations,
// slicing, ctypes), ~1 ms of a ~4.3 ms forward (measured: forward 4.0-4.5 ms layer by layer,
// 2.6-3.8 ms in one call; docs/benchmarks.md); at 17-64 bfloat16 rows the one call ran llama-32m
// 1.05-1.39x faster than the layer-by-layer path (docs/benchmarks.md); a verify step of 5 rows of
// one llama-32m sequence 1.7x (bench/NOTES.md).
//
// A mixture-of-experts layer (models/moe.py) runs its router in the caller's callback (torch's own
// ops, as the layer-by-layer path runs them, so the experts chosen stay transformers') and the rest
// in inferd_moe_layer (moe_experts.cpp), the call that path makes: a decode step of the qwen3-moe
// shape is one native call with one callback a layer instead of ~13 calls from Python a layer.
// Int8 experts run the int8 GEMV at every row count of the step (1-8), as its dense layers do.
//
// The caller (kernels/decode.py) checks every shape once when it builds the Model; per step it
// fills a Step with the batch's pointers. Scratch buffers are the caller's, sized for the rows.
#include <cstdint>
#include <cstring>

extern "C" {
int inferd_rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                    void* residual, const void* w, int dtype, int64_t rows, int64_t dim,
                    float eps);
int inferd_silu_mul(void* out, const void* gate_up, int dtype, int64_t rows, int64_t inter);
int inferd_rope_qkv(const void* qkv, int64_t qkv_stride, int dtype, int64_t T, int hq, int hkv,
                    int d, const int64_t* positions, const void* cos, const void* sin,
                    int64_t max_pos, const void* q_norm, const void* k_norm, float eps,
                    void* q_out, void* kv_cache, int kv_dtype, int64_t plane_slots,
                    const int64_t* slots);
int inferd_paged_attention(void* out, const void* q, int act_dtype, const void* kv_cache,
                           int kv_dtype, int64_t num_blocks, int block_size, int num_heads,
                           int num_kv_heads, int head_dim, const int32_t* tables, int table_stride,
                           const int32_t* q_start, const int32_t* q_len, const int32_t* ctx_len,
                           int num_seqs, float scale, int window, const float* sinks);
int inferd_gemv_int8(const void* x, int64_t rows, int64_t x_stride, const int8_t* w, int64_t n,
                     int64_t k, const float* w_scale, const int32_t* w_sum, const float* bias,
                     void* y, int64_t y_stride, int dtype);
int inferd_gemm_panel(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n,
                      int64_t k, const void* bias, void* y, int64_t y_stride, int dtype);
int inferd_moe_layer(const void* x, int64_t x_stride, int64_t tokens, const int64_t* experts,
                     const void* weights, int64_t num_experts, int64_t k, const void* const* w13,
                     const void* const* w2, int kernel, int64_t max_rows, int64_t hidden,
                     int64_t inter, int64_t* counts, void* scratch, void* y, int dtype);
}

namespace {

// One linear layer, on the kernel its dispatch plan gives the step (models/linear.py; decode.py's
// STEP_KERNELS): the panel GEMM on W packed in VNNI panels (gemv.py's PanelWeight) and a
// model-dtype bias, or the int8 GEMV on an int8 W with per-row float32 scales, row sums and a
// float32 bias (gemv.py's Int8Weight).
enum Kernel : int64_t { kPanel = 0, kGemvInt8 = 1 };

struct Lin {
  const void* w;  // int8 W [n, k] (kGemvInt8)
  const void* bias;
  const float* scale;
  const int32_t* row_sum;
  int64_t n;
  int64_t k;
  int64_t kernel;  // Kernel
  const void* panel;  // the panels (kPanel)
};

// An MoE layer's experts: every expert's gate/up and down weights by expert id, as
// inferd_moe_layer's `kernel` reads them (the panels of gemv.py's PanelWeight, or the four
// addresses of its Int8Weight), and where the rows routed to each are added up across steps.
struct Moe {
  const void* const* w13;
  const void* const* w2;
  int64_t experts, top_k, inter;
  int64_t* counts;  // [experts]
  int64_t kernel;    // moe_experts.cpp's MoeKernel
  int64_t max_rows;  // the most rows one expert takes (at least the step's)
};

struct Layer {
  const void* in_norm;    // [hidden]
  const void* post_norm;  // [hidden]
  const void* q_norm;     // [d] or null
  const void* k_norm;     // [d] or null
  void* kv_cache;         // [2, num_blocks, block_size, hkv, d] in kv_dtype
  Lin qkv, o, gate_up, down;  // gate_up, down: unused where `moe` is set
  int64_t window;         // sliding window of this layer's attention (0: none)
  const Moe* moe;         // the MLP's experts, or null (a dense MLP)
};

struct Model {
  const Layer* layers;
  int64_t num_layers;
  const void* final_norm;  // [hidden]
  int64_t hidden, inter, hq, hkv, d;
  int64_t num_blocks, block_size;
  const void* cos;  // [max_pos, d / 2]
  const void* sin;
  int64_t max_pos;
  float eps, qk_eps, scale;
  int32_t dtype, kv_dtype;
  // MoE layer `layer`'s router on Step::x's first `rows` rows -> Step::experts and ::weights
  // ([rows, top_k]); nonzero: it failed (the caller keeps why).
  int (*route)(int64_t layer, int64_t rows);
};

// One step's rows and the caller's buffers, all contiguous. Sequence s owns rows
// [q_start[s], q_start[s] + q_len[s]) (positions ctx_len - q_len .. ctx_len - 1, whose K/V this
// step writes); row j of it sees its cached context and the sequence's rows 0..j.
struct Step {
  int64_t rows;
  const void* embed;  // [rows, hidden] the tokens' embeddings
  void* out;          // [rows, hidden] the final norm's output
  void* h;            // [rows, hidden]
  void* residual;     // [rows, hidden]
  void* x;            // [rows, hidden]
  void* qkv;          // [rows, (hq + 2 hkv) d]
  void* q;            // [rows, hq d]
  void* attn;         // [rows, hq d]
  void* gate_up;      // [rows, 2 inter]
  void* act;          // [rows, inter]
  const int64_t* positions;
  const int64_t* slots;
  const int32_t* tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* ctx_len;
  int64_t num_seqs;
  int64_t* experts;   // [rows, top_k] the router's choices (MoE layers)
  void* weights;      // [rows, top_k] their routing weights
  void* moe_scratch;  // inferd_moe_layer's: rows * top_k * (2 hidden + 3 inter) values
  int64_t* counts;    // [experts] rows routed to each in this layer
};

int linear(const Lin& l, const void* x, int64_t rows, void* y, int dtype) {
  switch (l.kernel) {
    case kPanel:
      return inferd_gemm_panel(x, rows, l.k, l.panel, l.n, l.k, l.bias, y, l.n, dtype);
    case kGemvInt8:
      return inferd_gemv_int8(x, rows, l.k, static_cast<const int8_t*>(l.w), l.n, l.k, l.scale,
                              l.row_sum, static_cast<const float*>(l.bias), y, l.n, dtype);
    default:
      return -1;
  }
}

// The MLP of layer `index` on x (its post-attention norm) -> h.
int mlp(const Model& m, const Layer& L, int64_t index, const Step& s) {
  const int dt = m.dtype;
  if (L.moe == nullptr) {
    int rc = linear(L.gate_up, s.x, s.rows, s.gate_up, dt);
    if (rc == 0) rc = inferd_silu_mul(s.act, s.gate_up, dt, s.rows, m.inter);
    if (rc == 0) rc = linear(L.down, s.act, s.rows, s.h, dt);
    return rc;
  }
  const Moe& e = *L.moe;
  if (m.route(index, s.rows) != 0) return -3;
  const int rc = inferd_moe_layer(s.x, m.hidden, s.rows, s.experts, s.weights, e.experts, e.top_k,
                                  e.w13, e.w2, static_cast<int>(e.kernel), e.max_rows,
                                  m.hidden, e.inter, s.counts, s.moe_scratch, s.h, dt);
  for (int64_t j = 0; rc == 0 && j < e.experts; ++j) e.counts[j] += s.counts[j];
  return rc;
}

// Layer `index` (L) on x = norm(its input) (residual: the stream up to its input): leaves the
// layer's output less the residual in h, the residual updated to its attention half. Returns the
// first nonzero return code of its kernels (0: all ran).
int layer(const Model& m, const Layer& L, int64_t index, const Step& s) {
  const int64_t rows = s.rows, hid = m.hidden;
  const int dt = m.dtype;
  int rc = linear(L.qkv, s.x, rows, s.qkv, dt);
  if (rc == 0)
    rc = inferd_rope_qkv(s.qkv, L.qkv.n, dt, rows, static_cast<int>(m.hq),
                         static_cast<int>(m.hkv), static_cast<int>(m.d), s.positions, m.cos,
                         m.sin, m.max_pos, L.q_norm, L.k_norm, m.qk_eps, s.q, L.kv_cache,
                         m.kv_dtype, m.num_blocks * m.block_size, s.slots);
  if (rc == 0)
    rc = inferd_paged_attention(s.attn, s.q, dt, L.kv_cache, m.kv_dtype, m.num_blocks,
                                static_cast<int>(m.block_size), static_cast<int>(m.hq),
                                static_cast<int>(m.hkv), static_cast<int>(m.d), s.tables,
                                static_cast<int>(s.table_stride), s.q_start, s.q_len, s.ctx_len,
                                static_cast<int>(s.num_seqs), m.scale, static_cast<int>(L.window),
                                nullptr);  // no sinks: a model with them has no decode plan
  if (rc == 0) rc = linear(L.o, s.attn, rows, s.h, dt);
  if (rc == 0)
    rc = inferd_rms_norm(s.x, hid, s.h, hid, s.residual, L.post_norm, dt, rows, hid, m.eps);
  if (rc == 0) rc = mlp(m, L, index, s);
  return rc;
}

}  // namespace

extern "C" {

// Returns 0; otherwise the failing kernel's code (-1 bad arguments, -2 a position, slot or expert
// id out of range, -3 the router's callback failed), after which the output and the KV cache are
// unspecified.
int inferd_decode_layers(const Model* m, const Step* s) {
  const int64_t hid = m->hidden, rows = s->rows;
  const int dt = m->dtype;
  // The residual stream starts as the embeddings; the first layer's input is their norm.
  std::memcpy(s->residual, s->embed, static_cast<size_t>(rows * hid * (dt == 0 ? 4 : 2)));
  int rc = inferd_rms_norm(s->x, hid, s->embed, hid, nullptr, m->layers[0].in_norm, dt, rows, hid,
                           m->eps);
  for (int64_t i = 0; i < m->num_layers && rc == 0; ++i) {
    rc = layer(*m, m->layers[i], i, *s);
    // Add the layer's output into the residual stream and norm it for the next layer, or with
    // the model's final norm into `out`.
    const bool last = i + 1 == m->num_layers;
    if (rc == 0)
      rc = inferd_rms_norm(last ? s->out : s->x, hid, s->h, hid, s->residual,
                           last ? m->final_norm : m->layers[i + 1].in_norm, dt, rows, hid, m->eps);
  }
  return rc;
}

}  // extern "C"
