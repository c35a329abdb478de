// The buckets in memory every rank on the host maps (Group::allocate_shared), see sync.h and
// ddp.h. Layout of the allocation, each part `stride` bytes:
//   [values of every bucket (ZeRO 1)][rank 0's gradients][rank 1's gradients]...
// A bucket sits at the same offset in each part (both hold `padded` floats, 64-byte aligned).
// - SharedAllReduceSync (ZeRO 0): a bucket is averaged in place by all_reduce_shared: every rank
//   reduces its slice straight from the ranks' slots and writes it into all of them.
// - SharedZeroSync (ZeRO 1): the values are one copy for the host (rank 0's at the start), the
//   reduce_scatter reads the peers' slots in place and writes each rank's averaged piece over
//   its range of slot 0 or 1 (no memory of its own), and each rank updates its piece of the one
//   copy, so gather() is a barrier.
// - SharedZeroSync without shared gradients (ZeRO 3): the values are one copy for the host as for ZeRO 1 (the
//   allocation is only that part), each rank's piece (`own`) is its slice of it, and whole
//   buckets are always there: a gather is nothing and gather() the barrier after the updates.
//   The gradients take ZeRO 2's heap path (allocated for the step, reduce_scattered, freed).
#include <sys/statvfs.h>

#include "dtrain/core/log.h"
#include "sync.h"

namespace dtrain::parallel {

using comm::DataType;
using comm::ReduceOp;

namespace {

// ZeRO 0: buckets up to this size still take the copying all_reduce on the rank's slot (one
// phase, or the lines path up to 192 B) instead of all_reduce_shared's two full phases; the
// result is the same bits.
constexpr size_t kCopyingBucketBytes = size_t{16} << 10;

// Where the buckets lie in the allocation.
struct SharedLayout {
  comm::SharedMemory memory;
  size_t stride = 0;        // bytes between two parts
  std::vector<size_t> at;   // each bucket's offset in a part, in floats
  bool values_too = false;  // ZeRO 1: the values are the first part
  size_t grad_at(size_t bucket) const { return (values_too ? stride : 0) + at[bucket] * sizeof(float); }
  Floats floats(size_t byte_offset) const {
    return Floats(memory.keep_alive(), reinterpret_cast<float*>(memory.data() + byte_offset));
  }
};

class SharedAllReduceSync : public AllReduceSync {
 public:
  SharedAllReduceSync(SyncContext context, SharedLayout layout)
      : AllReduceSync(std::move(context)), layout_(std::move(layout)) {}

  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& /*params*/) override {
    const size_t rank = static_cast<size_t>(ctx_.group.rank());
    for (Bucket& b : buckets) b.grad = layout_.floats(layout_.grad_at(b.index) + rank * layout_.stride);
  }

  comm::Work start(Bucket& b) override {
    if (b.count * sizeof(float) <= kCopyingBucketBytes) return AllReduceSync::start(b);
    count_volume(b);
    return comm::all_reduce_shared_async(ctx_.group, layout_.memory, layout_.grad_at(b.index), layout_.stride, b.count,
                                         DataType::f32, ReduceOp::avg);
  }

  bool shares_memory() const override { return true; }

 private:
  SharedLayout layout_;
};

// ZeRO 1 (`shared_grads`) and ZeRO 3 on one host: the buckets' values are the host's one copy,
// each rank updating its piece of it. ZeRO 1 also keeps every rank's gradient slot there and
// reduce_scatters it in place; ZeRO 3 keeps only the values (a rank's piece, `own`, is its slice
// of them, so no all_gather makes a bucket whole) and its gradients take ZeroSync's heap path
// (allocated for the step, reduce_scattered, freed).
class SharedZeroSync : public ZeroSync {
 public:
  SharedZeroSync(SyncContext context, SharedLayout layout, bool shared_grads)
      : ZeroSync(std::move(context)), layout_(std::move(layout)), shared_grads_(shared_grads) {}

  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override {
    const size_t rank = static_cast<size_t>(ctx_.group.rank());
    for (Bucket& b : buckets) {
      b.values = layout_.floats(layout_.at[b.index] * sizeof(float));
      if (shared_grads_) {
        b.grad = layout_.floats(layout_.grad_at(b.index) + rank * layout_.stride);
      } else {
        b.own = Floats(b.values, b.values.get() + rank * ctx_.piece_of(b));
      }
      if (rank == 0) copy_values_in(b, params);  // rank 0's values become the host's copy
      if (shared_grads_) {
        // The averaged piece goes over this rank's piece of slot 0 or 1 (its own as rank 0 or
        // 1): no other rank reads that range, and the reduction reads slots 0 and 1 before it
        // writes (reduce_scatter_shared). Nothing else writes it before the next backward, which
        // starts after every rank's update (gather()).
        const size_t into = rank <= 1 ? rank : 0;
        b.piece_grad =
            layout_.floats(layout_.grad_at(b.index) + into * layout_.stride + rank * ctx_.piece_of(b) * sizeof(float));
      } else {
        b.piece_grad = zeroed_floats(ctx_.allocate, ctx_.piece_of(b));
      }
    }
    ctx_.group.barrier();  // rank 0's values are in place before anyone reads them
  }

  comm::Work start(Bucket& b) override {
    if (!shared_grads_) return ZeroSync::start(b);
    count_volume(b);
    return comm::reduce_scatter_shared_async(ctx_.group, layout_.memory, layout_.grad_at(b.index), layout_.stride,
                                             b.piece_grad.get(), ctx_.piece_of(b), DataType::f32, ReduceOp::avg);
  }

  // Every rank updated its piece of the one copy: wait until all did.
  void gather(std::vector<Bucket>& /*buckets*/) override { ctx_.group.barrier(); }

  bool shares_memory() const override { return true; }
  bool shares_values() const override { return true; }
  bool pieces_in_slots() const override { return shared_grads_; }

 private:
  SharedLayout layout_;
  bool shared_grads_;
};

}  // namespace

std::unique_ptr<SyncStrategy> make_shared_sync(SyncContext context, const std::vector<Bucket>& buckets) {
  comm::Group& group = context.group;
  // ZeRO 0 shares only where the group runs its direct collectives: a plan chosen with
  // DTRAIN_ALGO (ring, hd, ...) is what the user asked for, and the shared all_reduce is not it.
  const bool direct = group.all_reduce_algorithm(0) == comm::Algorithm::direct;
  if (!((context.zero == 0 && direct) || context.zero == 1 || context.zero == 3) || !comm::can_share_memory(group))
    return nullptr;
  SharedLayout layout;
  layout.values_too = context.zero == 1 || context.zero == 3;
  const bool grads_too = context.zero < 3;  // ZeRO 3: the values only
  const size_t world = context.world();
  const size_t align = 64 / sizeof(float);
  size_t floats = 0;
  for (const Bucket& b : buckets) {
    layout.at.push_back(floats);
    floats += (b.padded + align - 1) / align * align;
  }
  layout.stride = floats * sizeof(float);
  const size_t bytes = ((layout.values_too ? 1 : 0) + (grads_too ? world : 0)) * layout.stride;
  // Every rank must take the same path: share only if /dev/shm has room as every rank sees it
  // and every rank wants the same size (a rank with another model copies, and
  // broadcast_parameters() names the difference).
  struct statvfs fs {};
  const int64_t room =
      ::statvfs("/dev/shm", &fs) == 0 && static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) >=
                                             1.05 * static_cast<double>(bytes) + (64 << 20);
  int64_t agree[3] = {room, static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};
  group.all_reduce(agree, agree, 3, DataType::i64, ReduceOp::min);
  if (agree[1] != -agree[2]) return nullptr;
  if (agree[0] == 0) {
    if (group.rank() == 0) {
      DT_LOG_WARN(
          "data parallel: /dev/shm has no room for the {} MiB of {} the ranks would share; copying "
          "through the collectives instead (make /dev/shm larger, e.g. docker --shm-size)",
          bytes >> 20,
          !grads_too          ? "parameters"
          : layout.values_too ? "parameters and gradients"
                              : "gradients");
    }
    return nullptr;
  }
  layout.memory = comm::allocate_shared(group, bytes);
  if (layout.values_too) return std::make_unique<SharedZeroSync>(std::move(context), std::move(layout), grads_too);
  return std::make_unique<SharedAllReduceSync>(std::move(context), std::move(layout));
}

}  // namespace dtrain::parallel
