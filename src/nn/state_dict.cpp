#include "dp/nn/state_dict.h"

#include <map>

#include "dp/core/error.h"

namespace dp::nn {
namespace {

// "'a', 'b', 'c' … and 7 more"
std::string join_names(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 10;  // enough to see the pattern (a prefix, a renamed layer)
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > kShown) s += detail::str_cat(" … and ", names.size() - kShown, " more");
  return s;
}

// "expected [32, 1, 3, 3], got [32, 3, 3, 3] for 'w'", naming dtypes only when they differ;
// empty when src fits dst.
std::string misfit(const std::string& name, const Tensor& dst, const Tensor& src) {
  if (!src.defined()) {
    return detail::str_cat("expected ", shape_str(dst.shape()), " ", dtype_name(dst.dtype()),
                           ", got an undefined tensor for '", name, "'");
  }
  if (src.shape() == dst.shape() && src.dtype() == dst.dtype()) return {};
  std::string exp = shape_str(dst.shape()), got = shape_str(src.shape());
  if (src.dtype() != dst.dtype()) {
    exp += detail::str_cat(" ", dtype_name(dst.dtype()));
    got += detail::str_cat(" ", dtype_name(src.dtype()));
  }
  return detail::str_cat("expected ", exp, ", got ", got, " for '", name, "'");
}

}  // namespace

StateDictMatch match_state_dict(const StateDict& target, const StateDict& given, bool strict,
                                const MatchContext& ctx) {
  std::map<std::string, const Tensor*> own;
  for (const auto& [k, v] : target) {
    DP_CHECK(own.emplace(k, &v).second, ctx.what, ": the name '", k, "' appears twice in ", ctx.target,
             "; every name must be unique");
    DP_CHECK(v.defined(), ctx.what, ": the tensor '", k, "' of ", ctx.target, " is undefined");
  }
  std::map<std::string, const Tensor*> src;
  for (const auto& [k, v] : given) {
    DP_CHECK(src.emplace(k, &v).second, ctx.what, ": the name '", k, "' appears twice in ", ctx.source,
             "; every name must be unique");
  }

  StateDictMatch m;
  for (const auto& [k, v] : target)
    if (!src.count(k)) m.keys.missing_keys.push_back(k);
  for (const auto& [k, v] : given)
    if (!own.count(k)) m.keys.unexpected_keys.push_back(k);
  if (strict && (!m.keys.missing_keys.empty() || !m.keys.unexpected_keys.empty())) {
    std::string msg = detail::str_cat(ctx.what, ": the names in ", ctx.source, " do not match ",
                                      ctx.target, "'s.");
    if (!m.keys.missing_keys.empty())
      msg += detail::str_cat(" Missing from ", ctx.source, ": ", join_names(m.keys.missing_keys), ".");
    if (!m.keys.unexpected_keys.empty()) {
      msg += detail::str_cat(" Unexpected (in ", ctx.source, ", not in ", ctx.target,
                             "): ", join_names(m.keys.unexpected_keys), ".");
    }
    DP_FAIL(msg, " ", ctx.fix_names);
  }

  // Every shape and dtype, all named at once: a renamed or resized layer shows as a pattern.
  std::vector<std::string> wrong;
  for (const auto& [k, dst] : target) {
    auto it = src.find(k);
    if (it == src.end()) continue;
    std::string w = misfit(k, dst, *it->second);
    if (!w.empty()) wrong.push_back(std::move(w));
    m.matched.emplace_back(k, *it->second);
  }
  if (!wrong.empty()) {
    constexpr std::size_t kShown = 8;  // each entry is long; the first few show the pattern
    std::string msg = detail::str_cat(ctx.what, ": ", wrong.size(), " tensor",
                                      wrong.size() > 1 ? "s do" : " does", " not fit ", ctx.target, ": ");
    for (std::size_t i = 0; i < wrong.size() && i < kShown; ++i) msg += (i ? "; " : "") + wrong[i];
    if (wrong.size() > kShown) msg += detail::str_cat("; … and ", wrong.size() - kShown, " more");
    DP_FAIL(msg, ". ", ctx.fix_shapes);
  }
  return m;
}

}  // namespace dp::nn
