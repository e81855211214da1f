/*
 * cpu.h - the CPU backend: scalar references, SIMD variants, run-time dispatch.
 *
 * Each op has
 *   kc_<op>_ref(args)        plain C, double accumulation: the reference every
 *                            other implementation is tested against;
 *   kc_<op>_isa(isa, args)   one specific implementation (conformance tests call
 *                            every ISA the machine supports);
 *   the backend's op         dispatches to the best ISA found at run time.
 *
 * The ISA is detected once (cpuid through __builtin_cpu_supports) and can be
 * lowered with $DS_CPU_ISA=scalar|avx2|avx512|avx512bf16 or kc_isa_force().
 */
#ifndef DS_KERNELS_CPU_H
#define DS_KERNELS_CPU_H

#include "kernels/backend.h"

enum kc_isa {
	KC_ISA_SCALAR = 0,
	KC_ISA_AVX2 = 1,       /* AVX2 + FMA + F16C */
	KC_ISA_AVX512 = 2,     /* AVX-512 F/BW/VL/DQ */
	KC_ISA_AVX512BF16 = 3, /* AVX-512 + BF16 dot products */
	KC_ISA_COUNT
};

/* Best ISA this CPU supports (ignores any forced value). */
enum kc_isa kc_isa_detect(void);
/* The ISA the dispatcher uses: min(detected, forced or $DS_CPU_ISA). */
enum kc_isa kc_isa_active(void);
/* Caps the dispatcher at isa (tests, benchmarks); returns the previous cap. */
enum kc_isa kc_isa_force(enum kc_isa isa);
const char *kc_isa_name(enum kc_isa isa);
int kc_isa_parse(const char *s, enum kc_isa *out);

const kb_backend *kc_backend(void);

/* --- rmsnorm --- */
void kc_rmsnorm_ref(const kb_rmsnorm_args *a);
/* DS_EUNSUPPORTED when this CPU lacks isa. */
int kc_rmsnorm_isa(enum kc_isa isa, const kb_rmsnorm_args *a);

#endif
