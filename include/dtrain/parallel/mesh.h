// The device mesh: world = DP x PP x TP. A rank's coordinates and one sub-group per axis.
//
// Rank order: rank = (dp * PP + pp) * TP + tp. Tensor-parallel ranks, which talk in every
// layer, are adjacent; the ranks of one pipeline stage's data-parallel group are TP * PP apart.
#pragma once

#include <string>

#include "dtrain/comm/group.h"

namespace dtrain::parallel {

struct MeshShape {
  int dp = 1, pp = 1, tp = 1;
  int world() const { return dp * pp * tp; }
  std::string str() const;  // "dp 2 x pp 2 x tp 1"
};

struct MeshCoord {
  int dp = 0, pp = 0, tp = 0;
};

MeshCoord mesh_coord(const MeshShape& shape, int rank);
int mesh_rank(const MeshShape& shape, const MeshCoord& coord);

class Mesh {
 public:
  /// Collective over `world`: checks that its size is shape.world() (an error naming the three
  /// sizes otherwise) and splits it into the three axis groups.
  Mesh(const comm::Group& world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  comm::Group& world() { return world_; }
  /// Ranks that differ only in their dp coordinate: they hold the same parameters.
  comm::Group& dp() { return dp_; }
  /// Ranks that differ only in their pp coordinate: the stages of one pipeline, in stage order.
  comm::Group& pp() { return pp_; }
  /// Ranks that differ only in their tp coordinate: the shards of one stage.
  comm::Group& tp() { return tp_; }

 private:
  MeshShape shape_;
  MeshCoord coord_;
  comm::Group world_, dp_, pp_, tp_;
};

}  // namespace dtrain::parallel
