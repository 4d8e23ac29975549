// dp/dp.h — the umbrella header: everything a training program needs.
//
//   #include <dp/dp.h>
//   dp::DataParallel model(net, {0, 1, 2, 3});
#pragma once

#include "dp/autograd/grad_mode.h"
#include "dp/comm/communicator.h"
#include "dp/comm/mpi_communicator.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/core/half.h"
#include "dp/data/dataloader.h"
#include "dp/data/idx.h"
#include "dp/data/cifar10.h"
#include "dp/data/synthetic.h"
#include "dp/data/tensor_dataset.h"
#include "dp/data/text.h"
#include "dp/data/sampler.h"
#include "dp/dist/dist.h"
#include "dp/io/checkpoint.h"
#include "dp/nn/nn.h"
#include "dp/optim/optim.h"
#include "dp/parallel/data_parallel.h"
#include "dp/parallel/stats.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"
#include "dp/version.h"
