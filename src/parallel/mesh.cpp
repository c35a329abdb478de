#include "dtrain/parallel/mesh.h"

#include <fmt/format.h>

#include <cstdlib>

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
  // Pipeline stages wait milliseconds for each other and then want the message at once: with
  // DTRAIN_PP_SPIN_US set (for hosts where every rank has a physical core to itself) their
  // waits spin that long instead of sleeping on a futex. Off by default: on SMT siblings or
  // shared cores a spinning stage slows the one computing next to it.
  comm::GroupOptions pp_options = world.options();
  if (const char* v = std::getenv("DTRAIN_PP_SPIN_US"); v != nullptr && pp_options.spin.count() == 0) {
    char* end = nullptr;
    const long long us = std::strtoll(v, &end, 10);
    DT_CHECK(end != v && *end == '\0' && us >= 0 && us <= 10'000'000, "mesh",
             "DTRAIN_PP_SPIN_US='{}': expected microseconds in [0, 10000000]", v);
    pp_options.spin = std::chrono::microseconds(us);
  }
  pp_ = world.split(c.dp * shape.tp + c.tp, c.pp, pp_options);
  tp_ = world.split(c.dp * shape.pp + c.pp, c.tp);
}

}  // namespace dtrain::parallel
