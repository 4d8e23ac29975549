// src/parallel/designs/designs.h — the three designs DataParallel's options name
// (internal; Note [Designs] in src/parallel/design.h). One file each.
#pragma once

#include <memory>

#include "parallel/design.h"

namespace dp::parallel {

/// Mode::DP (designs/dp.cpp): transient replicas refreshed from device 0, the
/// gradients reduced onto device 0 after backward.
std::unique_ptr<Design> make_dp_design(DataParallel& dp);
/// Mode::DDP (designs/ddp.cpp): persistent replicas, buckets all-reduced while backward runs.
std::unique_ptr<Design> make_ddp_design(DataParallel& dp);
/// Mode::Sharded, stages 1-3 (designs/sharded.cpp, designs/sharded_units.cpp).
std::unique_ptr<Design> make_sharded_design(DataParallel& dp);

}  // namespace dp::parallel
