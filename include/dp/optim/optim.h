// dp/optim/optim.h — every optimizer and learning-rate scheduler of dp.
//
//   #include "dp/optim/optim.h"
//   dp::optim::Adam opt(net->parameters(), {.lr = 1e-3});
#pragma once

#include "dp/optim/adam.h"
#include "dp/optim/adamw.h"
#include "dp/optim/grad_scaler.h"
#include "dp/optim/lr_scheduler.h"
#include "dp/optim/optimizer.h"
#include "dp/optim/sgd.h"
#include "dp/optim/step_executor.h"
