// The backward engine: runs a graph's nodes on the calling thread in reverse
// creation order. Each DataParallel worker calls it on its own graph, so the
// engine keeps no shared state.
#include <queue>
#include <unordered_map>

#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"

namespace dp::autograd {
namespace {

struct ByLaterFirst {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr < b->sequence_nr; }
};

// Adds g into slot (the sum of every path's gradient for one node input).
void accumulate(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g;
  } else {
    slot = slot + g;  // grad mode is off here: no graph is recorded
  }
}

// What grad_sink needs of the backward running on this thread: the node it runs, the
// edges still to come per node, and the gradients waiting per node.
struct Running {
  Node* node = nullptr;
  const std::unordered_map<Node*, int>* deps = nullptr;
  const std::unordered_map<Node*, std::vector<Tensor>>* inputs = nullptr;
};
thread_local Running t_running;

// Sets t_running for one node's apply, restoring the previous (a backward inside a
// backward function runs its own graph).
class RunningScope {
 public:
  explicit RunningScope(Running r) : prev_(t_running) { t_running = r; }
  ~RunningScope() { t_running = prev_; }
  RunningScope(const RunningScope&) = delete;
  RunningScope& operator=(const RunningScope&) = delete;

 private:
  Running prev_;
};

}  // namespace

GradSink grad_sink(int input_nr) {
  const Running& r = t_running;
  if (r.node == nullptr || input_nr < 0 || static_cast<std::size_t>(input_nr) >= r.node->next_edges.size()) return {};
  Node* next = r.node->next_edges[static_cast<std::size_t>(input_nr)].fn.get();
  auto* acc = dynamic_cast<AccumulateGrad*>(next);
  if (acc == nullptr) return {};
  // Note [Gradients added in place]: this edge must be the leaf's last one to come and
  // no earlier edge may have delivered a gradient, so nothing is summed with it.
  auto d = r.deps->find(next);
  if (d == r.deps->end() || d->second != 1 || r.inputs->count(next) != 0) return {};
  return acc->sink();
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  DP_CHECK(roots.size() == grads.size(), "backward: expected one gradient per root, got ", grads.size(),
           " for ", roots.size());
  NoGradGuard no_grad;  // backward itself is never recorded
  // Each node computes in its forward's dtypes (Note [Autocast op policy]).
  amp::AutocastStateGuard no_autocast(amp::AutocastState{false, amp::get_autocast_dtype()});

  std::unordered_map<Node*, std::vector<Tensor>> inputs;  // gradients waiting per node
  inputs.reserve(64);
  std::vector<std::shared_ptr<Node>> root_nodes;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    DP_CHECK(r.defined(), "backward: expected a defined tensor");
    Edge e = gradient_edge(r);
    DP_CHECK(e.valid(), "backward: ", r.str(),
             " does not require grad and has no grad_fn (did you run forward under no_grad, or "
             "forget set_requires_grad?)");
    Tensor g = grads[i];
    if (!g.defined()) {
      DP_CHECK(r.numel() == 1, "backward: a gradient can be created implicitly only for a scalar, got ",
               shape_str(r.shape()), "; pass grad explicitly");
      g = ones(r.shape(), r.device());
    }
    DP_CHECK(g.shape() == r.shape() && g.device() == r.device(), "backward: gradient ", g.str(),
             " does not match ", r.str());
    auto& slot = inputs[e.fn.get()];
    if (slot.size() <= static_cast<std::size_t>(e.input_nr)) slot.resize(e.input_nr + 1);
    accumulate(slot[e.input_nr], g);
    root_nodes.push_back(e.fn);
  }

  // Count, for every reachable node, how many edges point at it. A node is seen once
  // it has an entry (one map, not a map and a set: every entry is an allocation, and a
  // small model's step is dominated by such fixed costs).
  std::unordered_map<Node*, int> deps;
  deps.reserve(64);  // a small graph's nodes without rehashing
  std::vector<Node*> stack;
  for (auto& n : root_nodes)
    if (deps.try_emplace(n.get(), 0).second) stack.push_back(n.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    DP_CHECK(!n->released(), "backward through ", n->name(),
             " a second time: the graph was freed by the first backward. Pass retain_graph=true "
             "to the first backward() if you need to run it twice");
    for (auto& e : n->next_edges) {
      if (!e.valid()) continue;
      auto [it, fresh] = deps.try_emplace(e.fn.get(), 0);
      ++it->second;
      if (fresh) stack.push_back(e.fn.get());
    }
  }

  std::priority_queue<Node*, std::vector<Node*>, ByLaterFirst> ready;
  for (auto& n : root_nodes)
    if (deps[n.get()] == 0) {
      ready.push(n.get());
      deps[n.get()] = -1;  // queued
    }
  // Keep every node alive while the engine runs even if a released node drops edges.
  std::vector<std::shared_ptr<Node>> keep_alive(root_nodes);

  const BackwardNodeHook::Fn* hook = BackwardNodeHook::current();
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> in = std::move(inputs[node]);
    inputs.erase(node);
    bool any = false;
    for (auto& g : in) any = any || g.defined();
    std::vector<Tensor> out;
    if (any) {
      if (hook) (*hook)(*node);
      RunningScope running({node, &deps, &inputs});
      out = node->apply(std::move(in));
    }
    for (std::size_t i = 0; i < node->next_edges.size(); ++i) {
      Edge& e = node->next_edges[i];
      if (!e.valid()) continue;
      if (i < out.size() && out[i].defined()) {
        auto& slot = inputs[e.fn.get()];
        if (slot.size() <= static_cast<std::size_t>(e.input_nr)) slot.resize(e.input_nr + 1);
        accumulate(slot[e.input_nr], out[i]);
      }
      if (--deps[e.fn.get()] == 0) {
        keep_alive.push_back(e.fn);
        ready.push(e.fn.get());
      }
    }
    if (!retain_graph) node->release_saved();
  }
}

}  // namespace dp::autograd
