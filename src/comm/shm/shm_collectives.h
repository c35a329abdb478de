// Direct collectives of the shm transport (internal to src/comm): each rank copies its data
// once into its staging slot in the segment, and the ranks reduce or copy straight out of each
// other's slots. See shm_collectives.cpp for the protocol.
#pragma once

#include <functional>

#include "dtrain/comm/transport.h"
#include "shm_segment.h"

namespace dtrain::comm::shm {

class Collectives final : public DirectCollectives, public MappedCollectives {
 public:
  /// `check_abort` throws TransportError(aborted) when the segment's abort flag is set.
  Collectives(const Segment& segment, int rank, int size, std::function<void()> check_abort);

  void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                  Deadline deadline) override;
  void broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline) override;
  void all_gather(const void* input, void* output, size_t count, DataType dtype, Deadline deadline) override;
  void reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                      Deadline deadline) override;
  void barrier(Deadline deadline) override;
  void reduce_scatter_mapped(const char* inputs, size_t stride, void* output, size_t count, DataType dtype, ReduceOp op,
                             Deadline deadline) override;
  void all_reduce_mapped(char* vectors, size_t stride, size_t count, DataType dtype, ReduceOp op,
                         Deadline deadline) override;

  /// How this rank writes its staging slot for large chunks (see "Staging writes" in the .cpp).
  enum class StageWrites { automatic, cached, streaming };

 private:
  enum class Kind : uint64_t {
    all_reduce = 1,
    broadcast,
    all_gather,
    reduce_scatter,
    barrier,
    reduce_scatter_mapped,
    all_reduce_mapped
  };
  struct Call {
    Kind kind;
    DataType dtype;
    size_t count;
    uint64_t arg;  // op, or root
  };

  // Publishes this rank's record of the call (checked against the peers' after the first phase).
  void begin(const Call& call);
  // Ends a phase: bumps this rank's phase counter, wakes sleeping peers.
  void arrive();
  // Waits until every rank ended this rank's current phase; throws on abort, death, deadline.
  void wait_all(Deadline deadline);
  // The waiting loop of wait_all (spin, yield, sleep; abort, liveness, deadline) until
  // `ready(cursor)` holds; `cursor` counts the ranks known to have ended phase `target`.
  template <typename Ready>
  void wait_until(uint64_t target, Deadline deadline, Ready&& ready);
  // all_reduce of at most kLinesPerCall lines: data and flag travel in the same cache lines.
  void all_reduce_lines(const char* in, char* out, size_t count, DataType dtype, ReduceOp op, Deadline deadline);
  // arrive() + wait_all(); the first one of a call also compares the call records.
  void sync(Deadline deadline);
  bool all_arrived(uint64_t target, int& cursor) const;
  void check_calls() const;
  [[noreturn]] void throw_stalled(uint64_t target, Clock::duration waited, bool timed_out) const;
  char* stage(int r) const { return seg_.stage(r, static_cast<int>(chunk_ & 1)); }
  // Copies a large chunk's data into this rank's staging slot, the way streaming_ says.
  void stage_write(char* dst, const char* src, size_t bytes) const;
  // Copies a publish block with plain stores and times it; the first kProbeBlocks of a call
  // decide streaming_ for the rest of it and for the next calls.
  void probe_stage_write(char* dst, const char* src, size_t bytes);

  const Segment& seg_;
  const int rank_;
  const int size_;
  std::function<void()> check_abort_;
  uint64_t phase_ = 0;           // phases this rank ended (mirrors its RankSlot::arrived)
  uint64_t calls_ = 0;           // calls made; the parity selects the call record
  uint64_t chunk_ = 0;           // chunks moved; the parity selects the staging slot
  uint64_t line_calls_ = 0;      // all_reduces in lines; the parity selects RankSlot::lines
  bool checked_ = true;          // whether the current call's records were compared
  int cores_ = 1;                // the cores this process may run on (or the job's, DTRAIN_JOB_CPUS)
  bool oversubscribed_ = false;  // more ranks than cores this process may run on
  StageWrites stage_writes_ = StageWrites::automatic;
  bool streaming_ = false;        // stage large chunks with streaming stores
  double local_ns_per_byte_ = 0;  // a plain copy between two private cached buffers; 0: not yet timed
  int probes_left_ = 0;           // publish blocks of this call still to time
  double probe_best_ = 0;         // the fastest of them, ns per byte
  Call call_{};
};

}  // namespace dtrain::comm::shm
