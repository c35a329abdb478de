// Ending a job that spans several nodes (internal to the launch layer): the node that serves
// the rendezvous store must outlive the others' last use of it.
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/comm/store.h"

namespace dtrain::launch {

/// Adds this node to the count at `done_key`. The node that serves the store (`wait`) then
/// polls until `members` nodes did, `stop_key` (when not empty) appeared, or 60 s passed.
void finish_together(comm::Store& store, const std::string& done_key, int64_t members, bool wait,
                     const std::string& stop_key = "");

}  // namespace dtrain::launch
