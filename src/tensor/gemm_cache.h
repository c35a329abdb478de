// The auto policy's calibrations on disk (gemm.h): one file per machine signature (CPU model,
// libraries, their kernels), shared by every process on the machine under an exclusive lock, so
// that the first process to meet a shape decides it for all that come after, and concurrent ones
// (data-parallel ranks) wait for that decision instead of making their own.
//
// Where: DTRAIN_GEMM_CACHE (a folder; "off" or empty: nowhere), else $XDG_CACHE_HOME/dtrain, else
// $HOME/.cache/dtrain; the file is gemm-auto-<hash of the signature>.txt. A folder that cannot be
// written means nowhere: calibrations then live in the process only.
//
// Format (text): the line "dtrain-gemm-auto 1", the line "# <signature>", then one line per
// shape: trans_a trans_b M N K threads library openblas_s onednn_s. A file whose first line or
// signature differs is ignored (and left alone); a malformed shape line is skipped.
#pragma once

#include <string>
#include <vector>

#include "dtrain/tensor/gemm.h"

namespace dtrain::detail {

/// The file for `signature`, or "" when persistence is off.
std::string gemm_cache_path(const std::string& signature);

/// The cache file opened and locked for as long as this object lives.
class GemmCacheFile {
 public:
  explicit GemmCacheFile(const std::string& signature);
  ~GemmCacheFile();
  GemmCacheFile(const GemmCacheFile&) = delete;
  GemmCacheFile& operator=(const GemmCacheFile&) = delete;

  /// False when persistence is off or the file could not be opened and locked.
  bool is_open() const { return fd_ >= 0 && valid_; }
  /// The shapes decided so far, in file order.
  const std::vector<GemmCalibration>& entries() const { return entries_; }
  /// Appends one decision (flushed before the lock is released).
  void append(const GemmCalibration& cal);

 private:
  std::string signature_;
  int fd_ = -1;
  bool valid_ = false;  // the file is ours: right header and signature (or new)
  std::vector<GemmCalibration> entries_;
};

}  // namespace dtrain::detail
