// Basic vocabulary of the communication library: element types, reduction operators,
// deadlines and the error every failed or timed-out operation raises.
//
// dtrain_comm knows buffers (pointer, count, dtype), never tensors; it depends only on
// dtrain_core.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain::comm {

enum class DataType : uint8_t { f32, bf16, f16, f64, i32, i64, u8 };
enum class ReduceOp : uint8_t { sum, avg, max, min, prod };

size_t size_of(DataType t);
const char* name_of(DataType t);
const char* name_of(ReduceOp op);
/// Parses "f32", "bf16", ...; throws dtrain::Error naming the text.
DataType parse_dtype(const std::string& text);
ReduceOp parse_op(const std::string& text);

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::milliseconds;
using Deadline = Clock::time_point;

inline Deadline deadline_after(Duration d) { return Clock::now() + d; }

/// Raised by every collective and point-to-point call that fails: a timeout, a dead or
/// misbehaving peer, or an error reported by another rank. what() names the operation, its
/// sequence number on the group and the peers involved.
class CommError : public Error {
 public:
  CommError(const std::string& op, uint64_t seq, std::vector<int> peers, const std::string& message, const char* file,
            int line);
  const std::string& op() const { return op_; }
  uint64_t seq() const { return seq_; }
  /// Ranks that did not arrive or failed (empty when unknown).
  const std::vector<int>& peers() const { return peers_; }

 private:
  std::string op_;
  uint64_t seq_;
  std::vector<int> peers_;
};

}  // namespace dtrain::comm
