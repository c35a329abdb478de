// The trainer's state as a checkpoint shard, and back (internal to src/train): parameters and
// optimizer state by parameter name, whole even under ZeRO, so that any data-parallel or
// pipeline layout can load what another wrote.
#pragma once

#include <cstdint>

#include "dtrain/checkpoint/checkpoint.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optim.h"
#include "dtrain/parallel/ddp.h"
#include "dtrain/parallel/mesh.h"

namespace dtrain::train {

/// This rank's shard after `step` optimizer steps. Collective over the data-parallel replicas
/// under ZeRO (the optimizer state is gathered whole); `ddp` may be null.
checkpoint::CheckpointShard checkpoint_shard(int64_t step, const nn::Model& model, const optim::Optimizer& optimizer,
                                             const parallel::DataParallel* ddp);

/// Loads checkpoint `found`, written by any data-parallel / pipeline / ZeRO layout: this rank's
/// parameters by name from the shards of the writer's first replica (its stages with this
/// rank's tensor-parallel coordinate), its optimizer state cut to this layout. Collective over
/// the replicas when they share parameters or shard the optimizer. The compression state
/// ("comm/" entries) is left to the caller.
void restore_checkpoint(const checkpoint::Checkpointer& ckpt, const checkpoint::CheckpointFound& found,
                        nn::Model& model, optim::Optimizer& optimizer, parallel::DataParallel* ddp,
                        const parallel::MeshCoord& coord);

}  // namespace dtrain::train
