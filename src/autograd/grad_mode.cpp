#include "dp/autograd/grad_mode.h"

namespace dp {
namespace {
// Per thread: each DataParallel worker has its own grad mode.
thread_local bool t_grad_enabled = true;
}  // namespace

bool is_grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool enabled) { t_grad_enabled = enabled; }

}  // namespace dp
