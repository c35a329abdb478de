// Model files and parameter digests.
//
// Format (little-endian): magic "DTRAINMD", u32 version (1), u32 metadata length, metadata
// (JSON text), u32 tensor count, then per tensor: u32 name length, name, u8 dtype, u32 ndim,
// i64 dims[ndim], u64 byte count, data; then the SHA-256 of every preceding byte. Files are
// written to a temporary name, fsynced and renamed, so a crash never leaves a partial file
// under the final name.
#pragma once

#include <string>
#include <vector>

#include "dtrain/core/file.h"  // write_file_atomic
#include "dtrain/nn/module.h"

namespace dtrain::checkpoint {

struct ModelFile {
  std::string metadata;  // JSON: model kind and shape options
  std::vector<nn::NamedTensor> tensors;
};

void save_model(const std::string& path, const ModelFile& file);
/// The bytes save_model writes.
std::string encode_model(const ModelFile& file);
/// Throws dtrain::Error naming the file for a missing, truncated, corrupted or foreign file.
ModelFile load_model(const std::string& path);
/// The same for a file's bytes; `where` names them in errors.
ModelFile decode_model(const std::string& bytes, const std::string& where);

/// SHA-256 (hex) of the tensors' values as little-endian f32, in the given order.
std::string params_digest(const std::vector<nn::NamedTensor>& tensors);
std::string sha256_hex(const void* data, size_t size);

struct TensorDiff {
  std::string name;
  double max_abs = 0.0;  // max |a - b|
  double rel = 0.0;      // max |a - b| / max |a| (0 when both are all zero)
};
struct DiffResult {
  std::vector<TensorDiff> tensors;
  double max_abs = 0.0;
  double max_rel = 0.0;
};
/// Compares two models tensor by tensor; names, order and shapes must match.
DiffResult diff_models(const ModelFile& a, const ModelFile& b);

}  // namespace dtrain::checkpoint
