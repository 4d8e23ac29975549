// dp/nn/nn.h — everything of the nn layer: modules, layers, functional ops, init.
//
//   #include "dp/nn/nn.h"
//   auto net = std::make_shared<dp::nn::Sequential>(std::make_shared<dp::nn::Linear>(784, 10));
//   auto loss = dp::nn::cross_entropy((*net)(x), y);
#pragma once

#include "dp/nn/activation.h"
#include "dp/nn/attention.h"
#include "dp/nn/batchnorm.h"
#include "dp/nn/conv2d.h"
#include "dp/nn/dropout.h"
#include "dp/nn/embedding.h"
#include "dp/nn/flatten.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"
#include "dp/nn/linear.h"
#include "dp/nn/loss.h"
#include "dp/nn/module.h"
#include "dp/nn/normalization.h"
#include "dp/nn/parameter_set.h"
#include "dp/nn/pooling.h"
#include "dp/nn/sequential.h"
#include "dp/nn/state_dict.h"
#include "dp/nn/transformer.h"
#include "dp/nn/utils.h"
