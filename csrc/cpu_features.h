// CPU feature detection shared by the native kernels: AVX-512 code is compiled per function
// (target attribute) and picked at run time, so one build runs on any x86-64 machine.
#pragma once

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VSP_HAVE_AVX512 1
#define VSP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// True when the CPU has the AVX-512 subsets the kernels use; VLLM_SPARSE_NO_AVX512=1 forces the
// portable path (tests).
inline bool cpu_has_avx512() {
  static const char* off = std::getenv("VLLM_SPARSE_NO_AVX512");
  static const bool ok = !(off && *off && *off != '0') && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq");
  return ok;
}
#else
#define VSP_HAVE_AVX512 0
inline bool cpu_has_avx512() { return false; }
#endif
