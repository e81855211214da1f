/*
 * attn_paged_impl.h - the body of the paged GQA attention kernels, included
 * by attn_paged.c once per instruction set (private to kernels/cpu).
 *
 * The includer defines, with the matching target pragma active:
 *   VW            lanes per vector (16 for AVX-512, 8 for AVX2)
 *   VF            the vector type (__m512 / __m256)
 *   SFX(name)     the name with the ISA's suffix
 *   VLOAD(p) VSTORE(p, v) VSET1(x) VZERO() VFMA(a, b, c) = a * b + c
 *   VLOADH(p)     VW IEEE halves at p as f32
 *   VMUL VADD VSUB VMAX  VEXP(v)  VHSUM(v) VHMAX(v)
 *   VBLEND_LT(pos, j, a, b)  a where lanes of pos >= j, else b (the causal mask)
 *   VHSUM4(a, b, c, d, out)  out[0..3] = the horizontal sums of a, b, c, d
 *   VNREG         vector registers
 * and undefines them all at its end.
 *
 * Two kernels (see attn_paged.c for how work is split):
 *  - dec: one query token, the G heads of one KV head, keys [j0, j1): every
 *    K and V row slice is loaded once for the G heads; lanes are dimensions
 *    (head_dim % VW == 0).  Writes the unnormalised sum, the max and the
 *    normaliser (a split of the keys is merged by log-sum-exp afterwards).
 *  - tile: up to VW consecutive query tokens of one sequence (a prefill chunk)
 *    and one head, lanes are the tokens: scores of a key for all the tile's
 *    tokens are one vector (q transposed once per tile, the key's elements
 *    broadcast), and so is the running max and normaliser; no horizontal
 *    reduction, no transpose per key.  Keys are read once per tile instead of
 *    once per token.
 */

/* ---------------- decode: G heads of one KV head over keys [j0, j1) ----------------
 * H = 1: the rows are IEEE halves, widened where they are loaded (one
 * vcvtph2ps a vector); H = 0: f32.  Offsets count elements either way. */

/* VW elements of a row at element i */
__attribute__((always_inline)) static inline VF SFX(kv_load)(const int H, const void *row, int64_t i)
{
	return H ? VLOADH((const uint16_t *)row + i) : VLOAD((const float *)row + i);
}

/* acc[g][0..hd) += sum_i p[g][i] * V_i, CB vectors of every head in registers */
__attribute__((always_inline)) static inline void SFX(dec_pv)(const int G, const int CB, const int H, float *acc,
							    int64_t hd, const float *p, int64_t pstride,
							    const void *const *rows, int64_t off, int64_t n)
{
	for (int64_t c0 = 0; c0 < hd; c0 += (int64_t)CB * VW) {
		VF r[DEC_GMAX][4];
#pragma GCC unroll 8
		for (int g = 0; g < G; g++)
#pragma GCC unroll 4
			for (int c = 0; c < CB; c++)
				r[g][c] = VLOAD(acc + g * hd + c0 + c * VW);
		for (int64_t i = 0; i < n; i++) {
			VF x[4];
#pragma GCC unroll 4
			for (int c = 0; c < CB; c++)
				x[c] = SFX(kv_load)(H, rows[i], off + c0 + c * VW);
#pragma GCC unroll 8
			for (int g = 0; g < G; g++) {
				VF w = VSET1(p[g * pstride + i]);
#pragma GCC unroll 4
				for (int c = 0; c < CB; c++)
					r[g][c] = VFMA(w, x[c], r[g][c]);
			}
		}
#pragma GCC unroll 8
		for (int g = 0; g < G; g++)
#pragma GCC unroll 4
			for (int c = 0; c < CB; c++)
				VSTORE(acc + g * hd + c0 + c * VW, r[g][c]);
	}
}

/* s[g] += q_g . k over [d, d + VW) for the G heads, with only k's vector
 * live: q is read again for every row (dec_qk's R4 = 2). */
__attribute__((always_inline)) static inline void SFX(qk_lean)(const int G, const int H, VF *s, const float *q,
							     int64_t hd, const void *k, int64_t off, int64_t d)
{
	VF x = SFX(kv_load)(H, k, off + d);
#pragma GCC unroll 8
	for (int g = 0; g < G; g++)
		s[g] = VFMA(VLOAD(q + g * hd + d), x, s[g]);
}

/* sc[g][i] = q_g . K_i for the n rows from k0 (q already scaled).  R4 = 1
 * (when 4 rows x G heads of accumulators, the 4 rows' vectors and q fit the
 * registers): four rows at a time share each load of q; R4 = 2 (when only
 * the accumulators and one row's vector fit, e.g. G = 3 on AVX2): four rows
 * at a time, one row's vector live at once, q read again for each row (an
 * L1 hit, folded into the FMA).  Either way each head's four sums are
 * reduced together (VHSUM4) instead of one horizontal sum per row. */
__attribute__((always_inline)) static inline void SFX(dec_qk)(const int G, const int R4, const int H, float *sc,
							    int64_t sstride, const float *q, int64_t hd,
							    const void *const *rows, int64_t off, int64_t n)
{
	int64_t i = 0;
	if (R4)
		for (; i + 4 <= n; i += 4) {
			const void *k = rows[i], *k1 = rows[i + 1], *k2 = rows[i + 2], *k3 = rows[i + 3];
			VF s0[DEC_GMAX], s1[DEC_GMAX], s2[DEC_GMAX], s3[DEC_GMAX];
#pragma GCC unroll 8
			for (int g = 0; g < G; g++)
				s0[g] = s1[g] = s2[g] = s3[g] = VZERO();
			for (int64_t d = 0; d < hd; d += VW) {
				if (R4 == 2) {
					SFX(qk_lean)(G, H, s0, q, hd, k, off, d);
					SFX(qk_lean)(G, H, s1, q, hd, k1, off, d);
					SFX(qk_lean)(G, H, s2, q, hd, k2, off, d);
					SFX(qk_lean)(G, H, s3, q, hd, k3, off, d);
					continue;
				}
				VF x0 = SFX(kv_load)(H, k, off + d), x1 = SFX(kv_load)(H, k1, off + d);
				VF x2 = SFX(kv_load)(H, k2, off + d), x3 = SFX(kv_load)(H, k3, off + d);
#pragma GCC unroll 8
				for (int g = 0; g < G; g++) {
					VF qv = VLOAD(q + g * hd + d);
					s0[g] = VFMA(qv, x0, s0[g]);
					s1[g] = VFMA(qv, x1, s1[g]);
					s2[g] = VFMA(qv, x2, s2[g]);
					s3[g] = VFMA(qv, x3, s3[g]);
				}
			}
#pragma GCC unroll 8
			for (int g = 0; g < G; g++)
				VHSUM4(s0[g], s1[g], s2[g], s3[g], sc + g * sstride + i);
		}
	for (; i < n; i++) {
		VF s[DEC_GMAX];
#pragma GCC unroll 8
		for (int g = 0; g < G; g++)
			s[g] = VZERO();
		for (int64_t d = 0; d < hd; d += VW) {
			VF x = SFX(kv_load)(H, rows[i], off + d);
#pragma GCC unroll 8
			for (int g = 0; g < G; g++)
				s[g] = VFMA(VLOAD(q + g * hd + d), x, s[g]);
		}
#pragma GCC unroll 8
		for (int g = 0; g < G; g++)
			sc[g * sstride + i] = VHSUM(s[g]);
	}
}

/* One block of n keys (their rows) for G heads of KV head kh:
 * q [G][hd] scaled, the stretch's acc [G][hd], m [G], l [G] updated. */
__attribute__((always_inline)) static inline void SFX(dec_block_fixed)(const int G, const int H,
								     const kb_paged_attn_args *a, int64_t kh,
								     const float *q, const void *const *rows,
								     int64_t n, float *acc, float *m, float *l)
{
	const int64_t hd = a->head_dim;
	_Alignas(64) float sc[DEC_GMAX][BLK + VW];
	/* G heads x 4 accumulators, 4 row vectors and one more (q or the
	 * weight) fit the registers: the four-row scores and the 4-vector V
	 * pass.  R4 = 2 on AVX2 only, where it was measured (G = 3: 10% faster
	 * in bench_kernels --attn, docs/benchmarks.md). */
	const int fit4 = 4 * G + 5 <= VNREG;
	const int r4 = fit4 ? 1 : VNREG == 16 && 4 * G + 1 <= VNREG ? 2 : 0;
	SFX(dec_qk)(G, r4, H, &sc[0][0], BLK + VW, q, hd, rows, a->k_off + kh * hd, n);
	for (int g = 0; g < G; g++) {
		float *s = sc[g];
		VF vm = VSET1(-INFINITY);
		int64_t i = 0;
		for (; i + VW <= n; i += VW)
			vm = VMAX(vm, VLOAD(s + i));
		float bmax = VHMAX(vm);
		for (; i < n; i++)
			bmax = s[i] > bmax ? s[i] : bmax;
		if (bmax > m[g]) { /* the running max grows: rescale what is summed */
			float c = expf(m[g] - bmax);
			VF vc = VSET1(c);
			for (int64_t d = 0; d < hd; d += VW)
				VSTORE(acc + g * hd + d, VMUL(VLOAD(acc + g * hd + d), vc));
			l[g] *= c;
			m[g] = bmax;
		}
		VF vmx = VSET1(m[g]), sum = VZERO();
		for (i = 0; i + VW <= n; i += VW) {
			VF e = VEXP(VSUB(VLOAD(s + i), vmx));
			VSTORE(s + i, e);
			sum = VADD(sum, e);
		}
		float ls = VHSUM(sum);
		for (; i < n; i++)
			ls += (s[i] = expf(s[i] - m[g]));
		l[g] += ls;
	}
	const int64_t v0 = a->v_off + kh * hd;
	/* CB = 4 only when it fits (fit4; on AVX2 G = 3 would need 17, and spilled) */
	if (hd % (4 * VW) == 0 && G <= 4 && fit4)
		SFX(dec_pv)(G, 4, H, acc, hd, &sc[0][0], BLK + VW, rows, v0, n);
	else if (hd % (2 * VW) == 0)
		SFX(dec_pv)(G, 2, H, acc, hd, &sc[0][0], BLK + VW, rows, v0, n);
	else
		SFX(dec_pv)(G, 1, H, acc, hd, &sc[0][0], BLK + VW, rows, v0, n);
}

/* h16: the rows are halves (a->cache_type == KB_F16) */
static void SFX(dec_block)(int g, int h16, const kb_paged_attn_args *a, int64_t kh, const float *q,
			   const void *const *rows, int64_t n, float *acc, float *m, float *l)
{
#define DEC_CASES(H)                                                                              \
	switch (g) {                                                                              \
	case 1: SFX(dec_block_fixed)(1, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 2: SFX(dec_block_fixed)(2, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 3: SFX(dec_block_fixed)(3, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 4: SFX(dec_block_fixed)(4, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 5: SFX(dec_block_fixed)(5, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 6: SFX(dec_block_fixed)(6, H, a, kh, q, rows, n, acc, m, l); break;                  \
	case 7: SFX(dec_block_fixed)(7, H, a, kh, q, rows, n, acc, m, l); break;                  \
	default: SFX(dec_block_fixed)(8, H, a, kh, q, rows, n, acc, m, l); break;                 \
	}
	if (h16)
		DEC_CASES(1)
	else
		DEC_CASES(0)
#undef DEC_CASES
}

/* F16 cache, prefill tiles: elements [k0, k0 + w) and [v0, v0 + w) of the
 * n rows src[i] as f32, row i at cv + 2 w i (K, then V); w % VW == 0. */
static void SFX(cvt_rows)(float *cv, const void *const *src, int64_t n, int64_t k0, int64_t v0, int64_t w)
{
	for (int64_t i = 0; i < n; i++) {
		const uint16_t *r = src[i];
		float *o = cv + i * 2 * w;
		for (int64_t d = 0; d < w; d += VW)
			VSTORE(o + d, VLOADH(r + k0 + d));
		for (int64_t d = 0; d < w; d += VW)
			VSTORE(o + w + d, VLOADH(r + v0 + d));
	}
}

/* ---------------- prefill tile: nq <= VW consecutive tokens, one head ---------------- */

/* Scores, softmax update and weighted sum of one block (n keys, their rows;
 * K at koff, V at voff) for one head of a tile: qt [hd][VW], acc [hd][VW], m and l
 * per lane. */
__attribute__((always_inline)) static inline void SFX(tile_block)(const float *qt, float *acc, VF *mp, VF *lp,
								float *sc, const float *const *rows, int64_t koff,
								int64_t voff, int64_t hd, int64_t n, int64_t jb,
								int masked, VF vpos)
{
	/* scores, 4 keys at a time sharing each load of q */
	int64_t i = 0;
	for (; i + 4 <= n; i += 4) {
		VF s0 = VZERO(), s1 = VZERO(), s2 = VZERO(), s3 = VZERO();
		const float *k0 = rows[i] + koff, *k1 = rows[i + 1] + koff;
		const float *k2 = rows[i + 2] + koff, *k3 = rows[i + 3] + koff;
		for (int64_t d = 0; d < hd; d++) {
			VF qd = VLOAD(qt + d * VW);
			s0 = VFMA(qd, VSET1(k0[d]), s0);
			s1 = VFMA(qd, VSET1(k1[d]), s1);
			s2 = VFMA(qd, VSET1(k2[d]), s2);
			s3 = VFMA(qd, VSET1(k3[d]), s3);
		}
		VSTORE(sc + (i + 0) * VW, s0);
		VSTORE(sc + (i + 1) * VW, s1);
		VSTORE(sc + (i + 2) * VW, s2);
		VSTORE(sc + (i + 3) * VW, s3);
	}
	for (; i < n; i++) {
		VF s0 = VZERO();
		const float *k0 = rows[i] + koff;
		for (int64_t d = 0; d < hd; d++)
			s0 = VFMA(VLOAD(qt + d * VW), VSET1(k0[d]), s0);
		VSTORE(sc + i * VW, s0);
	}
	/* the running max and normaliser of every lane */
	VF bm = VSET1(-INFINITY);
	for (i = 0; i < n; i++) {
		VF s = VLOAD(sc + i * VW);
		if (masked)
			s = VBLEND_LT(vpos, (float)(jb + i), s, VSET1(-INFINITY));
		bm = VMAX(bm, s);
	}
	VF mn = VMAX(*mp, bm);
	VF c = VEXP(VSUB(*mp, mn)); /* m = -inf on the first block: acc and l are 0 anyway */
	VF l = VMUL(*lp, c);
	for (int64_t d = 0; d < hd; d++)
		VSTORE(acc + d * VW, VMUL(VLOAD(acc + d * VW), c));
	*mp = mn;
	for (i = 0; i < n; i++) {
		VF e = VEXP(VSUB(VLOAD(sc + i * VW), mn));
		if (masked)
			e = VBLEND_LT(vpos, (float)(jb + i), e, VZERO());
		VSTORE(sc + i * VW, e);
		l = VADD(l, e);
	}
	*lp = l;
	/* acc[d] += sum_i p_i * V_i[d], 8 dimensions in registers over the block */
	int64_t d0 = 0;
	for (; d0 + 8 <= hd; d0 += 8) {
		VF r[8];
#pragma GCC unroll 8
		for (int e = 0; e < 8; e++)
			r[e] = VLOAD(acc + (d0 + e) * VW);
		for (i = 0; i < n; i++) {
			const float *vi = rows[i] + voff + d0;
			VF p = VLOAD(sc + i * VW);
#pragma GCC unroll 8
			for (int e = 0; e < 8; e++)
				r[e] = VFMA(p, VSET1(vi[e]), r[e]);
		}
#pragma GCC unroll 8
		for (int e = 0; e < 8; e++)
			VSTORE(acc + (d0 + e) * VW, r[e]);
	}
	for (; d0 < hd; d0++) {
		VF r = VLOAD(acc + d0 * VW);
		for (i = 0; i < n; i++)
			r = VFMA(VLOAD(sc + i * VW), VSET1(rows[i][voff + d0]), r);
		VSTORE(acc + d0 * VW, r);
	}
}

/* nq <= VW consecutive tokens from t0 (one sequence), heads [h0, h0 + nh) of
 * one KV head: every block of keys is read once for all of them. */
static void SFX(tile)(const paged_ctx *x, int64_t t0, int nq, int64_t h0, int nh)
{
	const kb_paged_attn_args *a = x->a;
	const int64_t hd = a->head_dim;
	const int64_t kh = h0 / (a->n_heads / a->n_kv_heads);
	const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[t0] * a->max_blocks;
	const int64_t p0 = a->tok_pos[t0], plast = a->tok_pos[t0 + nq - 1];
	_Alignas(64) float qt[TILE_FMAX];  /* per head [d][lane] = scale * q[t0 + lane][h][d] */
	_Alignas(64) float acc[TILE_FMAX]; /* per head [d][lane] */
	_Alignas(64) float sc[BLK * VW];   /* [key][lane] */
	_Alignas(64) float pos[VW];
	const int f16 = a->cache_type == KB_F16;
	_Alignas(64) float cv[BLK * 2 * DEC_HDMAX]; /* F16: a block's K and V of kh (128 KiB of stack) */
	VF m[TILE_HMAX], l[TILE_HMAX];
	for (int g = 0; g < nh; g++) {
		for (int i = 0; i < VW; i++) {
			int li = i < nq ? i : nq - 1; /* idle lanes repeat the last token */
			const float *q = a->q + (t0 + li) * a->q_stride + (h0 + g) * hd;
			for (int64_t d = 0; d < hd; d++)
				qt[(g * hd + d) * VW + i] = q[d] * a->scale;
		}
		m[g] = VSET1(-INFINITY);
		l[g] = VZERO();
	}
	for (int i = 0; i < VW; i++)
		pos[i] = (float)a->tok_pos[t0 + (i < nq ? i : nq - 1)];
	memset(acc, 0, (size_t)(nh * hd * VW) * sizeof *acc);
	const VF vpos = VLOAD(pos);
	for (int64_t jb = 0; jb <= plast;) {
		/* blocks of BLK positions, whatever the page size (the rescale
		 * points, hence the rounding, follow positions only) */
		int64_t n = plast + 1 - jb;
		n = n < BLK ? n : BLK;
		const void *src[BLK];
		const float *rows[BLK];
		int64_t koff = a->k_off + kh * hd, voff = a->v_off + kh * hd;
		for (int64_t i = 0; i < n; i++)
			src[i] = key_row(a, bt, jb + i);
		if (f16) {
			SFX(cvt_rows)(cv, src, n, koff, voff, hd);
			koff = 0, voff = hd;
		}
		for (int64_t i = 0; i < n; i++)
			rows[i] = f16 ? cv + i * 2 * hd : (const float *)src[i];
		const int masked = jb + n - 1 > p0; /* some key of the block lies past a lane's token */
		for (int g = 0; g < nh; g++)
			SFX(tile_block)(qt + g * hd * VW, acc + g * hd * VW, &m[g], &l[g], sc, rows, koff, voff,
					hd, n, jb, masked, vpos);
		jb += n;
	}
	for (int g = 0; g < nh; g++) {
		_Alignas(64) float inv[VW];
		VSTORE(inv, l[g]);
		for (int i = 0; i < nq; i++) {
			float *o = a->out + (t0 + i) * a->out_stride + (h0 + g) * hd;
			float s = 1.0f / inv[i];
			for (int64_t d = 0; d < hd; d++)
				o[d] = acc[(g * hd + d) * VW + i] * s;
		}
	}
}

#undef VW
#undef VF
#undef SFX
#undef VLOAD
#undef VLOADH
#undef VSTORE
#undef VSET1
#undef VZERO
#undef VFMA
#undef VMUL
#undef VADD
#undef VSUB
#undef VMAX
#undef VEXP
#undef VHSUM
#undef VHMAX
#undef VBLEND_LT
#undef VNREG
#undef VHSUM4
