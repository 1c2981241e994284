// Fused CPU AdamW step for host-resident fp32 optimizer state: one pass over memory.
//
// Per element, one read of master/exp_avg/exp_avg_sq/grad and one write of master/exp_avg/exp_avg_sq
// plus (optionally) the compute-dtype copy of the new master that goes to the GPU. torch's fused CPU
// AdamW needs two more passes for the same job (grad bf16->fp32 cast before, master->bf16 copy after).
//
// Plain C ABI on raw pointers (no torch or Python headers here); loaded from Python with ctypes by
// megatrain_lightning/optim/native.py. Stateless apart from settings (thread count, ISA cap, placement).
//
// Numerics follow torch's single-tensor AdamW (torch/optim/adam.py, _single_tensor_adam) op by op,
// with each scalar hyperparameter turned into a float exactly the way ATen does (derived in double,
// then rounded to float once):
//   g      = float(grad) * grad_scale
//   p      = p * (1 - lr*wd)                                  decoupled (AdamW), wd != 0
//   g      = fma(p, wd, g)                                    L2 (Adam, decoupled=0), wd != 0
//   m      = lerp(m, g, w), w = 1-beta1:  w < 0.5: fma(w, g-m, m)  else fma(w-1, g-m, g)   (ATen lerp_vec)
//   v      = fma((1-beta2)*g, g, v*beta2)                     mul_ then addcmul_, which torch's build
//                                                             (GCC, -ffp-contract=fast over ATen's
//                                                             vector code) evaluates as this one FMA
//   denom  = sqrt(v) / bias_correction2_sqrt + eps
//   p      = p + ((-lr/bias_correction1) * m) / denom         addcdiv_
// sqrt is the correctly rounded instruction, as in torch's fused CPU AdamW, whose vector loop this
// matches bit for bit; torch's single-tensor path takes sqrt through MKL's vector math, which is 1-2
// ulp off for some inputs, so it agrees with this kernel to rounding only.
// The bias corrections are passed in (the caller computes 1 - beta1**step and sqrt(1 - beta2**step)
// in double, as torch does), so this library has no step counter. The scalar path uses std::fma where
// the vector paths use an FMA instruction and the file is built with -ffp-contract=off, so the scalar,
// AVX2 and AVX-512 paths give bitwise identical results.
//
// bf16 output rounds to nearest even exactly like tensor.to(torch.bfloat16) in ATen's vectorized
// conversion (NaN -> 0xFFFF, as ATen's AVX2/AVX-512 cvtfp32_bf16 writes it); bf16 input is widened by
// a 16-bit shift.
//
// Parallelism: one OpenMP parallel region per call, each thread one contiguous range of the array
// (ranges cut at multiples of 64 elements, so no two threads write to one cache line when the buffers
// are 64-byte aligned, as torch's CPU allocator makes them). Each thread gets at least 32K elements;
// smaller calls run on fewer threads, below 64K elements on the calling thread alone. Without OpenMP
// the same code runs single-threaded.
//
// Placement (NUMA): a thread may name a CPU for each member of the teams its calls start
// (mt_set_team_cpus; megatrain_lightning/optim/threads.py computes the list on machines with several
// NUMA nodes). Member t >= 1, an OpenMP helper thread, moves itself onto cpus[t] when a call starts and
// keeps it until the list changes; member 0 is the caller, whose own affinity is left as its owner set
// it. The list belongs to the calling thread (the engine's host worker), so kernel calls from other
// threads are not pinned. Placement never changes results: the ranges depend on the team size only.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <vector>

#if defined(__linux__)
#include <sched.h>  // sched_setaffinity, CPU_SET (g++ defines _GNU_SOURCE)
#define MT_CAN_PIN 1
#else
#define MT_CAN_PIN 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define MT_X86 1
#include <immintrin.h>
#else
#define MT_X86 0
#endif

#define MT_EXPORT extern "C" __attribute__((visibility("default")))

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wall reports as "may be used
// uninitialized" where they are inlined; a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

constexpr int kAbiVersion = 3;  // 3: adamw_peek

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum DType : int { kF32 = 0, kBF16 = 1 };
enum CopyKind : int { kCopyNone = 0, kCopyF32 = 1, kCopyBF16 = 2 };
enum WdMode : int { kWdNone = 0, kWdDecoupled = 1, kWdL2 = 2 };

// Elements below which a call stays on the calling thread (waking the team costs more than it saves).
constexpr int64_t kMinPerThread = int64_t(1) << 15;
// Thread ranges start at multiples of this many elements (64 fp32 = 4 cache lines).
constexpr int64_t kChunkAlign = 64;

std::atomic<int> g_num_threads{0};   // 0: OpenMP default of the calling thread
std::atomic<int> g_isa_cap{-1};      // -1: best the CPU supports

// CPUs for the members of the teams this thread's calls start (empty: no placement).
thread_local std::vector<int> tl_team_cpus;

struct AdamK {
  float decay;     // (float)(1 - lr*wd), used when mode == kWdDecoupled
  float l2;        // (float)wd,          used when mode == kWdL2
  int mode;
  float w1;        // lerp coefficient: (float)(1-beta1) if small, else (float)(1-beta1) - 1
  bool w1_small;   // |1-beta1| < 0.5 (ATen's is_lerp_weight_small)
  float beta2;     // (float)beta2
  float c2;        // (float)(1-beta2)
  float bc2s;      // (float)bias_correction2_sqrt
  float eps;       // (float)eps
  float nss;       // (float)(-(lr / bias_correction1))
  float gs;        // (float)grad_scale
  bool peek;       // write the copy alone: master, m and v are read and left as they are (adamw_peek)
};

// ---------------------------------------------------------------------------------------------------
// Scalar helpers (also the tails of the vector paths)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFF;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <int GT>
inline float load_grad(const void* g, int64_t i) {
  if (GT == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return static_cast<const float*>(g)[i];
}

template <int GT, int CT>
void adamw_scalar(const AdamK& k, float* __restrict p, float* __restrict m, float* __restrict v,
                  const void* __restrict g, void* __restrict out, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    float gi = load_grad<GT>(g, i) * k.gs;
    float pi = p[i];
    if (k.mode == kWdDecoupled) pi = pi * k.decay;
    else if (k.mode == kWdL2) gi = std::fma(pi, k.l2, gi);
    float mi = m[i];
    const float d = gi - mi;
    mi = k.w1_small ? std::fma(k.w1, d, mi) : std::fma(k.w1, d, gi);
    const float vi = std::fma(k.c2 * gi, gi, v[i] * k.beta2);
    const float den = std::sqrt(vi) / k.bc2s + k.eps;
    pi = pi + (k.nss * mi) / den;
    if (!k.peek) {
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
    if (CT == kCopyF32) static_cast<float*>(out)[i] = pi;
    else if (CT == kCopyBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(pi);
  }
}

template <int GT>
void accumulate_scalar(float* __restrict acc, const void* __restrict g, int first, int64_t b,
                       int64_t e) {
  if (first) {
    for (int64_t i = b; i < e; ++i) acc[i] = load_grad<GT>(g, i);
  } else {
    for (int64_t i = b; i < e; ++i) acc[i] = acc[i] + load_grad<GT>(g, i);
  }
}

template <int GT>
double sq_norm_scalar(const void* x, int64_t b, int64_t e) {
  double s = 0.0;
  for (int64_t i = b; i < e; ++i) {
    const double xi = load_grad<GT>(x, i);
    s += xi * xi;  // a float squared is exact in double
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Vector paths: the kernel bodies are written once (adamw_simd.inc) over a handful of primitives;
// each ISA namespace defines the primitives under its target attribute and includes the bodies.

#if MT_X86

namespace mt_avx2 {
#define MT_TARGET __attribute__((target("avx2,fma")))
constexpr int W = 8;
typedef __m256 vf;
typedef __m256d vd;

MT_TARGET inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
MT_TARGET inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
MT_TARGET inline vf vload_bf16(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
MT_TARGET inline void vstore_bf16(uint16_t* p, vf x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
  // every lane is <= 0xFFFF, so the unsigned-saturating pack is exact
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
MT_TARGET inline vf vset1(float a) { return _mm256_set1_ps(a); }
MT_TARGET inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
MT_TARGET inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
MT_TARGET inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
MT_TARGET inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
MT_TARGET inline vf vsqrt(vf a) { return _mm256_sqrt_ps(a); }
MT_TARGET inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  // a*b + c
MT_TARGET inline vd vdzero() { return _mm256_setzero_pd(); }
// acc0 += lo(x)^2, acc1 += hi(x)^2 in double
MT_TARGET inline void vacc_sq(vd& a0, vd& a1, vf x) {
  const vd lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const vd hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  a0 = _mm256_fmadd_pd(lo, lo, a0);
  a1 = _mm256_fmadd_pd(hi, hi, a1);
}
MT_TARGET inline double vdsum(vd a) {
  alignas(32) double t[4];
  _mm256_store_pd(t, a);
  return (t[0] + t[1]) + (t[2] + t[3]);
}
#include "adamw_simd.inc"
#undef MT_TARGET
}  // namespace mt_avx2

namespace mt_avx512 {
#define MT_TARGET __attribute__((target("avx512f,avx2,fma")))
constexpr int W = 16;
typedef __m512 vf;
typedef __m512d vd;

MT_TARGET inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
MT_TARGET inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
MT_TARGET inline vf vload_bf16(const uint16_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
MT_TARGET inline void vstore_bf16(uint16_t* p, vf x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
  // vpmovdw truncates each 32-bit lane to 16 bits; every lane is <= 0xFFFF, so this is exact
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
MT_TARGET inline vf vset1(float a) { return _mm512_set1_ps(a); }
MT_TARGET inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
MT_TARGET inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
MT_TARGET inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
MT_TARGET inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
MT_TARGET inline vf vsqrt(vf a) { return _mm512_sqrt_ps(a); }
MT_TARGET inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
MT_TARGET inline vd vdzero() { return _mm512_setzero_pd(); }
MT_TARGET inline void vacc_sq(vd& a0, vd& a1, vf x) {
  const vd lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const vd hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  a0 = _mm512_fmadd_pd(lo, lo, a0);
  a1 = _mm512_fmadd_pd(hi, hi, a1);
}
MT_TARGET inline double vdsum(vd a) {
  alignas(64) double t[8];
  _mm512_store_pd(t, a);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#include "adamw_simd.inc"
#undef MT_TARGET
}  // namespace mt_avx512

#endif  // MT_X86

// ---------------------------------------------------------------------------------------------------
// Dispatch

namespace {

int isa_supported() {
#if MT_X86
  static const int best = [] {
    __builtin_cpu_init();
    // libgcc only reports these when the OS saves the wider registers (XGETBV), so they are usable.
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
      return int(kAvx512);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return int(kAvx2);
    return int(kScalar);
  }();
  return best;
#else
  return kScalar;
#endif
}

int isa_active() {
  const int cap = g_isa_cap.load(std::memory_order_relaxed);
  const int best = isa_supported();
  return (cap >= 0 && cap < best) ? cap : best;
}

int threads_for(int64_t n) {
#ifdef _OPENMP
  int nt = g_num_threads.load(std::memory_order_relaxed);
  if (nt <= 0) nt = omp_get_max_threads();
  const int64_t by_size = n / kMinPerThread;
  if (by_size < nt) nt = int(by_size);
  return nt < 1 ? 1 : nt;
#else
  (void)n;
  return 1;
#endif
}

#ifdef _OPENMP
// Team member t (t >= 1) onto cpus[t]; back to the CPUs it had before its first move once the caller's
// list no longer names one for it. A system call only when the CPU changes; a refused move (a CPU
// outside the cgroup) leaves the thread where it was.
void place_member(const std::vector<int>& cpus, int t) {
#if MT_CAN_PIN
  thread_local int placed = -1;
  thread_local bool saved_valid = false;
  thread_local cpu_set_t saved;
  const int want = (t >= 1 && t < int(cpus.size())) ? cpus[t] : -1;
  if (t == 0 || want == placed) return;
  if (want >= 0 && want < CPU_SETSIZE) {
    if (!saved_valid) saved_valid = sched_getaffinity(0, sizeof(saved), &saved) == 0;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(want, &one);
    if (sched_setaffinity(0, sizeof(one), &one) == 0) placed = want;
  } else if (placed >= 0) {
    if (saved_valid) sched_setaffinity(0, sizeof(saved), &saved);
    placed = -1;
  }
#else
  (void)cpus;
  (void)t;
#endif
}
#endif  // _OPENMP

// Runs f(begin, end) over [0, n): one contiguous range per thread.
template <class F>
void parallel_ranges(int64_t n, F&& f) {
  const int nt = threads_for(n);
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
#ifdef _OPENMP
  const std::vector<int>& cpus = tl_team_cpus;  // the caller's list, read by every member
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t team = omp_get_num_threads();
    place_member(cpus, int(t));
    int64_t per = (n + team - 1) / team;
    per = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const int64_t b = t * per < n ? t * per : n;
    const int64_t e = b + per < n ? b + per : n;
    if (b < e) f(b, e);
  }
#endif
}

typedef void (*AdamFn)(const AdamK&, float*, float*, float*, const void*, void*, int64_t, int64_t);
typedef void (*AccFn)(float*, const void*, int, int64_t, int64_t);
typedef double (*NormFn)(const void*, int64_t, int64_t);

template <int GT, int CT>
AdamFn pick_adam(int isa) {
#if MT_X86
  if (isa == kAvx512) return &mt_avx512::adamw_range<GT, CT>;
  if (isa == kAvx2) return &mt_avx2::adamw_range<GT, CT>;
#endif
  (void)isa;
  return &adamw_scalar<GT, CT>;
}

template <int GT>
AdamFn pick_adam_copy(int isa, int ct) {
  if (ct == kCopyF32) return pick_adam<GT, kCopyF32>(isa);
  if (ct == kCopyBF16) return pick_adam<GT, kCopyBF16>(isa);
  return pick_adam<GT, kCopyNone>(isa);
}

template <int GT>
AccFn pick_acc(int isa) {
#if MT_X86
  if (isa == kAvx512) return &mt_avx512::accumulate_range<GT>;
  if (isa == kAvx2) return &mt_avx2::accumulate_range<GT>;
#endif
  (void)isa;
  return &accumulate_scalar<GT>;
}

template <int GT>
NormFn pick_norm(int isa) {
#if MT_X86
  if (isa == kAvx512) return &mt_avx512::sq_norm_range<GT>;
  if (isa == kAvx2) return &mt_avx2::sq_norm_range<GT>;
#endif
  (void)isa;
  return &sq_norm_scalar<GT>;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// C ABI. Return codes: 0 ok, -1 bad grad dtype, -2 bad copy dtype, -3 negative n, -4 null pointer.

MT_EXPORT int mt_abi_version(void) { return kAbiVersion; }

// Best ISA this CPU supports / the one calls use now (0 scalar, 1 AVX2+FMA, 2 AVX-512F).
MT_EXPORT int mt_isa_supported(void) { return isa_supported(); }
MT_EXPORT int mt_isa(void) { return isa_active(); }
// Caps the ISA (for tests and comparisons); level < 0 restores the best supported. Returns the ISA
// now in use (never above what the CPU supports).
MT_EXPORT int mt_set_isa(int level) {
  g_isa_cap.store(level < 0 ? -1 : level, std::memory_order_relaxed);
  return isa_active();
}

MT_EXPORT int mt_has_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// n > 0: every later call uses up to n threads, whatever thread calls; n <= 0: back to the OpenMP
// default of the calling thread (OMP_NUM_THREADS / omp_set_num_threads / number of CPUs).
MT_EXPORT void mt_set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

// CPUs for the members of the teams that later calls from the calling thread start: member t >= 1 runs
// on cpus[t] (cpus[0], the caller's own, is not applied). n == 0 clears the list: members go back to
// the CPUs they had. Returns 1 when threads can be placed (Linux, OpenMP build), else 0 (a no-op).
MT_EXPORT int mt_set_team_cpus(const int* cpus, int n) {
  if (cpus != nullptr && n > 0) {
    tl_team_cpus.assign(cpus, cpus + n);
  } else {
    tl_team_cpus.clear();
  }
#if MT_CAN_PIN && defined(_OPENMP)
  return 1;
#else
  return 0;
#endif
}

// The thread count a large call would use from the calling thread.
MT_EXPORT int mt_get_num_threads(void) {
#ifdef _OPENMP
  const int n = g_num_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
#else
  return 1;
#endif
}

namespace {

int adam_call(float* master, float* m, float* v, const void* grad, int grad_dtype, void* out_copy,
              int copy_dtype, int64_t n, double lr, double beta1, double beta2, double eps,
              double weight_decay, double bias_correction1, double bias_correction2_sqrt,
              double grad_scale, int decoupled, bool peek) {
  if (grad_dtype != kF32 && grad_dtype != kBF16) return -1;
  if (out_copy != nullptr && copy_dtype != kF32 && copy_dtype != kBF16) return -2;
  if (peek && out_copy == nullptr) return -4;  // a peek writes nothing else
  if (n < 0) return -3;
  if (n == 0) return 0;
  if (!master || !m || !v || !grad) return -4;

  AdamK k;
  k.mode = weight_decay == 0.0 ? kWdNone : (decoupled ? kWdDecoupled : kWdL2);
  k.decay = float(1.0 - lr * weight_decay);
  k.l2 = float(weight_decay);
  const float w = float(1.0 - beta1);
  k.w1_small = std::fabs(w) < 0.5f;
  k.w1 = k.w1_small ? w : w - 1.0f;
  k.beta2 = float(beta2);
  k.c2 = float(1.0 - beta2);
  k.bc2s = float(bias_correction2_sqrt);
  k.eps = float(eps);
  k.nss = float(-(lr / bias_correction1));
  k.gs = float(grad_scale);
  k.peek = peek;

  const int ct = out_copy == nullptr ? kCopyNone : (copy_dtype == kF32 ? kCopyF32 : kCopyBF16);
  const int isa = isa_active();
  const AdamFn fn = grad_dtype == kBF16 ? pick_adam_copy<kBF16>(isa, ct) : pick_adam_copy<kF32>(isa, ct);
  parallel_ranges(n, [&](int64_t b, int64_t e) { fn(k, master, m, v, grad, out_copy, b, e); });
  return 0;
}

}  // namespace

// One AdamW (decoupled=1) or Adam-with-L2 (decoupled=0) step over n elements, in place on master, m,
// v; writes the new master to out_copy (fp32 or bf16) when out_copy is not NULL. bias_correction1 is
// 1 - beta1**step and bias_correction2_sqrt is sqrt(1 - beta2**step). The scalars are doubles so the
// float constants are derived exactly as torch derives them from its Python floats.
MT_EXPORT int adamw_step(float* master, float* m, float* v, const void* grad, int grad_dtype,
                         void* out_copy, int copy_dtype, int64_t n, double lr, double beta1,
                         double beta2, double eps, double weight_decay, double bias_correction1,
                         double bias_correction2_sqrt, double grad_scale, int decoupled) {
  return adam_call(master, m, v, grad, grad_dtype, out_copy, copy_dtype, n, lr, beta1, beta2, eps,
                   weight_decay, bias_correction1, bias_correction2_sqrt, grad_scale, decoupled, false);
}

// The same step's new weights into out_copy (required) alone, computed exactly as adamw_step computes
// them, with master, m and v only read: a speculative step (engine/host/host_steps.py) that the step
// proper may still discard. 16 bytes of traffic per element with a bf16 gradient and copy, against 28.
MT_EXPORT int adamw_peek(float* master, float* m, float* v, const void* grad, int grad_dtype,
                         void* out_copy, int copy_dtype, int64_t n, double lr, double beta1,
                         double beta2, double eps, double weight_decay, double bias_correction1,
                         double bias_correction2_sqrt, double grad_scale, int decoupled) {
  return adam_call(master, m, v, grad, grad_dtype, out_copy, copy_dtype, n, lr, beta1, beta2, eps,
                   weight_decay, bias_correction1, bias_correction2_sqrt, grad_scale, decoupled, true);
}

// acc = grad (first=1) or acc += grad (first=0); grad fp32 or bf16, acc fp32.
MT_EXPORT int grad_accumulate(float* acc, const void* grad, int grad_dtype, int64_t n, int first) {
  if (grad_dtype != kF32 && grad_dtype != kBF16) return -1;
  if (n < 0) return -3;
  if (n == 0) return 0;
  if (!acc || !grad) return -4;
  const int isa = isa_active();
  const AccFn fn = grad_dtype == kBF16 ? pick_acc<kBF16>(isa) : pick_acc<kF32>(isa);
  parallel_ranges(n, [&](int64_t b, int64_t e) { fn(acc, grad, first, b, e); });
  return 0;
}

// Sum of squares of x (fp32 or bf16), accumulated in double. NaN for a bad dtype or n < 0.
MT_EXPORT double sq_norm(const void* x, int dtype, int64_t n) {
  if ((dtype != kF32 && dtype != kBF16) || n < 0) return std::nan("");
  if (n == 0) return 0.0;
  if (!x) return std::nan("");
  const int isa = isa_active();
  const NormFn fn = dtype == kBF16 ? pick_norm<kBF16>(isa) : pick_norm<kF32>(isa);
  const int nt = threads_for(n);
  if (nt <= 1) return fn(x, 0, n);
  // per-thread partials summed in thread order: the result does not depend on scheduling
  double partial[256] = {0};
  const int team_max = nt < 256 ? nt : 256;
#ifdef _OPENMP
  const std::vector<int>& cpus = tl_team_cpus;
#pragma omp parallel num_threads(team_max)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t team = omp_get_num_threads();
    place_member(cpus, int(t));
    int64_t per = (n + team - 1) / team;
    per = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const int64_t b = t * per < n ? t * per : n;
    const int64_t e = b + per < n ? b + per : n;
    if (b < e) partial[t] = fn(x, b, e);
  }
#endif
  double s = 0.0;
  for (int t = 0; t < team_max; ++t) s += partial[t];
  return s;
}
