// dp/autograd/grad_mode.h — per-thread switch for recording autograd graphs.
//
// Grad mode is thread-local: each DataParallel worker thread owns its own, so one
// worker's no_grad never affects another. This header knows nothing of tensors.
//
//   { dp::NoGradGuard g;  auto y = model(x); }   // nothing recorded in this scope
#pragma once

namespace dp {

/// True when ops on this thread record autograd nodes (the default).
bool is_grad_enabled();
/// Sets this thread's grad mode.
void set_grad_enabled(bool enabled);

/// RAII: disables recording on this thread for its lifetime, then restores.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/// RAII: sets grad mode to `enabled` for its lifetime, then restores.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(is_grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeGuard() { set_grad_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace dp
