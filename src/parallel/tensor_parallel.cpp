// Tensor parallelism: the f / g communication ops, shard layout, and the tensor-parallel
// transformer block that replaces nn::TransformerBlock.
#include "dtrain/parallel/tensor_parallel.h"

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/nn/layers.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::parallel {

namespace {

// Sum of `x` over the group into a new contiguous tensor.
Tensor all_reduce_sum(const Tensor& x, comm::Group& tp) {
  Tensor in = x.contiguous();
  Tensor out = Tensor::empty(in.shape());
  tp.all_reduce(in.data(), out.data(), static_cast<size_t>(in.numel()), comm::DataType::f32, comm::ReduceOp::sum);
  return out;
}

struct TpCopyBackward : Node {
  comm::Group tp;
  std::vector<Tensor> apply(const Tensor& g) override { return {all_reduce_sum(g, tp)}; }
  const char* name() const override { return "tp_copy"; }
};

struct TpReduceBackward : Node {
  std::vector<Tensor> apply(const Tensor& g) override { return {g}; }
  const char* name() const override { return "tp_reduce"; }
};

// The split of dimension `dim` of `shape` as (outer, groups, world, piece, inner) blocks:
// full[o, g, r, p, i] is rank r's piece[o, g, p, i].
struct Layout {
  int64_t outer = 1, inner = 1, piece = 0;
  Shape piece_shape;
};

Layout layout_of(const char* op, const Shape& full_shape, ShardSpec spec, int world) {
  const auto d = static_cast<int64_t>(spec.dim);
  DT_CHECK(d < static_cast<int64_t>(full_shape.size()), "parallel", "{}: shard dim {} of a tensor of shape {}", op,
           spec.dim, shape_str(full_shape));
  DT_CHECK(spec.groups > 0 && world > 0, "parallel", "{}: groups {} and world {} must be positive", op, spec.groups,
           world);
  const int64_t split = static_cast<int64_t>(spec.groups) * world;
  DT_CHECK(full_shape[static_cast<size_t>(d)] % split == 0, "parallel",
           "{}: dimension {} of shape {} ({}) is not divisible by {} groups x {} ranks", op, spec.dim,
           shape_str(full_shape), full_shape[static_cast<size_t>(d)], spec.groups, world);
  Layout l;
  for (int64_t i = 0; i < d; ++i) l.outer *= full_shape[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(d) + 1; i < full_shape.size(); ++i) l.inner *= full_shape[i];
  l.piece = full_shape[static_cast<size_t>(d)] / split;
  l.piece_shape = full_shape;
  l.piece_shape[static_cast<size_t>(d)] = l.piece * spec.groups;
  return l;
}

// Copies, for every (outer, group), `piece * inner` floats between full and piece layouts.
// to_piece: full -> piece of `rank`; otherwise piece of `rank` -> full.
void copy_blocks(const Layout& l, int groups, int rank, int world, float* full, float* piece, bool to_piece) {
  const int64_t run = l.piece * l.inner;
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int64_t g = 0; g < groups; ++g) {
      float* f = full + ((o * groups + g) * world + rank) * run;
      float* p = piece + (o * groups + g) * run;
      if (to_piece) {
        std::memcpy(p, f, static_cast<size_t>(run) * sizeof(float));
      } else {
        std::memcpy(f, p, static_cast<size_t>(run) * sizeof(float));
      }
    }
  }
}

// A Linear whose weight (and bias) hold this rank's piece; registers "weight" and "bias" so
// names match nn::Linear. forward() is the column-parallel form; a row-parallel owner calls
// ops::linear without the bias and adds it after the reduce.
class ShardLinear : public nn::Module {
 public:
  ShardLinear(const nn::Linear& full, ShardSpec weight_spec, ShardSpec bias_spec, int rank, int world) {
    weight = register_parameter("weight", shard_tensor(full.weight, weight_spec, rank, world));
    if (full.bias.defined()) bias = register_parameter("bias", shard_tensor(full.bias, bias_spec, rank, world));
  }
  Tensor forward(const Tensor& x) override { return ops::linear(x, weight, bias); }
  Tensor weight, bias;
};

constexpr ShardSpec kReplicated{};
constexpr ShardSpec kQkv{0, 3};     // rows [q | k | v], each split by heads
constexpr ShardSpec kColumn{0, 1};  // output features (weight rows, bias)
constexpr ShardSpec kRow{1, 1};     // input features (weight columns)

// The specs of a tensor-parallel block's parameters, by name relative to the block.
const std::map<std::string, ShardSpec>& block_specs() {
  static const std::map<std::string, ShardSpec> specs = {
      {"qkv.weight", kQkv},   {"qkv.bias", kQkv},   {"proj.weight", kRow},
      {"fc.weight", kColumn}, {"fc.bias", kColumn}, {"fc_proj.weight", kRow},
  };
  return specs;
}

/// nn::TransformerBlock with its attention heads and MLP hidden features split over `tp`.
/// Shapes on a rank of T: x (B, S, C); qkv (B, S, 3C/T) laid out [q_r | k_r | v_r];
/// attention (B, S, C/T) over heads/T heads; fc (B, S, 4C/T).
class TpTransformerBlock : public nn::Module {
 public:
  TpTransformerBlock(const nn::TransformerBlock& full, comm::Group tp)
      : tp_(std::move(tp)), local_heads_(full.heads() / tp_.size()) {
    const int r = tp_.rank(), t = tp_.size();
    ln1_ = register_module("ln1", full.ln1());
    qkv_ = register_module("qkv", std::make_shared<ShardLinear>(*full.qkv(), kQkv, kQkv, r, t));
    proj_ = register_module("proj", std::make_shared<ShardLinear>(*full.proj(), kRow, kReplicated, r, t));
    ln2_ = register_module("ln2", full.ln2());
    fc_ = register_module("fc", std::make_shared<ShardLinear>(*full.fc(), kColumn, kColumn, r, t));
    fc_proj_ = register_module("fc_proj", std::make_shared<ShardLinear>(*full.fc_proj(), kRow, kReplicated, r, t));
    drop_ = register_module("drop", full.drop());
  }

  Tensor forward(const Tensor& x) override {
    Tensor att = ops::causal_attention(qkv_->forward(tp_copy(ln1_->forward(x), tp_)), local_heads_);
    Tensor a = ops::add(tp_reduce(ops::linear(att, proj_->weight, Tensor()), tp_), proj_->bias);
    Tensor h = ops::add(x, drop_->forward(a));
    Tensor m = ops::gelu(fc_->forward(tp_copy(ln2_->forward(h), tp_)));
    Tensor mo = ops::add(tp_reduce(ops::linear(m, fc_proj_->weight, Tensor()), tp_), fc_proj_->bias);
    return ops::add(h, drop_->forward(mo));
  }

 private:
  comm::Group tp_;  // a shared handle: keeps the group alive as long as the block
  int64_t local_heads_;
  std::shared_ptr<nn::LayerNorm> ln1_, ln2_;
  std::shared_ptr<ShardLinear> qkv_, proj_, fc_, fc_proj_;
  std::shared_ptr<nn::Dropout> drop_;
};

}  // namespace

Tensor tp_copy(const Tensor& x, comm::Group& tp) {
  if (!autograd::needs_grad({&x})) return x;
  Tensor out = x.detach();
  auto node = std::make_shared<TpCopyBackward>();
  node->tp = tp;
  autograd::attach(out, node, {&x});
  return out;
}

Tensor tp_reduce(const Tensor& x, comm::Group& tp) {
  DT_CHECK(x.defined() && x.dtype() == DType::f32, "parallel", "tp_reduce: expected a defined f32 tensor, got {}",
           x.defined() ? x.str() : std::string("undefined"));
  Tensor out = all_reduce_sum(x, tp);
  if (autograd::needs_grad({&x})) autograd::attach(out, std::make_shared<TpReduceBackward>(), {&x});
  return out;
}

Tensor shard_tensor(const Tensor& full, ShardSpec spec, int rank, int world) {
  DT_CHECK(full.defined() && full.dtype() == DType::f32, "parallel", "shard_tensor: expected a defined f32 tensor");
  DT_CHECK(rank >= 0 && rank < world, "parallel", "shard_tensor: rank {} of {}", rank, world);
  if (spec.dim < 0) return full.detach().clone();
  const Layout l = layout_of("shard_tensor", full.shape(), spec, world);
  Tensor src = full.detach().contiguous();
  Tensor piece = Tensor::empty(l.piece_shape);
  copy_blocks(l, spec.groups, rank, world, src.data(), piece.data(), true);
  return piece;
}

Tensor gather_shards(const Tensor& piece_in, ShardSpec spec, comm::Group& tp) {
  DT_CHECK(piece_in.defined() && piece_in.dtype() == DType::f32, "parallel",
           "gather_shards: expected a defined f32 tensor");
  if (spec.dim < 0) return piece_in.detach().clone();
  const int world = tp.size();
  DT_CHECK(spec.dim < piece_in.dim() && spec.groups > 0 && piece_in.size(spec.dim) % spec.groups == 0, "parallel",
           "gather_shards: piece {} cannot be split in {} groups along dim {}", shape_str(piece_in.shape()),
           spec.groups, spec.dim);
  Shape full_shape = piece_in.shape();
  full_shape[static_cast<size_t>(spec.dim)] *= world;
  const Layout l = layout_of("gather_shards", full_shape, spec, world);
  Tensor piece = piece_in.detach().contiguous();
  const auto count = static_cast<size_t>(piece.numel());
  // The ranks' pieces side by side, then each moved to its place in the full layout.
  std::vector<float> all(count * static_cast<size_t>(world));
  tp.all_gather(piece.data(), all.data(), count, comm::DataType::f32);
  Tensor full = Tensor::empty(full_shape);
  for (int r = 0; r < world; ++r) {
    copy_blocks(l, spec.groups, r, world, full.data(), all.data() + count * static_cast<size_t>(r), false);
  }
  return full;
}

std::map<std::string, ShardSpec> tensor_parallelize(nn::Sequential& model, comm::Group& tp, int64_t heads) {
  const int t = tp.size();
  // Every check first, so that a failure leaves the model as it was.
  std::vector<size_t> targets;
  for (size_t i = 0; i < model.num_blocks(); ++i) {
    DT_CHECK(std::dynamic_pointer_cast<TpTransformerBlock>(model.block(i)) == nullptr, "parallel",
             "tensor_parallelize: block '{}' is already tensor-parallel", model.block_name(i));
    auto block = std::dynamic_pointer_cast<nn::TransformerBlock>(model.block(i));
    if (block == nullptr) continue;
    const int64_t width = block->ln1()->weight.numel();
    DT_CHECK(heads == block->heads(), "parallel", "tensor_parallelize: {} heads given, block '{}' has {}", heads,
             model.block_name(i), block->heads());
    DT_CHECK(width % t == 0, "parallel", "tensor_parallelize: width {} is not divisible by tensor-parallel size {}",
             width, t);
    DT_CHECK(heads % t == 0, "parallel", "tensor_parallelize: {} heads are not divisible by tensor-parallel size {}",
             heads, t);
    targets.push_back(i);
  }
  for (size_t i : targets) {
    const auto& block = static_cast<const nn::TransformerBlock&>(*model.block(i));
    auto tp_block = std::make_shared<TpTransformerBlock>(block, tp);
    tp_block->train(block.is_training());
    model.replace_block(i, std::move(tp_block));
  }

  std::map<std::string, ShardSpec> specs;
  for (size_t i = 0; i < model.num_blocks(); ++i) {
    const bool parallel = std::dynamic_pointer_cast<TpTransformerBlock>(model.block(i)) != nullptr;
    for (const auto& [name, param] : model.block(i)->named_parameters()) {
      ShardSpec spec = kReplicated;
      if (parallel) {
        auto it = block_specs().find(name);
        if (it != block_specs().end()) spec = it->second;
      }
      specs[model.block_name(i) + "." + name] = spec;
    }
  }
  return specs;
}

}  // namespace dtrain::parallel
