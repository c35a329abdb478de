// Picks the kernels' instruction set once (kernels.h): the widest this CPU runs, capped by
// DTRAIN_KERNELS_ISA or ONEDNN_MAX_CPU_ISA.
#include "dtrain/tensor/kernels.h"

#include <cctype>
#include <cstdlib>
#include <string>

#include "dot_tiles.h"
#include "dtrain/core/error.h"

namespace dtrain::kernels {

namespace avx512_bf16 {
const Table& make_table(const char* isa);
}
namespace avx512 {
const Table& make_table(const char* isa);
}
namespace avx2 {
const Table& make_table(const char* isa);
}
namespace build {
const Table& make_table(const char* isa);
}

namespace {

enum class Cap { none, avx512, avx2, build };

// The cap a variable names: oneDNN's spelling (AVX2, AVX2_VNNI, AVX512_CORE, AVX512_CORE_VNNI,
// AVX512_CORE_BF16, AVX512_CORE_AMX, ALL, SSE41, AVX) or dtrain's (avx512_bf16, avx512, avx2,
// build), in any case. An AVX-512 name without bf16 instructions (AVX512_CORE, dtrain's avx512)
// keeps the kernels off AVX512_BF16 too.
Cap cap_from(const char* name, const char* value) {
  std::string v = value;
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v.empty() || v == "all") return Cap::none;
  if (v.rfind("avx512", 0) == 0) {
    const bool bf16 = v.find("bf16") != std::string::npos || v.find("amx") != std::string::npos ||
                      v.find("fp16") != std::string::npos;
    return bf16 ? Cap::none : Cap::avx512;
  }
  if (v.rfind("avx2", 0) == 0) return Cap::avx2;
  if (v == "build" || v == "sse41" || v == "avx" || v == "default") return Cap::build;
  DT_THROW("tensor", "{}={}: expected avx512_bf16, avx512, avx2 or build (or oneDNN's ISA names)", name, value);
}

const Table& choose() {
  Cap cap = Cap::none;
  if (const char* v = std::getenv("DTRAIN_KERNELS_ISA"); v != nullptr) {
    cap = cap_from("DTRAIN_KERNELS_ISA", v);
  } else if (const char* o = std::getenv("ONEDNN_MAX_CPU_ISA"); o != nullptr) {
    cap = cap_from("ONEDNN_MAX_CPU_ISA", o);
  }
  if (cap == Cap::none) {
    if (const Table* t = table_for("avx512_bf16")) return *t;
  }
  if (cap == Cap::none || cap == Cap::avx512) {
    if (const Table* t = table_for("avx512")) return *t;
  }
  if (cap != Cap::build) {
    if (const Table* t = table_for("avx2")) return *t;
  }
  return *table_for("build");
}

}  // namespace

const Table& table() {
  static const Table& t = choose();
  return t;
}

const Table* table_for(std::string_view isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (isa == "avx512_bf16") {
    return avx512 && __builtin_cpu_supports("avx512bf16") ? &avx512_bf16::make_table("avx512_bf16") : nullptr;
  }
  if (isa == "avx512") return avx512 ? &avx512::make_table("avx512") : nullptr;
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &avx2::make_table("avx2") : nullptr;
  }
#endif
  return isa == "build" ? &build::make_table("build") : nullptr;
}

}  // namespace dtrain::kernels

namespace dtrain::detail {

bool f32_dot_available() {
  static const bool ok = std::string_view(kernels::table().isa).substr(0, 6) == "avx512";
  return ok;
}

// The kernels' table is the AVX512_BF16 one: the CPU has it and no cap holds the kernels below.
bool bf16_dot_available() {
  static const bool ok = std::string_view(kernels::table().isa) == "avx512_bf16";
  return ok;
}

}  // namespace dtrain::detail
