// Tensor parallelism (Megatron-LM): each transformer block's weight matrices are split over the
// T ranks of a tensor-parallel group, so every rank holds and computes 1/T of the block.
//
// Vocabulary: a column-parallel linear splits the weight's output rows (each rank computes
// some output features, no communication); a row-parallel linear splits its input columns
// (each rank computes a partial sum of every output, summed by an all_reduce). A parallel
// region is a column-parallel linear, a local op, then a row-parallel linear:
//   attention: ln1 -> tp_copy -> qkv (column: this rank's heads' q, k, v) -> causal_attention
//              on the local heads -> proj (row) -> tp_reduce -> + proj.bias
//   MLP:       ln2 -> tp_copy -> fc (column) -> gelu -> fc_proj (row) -> tp_reduce -> + fc_proj.bias
// tp_copy (Megatron's f) is the identity forward and all-reduces the gradient backward;
// tp_reduce (g) all-reduces forward and is the identity backward. Everything outside the
// parallel regions (LayerNorms, residuals, the row-parallel biases, embedding, head) is
// replicated: every rank computes it on the same values, and its gradients come out equal on
// every rank (bitwise, as each all_reduce hands every rank the same sum), so replicated
// parameters stay identical after an identical optimizer step without further communication.
//
// How a step goes (ranks of `tp` see the same batch):
//   auto model = std::make_shared<nn::Gpt>(cfg, seed);           // same seed on every rank
//   auto specs = tensor_parallelize(*model, tp, cfg.heads);      // now holds this rank's shards
//   optim::AdamW opt(model->parameters(), lr);                    // over the shards
//   loss(model->forward(x), y).backward(); opt.step(); opt.zero_grad();
// Checkpoints and comparisons rebuild full tensors with gather_shards(param, specs[name], tp).
//
// Dropout: the block's own Dropout module (and its generator) is kept as "drop" and applied, as
// in nn::TransformerBlock, to the replicated outputs of the two regions, so every rank draws the
// same masks as the single process (tested at p = 0.2). This holds while dropout runs only on
// replicated tensors; a dropout inside a parallel region would need per-rank generators.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "dtrain/comm/group.h"
#include "dtrain/nn/module.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::parallel {

/// Autograd-aware communication over `tp` (collective: every rank calls it in the same order).
/// tp_copy: forward the identity (shares x's storage); backward all_reduce(sum) of the gradient.
Tensor tp_copy(const Tensor& x, comm::Group& tp);
/// tp_reduce: forward all_reduce(sum) into a new tensor; backward the identity.
Tensor tp_reduce(const Tensor& x, comm::Group& tp);

/// How a parameter of the full model is split over the T tensor-parallel ranks.
/// dim < 0: replicated (every rank holds the whole tensor). Otherwise the full tensor's
/// dimension `dim` is viewed as (groups, T, piece) and rank r holds [:, r, :] of it
/// (groups = 3 for the fused qkv weight/bias laid out [q | k | v], 1 otherwise).
struct ShardSpec {
  int dim = -1;
  int groups = 1;
};

/// Rank `rank`'s piece of `full` (of `world` ranks) as a new contiguous tensor (no autograd);
/// a replicated spec gives a copy. Throws dtrain::Error when the split does not divide.
Tensor shard_tensor(const Tensor& full, ShardSpec spec, int rank, int world);
/// Collective over tp: every rank gets the full tensor back from the ranks' pieces (no
/// autograd). A replicated spec gives a copy of `piece` without communicating.
Tensor gather_shards(const Tensor& piece, ShardSpec spec, comm::Group& tp);

/// Replaces, in place, every nn::TransformerBlock among the top-level blocks of `model` (built
/// identically on every rank of `tp`, so the full weights agree) by a tensor-parallel block
/// holding rank tp.rank()'s shard, as described above. Other blocks stay replicated; `model`
/// may be a pipeline stage holding only some of a GPT's blocks. Parameter names are unchanged
/// ("h0.qkv.weight" is now this rank's piece of it). The parallel blocks keep a handle on `tp`.
/// Returns the ShardSpec of every parameter of the model, by name.
/// Throws dtrain::Error when `heads` differs from a block's, when the width or `heads` is not
/// divisible by tp.size(), or when a block is already tensor-parallel.
std::map<std::string, ShardSpec> tensor_parallelize(nn::Sequential& model, comm::Group& tp, int64_t heads);

}  // namespace dtrain::parallel
