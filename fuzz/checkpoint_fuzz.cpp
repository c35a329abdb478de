// Fuzz target for the checkpoint readers: the model-file decoder that loads every rank's shard
// (src/checkpoint/model_io.cpp) and the manifest parser (src/checkpoint/checkpoint.cpp).
//
// The first byte picks the reader; the rest is the input.
//  - 0 (even): a shard file. Its trailing SHA-256 is recomputed first, so that mutations
//    reach the decoder behind the checksum. An accepted file re-encodes to exactly its bytes
//    (the format is canonical); a refused one raises dtrain::Error with a message.
//  - 1 (odd): a manifest for step 12 of a fixed layout. Never throws; an accepted manifest
//    lists at least one file, each a plain name with a 64-character checksum.
// Beyond those checks: no crash, no sanitizer report. Built as a libFuzzer binary (clang,
// -DDTRAIN_FUZZ=ON) and as checkpoint_fuzz_replay (replay_main.cpp), which CTest runs.
#include <openssl/evp.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtrain/checkpoint/checkpoint.h"
#include "dtrain/checkpoint/model_io.h"
#include "dtrain/core/error.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    constexpr size_t kDigest = 32;
    if (bytes.size() >= kDigest) {
      unsigned char digest[kDigest];
      unsigned int len = 0;
      EVP_Digest(bytes.data(), bytes.size() - kDigest, digest, &len, EVP_sha256(), nullptr);
      bytes.replace(bytes.size() - kDigest, kDigest, reinterpret_cast<const char*>(digest), kDigest);
    }
    try {
      const dtrain::checkpoint::ModelFile f = dtrain::checkpoint::decode_model(bytes, "fuzz input");
      check(dtrain::checkpoint::encode_model(f) == bytes);
    } catch (const dtrain::Error& e) {
      check(e.what()[0] != '\0');
    }
    return 0;
  }
  static const nlohmann::json layout{{"dp", 2}, {"pp", 1}, {"tp", 1}, {"zero", 0}};
  std::vector<dtrain::checkpoint::ManifestFile> files;
  const std::string bad = dtrain::checkpoint::parse_manifest(bytes, 12, layout, &files);
  if (bad.empty()) {
    check(!files.empty());
    for (const auto& f : files)
      check(!f.name.empty() && f.name.find('/') == std::string::npos && f.sha256.size() == 64);
  }
  return 0;
}
