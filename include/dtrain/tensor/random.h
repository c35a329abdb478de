// A deterministic random generator: the same seed gives the same stream on every platform
// (std::normal_distribution is implementation-defined, so normals are drawn by hand).
#pragma once

#include <cstdint>
#include <random>
#include <string>

namespace dtrain {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : engine_(seed) {}
  void seed(uint64_t s) {
    engine_.seed(s);
    has_spare_ = false;
  }
  uint64_t next_u64() { return engine_(); }
  /// Uniform in [0, 1) with 24 random bits.
  float uniform() { return static_cast<float>(engine_() >> 40) * (1.0f / 16777216.0f); }
  /// Uniform integer in [0, n).
  uint64_t below(uint64_t n);
  /// Standard normal (Box-Muller).
  float normal();
  /// Serialises the full state (for checkpoints).
  std::string state() const;
  void set_state(const std::string& state);

 private:
  std::mt19937_64 engine_;
  bool has_spare_ = false;
  float spare_ = 0.0f;
};

}  // namespace dtrain
