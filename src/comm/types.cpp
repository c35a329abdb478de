#include "dtrain/comm/types.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dtrain::comm {

size_t size_of(DataType t) {
  switch (t) {
    case DataType::f32:
      return 4;
    case DataType::bf16:
    case DataType::f16:
      return 2;
    case DataType::f64:
      return 8;
    case DataType::i32:
      return 4;
    case DataType::i64:
      return 8;
    case DataType::u8:
      return 1;
  }
  return 0;
}

const char* name_of(DataType t) {
  switch (t) {
    case DataType::f32:
      return "f32";
    case DataType::bf16:
      return "bf16";
    case DataType::f16:
      return "f16";
    case DataType::f64:
      return "f64";
    case DataType::i32:
      return "i32";
    case DataType::i64:
      return "i64";
    case DataType::u8:
      return "u8";
  }
  return "?";
}

const char* name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
    case ReduceOp::prod:
      return "prod";
  }
  return "?";
}

DataType parse_dtype(const std::string& text) {
  for (DataType t :
       {DataType::f32, DataType::bf16, DataType::f16, DataType::f64, DataType::i32, DataType::i64, DataType::u8}) {
    if (text == name_of(t)) return t;
  }
  DT_THROW("comm", "unknown dtype '{}' (expected f32, bf16, f16, f64, i32, i64 or u8)", text);
}

ReduceOp parse_op(const std::string& text) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
    if (text == name_of(op)) return op;
  }
  DT_THROW("comm", "unknown reduction '{}' (expected sum, avg, max, min or prod)", text);
}

CommError::CommError(const std::string& op, uint64_t seq, std::vector<int> peers, const std::string& message,
                     const char* file, int line)
    : Error("comm",
            peers.empty() ? fmt::format("{} #{}: {}", op, seq, message)
                          : fmt::format("{} #{}: {} (peers: {})", op, seq, message, fmt::join(peers, ", ")),
            file, line),
      op_(op),
      seq_(seq),
      peers_(std::move(peers)) {}

}  // namespace dtrain::comm
