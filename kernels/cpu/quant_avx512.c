/*
 * quant_avx512.c - AVX-512 kernels of the quantized matmul (quant_impl.h),
 * in two builds chosen at run time (kc_qkernels_avx512):
 *   VNNI (AVX512-VNNI present, e.g. Zen 4, Ice Lake and later): the 256-bit
 *     template of quant_simd.h with vpdpbusd / vpdpwssd, Q8_0 packed as
 *     q ^ 0x80 (its -128 offset undone through the activation sums), and the
 *     512-bit GEMM tile with vpdpbusd;
 *   no VNNI (Skylake-X): the same template with pmaddubsw + pmaddwd and the
 *     512-bit tile with vpmaddubsw (Q8_0 kept signed: |w| x sign(x, w)).
 * Every integer dot is exact (see quant_avx2.c for the pmaddubsw bounds;
 * vpdpbusd adds four u8 x s8 products into i32 without saturation).
 *
 * Called through kc_qkernels_avx512() by quant.c only; stateless and
 * thread-safe (each call writes only its own y rows or tile).
 */
#include "kernels/cpu/quant_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* ---- VNNI build ---- */
#define QS_TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define QS_FN(name) qv_##name
#define QS_DOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define QS_DOTW(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#define QS_Q8_XOR 1
#include "kernels/cpu/quant_simd.h"
#define QT_TGT QS_TGT
#define QT_FN(name) qv_##name
#define QT_VNNI 1
#include "kernels/cpu/quant_tile512.h"
#undef QS_TGT
#undef QS_FN
#undef QS_DOT
#undef QS_DOTW
#undef QS_Q8_XOR
#undef QT_TGT
#undef QT_FN
#undef QT_VNNI

/* ---- build without VNNI ---- */
#define QS_TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define QS_FN(name) qm_##name
#define QS_DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define QS_DOTW(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define QS_Q8_XOR 0
#include "kernels/cpu/quant_simd.h"
#define QT_TGT QS_TGT
#define QT_FN(name) qm_##name
#define QT_VNNI 0
#include "kernels/cpu/quant_tile512.h"

static void pack_vnni(enum kb_dtype t, const uint8_t *w, size_t w_row_bytes, int nr, int64_t nblk,
		      uint8_t *wp, float *sc, float *mn)
{
	qv_pack(t, w, w_row_bytes, nr, nblk, wp, sc, mn, 16);
}

static void pack_maddubs(enum kb_dtype t, const uint8_t *w, size_t w_row_bytes, int nr, int64_t nblk,
			 uint8_t *wp, float *sc, float *mn)
{
	qm_pack(t, w, w_row_bytes, nr, nblk, wp, sc, mn, 16);
}

static const kc_qkernels kernels_vnni = {
	.name = "avx512vnni",
	.quantize = qv_quantize,
	.quantize2 = qv_quantize2,
	.gemv = qv_gemv,
	.nr = 16,
	.mr_max = 8,
	.gemm_min_m = 4,
	.q8_off = -128,
	.pack = pack_vnni,
	.tile = qv_tile,
};

static const kc_qkernels kernels_maddubs = {
	.name = "avx512",
	.quantize = qm_quantize,
	.quantize2 = qm_quantize2,
	.gemv = qm_gemv,
	.nr = 16,
	.mr_max = 8,
	.gemm_min_m = 8,
	.q8_off = 0,
	.pack = pack_maddubs,
	.tile = qm_tile,
};

const kc_qkernels *kc_qkernels_avx512(int vnni)
{
	return vnni ? &kernels_vnni : &kernels_maddubs;
}

#else
const kc_qkernels *kc_qkernels_avx512(int vnni)
{
	(void)vnni;
	return NULL;
}
#endif
