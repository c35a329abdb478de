// Bulk copies (see dtrain/comm/copy.h).
#include "dtrain/comm/copy.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dtrain::comm {

namespace {

// glibc uses rep movsb from a few KiB up; below this a copy is a handful of vector moves.
constexpr size_t kAliasMinBytes = 2048;

#if defined(__AVX2__)
template <bool kStreaming>
inline void store32(char* to, __m256i v) {
  if constexpr (kStreaming) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), v);
  }
}

// Copies the whole 128-byte blocks of [src, src + bytes) with plain or streaming stores and
// returns how many bytes it copied.
template <bool kStreaming>
size_t copy_blocks(char* dst, const char* src, size_t bytes) {
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    store32<kStreaming>(dst + i, a);
    store32<kStreaming>(dst + i + 32, b);
    store32<kStreaming>(dst + i + 64, c);
    store32<kStreaming>(dst + i + 96, d);
  }
  return i;
}
#endif

}  // namespace

void copy_bytes(void* dst, const void* src, size_t bytes) {
#if defined(__AVX2__)
  if (bytes >= kAliasMinBytes && near_page_alias(dst, src)) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t done = copy_blocks<false>(d, s, bytes);
    std::memcpy(d + done, s + done, bytes - done);  // under 128 bytes: vector moves, no rep movsb
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void copy_streaming(void* to, const void* from, size_t bytes) {
#if defined(__AVX2__)
  auto* dst = static_cast<char*>(to);
  const auto* src = static_cast<const char*>(from);
  const size_t head = std::min(bytes, static_cast<size_t>(-reinterpret_cast<uintptr_t>(dst) & 31));
  std::memcpy(dst, src, head);  // then dst is 32-byte aligned, as streaming stores need
  dst += head, src += head, bytes -= head;
  const size_t done = copy_blocks<true>(dst, src, bytes);
  std::memcpy(dst + done, src + done, bytes - done);
  _mm_sfence();
#else
  std::memcpy(dst_, src_, bytes);
#endif
}

}  // namespace dtrain::comm
