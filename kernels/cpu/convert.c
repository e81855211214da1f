/*
 * convert.c - scalar element conversions of the weight dtypes: FP8 E4M3FN
 * (256-entry table built from the bit-field formula), F16 and BF16 to f32.
 *
 * Called by the scalar references (matmul, embed) and by the tests, which
 * compare the SIMD paths against these.  Thread rule: the FP8 table is built
 * once under pthread_once and read-only afterwards.
 *
 * FP8 E4M3FN (deepseek_v3_spec.md §2.3): byte s eeee mmm, bias 7, no
 * infinities; e = 0: (-1)^s (m/8) 2^-6; e > 0: (-1)^s (1 + m/8) 2^(e-7);
 * 0x7F and 0xFF are NaN; the largest finite value is 448 (0x7E).
 */
#include "kernels/cpu/cpu.h"

#include <math.h>
#include <pthread.h>

static float fp8_lut[256];
static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;

static void fp8_build(void)
{
	for (int b = 0; b < 256; b++) {
		int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
		float v;
		if (e == 15 && m == 7)
			v = NAN;
		else if (e == 0)
			v = ldexpf((float)m, -9); /* (m/8) * 2^-6 */
		else
			v = ldexpf((float)(8 + m), e - 10); /* (1 + m/8) * 2^(e-7) */
		fp8_lut[b] = s ? -v : v;
	}
}

const float *kc_fp8_e4m3_lut(void)
{
	pthread_once(&fp8_once, fp8_build);
	return fp8_lut;
}

float kc_fp8_e4m3_to_f32(uint8_t b)
{
	return kc_fp8_e4m3_lut()[b];
}

float kc_f16_to_f32(uint16_t h)
{
	union {
		uint32_t u;
		float f;
	} v;
	uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
	if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
		v.f = (float)m * 0x1p-24f;
		v.u |= s;
	} else if (e == 31) {
		v.u = s | 0x7F800000u | (m << 13); /* inf, or NaN keeping the payload */
	} else {
		v.u = s | ((e + 112) << 23) | (m << 13); /* rebias 15 -> 127 */
	}
	return v.f;
}

float kc_bf16_to_f32(uint16_t h)
{
	union {
		uint32_t u;
		float f;
	} v = {.u = (uint32_t)h << 16};
	return v.f;
}
