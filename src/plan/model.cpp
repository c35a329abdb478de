// Model shapes for the planner: dtrain's MLP and GPT block by block, and GPTs by parameter count.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/plan/plan.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::plan {

Precision f32_precision() { return Precision{}; }

Precision mixed_precision() { return Precision{"mixed", 2, 2, 4, 2}; }

int64_t ModelSpec::params() const {
  int64_t n = 0;
  for (const auto& b : blocks) n += b.params;
  return n;
}

double ModelSpec::flops_per_sample() const {
  double f = 0.0;
  for (const auto& b : blocks) f += b.flops;
  return f;
}

std::vector<double> ModelSpec::block_flops() const {
  std::vector<double> f;
  for (const auto& b : blocks) f.push_back(b.flops);
  return f;
}

std::vector<int64_t> ModelSpec::block_params() const {
  std::vector<int64_t> p;
  for (const auto& b : blocks) p.push_back(b.params);
  return p;
}

ModelSpec mlp_spec(int64_t in, const std::vector<int64_t>& hidden, int64_t classes) {
  DT_CHECK(in > 0 && classes > 0, "plan", "MLP needs positive input and class counts, got {} and {}", in, classes);
  std::vector<int64_t> widths{in};
  for (int64_t h : hidden) {
    DT_CHECK(h > 0, "plan", "--hidden width {} must be positive", h);
    widths.push_back(h);
  }
  widths.push_back(classes);
  ModelSpec m;
  m.kind = "mlp";
  m.precision = f32_precision();
  std::vector<std::string> w;
  w.reserve(widths.size());
  for (int64_t x : widths) w.push_back(std::to_string(x));
  m.description = fmt::format("mlp {}", fmt::join(w, "-"));
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    const double out = static_cast<double>(widths[i + 1]);
    BlockSpec b;
    b.name = "fc" + std::to_string(i);
    b.flops = 2.0 * static_cast<double>(widths[i] * widths[i + 1]);
    b.params = widths[i] * widths[i + 1] + widths[i + 1];
    // Kept for backward: the ReLU's output (its backward reads it; the linear's output is freed),
    // or on the last block the logits the loss reads. The input is the previous block's output.
    b.act_bytes = 4.0 * out;
    b.out_bytes = 4.0 * out;
    m.blocks.push_back(b);
  }
  return m;
}

namespace {

// Blocks of a GPT-2 style model: embedding, `layers` transformer blocks, head (untied).
// Per sample = per token x seq_len. `act_block` and `act_block_tp` are the bytes per token a block
// keeps, replicated and sharded over tensor-parallel ranks.
ModelSpec gpt_blocks(int64_t layers, int64_t width, int64_t heads, int64_t seq_len, int64_t vocab,
                     const Precision& prec, double act_embed, double act_block, double act_block_tp, double act_head) {
  const double c = static_cast<double>(width), t = static_cast<double>(seq_len), v = static_cast<double>(vocab);
  ModelSpec m;
  m.kind = "gpt";
  m.precision = prec;
  m.tokens_per_sample = seq_len;
  m.heads = heads;
  m.width = width;
  BlockSpec embed;
  embed.name = "embed";
  embed.flops = c * t;
  embed.params = vocab * width + seq_len * width;
  embed.act_bytes = act_embed * t;
  embed.out_bytes = prec.act_bytes * c * t;
  m.blocks.push_back(embed);
  for (int64_t l = 0; l < layers; ++l) {
    BlockSpec b;
    b.name = "h" + std::to_string(l);
    // As nn::Gpt::block_flops: 24 C^2 of matmuls and 4 T C of attention per token, all of it
    // split by tensor parallelism (heads and MLP features).
    b.flops = (24.0 * c * c + 4.0 * t * c) * t;
    b.tp_flops = b.flops;
    b.params = 12 * width * width + 13 * width;
    // Sharded: qkv, fc (weights and biases), proj and fc_proj weights; replicated: the two
    // LayerNorms and the row-parallel biases.
    b.tp_params = 12 * width * width + 7 * width;
    b.act_bytes = act_block * t;
    b.tp_act_bytes = act_block_tp * t;
    b.out_bytes = prec.act_bytes * c * t;
    b.tp_all_reduces = 2;
    m.blocks.push_back(b);
  }
  BlockSpec head;
  head.name = "head";
  head.flops = (2.0 * c * v + 8.0 * c) * t;
  head.params = width * vocab + 2 * width;
  head.act_bytes = act_head * t;
  head.out_bytes = prec.act_bytes * v * t;
  m.blocks.push_back(head);
  return m;
}

}  // namespace

ModelSpec gpt_spec(int64_t layers, int64_t width, int64_t heads, int64_t seq_len, int64_t vocab) {
  DT_CHECK(layers > 0 && width > 0 && heads > 0 && seq_len > 0 && vocab > 0, "plan",
           "--layers {}, --width {}, --heads {}, --seq-len {}, --vocab {} must be positive", layers, width, heads,
           seq_len, vocab);
  DT_CHECK(width % heads == 0, "plan", "--width {} is not divisible by --heads {}", width, heads);
  const double c = static_cast<double>(width), h = static_cast<double>(heads), t = static_cast<double>(seq_len);
  const double v = static_cast<double>(vocab);
  // What dtrain's autograd keeps per token (f32; the allocator agrees exactly, see plan_test):
  // the embedding's output (C); a block's LayerNorm outputs (2C) and their statistics (4), its
  // output (C) and the residual stream h (C), replicated over tensor-parallel ranks; qkv (3C), the
  // attention's softmax (its probabilities, H T, on the library's route; each row's shift and
  // 1 / sum, 2 H, where the attention runs on dtrain's kernels and computes them again in
  // backward), the attention output (C), fc and GELU outputs (4C + 4C), sharded; the head's
  // LayerNorm output (C) and statistics (2) and the logits (V).
  const double softmax = ops::attention_f32_kernel() ? 2 * h : h * t;
  ModelSpec m = gpt_blocks(layers, width, heads, seq_len, vocab, f32_precision(), 4.0 * c, 4.0 * (4 * c + 4),
                           4.0 * (12 * c + softmax), 4.0 * (c + v + 2));
  m.description =
      fmt::format("gpt {} layers x width {}, {} heads, seq-len {}, vocab {}", layers, width, heads, seq_len, vocab);
  return m;
}

ModelSpec gpt_by_params(double params, int64_t seq_len, int64_t vocab, int64_t layers, int64_t width, int64_t heads) {
  DT_CHECK(params > 0 || (layers > 0 && width > 0), "plan", "--params {} must be positive", params);
  DT_CHECK(seq_len > 0 && vocab > 0, "plan", "--seq-len {} and --vocab {} must be positive", seq_len, vocab);
  // Published shapes (GPT-3 table 2.1; 70B as Llama 2's width and depth), the nearest in log
  // scale when within 25%; otherwise width = 128 x layers and 128-wide heads.
  struct Shape {
    double params;
    int64_t layers, width, heads;
  };
  static constexpr Shape kShapes[] = {{125e6, 12, 768, 12},  {350e6, 24, 1024, 16}, {760e6, 24, 1536, 16},
                                      {1.3e9, 24, 2048, 16}, {2.7e9, 32, 2560, 32}, {6.7e9, 32, 4096, 32},
                                      {13e9, 40, 5120, 40},  {30e9, 48, 7168, 56},  {70e9, 80, 8192, 64},
                                      {175e9, 96, 12288, 96}};
  if (layers <= 0 || width <= 0) {
    const Shape* best = nullptr;
    for (const Shape& s : kShapes) {
      if (best == nullptr || std::abs(std::log(s.params / params)) < std::abs(std::log(best->params / params))) {
        best = &s;
      }
    }
    int64_t l = best->layers, w = best->width, h = best->heads;
    if (std::abs(std::log(best->params / params)) > std::log(1.25)) {
      l = std::max<int64_t>(1, std::llround(std::cbrt(params / (12.0 * 128 * 128))));
      w = 128 * l;
      h = l;
    }
    if (layers <= 0) layers = l;
    if (width <= 0) width = w;
    if (heads <= 0) heads = width == w ? h : std::max<int64_t>(1, width / 128);
  }
  if (heads <= 0) heads = std::max<int64_t>(1, width / 128);
  DT_CHECK(width % heads == 0, "plan", "--width {} is not divisible by --heads {}", width, heads);
  const double c = static_cast<double>(width), h = static_cast<double>(heads), t = static_cast<double>(seq_len);
  const double v = static_cast<double>(vocab);
  // Korthikanti et al. 2022 (no sequence parallelism), bytes per token of a block: 10C
  // replicated, 24C + 5 H T sharded (bf16 tensors, 1-byte dropout masks); the embedding's output
  // and mask 3C; the head's LayerNorm output (2C), bf16 logits and their f32 softmax (6V).
  ModelSpec m = gpt_blocks(layers, width, heads, seq_len, vocab, mixed_precision(), 3 * c, 10 * c, 24 * c + 5 * h * t,
                           2 * c + 6 * v);
  m.description = fmt::format("gpt {} layers x width {}, {} heads, seq-len {}, vocab {} ({:.3g} parameters)", layers,
                              width, heads, seq_len, vocab, static_cast<double>(m.params()));
  return m;
}

}  // namespace dtrain::plan
