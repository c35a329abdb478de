// Process groups and their collectives.
//
// A Group is a cheap handle (copyable, shared) over a backend. Every collective exists in a
// blocking form and an asynchronous form (suffix _async) that returns a Work. Ordering: the
// operations of one group start in the order they were issued, on the group's progress
// thread (a blocking call issued while nothing is queued runs inline in the caller's thread).
// A collective runs to completion before the next operation starts. A send or receive only
// posts its message and completes later, as its peer matches it, so later operations start
// meanwhile: `send_async` to the next rank then `recv` from the previous one works for any
// size. Messages between two ranks are matched in the order they were posted. Every rank
// must issue the same collectives on a group in the same order.
//
// Algorithms: on one host all_reduce, reduce_scatter, all_gather, broadcast and barrier run
// the shm transport's direct collectives (reduced straight from shared staging buffers).
// A group whose ranks span two or more hosts, with the same number L >= 2 of ranks on each,
// runs all_reduce hierarchically: reduce_scatter within each host (shm), all_reduce of each
// rank's 1/L piece with the ranks of the same local index on the other hosts (tcp), then
// all_gather within the host; each host's link carries 2(H-1)/H of the vector instead of the
// flat ring's 2(P-1)/P, in 2(H-1) instead of 2(P-1) steps. Its two sub-groups are created by
// the first such all_reduce. GroupOptions::algorithm or DTRAIN_ALGO=ring|hd|rd|direct|hier
// overrides the choice ("hier" on a group without that shape runs as "auto").
//
// Buffers: counts are elements of `dtype`; send and recv may be the same pointer (in place)
// except where noted. Buffers passed to an _async call must stay valid until its Work
// completed.
//
// Failure: a call that cannot complete within the timeout, or whose peer died or reported
// an error, raises CommError naming the operation, its sequence number on this group and
// the peers that did not arrive. After a failure the group is broken: later calls raise at
// once. An error on one rank aborts the transport, so its peers raise instead of waiting.
//
// More collectives on a group, as free functions under the same rules: compressed ones on
// f32 gradients (compressed.h), and ones in memory every rank of a host maps (shared.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/flight_record.h"
#include "dtrain/comm/plan.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm {

namespace detail {
struct GroupAccess;  // the comm library's internal view of a group
}

/// Transport choice (transport.h): shm (every rank on one host), tcp, mpi (Group::from_mpi
/// sets it; every rank must be in MPI_COMM_WORLD), or automatic: shm when every rank runs on
/// this host, tcp otherwise. While `transport` is automatic, the environment variable
/// DTRAIN_TRANSPORT=shm|tcp|auto decides instead. Every rank must end up with the same choice
/// (checked: a mismatch raises naming both ranks).
///
/// TCP: each rank listens on `bind_address` (an ephemeral port) and publishes that address in
/// the store, so it must be one the other ranks can reach: the default "" means 127.0.0.1,
/// fine on one host; a group spanning hosts needs the address of an interface they can reach
/// (a wildcard 0.0.0.0 or :: publishes this host's name instead). Every connection is
/// authenticated with `secret`, the job secret ("" means DTRAIN_SECRET).
struct GroupOptions {
  Duration timeout = std::chrono::minutes(5);          // default for blocking calls and Work::wait()
  TransportKind transport = TransportKind::automatic;  // see above (also DTRAIN_TRANSPORT)
  Algorithm algorithm = Algorithm::automatic;          // overrides the per-size choice (also DTRAIN_ALGO)
  std::string bind_address;                            // tcp: address to listen on and publish; "" = 127.0.0.1
  std::string secret;                                  // tcp: the job secret; "" = DTRAIN_SECRET
  /// Which host this rank is on, as far as transports and the hierarchy go: ranks with equal
  /// ids share memory. "" = DTRAIN_HOST_ID if set, else the host name and boot id. Tests set
  /// it to run several "hosts" as threads of one process; a group with it set may then use
  /// loopback addresses between its hosts.
  std::string host_id;
  /// shm: a blocking wait spins at least this long before it sleeps on a futex (0: a few
  /// microseconds). Longer spins cut the wake-up latency of a message that arrives after a
  /// long wait (pipeline stages), at the price of a busy core: use it only when every rank on
  /// the host has a core to itself.
  std::chrono::microseconds spin{0};
  /// Heartbeats (0: off). Every rank publishes a counter in the store every
  /// `heartbeat_interval` (0: a fifth of the timeout) and watches the next rank's; one that
  /// published nothing for `heartbeat_timeout` (dead, stopped, hung host, lost network) makes
  /// the watcher abort every group of its process and tell the others through the store, so
  /// every rank's pending operations raise within about the timeout, naming that rank. Only
  /// the group created with it runs heartbeats (a split does not start its own).
  Duration heartbeat_timeout{0};
  Duration heartbeat_interval{0};
  /// The store the heartbeats go through (null: the group's store). A TCP store client
  /// serialises its requests, so give the heartbeat a connection of its own (from_env does).
  std::shared_ptr<Store> heartbeat_store;
  /// Operations kept in the group's flight record (see Group::flight_record()).
  size_t flight_record_size = 256;
};

/// The environment variables that carry this process's rank and world size, as the launcher
/// that started it set them: RANK / WORLD_SIZE (dtrain launch, torchrun), Open MPI's
/// OMPI_COMM_WORLD_RANK / _SIZE, PMIx's PMIX_RANK, MPICH's PMI_RANK / PMI_SIZE, or Slurm's
/// SLURM_PROCID / SLURM_NTASKS, the last only inside a job step (srun; a batch script has them
/// too). The first set of each list; nullptr when none is.
struct LauncherVars {
  const char* rank = nullptr;
  const char* size = nullptr;
};
LauncherVars launcher_vars();

/// This machine's host name (gethostname).
std::string host_name();

/// The address of the local interface that routes to `host` (a name or an address; `port` only
/// picks the route): what a rank publishes for the others to reach it when the store is at
/// host:port. Nothing is sent. A loopback address when `host` is one (127.x, ::1, "localhost");
/// when `host` is a name that this host maps to loopback (Debian maps its own name to 127.0.1.1)
/// the first interface that is up and not loopback instead, since other hosts know the name by
/// that. Throws dtrain::Error naming `host` when it does not resolve or no interface routes to it.
std::string address_toward(const std::string& host, int port);

class Store;
class TcpStoreServer;

/// A TCP store for every rank of an mpirun job, met through MPI itself (collective over
/// MPI_COMM_WORLD): rank 0 serves it with a fresh secret, announcing `host` (empty: 127.0.0.1
/// when every rank shares its host, else its host name, listening on every interface), and the
/// others learn the address, port and secret from rank 0 by broadcast. When rank 0 cannot serve,
/// every rank raises its error instead of waiting. `server` is set on rank 0 only: keep it alive
/// while the store is in use.
struct MpiStore {
  std::shared_ptr<Store> store;
  std::shared_ptr<TcpStoreServer> server;
  std::string host;
  uint16_t port = 0;
  std::string secret;
};
MpiStore mpi_store(const std::string& host, Duration timeout);

class Work {
 public:
  Work() = default;
  /// True when the operation finished; rethrows its error if it failed.
  bool test();
  /// Waits up to `timeout` (the group's default when zero); throws CommError on timeout or failure.
  void wait(Duration timeout = Duration::zero());
  /// When the operation finished (for traces); the epoch of Clock while it has not.
  Clock::time_point finish_time() const;
  bool valid() const { return state_ != nullptr; }
  struct State;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

class Group {
 public:
  /// Joins group `name` as `rank` of `size` through `store` (all ranks call this).
  static Group create(const std::shared_ptr<Store>& store, int rank, int size, GroupOptions options = {},
                      const std::string& name = "world");
  /// Joins the world described by the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
  /// MASTER_PORT, DTRAIN_SECRET); throws dtrain::Error naming a missing or malformed variable.
  /// The group is named "world", or "world@ID" with DTRAIN_RUN_ID=ID (an elastic round).
  /// An empty options.bind_address becomes DTRAIN_BIND_ADDR if set, else
  /// address_toward(MASTER_ADDR, MASTER_PORT): the address of the local interface that routes
  /// to the master (127.0.0.1 when MASTER_ADDR is a loopback address).
  /// RANK and WORLD_SIZE may come from Open MPI (OMPI_COMM_WORLD_RANK, _SIZE), PMIx
  /// (PMIX_RANK), MPICH's PMI (PMI_RANK, PMI_SIZE) or Slurm (SLURM_PROCID, SLURM_NTASKS) instead.
  static Group from_env(GroupOptions options = {});
  /// Joins MPI_COMM_WORLD (a job started by mpirun or srun) with transport "mpi": rank and size
  /// from MPI, a store served by rank 0 (its address, MASTER_ADDR if set, and a fresh secret
  /// reach the others through MPI_Bcast), messages as MPI_Isend/MPI_Irecv and all_reduce,
  /// reduce_scatter, all_gather, broadcast and barrier as MPI's non-blocking collectives, in
  /// their blocking and asynchronous forms, polled against the timeout. Throws dtrain::Error
  /// when dtrain was built without MPI (comm/mpi.h).
  static Group from_mpi(GroupOptions options = {});

  Group() = default;
  int rank() const;
  int size() const;
  /// The transport it runs over (never automatic); TransportKind::none for an empty group.
  TransportKind transport_kind() const;
  /// The options this group was created with (a split without options inherits them).
  const GroupOptions& options() const;
  /// Collective: ranks with the same color form a sub-group ordered by (key, rank). A
  /// negative color returns an empty Group (size 0) for that rank.
  Group split(int color, int key) const;
  /// The same, with its own options (e.g. another algorithm or timeout) for the sub-group;
  /// an empty bind_address, secret or host_id is the parent's.
  Group split(int color, int key, const GroupOptions& options) const;
  /// The last operations of this group, oldest first (flight_record.h).
  std::vector<FlightEntry> flight_record() const;
  /// What all_reduce of `bytes` bytes runs on this group: direct, hier, ring, hd or rd.
  Algorithm all_reduce_algorithm(size_t bytes) const;

  void all_reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op);
  /// send holds size() * recv_count elements; rank r receives block r reduced.
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op);
  void reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype, ReduceOp op);
  /// recv holds size() * send_count elements, rank r's block at r * send_count.
  void all_gather(const void* send, void* recv, size_t send_count, DataType dtype);
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype);
  void broadcast(void* buffer, size_t count, DataType dtype, int root);
  void reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root);
  /// recv (root only) holds size() * count elements.
  void gather(const void* send, void* recv, size_t count, DataType dtype, int root);
  /// send (root only) holds size() * count elements.
  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root);
  /// Block j of send (count elements each) goes to rank j, landing in its block rank(). Not in place.
  void all_to_all(const void* send, void* recv, size_t count, DataType dtype);
  void barrier();
  /// Point to point: messages between two ranks are received in the order they were sent;
  /// a receive whose tag or count differs from the next message fails naming both.
  void send(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag = 0);
  void recv(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag = 0);

  Work all_reduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op);
  Work reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op);
  Work all_gather_async(const void* send, void* recv, size_t send_count, DataType dtype);
  Work broadcast_async(void* buffer, size_t count, DataType dtype, int root);
  Work send_async(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag = 0);
  Work recv_async(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag = 0);

  struct Impl;

 private:
  friend struct detail::GroupAccess;
  explicit Group(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Impl& impl(const char* op) const;  // throws for an empty group
  std::shared_ptr<Impl> impl_;
};

}  // namespace dtrain::comm
