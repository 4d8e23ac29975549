// The per-thread autocast state (Note [Autocast op policy] in dp/tensor/autocast.h).
#include "dp/tensor/autocast.h"

#include "dp/core/error.h"
#include "tensor/autocast_policy.h"

namespace dp::amp {
namespace {

thread_local AutocastState t_state;

}  // namespace

AutocastState autocast_state() { return t_state; }
void set_autocast_state(AutocastState state) { t_state = state; }
bool is_autocast_enabled() { return t_state.enabled; }
Dtype get_autocast_dtype() { return t_state.dtype; }

autocast::autocast(Dtype dtype, bool enabled) : prev_(t_state) {
  DP_CHECK(dtype == Dtype::BFloat16 || dtype == Dtype::Float16,
           "autocast: expected dtype bfloat16 or float16 (the lower precision ops run in), got ", dtype_name(dtype));
  t_state = AutocastState{enabled, dtype};
}
autocast::~autocast() { t_state = prev_; }

AutocastStateGuard::AutocastStateGuard(AutocastState state) : prev_(t_state) { t_state = state; }
AutocastStateGuard::~AutocastStateGuard() { t_state = prev_; }

namespace detail {

Tensor cast(const Tensor& t, Dtype dtype) {
  return t.defined() && is_floating_point(t.dtype()) && t.dtype() != dtype ? t.to(dtype) : t;
}

}  // namespace detail
}  // namespace dp::amp
