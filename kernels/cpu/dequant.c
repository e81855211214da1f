/*
 * dequant.c - weight slice to f32 (kb_dequant_args).  Run at model load for
 * the few matrices the engine keeps in f32; element-wise and simple, using the
 * exact element conversions of convert.c, and for the GGUF block-quantized
 * types whole blocks at a time through kc_dequant_row_ref (quant.h): the
 * slice then starts on a block and cols and w_stride are multiples of the
 * block (else DS_EINVAL).
 */
#include "kernels/cpu/attn.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

int kc_dequant(const kb_dequant_args *a)
{
	if (a->rows < 0 || a->cols < 0 || a->w_stride < a->cols || a->out_stride < a->cols)
		return DS_EINVAL;
	if (a->wtype == KB_F8_E4M3 && (!a->w_scale || a->block <= 0 || a->row0 < 0 || a->col0 < 0))
		return DS_EINVAL;
	if (kb_dtype_is_quant(a->wtype)) {
		const int64_t blk = kb_dtype_block(a->wtype);
		if (a->cols % blk || a->w_stride % blk)
			return DS_EINVAL;
		for (int64_t r = 0; r < a->rows; r++)
			kc_dequant_row_ref(a->wtype, (const char *)a->w + kb_dtype_bytes(a->wtype, r * a->w_stride),
					   a->out + r * a->out_stride, a->cols);
		return DS_OK;
	}
	const float *lut = kc_fp8_e4m3_lut();
	for (int64_t r = 0; r < a->rows; r++) {
		float *out = a->out + r * a->out_stride;
		for (int64_t c = 0; c < a->cols; c++) {
			int64_t i = r * a->w_stride + c;
			switch (a->wtype) {
			case KB_F32: out[c] = ((const float *)a->w)[i]; break;
			case KB_F16: out[c] = kc_f16_to_f32(((const uint16_t *)a->w)[i]); break;
			case KB_BF16: out[c] = kc_bf16_to_f32(((const uint16_t *)a->w)[i]); break;
			case KB_F8_E4M3: {
				int64_t sr = (a->row0 + r) / a->block, sc = (a->col0 + c) / a->block;
				out[c] = lut[((const uint8_t *)a->w)[i]] * a->w_scale[sr * a->scale_stride + sc];
				break;
			}
			default: return DS_EUNSUPPORTED;
			}
		}
	}
	return DS_OK;
}
