// Optimizer state offloaded to disk (--offload DIR): each state tensor lives in a file under DIR,
// memory-mapped (MAP_SHARED). The optimizer steps through its state in chunks of kOffloadChunk
// elements and releases each chunk when done (madvise MADV_DONTNEED: the pages leave this
// process, their values stay in the page cache and reach the file), so the state takes at most a
// chunk of resident memory per state tensor being stepped, whatever its size.
//
// The files are scratch, not a checkpoint: checkpoints copy the state into their own files, so a
// crash in the middle of a step (files half updated) never touches a checkpoint, and a run
// starts its files anew (a resumed run fills them from its checkpoint).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/optim/optim.h"

namespace dtrain::optim {

/// Elements per chunk the step streams: a multiple of the quantization block and of a page for
/// every dtype (4 KiB pages of f32, 1 MiB per f32 chunk).
constexpr int64_t kOffloadChunk = int64_t{1} << 18;

/// State in memory-mapped files created as DIR/NAME.state and unlinked at once (DIR is created
/// when missing; nothing stays there, even after a kill). Throws dtrain::Error naming the file
/// when it cannot be created, sized or mapped.
std::shared_ptr<StateStorage> offload_storage(const std::string& dir);

}  // namespace dtrain::optim
