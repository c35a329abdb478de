// Bulk copies for the shared-memory paths and the data-parallel buckets.
//
// copy_bytes is memcpy except for one case: glibc copies 4-256 KiB with `rep movsb`, and on
// CPUs with fast short rep movsb (FSRM) that runs many times slower when the destination lies
// 1-63 bytes after the source modulo 4 KiB (figures: docs/measurements.md).
// Collectives hit it systematically: large malloc'd buffers start 16 bytes into a page and
// staging slots on a page, so every copy from a slot into such a buffer is in that window.
// There copy_bytes runs its own vector loop. copy_streaming writes with non-temporal stores
// (the destination is not read back into this core's cache).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrain::comm {

/// True when `dst` lies 1-63 bytes after `src` modulo 4 KiB (the slow window above).
inline bool near_page_alias(const void* dst, const void* src) {
  const auto d = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  return d != 0 && d < 64;
}

/// memcpy(dst, src, bytes) for non-overlapping buffers, without glibc's slow window.
void copy_bytes(void* dst, const void* src, size_t bytes);

/// Copy with streaming (non-temporal) stores, fenced before it returns.
void copy_streaming(void* dst, const void* src, size_t bytes);

}  // namespace dtrain::comm
