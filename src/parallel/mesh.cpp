#include "dtrain/parallel/mesh.h"

#include <sched.h>

#include <fmt/format.h>

#include "dtrain/core/error.h"

namespace dtrain::parallel {

std::string MeshShape::str() const { return fmt::format("dp {} x pp {} x tp {}", dp, pp, tp); }

MeshCoord mesh_coord(const MeshShape& s, int rank) {
  return MeshCoord{rank / (s.tp * s.pp), (rank / s.tp) % s.pp, rank % s.tp};
}

int mesh_rank(const MeshShape& s, const MeshCoord& c) { return (c.dp * s.pp + c.pp) * s.tp + c.tp; }

Mesh::Mesh(const comm::Group& world, MeshShape shape) : shape_(shape), world_(world) {
  DT_CHECK(shape.dp >= 1 && shape.pp >= 1 && shape.tp >= 1, "mesh", "mesh sizes must be positive ({})", shape.str());
  DT_CHECK(world.size() == shape.world(), "mesh", "{} = {} ranks, but the world has {}", shape.str(), shape.world(),
           world.size());
  coord_ = mesh_coord(shape, world.rank());
  const MeshCoord c = coord_;
  // One split per axis; the color names the coordinates that stay fixed, the key orders the axis.
  dp_ = world.split(c.pp * shape.tp + c.tp, c.dp);
  // Pipeline stages wait milliseconds for each other and then want the message at once: when
  // every rank has a core, their waits spin instead of sleeping (a futex wake-up costs tens of
  // microseconds, twice per micro-batch on the critical path).
  comm::GroupOptions pp_options = world.options();
  cpu_set_t cpus;
  const int cores = ::sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  if (world.size() <= cores && pp_options.spin.count() == 0) pp_options.spin = std::chrono::milliseconds(100);
  pp_ = world.split(c.dp * shape.tp + c.tp, c.pp, pp_options);
  tp_ = world.split(c.dp * shape.pp + c.pp, c.tp);
}

}  // namespace dtrain::parallel
