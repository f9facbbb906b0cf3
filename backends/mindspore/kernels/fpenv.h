// mindserve kernels: every kernel computes in the IEEE default floating-point mode (round to nearest,
// subnormals kept), whatever mode the calling thread runs in.
//
// Why: MindSpore's own thread pools turn on flush-to-zero and denormals-are-zero on x86 (MXCSR 0x8040), and
// an AOT entry runs on one of those threads, while the pool's workers and the NumPy reference keep subnormals.
// Without a fixed mode, a chunk's bits would depend on which thread ran it, and served outputs on MindSpore's
// settings. Each extern "C" entry opens an FpScope; each pool worker sets the mode once when it starts.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace mindserve {

#if defined(__x86_64__) || defined(__i386__)
using FpMode = uint32_t;
constexpr FpMode kDefaultFp = 0x1F80;  // MXCSR: every exception masked, round to nearest, no FTZ, no DAZ
constexpr FpMode kFpStatus = 0x3F;     // the sticky exception flags, not part of the mode
inline FpMode get_fp_mode() { return _mm_getcsr(); }
inline void set_fp_mode(FpMode m) { _mm_setcsr(m); }
#elif defined(__aarch64__)
using FpMode = uint64_t;
constexpr FpMode kDefaultFp = 0;  // FPCR: round to nearest, FZ / FZ16 / DN off, no traps
constexpr FpMode kFpStatus = 0;
inline FpMode get_fp_mode() {
  uint64_t v;
  __asm__ volatile("mrs %0, fpcr" : "=r"(v));
  return v;
}
inline void set_fp_mode(FpMode m) { __asm__ volatile("msr fpcr, %0" : : "r"(m)); }
#else
using FpMode = uint32_t;  // no mode register we know of: the compiler's default is the IEEE one
constexpr FpMode kDefaultFp = 0;
constexpr FpMode kFpStatus = 0;
inline FpMode get_fp_mode() { return kDefaultFp; }
inline void set_fp_mode(FpMode) {}
#endif

// The default mode for the lifetime of a scope, the caller's back afterwards.
class FpScope {
 public:
  FpScope() : saved_(get_fp_mode()), changed_((saved_ & ~kFpStatus) != kDefaultFp) {
    if (changed_) set_fp_mode(kDefaultFp);
  }
  ~FpScope() {
    if (changed_) set_fp_mode(saved_);
  }
  FpScope(const FpScope &) = delete;
  FpScope &operator=(const FpScope &) = delete;

 private:
  FpMode saved_;
  bool changed_;
};

}  // namespace mindserve
