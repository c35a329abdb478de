#include "run_record.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>

namespace dtrain::train {

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// `path` made absolute (the report may run elsewhere); empty stays empty.
std::string absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

}  // namespace

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string make_run_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("{:016x}", v);
}

int restart_attempt() {
  const std::string v = env_or_empty("DTRAIN_RESTART");
  return v.empty() ? 0 : std::atoi(v.c_str());
}

nlohmann::json start_record(const TrainConfig& cfg, int world, int64_t resumed_step, int64_t total_steps,
                            const std::string& run_id) {
  nlohmann::json r{{"event", "start"},
                   {"time", unix_seconds()},
                   {"run_id", run_id},
                   {"attempt", restart_attempt()},
                   {"world", world},
                   {"dp", cfg.dp},
                   {"pp", cfg.pp},
                   {"tp", cfg.tp},
                   {"model", cfg.model},
                   {"batch_size", cfg.batch_size},
                   {"steps", total_steps},
                   {"resumed_step", resumed_step},
                   {"log_every", cfg.log_every},
                   {"trace", absolute(cfg.trace)},
                   {"checkpoint_dir", absolute(cfg.checkpoint_dir)},
                   {"flight_dir", absolute(env_or_empty("DTRAIN_FLIGHT_DIR"))}};
  // Set by dtrain launch when it starts the job again after a failure (or an elastic round ended).
  const std::string reason = env_or_empty("DTRAIN_RESTART_REASON");
  if (!reason.empty()) r["restart_reason"] = reason;
  const std::string failed_at = env_or_empty("DTRAIN_RESTART_FAILED_AT");
  if (!failed_at.empty()) r["failed_at"] = std::strtod(failed_at.c_str(), nullptr);
  const std::string failed_records = env_or_empty("DTRAIN_RESTART_FLIGHT_DIR");
  if (!failed_records.empty()) r["failed_flight_dir"] = failed_records;
  return r;
}

}  // namespace dtrain::train
