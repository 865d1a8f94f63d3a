// Which vector path a kernel of this library may take here: what the CPU has, lowered by
// ONEDNN_MAX_CPU_ISA. The cap that lowers PyTorch's and w4a8's paths lowers these, so one machine runs
// (and the tests compare) every path it has. attention.cpp and layer_ops.cpp choose their paths by it.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace specdec {

// Whether ONEDNN_MAX_CPU_ISA lets this process take a path: unset, ALL, DEFAULT, or a cap that starts
// with one of `names` (that ISA or a newer one).
inline bool cap_allows(std::initializer_list<const char*> names) {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr || std::strcmp(cap, "ALL") == 0 || std::strcmp(cap, "DEFAULT") == 0) return true;
  for (const char* name : names)
    if (std::strncmp(cap, name, std::strlen(name)) == 0) return true;
  return false;
}

#if defined(__x86_64__) && defined(__GNUC__)
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && cap_allows({"AVX2", "AVX512", "AMX"});
  return yes;
}

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && cap_allows({"AVX512"});
  return yes;
}
#endif

}  // namespace specdec
