// Bulk copies (see copy.h).
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
}  // namespace

void copy_bytes(void* dst, const void* src, size_t bytes) {
#if defined(__AVX2__)
  if (bytes >= kAliasMinBytes && near_page_alias(dst, src)) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    size_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
    std::memcpy(d + i, s + i, bytes - i);  // under 128 bytes: vector moves, no rep movsb
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void copy_streaming(void* dst_, const void* src_, size_t bytes) {
#if defined(__AVX2__)
  auto* dst = static_cast<char*>(dst_);
  const auto* src = static_cast<const char*>(src_);
  const size_t head = std::min(bytes, static_cast<size_t>(-reinterpret_cast<uintptr_t>(dst) & 31));
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  copy_bytes(dst + i, src + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst_, src_, bytes);
#endif
}

}  // namespace dtrain::comm
