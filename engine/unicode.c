/*
 * unicode.c - General Category / White_Space lookups and strict UTF-8 (see unicode.h).
 *
 * Called by the tokenizer's pre-tokenizer (tok_pretok.c) and byte-level
 * decoding (tok.c).  Pure functions over const tables: thread-safe.
 * Invariants: the generated run table partitions U+0000..U+10FFFF (so a binary
 * search always finds a run); well-formedness follows Unicode Table 3-7, which
 * is also the rule of Rust's str and Python's decoder.
 */
#include "engine/unicode_impl.h"

static const char *const gc_names[UNI_GC_COUNT] = {
	"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
	"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So",
	"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co",
};

static const unsigned char gc_class[UNI_GC_COUNT] = {
	[UNI_GC_CN] = UNI_C,
	[UNI_GC_LU] = UNI_L, [UNI_GC_LL] = UNI_L, [UNI_GC_LT] = UNI_L,
	[UNI_GC_LM] = UNI_L, [UNI_GC_LO] = UNI_L,
	[UNI_GC_MN] = UNI_M, [UNI_GC_MC] = UNI_M, [UNI_GC_ME] = UNI_M,
	[UNI_GC_ND] = UNI_N, [UNI_GC_NL] = UNI_N, [UNI_GC_NO] = UNI_N,
	[UNI_GC_PC] = UNI_P, [UNI_GC_PD] = UNI_P, [UNI_GC_PS] = UNI_P, [UNI_GC_PE] = UNI_P,
	[UNI_GC_PI] = UNI_P, [UNI_GC_PF] = UNI_P, [UNI_GC_PO] = UNI_P,
	[UNI_GC_SM] = UNI_S, [UNI_GC_SC] = UNI_S, [UNI_GC_SK] = UNI_S, [UNI_GC_SO] = UNI_S,
	[UNI_GC_ZS] = UNI_Z, [UNI_GC_ZL] = UNI_Z, [UNI_GC_ZP] = UNI_Z,
	[UNI_GC_CC] = UNI_C, [UNI_GC_CF] = UNI_C, [UNI_GC_CS] = UNI_C, [UNI_GC_CO] = UNI_C,
};

const char *uni_version(void)
{
	return uni_tables_version;
}

const char *uni_gc_name(enum uni_gc gc)
{
	return (unsigned)gc < UNI_GC_COUNT ? gc_names[gc] : "??";
}

enum uni_gc uni_gc_of(uint32_t cp)
{
	if (cp > UNI_MAX)
		return UNI_GC_CN;
	/* last run whose start <= cp */
	size_t lo = 0, hi = uni_gc_nruns; /* answer in [lo, hi) */
	while (hi - lo > 1) {
		size_t mid = lo + (hi - lo) / 2;
		if ((uni_gc_runs[mid] >> UNI_RUN_SHIFT) <= cp)
			lo = mid;
		else
			hi = mid;
	}
	return (enum uni_gc)(uni_gc_runs[lo] & ((1u << UNI_RUN_SHIFT) - 1));
}

static int is_white_space(uint32_t cp)
{
	for (size_t i = 0; i < uni_ws_nranges; i++) {
		if (cp < uni_ws_ranges[i][0])
			return 0;
		if (cp <= uni_ws_ranges[i][1])
			return 1;
	}
	return 0;
}

unsigned uni_class(uint32_t cp)
{
	unsigned c = gc_class[uni_gc_of(cp)];
	if (is_white_space(cp))
		c |= UNI_WS;
	return c;
}
