/*
 * quant.h - GGUF block-quantized weights on the CPU: dequantization and the
 * quantized matmul y (+)= x W^T (kernels/cpu, module prefix kc_).
 *
 * Block layouts (ggml's, as stored in GGUF files; little-endian; f16 = IEEE
 * binary16; a row of K elements is K / block consecutive blocks, no padding):
 *
 *   Q8_0  32 elements, 34 bytes: f16 d | int8 q[32]
 *         x[i] = d * q[i]
 *   Q4_0  32 elements, 18 bytes: f16 d | uint8 qs[16]
 *         x[i] = d * ((qs[i] & 15) - 8),  x[i + 16] = d * ((qs[i] >> 4) - 8),  i < 16
 *   Q4_1  32 elements, 20 bytes: f16 d | f16 m | uint8 qs[16]
 *         x[i] = d * (qs[i] & 15) + m,    x[i + 16] = d * (qs[i] >> 4) + m
 *   Q4_K  256 elements, 144 bytes: f16 d | f16 dmin | uint8 sc[12] | uint8 qs[128]
 *         8 sub-blocks j of 32 with a 6-bit scale s_j and a 6-bit min m_j
 *         packed in sc[12]:
 *           j < 4:  s_j = sc[j] & 63,   m_j = sc[j + 4] & 63
 *           j >= 4: s_j = (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4
 *                   m_j = (sc[j + 4] >> 4) | (sc[j] >> 6) << 4
 *         elements 64c + i (c < 4, i < 32): q = qs[32c + i] & 15, sub-block 2c;
 *         elements 64c + 32 + i:            q = qs[32c + i] >> 4, sub-block 2c + 1;
 *         x = (d * s_j) * q - (dmin * m_j)
 *   Q5_K  256 elements, 176 bytes: f16 d | f16 dmin | uint8 sc[12] | uint8 qh[32] | uint8 qs[128]
 *         as Q4_K with a fifth bit: element 64c + i adds 16 * ((qh[i] >> 2c) & 1),
 *         element 64c + 32 + i adds 16 * ((qh[i] >> (2c + 1)) & 1), so q < 32
 *   Q6_K  256 elements, 210 bytes: uint8 ql[128] | uint8 qh[64] | int8 sc[16] | f16 d
 *         two halves h < 2 of 128 elements; with L = ql + 64h, H = qh + 32h, i < 32:
 *           element 128h +      i: q = (L[i]      & 15) | ((H[i] >> 0) & 3) << 4
 *           element 128h + 32 + i: q = (L[i + 32] & 15) | ((H[i] >> 2) & 3) << 4
 *           element 128h + 64 + i: q = (L[i]      >> 4) | ((H[i] >> 4) & 3) << 4
 *           element 128h + 96 + i: q = (L[i + 32] >> 4) | ((H[i] >> 6) & 3) << 4
 *         x[e] = (d * sc[e / 16]) * (q - 32)
 * Dequantization evaluates these in f32 in the order written.
 *
 * The quantized matmul quantizes the activations on the fly, in two 8-bit
 * levels (x ~ d1 q1 + d2 q2, about 16 bits), and multiplies integers inside
 * each block:
 *   Q4_0, Q4_1, Q8_0 weights: x in blocks of 32 ("Q8 32"); Q4_K, Q5_K, Q6_K
 *   weights: x in super-blocks of 256 ("Q8 256").  Per x block:
 *   level 1 (as ggml): d1 = amax / 127, q1 = round-to-nearest-even(x * (127 /
 *     amax)) (both divisions in f32; an all-zero block gives d1 = 0, q1 = 0);
 *   level 2, the residual on a fixed finer scale: d2 = d1 / 256,
 *     q2 = clamp(round-to-nearest-even((x - d1 q1) * (256 / d1)), -127, 127)
 *     (x - d1 q1 and the products in f32, no fused multiply-add; |x - d1 q1|
 *     <= d1 / 2, so q2 fits; q2 = 0 when d1 = 0 or 256 / d1 overflows);
 *   plus, per level, the integer sum of each 16 q's, and for Q8 32 the sum of
 *   the reconstructed block sx = d1 (float)sum(q1) + d2 (float)sum(q2) (f32).
 * Per weight block and level the integer dot products are exact (int32); with
 * (dx, qx) = (d1, q1) and (d2, q2) in turn and the two results added:
 *   Q8_0: dw dx sum(qw qx)          Q4_0: dw dx sum((qw - 8) qx)
 *   Q4_1: dw dx sum(qw qx), plus mw sx once per block
 *   Q4_K, Q5_K: dx (d sum_j s_j sum(qw qx) - dmin sum_j m_j sum_j(qx))
 *   Q6_K: d dx sum_g sc_g sum((qw - 32) qx)            (g: sub-blocks of 16)
 * The SIMD kernels may join the levels exactly in one integer, 256 dot(qw, q1)
 * + dot(qw, q2) scaled by d2 (< 2^28 in magnitude per sub-block).  Block
 * results are summed in f32 (SIMD) or double (reference), so every
 * implementation agrees with kc_qmatmul_ref up to rounding.
 * Against an f32 product of the dequantized weights the activation error is
 * at most one step d2 = amax / 32512 per element (half a step by rounding; a
 * residual of exactly d1 / 2 is clamped from 128 to 127) plus f32 rounding:
 * about 128 times smaller than 8-bit activations, for twice the integer work
 * on the same weight loads.
 *
 * Every value an ISA computes for one y element comes from the same sequence
 * of operations whatever the thread count; decode-sized M (below the ISA's
 * GEMM threshold) and prefill-sized M use different kernels, which agree to
 * rounding.
 */
#ifndef DS_KERNELS_CPU_QUANT_H
#define DS_KERNELS_CPU_QUANT_H

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

/* Scalar dequantization of n elements (a multiple of kb_dtype_block(t)) of
 * block-quantized type t from src to dst; a no-op for other types. */
void kc_dequant_row_ref(enum kb_dtype t, const void *src, float *dst, int64_t n);

/* The quantized matmul's reference: the scheme above, block by block, with
 * double accumulation; single-threaded, allocates nothing.  Arguments as for
 * kb_matmul_args with a block-quantized wtype (K and w_stride multiples of the
 * block), validated by the caller; batch is honoured. */
void kc_qmatmul_ref(const kb_matmul_args *a);

/* The quantized matmul on one ISA (KC_ISA_SCALAR runs the scalar kernels
 * through the threaded driver).  Arguments validated by the caller.  Returns
 * DS_EUNSUPPORTED when this CPU lacks isa, DS_ENOMEM when the activation
 * scratch cannot be had (y untouched), else DS_OK.
 *
 * Memory: the quantized activations live in a per-calling-thread scratch
 * buffer that grows on demand up to KC_QUANT_SCRATCH_MAX bytes (larger M is
 * processed in row chunks) and is kept for the next call, so a decode loop
 * allocates only on its first call; it is freed when the thread exits.
 * Threads: uses the pool (pool.h: one caller at a time). */
#define KC_QUANT_SCRATCH_MAX ((size_t)64 << 20)
int kc_qmatmul_isa(enum kc_isa isa, const kb_matmul_args *a);

/* n products of one x row (every M = 1, the same x and K, weight types whose
 * activations are quantized alike, none batched): x is quantized once and the
 * rows of all the products are split over the pool as one range, so the
 * threads meet once instead of n times (a decode step's q, k and v, or gate
 * and up).  DS_EUNSUPPORTED (nothing done) when the products do not qualify:
 * the caller then runs them one by one.  Arguments already validated. */
int kc_qmatmul_multi_isa(enum kc_isa isa, const kb_matmul_args *a, int n);

/* Embedding lookup from a block-quantized table: out[i] = dequantized row
 * ids[i] (a->dim and a->table_stride multiples of the block; validated by the
 * caller).  Rows are spread over the pool. */
int kc_qembed(const kb_embed_args *a);

/* Tests only: 0 makes the AVX-512 path use its 512-bit maddubs kernels even
 * on a CPU with AVX512-VNNI (1, the default, uses VNNI when present).
 * Returns the previous setting.  Not thread-safe against running matmuls. */
int kc_quant_allow_vnni(int allow);
/* 1 when the AVX-512 path would use VNNI now. */
int kc_quant_uses_vnni(void);

#endif
