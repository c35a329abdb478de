// Ranks of one run must be started with the same options (internal to src/train).
#pragma once

#include <nlohmann/json.hpp>

#include "dtrain/comm/group.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

/// The options that must be the same on every rank: all that shape the math, the data order,
/// the layout and the run's length (outputs, logging and threads may differ).
nlohmann::json run_options(const TrainConfig& cfg);

/// Collective: every rank compares all the ranks' run_options and raises, naming the ranks and
/// the options that differ.
void check_same_options(const TrainConfig& cfg, comm::Group& group);

}  // namespace dtrain::train
