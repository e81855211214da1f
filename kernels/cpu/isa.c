/*
 * isa.c - run-time detection of the CPU's SIMD level (see cpu.h).
 * Thread rule: detection is idempotent and cached in atomics; safe from any
 * thread.
 */
#include "kernels/cpu/cpu.h"

#include <stdlib.h>
#include <string.h>

static const char *isa_names[KC_ISA_COUNT] = {"scalar", "avx2", "avx512", "avx512bf16"};
static int g_detected = -1;
static int g_cap = -1;

const char *kc_isa_name(enum kc_isa isa)
{
	return isa < KC_ISA_COUNT ? isa_names[isa] : "unknown";
}

int kc_isa_parse(const char *s, enum kc_isa *out)
{
	for (int i = 0; i < KC_ISA_COUNT; i++) {
		if (s && strcmp(s, isa_names[i]) == 0) {
			*out = (enum kc_isa)i;
			return DS_OK;
		}
	}
	return DS_EINVAL;
}

enum kc_isa kc_isa_detect(void)
{
	int d = __atomic_load_n(&g_detected, __ATOMIC_RELAXED);
	if (d >= 0)
		return (enum kc_isa)d;
	d = KC_ISA_SCALAR;
#if defined(__x86_64__)
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
		d = KC_ISA_AVX2; /* every AVX2 CPU has F16C */
	if (d == KC_ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
	    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
	    __builtin_cpu_supports("avx512dq"))
		d = KC_ISA_AVX512;
	if (d == KC_ISA_AVX512 && __builtin_cpu_supports("avx512bf16"))
		d = KC_ISA_AVX512BF16;
#endif
	__atomic_store_n(&g_detected, d, __ATOMIC_RELAXED);
	return (enum kc_isa)d;
}

enum kc_isa kc_isa_active(void)
{
	int cap = __atomic_load_n(&g_cap, __ATOMIC_RELAXED);
	if (cap < 0) {
		enum kc_isa env_isa = KC_ISA_COUNT - 1;
		const char *env = getenv("DS_CPU_ISA");
		if (env && kc_isa_parse(env, &env_isa) != DS_OK)
			env_isa = KC_ISA_COUNT - 1;
		cap = (int)env_isa;
		__atomic_store_n(&g_cap, cap, __ATOMIC_RELAXED);
	}
	enum kc_isa det = kc_isa_detect();
	return (int)det < cap ? det : (enum kc_isa)cap;
}

enum kc_isa kc_isa_force(enum kc_isa isa)
{
	enum kc_isa prev = kc_isa_active();
	__atomic_store_n(&g_cap, (int)isa, __ATOMIC_RELAXED);
	return prev;
}
