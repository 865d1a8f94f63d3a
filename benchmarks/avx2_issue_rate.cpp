// How many vpmaddubsw a core issues per cycle, alone and in the w4a8 AVX2 tile's patterns
// (benchmarks/RESULTS.md, "AVX2: one pass per block"). Inline asm, so the compiler cannot change
// the instruction mix; the rate assumes the core clock given on the command line (GHz; measure it
// with the dependent-add loop printed first).
//
//   g++ -O2 -mavx2 -o /tmp/avx2_issue_rate benchmarks/avx2_issue_rate.cpp && /tmp/avx2_issue_rate
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define TIME(name, per_loop, body)                                                                    \
  {                                                                                                \
    const long n = 100000000;                                                                      \
    const auto start = std::chrono::steady_clock::now();                                          \
    for (long i = 0; i < n; i++) __asm__ volatile(body ::: CLOBBERS);                              \
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); \
    std::printf("%-44s %.2f per cycle\n", name, per_loop * n / s / (ghz * 1e9));                      \
  }
#define MADD(dst) "vpmaddubsw %%ymm15, %%ymm14, %%ymm" #dst "\n"
#define MADD_ADD(tmp, acc) "vpmaddubsw %%ymm15, %%ymm14, %%ymm" #tmp "\n vpaddw %%ymm" #tmp ", %%ymm" #acc ", %%ymm" #acc "\n"
#define MEM_ADD(off, tmp, acc) "vpmaddubsw " #off "(%%rsp), %%ymm14, %%ymm" #tmp "\n vpaddw %%ymm" #tmp ", %%ymm" #acc ", %%ymm" #acc "\n"
#define BCAST_ADD(off, x, tmp, acc) "vpbroadcastd " #off "(%%rsp), %%ymm" #x "\n" \
  "vpmaddubsw %%ymm" #x ", %%ymm14, %%ymm" #tmp "\n vpaddw %%ymm" #tmp ", %%ymm" #acc ", %%ymm" #acc "\n"

int main(int argc, char** argv) {
  double ghz = 1.0;
  {
    const long n = 500000000;
    long x = 0;
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < n; i++)
      __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                       : "+r"(x));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("dependent adds: %.2f G/s (the core clock, one add per cycle)\n", 8.0 * n / s / 1e9);
    ghz = argc > 1 ? std::atof(argv[1]) : 8.0 * n / s / 1e9;
  }
  TIME("vpmaddubsw alone", 8.0, MADD(0) MADD(1) MADD(2) MADD(3) MADD(4) MADD(5) MADD(6) MADD(7));
  TIME("vpmaddubsw + vpaddw", 8.0,
       MADD_ADD(8, 0) MADD_ADD(9, 1) MADD_ADD(10, 2) MADD_ADD(11, 3) MADD_ADD(8, 4) MADD_ADD(9, 5) MADD_ADD(10, 6)
       MADD_ADD(11, 7));
  TIME("vpmaddubsw (memory operand) + vpaddw", 8.0,
       MEM_ADD(0, 8, 0) MEM_ADD(32, 9, 1) MEM_ADD(-32, 10, 2) MEM_ADD(-64, 11, 3) MEM_ADD(0, 8, 4) MEM_ADD(32, 9, 5)
       MEM_ADD(-32, 10, 6) MEM_ADD(-64, 11, 7));
  TIME("vpbroadcastd + vpmaddubsw + vpaddw", 8.0,
       BCAST_ADD(0, 12, 8, 0) BCAST_ADD(4, 13, 9, 1) BCAST_ADD(8, 12, 10, 2) BCAST_ADD(12, 13, 11, 3)
       BCAST_ADD(16, 12, 8, 4) BCAST_ADD(20, 13, 9, 5) BCAST_ADD(24, 12, 10, 6) BCAST_ADD(28, 13, 11, 7));
  return 0;
}
