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

/* The CPU backend's ops table (kb_backend_open("cpu", ...) runs it). */
const kb_backend_ops *kc_backend_ops(void);

/* --- rmsnorm --- */
void kc_rmsnorm_ref(const kb_rmsnorm_args *a);
/* DS_EUNSUPPORTED when this CPU lacks isa. */
int kc_rmsnorm_isa(enum kc_isa isa, const kb_rmsnorm_args *a);

/* --- element conversions (convert.c), exact --- */
/* The 256 FP8 E4M3FN values (0x7F, 0xFF: NaN), built from the bit fields. */
const float *kc_fp8_e4m3_lut(void);
float kc_fp8_e4m3_to_f32(uint8_t b);
float kc_f16_to_f32(uint16_t h);
float kc_bf16_to_f32(uint16_t h);

/* The kc_<op>_isa functions below assume arguments the backend has validated
 * (backend_cpu.c); each returns DS_EUNSUPPORTED when this CPU lacks isa.  The
 * SIMD versions of matmul and the element-wise ops use the thread pool
 * (pool.h), so they share its one-caller-at-a-time rule. */

/* --- matmul (matmul.c; kernels in matmul_avx2.c, matmul_avx512.c) ---
 * f32 activations, f32 accumulation.  FP8 weights are dequantized 16 at a
 * time in registers (or into a small per-thread panel when M > the tile
 * height), never as a whole matrix.  The fast FP8 paths decode 0x7F/0xFF as
 * +-480 instead of NaN: those patterns never occur in real weights. */
void kc_matmul_ref(const kb_matmul_args *a);
int kc_matmul_isa(enum kc_isa isa, const kb_matmul_args *a);
/* a->batch > 1 products (kb_matmul_args' batched form; arguments checked by
 * the caller).  With one x row each and the W matrices back to back (the
 * absorbed-MLA per-head matrices) one pass streams them all, each thread one
 * stretch of rows; otherwise one product per pool item.  Either way each y
 * element is what kc_matmul_isa gives for its product alone. */
int kc_matmul_batch_isa(enum kc_isa isa, const kb_matmul_args *a);
/* n <= 32 products of one x row each (their own x, W, y; arguments checked
 * by the caller) as one pool job: the rows of all of them cut into shares
 * the threads claim, each x permuted once however many products share it;
 * a product goes through the one-row kernels when they take its rows, else
 * through the decode tiles.  Each y element is what kc_matmul_isa gives for
 * its product alone.  DS_EUNSUPPORTED (nothing computed) for a product of
 * more x rows, a batched or block-quantized one, or an instruction set
 * without the SIMD kernels. */
int kc_matmul_multi_isa(enum kc_isa isa, const kb_matmul_args *a, int n);

/* --- embed, rope, silu_mul, axpy, softmax --- */
void kc_embed_ref(const kb_embed_args *a);
int kc_embed_isa(enum kc_isa isa, const kb_embed_args *a);
/* rope has one implementation (scalar, cos/sin once per token and pair, in
 * double); every isa runs it. */
void kc_rope_ref(const kb_rope_args *a);
int kc_rope_isa(enum kc_isa isa, const kb_rope_args *a);
void kc_silu_mul_ref(const kb_silu_mul_args *a);
int kc_silu_mul_isa(enum kc_isa isa, const kb_silu_mul_args *a);
void kc_axpy_ref(const kb_axpy_args *a);
int kc_axpy_isa(enum kc_isa isa, const kb_axpy_args *a);
void kc_softmax_ref(const kb_softmax_args *a);
int kc_softmax_isa(enum kc_isa isa, const kb_softmax_args *a);

#endif
