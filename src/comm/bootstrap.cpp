// How a group comes to be: the environment read once into the options, the ranks' meeting at
// the store (host identities, the transport choice, the hierarchy's shape), the transport,
// the executor and the health hooks (Group::create); the world of a launcher (from_env) or of
// MPI (from_mpi). Nothing here runs after the group exists.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>

#include "dtrain/comm/group.h"
#include "dtrain/comm/mpi.h"
#include "dtrain/core/log.h"
#include "group_impl.h"
#include "tcp/net.h"

namespace dtrain::comm {

namespace {

// Every environment variable the bootstrap reads, read in one place when a group is created;
// nullopt where the variable is not set. The rest of this file reads only these.
struct Environment {
  std::optional<std::string> algo;          // DTRAIN_ALGO: the algorithm while the option is auto
  std::optional<std::string> transport;     // DTRAIN_TRANSPORT: the transport while the option is auto
  std::optional<std::string> secret;        // DTRAIN_SECRET: the job secret
  std::optional<std::string> host_id;       // DTRAIN_HOST_ID: this rank's host identity
  std::optional<std::string> bind_address;  // DTRAIN_BIND_ADDR: where tcp listens (from_env)
  std::optional<std::string> master_addr;   // MASTER_ADDR, MASTER_PORT: the store (from_env, from_mpi)
  std::optional<std::string> master_port;
  std::optional<std::string> store_hosted;  // DTRAIN_STORE_HOSTED=1: dtrain launch serves the store
  std::optional<std::string> run_id;        // DTRAIN_RUN_ID: the elastic round
  // This rank and the world size as the launcher set them (launcher_vars()): the variables'
  // names, RANK and WORLD_SIZE when none is set, and their values.
  const char* rank_var = "RANK";
  const char* size_var = "WORLD_SIZE";
  std::optional<std::string> rank, size;

  static Environment read() {
    auto get = [](const char* name) -> std::optional<std::string> {
      const char* v = std::getenv(name);
      return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
    };
    Environment e;
    e.algo = get("DTRAIN_ALGO");
    e.transport = get("DTRAIN_TRANSPORT");
    e.secret = get("DTRAIN_SECRET");
    e.host_id = get("DTRAIN_HOST_ID");
    e.bind_address = get("DTRAIN_BIND_ADDR");
    e.master_addr = get("MASTER_ADDR");
    e.master_port = get("MASTER_PORT");
    e.store_hosted = get("DTRAIN_STORE_HOSTED");
    e.run_id = get("DTRAIN_RUN_ID");
    const LauncherVars vars = launcher_vars();
    if (vars.rank != nullptr) e.rank_var = vars.rank;
    if (vars.size != nullptr) e.size_var = vars.size;
    e.rank = get(e.rank_var);
    e.size = get(e.size_var);
    return e;
  }
};

bool set_and_not_empty(const std::optional<std::string>& v) { return v.has_value() && !v->empty(); }

// A group's options with the environment applied, and what the transports need beside them.
struct Setup {
  /// The caller's options, the algorithm resolved (DTRAIN_ALGO while automatic) and the
  /// transport too (DTRAIN_TRANSPORT while automatic; automatic itself is resolved at the
  /// meeting, once the hosts are known). What Group::options() returns.
  GroupOptions options;
  std::string host;                // this rank's host identity
  std::string secret;              // tcp: the job secret, "" when neither option nor variable has one
  const char* secret_source = "";  // where it came from, for the errors that name it
};

Setup resolve(GroupOptions options, const Environment& env) {
  if (options.algorithm == Algorithm::automatic && env.algo) options.algorithm = parse_algorithm(*env.algo);
  if (options.transport == TransportKind::automatic && set_and_not_empty(env.transport)) {
    const std::string& text = *env.transport;
    DT_CHECK(text == "auto" || text == "shm" || text == "tcp", "comm",
             "DTRAIN_TRANSPORT='{}': expected auto, shm or tcp", text);
    options.transport = parse_transport(text);
  }
  DT_CHECK(options.transport != TransportKind::none, "comm", "transport '{}': expected auto, shm, tcp or mpi",
           name_of(options.transport));
  Setup s;
  if (!options.host_id.empty()) {
    s.host = options.host_id;
  } else if (env.host_id) {
    s.host = *env.host_id;
  } else {
    std::string boot;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
    s.host = host_name() + "/" + boot;
  }
  if (!options.secret.empty()) {
    s.secret = options.secret;
    s.secret_source = "GroupOptions::secret";
  } else {
    s.secret = env.secret.value_or("");
    s.secret_source = "DTRAIN_SECRET";
  }
  s.options = std::move(options);
  return s;
}

// Ranks that chose different transports would each wait for the other at the rendezvous until
// the timeout; compare the choices first and name the odd one out.
void check_same_choice(Store& store, const std::string& name, int rank, int size, TransportKind choice,
                       Duration timeout) {
  const std::string kind = name_of(choice);
  store.set(fmt::format("{}/transport/{}", name, rank), kind);
  for (int r = 0; r < size; ++r) {
    const std::string theirs = store.get(fmt::format("{}/transport/{}", name, r), timeout);
    DT_CHECK(theirs == kind, "comm",
             "group '{}': rank {} uses transport {} but rank {} uses {} (set DTRAIN_TRANSPORT the same on every rank)",
             name, rank, kind, r, net::printable(theirs));
  }
}

bool is_loopback(const std::string& address) {
  return address == "localhost" || address == "::1" || address.starts_with("127.");
}

// Where the ranks of a group live: hosts numbered in order of their lowest rank.
struct HostMap {
  bool same_host = true;  // every rank on this rank's host
  int hosts = 0;
  std::vector<int> ranks_on;       // per host
  std::vector<int> host_of;        // per rank
  std::vector<int> local_rank_of;  // per rank: its index among its host's ranks
};

HostMap meet_hosts(Store& store, const std::string& name, int rank, int size, const std::string& me, Duration timeout) {
  store.set(fmt::format("{}/host/{}", name, rank), me);
  HostMap m;
  std::vector<std::string> hosts;
  m.ranks_on.assign(static_cast<size_t>(size), 0);
  m.host_of.assign(static_cast<size_t>(size), 0);
  m.local_rank_of.assign(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) {
    const std::string id = store.get(fmt::format("{}/host/{}", name, r), timeout);
    if (id != me) m.same_host = false;
    const auto it = std::find(hosts.begin(), hosts.end(), id);
    const int h = static_cast<int>(it - hosts.begin());
    if (it == hosts.end()) hosts.push_back(id);
    m.host_of[static_cast<size_t>(r)] = h;
    m.local_rank_of[static_cast<size_t>(r)] = m.ranks_on[static_cast<size_t>(h)]++;
  }
  m.hosts = static_cast<int>(hosts.size());
  return m;
}

Group create_group(const std::shared_ptr<Store>& store, int rank, int size, GroupOptions given, const std::string& name,
                   const Environment& env) {
  DT_CHECK(store != nullptr, "comm", "Group::create: no store");
  DT_CHECK(size >= 1 && rank >= 0 && rank < size, "comm", "Group::create: rank {} of size {}", rank, size);
  Setup setup = resolve(std::move(given), env);
  const GroupOptions& options = setup.options;
  auto impl = std::make_shared<Group::Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->name = name;
  impl->options = options;
  impl->store = store;

  // Which transport: shared memory when every rank runs on this host, TCP otherwise.
  const HostMap hosts = meet_hosts(*store, name, rank, size, setup.host, options.timeout);
  TransportKind kind = options.transport;
  if (kind == TransportKind::automatic) kind = hosts.same_host ? TransportKind::shm : TransportKind::tcp;
  DT_CHECK(!(kind == TransportKind::shm && !hosts.same_host), "comm",
           "group '{}': transport shm needs every rank on one host", name);
  check_same_choice(*store, name, rank, size, kind, options.timeout);
  if (kind == TransportKind::shm) {
    impl->transport = make_shm_transport(*store, name, rank, size, options.timeout, options.spin);
  } else if (kind == TransportKind::mpi) {
    impl->transport = make_mpi_transport(*store, name, rank, size, options.timeout);
  } else {
    DT_CHECK(!setup.secret.empty(), "comm",
             "group '{}': the tcp transport needs the job secret (GroupOptions::secret or DTRAIN_SECRET)", name);
    check_secret(setup.secret, fmt::format("group '{}': {}", name, setup.secret_source));
    const std::string bind = options.bind_address.empty() ? "127.0.0.1" : options.bind_address;
    DT_CHECK(hosts.same_host || !is_loopback(bind) || !options.host_id.empty(), "comm",
             "group '{}': ranks span several hosts but rank {} would publish the loopback address {}; set "
             "GroupOptions::bind_address (or DTRAIN_BIND_ADDR) to an address the other hosts can reach",
             name, rank, bind);
    impl->transport = make_tcp_transport(*store, name, rank, size, setup.secret, bind, options.timeout);
    const auto& on = hosts.ranks_on;
    const bool uniform = std::all_of(on.begin(), on.begin() + hosts.hosts, [&](int k) { return k == on[0]; });
    if (hosts.hosts >= 2 && uniform && on[0] >= 2) {
      const detail::HostLayout layout{hosts.hosts, hosts.host_of[static_cast<size_t>(rank)], on[0],
                                      hosts.local_rank_of[static_cast<size_t>(rank)]};
      impl->hierarchy = std::make_unique<detail::HierarchicalAllReduce>(layout, rank, size, store, name, options);
    }
  }
  DT_CHECK(options.algorithm != Algorithm::direct || impl->transport->direct() != nullptr, "comm",
           "group '{}': algorithm 'direct' needs a transport with native collectives (shm), not {}", name,
           name_of(impl->transport->kind()));
  impl->kind = impl->transport->kind();
  impl->recorder = std::make_shared<detail::FlightRecorder>(options.flight_record_size);
  Group::Impl* raw = impl.get();
  impl->executor =
      std::make_unique<detail::Executor>(*impl->transport, name, rank, options.timeout, impl->recorder,
                                         [raw](const std::string& reason) { raw->abort_hierarchy(reason); });
  impl->registration =
      health::register_group([raw](const std::string& reason) { raw->abort(reason); },
                             [raw] { return raw->describe_json(); }, [raw] { return raw->pending_json(); });
  if (options.heartbeat_timeout > Duration::zero() && size > 1) {
    impl->heartbeat = std::make_unique<health::Heartbeat>(
        options.heartbeat_store ? options.heartbeat_store : store, name, rank, size, options.heartbeat_interval,
        options.heartbeat_timeout, [rank](const std::string& reason) {
          DT_LOG_ERROR("rank {}: {}; aborting every pending operation", rank, reason);
          health::abort_all(reason);
        });
  }
  return detail::GroupAccess::wrap(std::move(impl));
}

int env_int(const char* var, const std::optional<std::string>& value) {
  DT_CHECK(set_and_not_empty(value), "comm", "environment variable {} is not set (start ranks with dtrain launch)",
           var);
  const char* v = value->c_str();
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  DT_CHECK(end != v && *end == '\0' && x >= 0 && x < (1L << 30), "comm",
           "environment variable {}='{}' is not a valid integer", var, v);
  return static_cast<int>(x);
}

// The first of `vars` set (and not empty) in the environment, or nullptr.
const char* first_set(std::initializer_list<const char*> vars) {
  for (const char* v : vars) {
    if (const char* x = std::getenv(v); x != nullptr && *x != '\0') return v;
  }
  return nullptr;
}

}  // namespace

Group Group::create(const std::shared_ptr<Store>& store, int rank, int size, GroupOptions options,
                    const std::string& name) {
  return create_group(store, rank, size, std::move(options), name, Environment::read());
}

Group Group::from_env(GroupOptions options) {
  const Environment env = Environment::read();
  const int rank = env_int(env.rank_var, env.rank);
  const int size = env_int(env.size_var, env.size);
  DT_CHECK(set_and_not_empty(env.master_addr), "comm",
           "environment variable MASTER_ADDR is not set (start ranks with dtrain launch; under mpirun or srun "
           "without MASTER_ADDR and MASTER_PORT, use --backend mpi)");
  DT_CHECK(set_and_not_empty(env.secret), "comm", "environment variable DTRAIN_SECRET is not set");
  const std::string& addr = *env.master_addr;
  const std::string& secret = *env.secret;
  const int port = env_int("MASTER_PORT", env.master_port);
  DT_CHECK(port > 0 && port < 65536, "comm", "MASTER_PORT {} out of range", port);
  if (options.bind_address.empty()) {
    if (set_and_not_empty(env.bind_address)) {
      options.bind_address = *env.bind_address;
    } else {
      try {
        options.bind_address = address_toward(addr, port);
      } catch (const Error& e) {
        DT_THROW("comm", "MASTER_ADDR={}: {}", addr, e.what());
      }
    }
  }
  if (options.secret.empty()) options.secret = secret;
  // Under dtrain launch the launcher serves the store, and tells a rank that ends before the
  // job does (exit code 0 without leaving its world, or before joining it while others wait)
  // from one that finished.
  const bool launched = env.store_hosted == "1";
  std::shared_ptr<void> server;
  if (rank == 0 && !launched) server = std::make_shared<TcpStoreServer>(addr, static_cast<uint16_t>(port), secret);
  auto store = connect_tcp_store(addr, static_cast<uint16_t>(port), secret, options.timeout);
  if (options.heartbeat_timeout > Duration::zero() && !options.heartbeat_store) {
    // Its own connection: the group's requests (a blocking get) must not hold up a heartbeat;
    // and a short I/O timeout, so that a silent store counts as a missed beat, not a long wait.
    options.heartbeat_store = connect_tcp_store(addr, static_cast<uint16_t>(port), secret,
                                                std::max(options.heartbeat_timeout, Duration(1000)));
  }
  // An elastic job meets in rounds at one store: each round's world has a name of its own.
  const std::string name = set_and_not_empty(env.run_id) ? fmt::format("world@{}", *env.run_id) : "world";
  if (launched) store->set(fmt::format("{}/joined/{}", name, rank), std::to_string(::getpid()));
  Group g = create_group(store, rank, size, options, name, env);
  g.impl_->keep_alive = server;
  if (launched) g.impl_->left_key = fmt::format("{}/left/{}", name, rank);
  return g;
}

LauncherVars launcher_vars() {
  LauncherVars v;
  v.rank = first_set({"RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"});
  v.size = first_set({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  if (first_set({"SLURM_STEP_ID", "SLURM_STEPID"}) != nullptr) {
    if (v.rank == nullptr) v.rank = first_set({"SLURM_PROCID"});
    if (v.size == nullptr) v.size = first_set({"SLURM_NTASKS"});
  }
  return v;
}

std::string address_toward(const std::string& host, int port) {
  DT_CHECK(port >= 0 && port < 65536, "comm", "address_toward: port {} out of range", port);
  std::string route;
  try {
    route = net::local_address_toward(host, static_cast<uint16_t>(port));
  } catch (const net::NetError& e) {
    DT_THROW("comm", "cannot find the local address that reaches '{}' ({}); set DTRAIN_BIND_ADDR", host, e.message());
  }
  // A host name that this host maps to loopback names it for the others all the same: Debian's
  // /etc/hosts maps the host's own name to 127.0.1.1, and torchrun's c10d rendezvous sets
  // MASTER_ADDR to the first node's name. Loopback would reach no other host, so publish the
  // address of an interface that other hosts can reach. A numeric loopback address or
  // "localhost" means this host only: kept.
  in6_addr numeric{};
  const bool name = host != "localhost" && ::inet_pton(AF_INET, host.c_str(), &numeric) != 1 &&
                    ::inet_pton(AF_INET6, host.c_str(), &numeric) != 1;
  if (is_loopback(route) && name) {
    const std::vector<net::InterfaceAddress> interfaces = net::interface_addresses();
    if (const net::InterfaceAddress* out = net::outward_address(interfaces); out != nullptr) {
      DT_LOG_DEBUG(
          "comm: '{}' resolves to loopback on this host; publishing {} ({}) instead (DTRAIN_BIND_ADDR sets it)", host,
          out->address, out->name);
      return out->address;
    }
  }
  return route;
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

MpiStore mpi_store(const std::string& host, Duration timeout) {
  const MpiWorld world = mpi_world();
  MpiStore out;
  std::string contact;
  if (world.rank == 0) {
    std::string announce = host;
    std::string bind = host;
    if (announce.empty()) {
      announce = world.one_host ? "127.0.0.1" : host_name();
      bind = world.one_host ? "127.0.0.1" : "0.0.0.0";
    }
    const std::string secret = make_secret();
    try {
      out.server = std::make_shared<TcpStoreServer>(bind, 0, secret);
      contact = fmt::format("{}\n{}\n{}", announce, out.server->port(), secret);
    } catch (const std::exception& e) {
      contact = fmt::format("!{}", e.what());  // the others raise it too instead of waiting
    }
  }
  contact = mpi_broadcast_from_root(contact);
  DT_CHECK(contact.empty() || contact[0] != '!', "comm", "mpirun: rank 0 could not serve the store: {}",
           contact.substr(1));
  const size_t a = contact.find('\n'), b = contact.rfind('\n');
  DT_CHECK(a != std::string::npos && b != a, "comm", "mpirun: malformed store contact from rank 0");
  out.host = contact.substr(0, a);
  out.port = static_cast<uint16_t>(std::stoi(contact.substr(a + 1, b - a - 1)));
  out.secret = contact.substr(b + 1);
  out.store = connect_tcp_store(out.host, out.port, out.secret, timeout);
  return out;
}

Group Group::from_mpi(GroupOptions options) {
  const Environment env = Environment::read();
  const MpiWorld world = mpi_world();
  // The store (splits, heartbeats, checks) is served by rank 0; its address and a fresh secret
  // reach the others through MPI itself (MASTER_ADDR, when set, is the address rank 0 announces).
  MpiStore met = mpi_store(env.master_addr.value_or(""), options.timeout);
  if (options.heartbeat_timeout > Duration::zero() && !options.heartbeat_store) {
    options.heartbeat_store =
        connect_tcp_store(met.host, met.port, met.secret, std::max(options.heartbeat_timeout, Duration(1000)));
  }
  options.transport = TransportKind::mpi;
  options.secret = met.secret;
  Group g = create_group(met.store, world.rank, world.size, options, "world", env);
  g.impl_->keep_alive = met.server;
  return g;
}

}  // namespace dtrain::comm
