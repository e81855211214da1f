/*
 * matmul_rows_impl.h - the driver of the one-x-row decode kernel
 * (kc_mm_kernels.rows; kc_mm_rows in matmul_impl.h), included once by
 * matmul_avx2.c and once by matmul_avx512.c (private to kernels/cpu).
 *
 * The includer defines, before the include:
 *   TGT, INL      its target attribute (and the always-inline form of it)
 *   RV, RZERO()   the vector type of one row's partial sums, a zero one
 *   FP8_UNDO      what FP8 sums are multiplied by when y is written
 * and the static functions the driver calls:
 *   RV   row_bf16(t, pf_end, x, w)   one BF16 row against the permuted x
 *   RV   row_fp8(t, pf_end, w)       one FP8 row against t->xs
 *   void rows_fp8_scale_x(t, x, s)   t->xs = x times scale row s, times FP8_SC
 *   __m128 sum4(a, b, c, d)          the four vectors' sums, each by one tree
 * (after them) and defines rows from them; it undefines RV and RZERO at its
 * end.
 *
 * Invariants: a thread's share [n0, n1) is read row by row in memory order
 * (one sequential stream); rows are written four at a time by one tree of
 * sums whatever the share's start, so a row's result does not depend on the
 * thread split; FP8 x is rescaled whenever a row enters another scale-block
 * row or product.
 */

/* y[0 .. nd) = (or +=) the sums of the nd <= 4 vectors in v.  sum4 sums
 * each vector by the same tree whatever the others hold, so a row's result
 * does not depend on where a thread's share or a group of four starts.  Four
 * rows go out as one vector store (or load, add, store): through a stack
 * array and a scalar loop they cost rows of K = 128 (W_UK^T) 6-11% and rows
 * of K = 512 2-3% (same bits; docs/benchmarks.md, "2026-12-06, evening"). */
INL void rows_write(const kc_mm_rows *t, RV v[4], int nd, float *y)
{
	for (int i = nd; i < 4; i++)
		v[i] = RZERO();
	__m128 s = sum4(v[0], v[1], v[2], v[3]);
	if (t->dt == KB_F8_E4M3)
		s = _mm_mul_ps(s, _mm_set1_ps(FP8_UNDO));
	if (nd == 4) { /* every group but a share's, product's or block row's last */
		_mm_storeu_ps(y, t->store ? s : _mm_add_ps(_mm_loadu_ps(y), s));
		return;
	}
	_Alignas(16) float r[4];
	_mm_store_ps(r, s);
	for (int i = 0; i < nd; i++)
		y[i] = t->store ? r[i] : y[i] + r[i];
}

/* One row at w: FP8 against t->xs, or BF16 against x. */
INL RV row_any(const kc_mm_rows *t, const char *pf_end, int fp8, const float *x, const char *w)
{
	return fp8 ? row_fp8(t, pf_end, (const uint8_t *)w) : row_bf16(t, pf_end, x, (const uint16_t *)w);
}

TGT static void rows(const kc_mm_rows *t)
{
	const size_t rb = (size_t)t->K * (t->dt == KB_BF16 ? 2 : 1);
	const char *w = (const char *)t->w + (size_t)t->n0 * rb, *pf_end = t->pf_end;
	/* the share's first pf_bytes: nothing ran ahead of them */
	for (const char *p = w; p < w + t->pf_bytes && p < pf_end; p += 64)
		__builtin_prefetch(p, 0, 1);
	/* product i, its row r, its x, y and scales (no division per row: with
	 * K = 128 a row is only two steps) */
	int64_t i = t->n0 / t->per_item, r = t->n0 - i * t->per_item;
	const float *x = t->x + i * t->K, *s = t->scale ? t->scale + i * t->s_bstride : NULL;
	float *y = t->y + i * t->y_bstride;
	int64_t sb_end = r; /* FP8: the first row of the next scale block row */
	const int fp8 = t->dt == KB_F8_E4M3;
	for (int64_t n = t->n0; n < t->n1;) {
		if (r == t->per_item) {
			r = 0, sb_end = 0;
			x += t->K, y += t->y_bstride;
			if (s)
				s += t->s_bstride;
		}
		if (fp8 && r == sb_end) {
			rows_fp8_scale_x(t, x, s + r / t->block * t->scale_stride);
			sb_end = (r / t->block + 1) * t->block;
		}
		/* the next q <= 4 rows: of this call, this product and (FP8) this
		 * scale block row.  Four at a time into four named vectors: when each
		 * row's sums went into an array at a running index they went through
		 * the stack, which cost short rows 10% (K = 128, two steps a row) and
		 * 3-5% (K = 512), same bits (docs/benchmarks.md). */
		int64_t q = t->n1 - n;
		if (t->per_item - r < q)
			q = t->per_item - r;
		if (fp8 && sb_end - r < q)
			q = sb_end - r;
		RV v[4];
		if (q >= 4) {
			q = 4;
			v[0] = row_any(t, pf_end, fp8, x, w);
			v[1] = row_any(t, pf_end, fp8, x, w + rb);
			v[2] = row_any(t, pf_end, fp8, x, w + 2 * rb);
			v[3] = row_any(t, pf_end, fp8, x, w + 3 * rb);
		} else {
			v[0] = v[1] = v[2] = v[3] = RZERO(); /* rows_write ignores v[q..4) */
			for (int j = 0; j < q; j++)
				v[j] = row_any(t, pf_end, fp8, x, w + j * rb);
		}
		rows_write(t, v, (int)q, y + r);
		n += q, r += q, w += (size_t)q * rb;
	}
}

#undef RV
#undef RZERO
