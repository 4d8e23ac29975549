#include "dp/version.h"

namespace dp {

// The macros are expanded here, when libdp is compiled, so these report the library's
// version whatever headers the calling program was compiled against.
const char* version() noexcept { return DP_VERSION_STRING; }
int version_major() noexcept { return DP_VERSION_MAJOR; }
int version_minor() noexcept { return DP_VERSION_MINOR; }
int version_patch() noexcept { return DP_VERSION_PATCH; }

}  // namespace dp
