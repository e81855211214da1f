/*
 * sampler.h - next-token sampling for one sequence.
 *
 * Order of operations (as vLLM applies them):
 *   1. penalties on the raw logits: repetition (HF rule: divide positive,
 *      multiply negative logits of every token seen in prompt or output),
 *      presence and frequency (OpenAI rule: logit -= presence * [count > 0]
 *      + frequency * count, output tokens only);
 *   2. temperature == 0: greedy argmax (lowest id on ties);
 *   3. else logits / temperature, softmax, then top_k, top_p (smallest set with
 *      cumulative probability >= top_p), min_p (drop p < min_p * p_max),
 *      renormalise and draw with the sequence's own RNG (xoshiro256**,
 *      seeded from `seed`, so a seed reproduces a sequence exactly).
 * All scratch memory is allocated in smp_new; sampling never allocates.
 * Thread rule: one smp_state per sequence, used by one thread at a time.
 */
#ifndef DS_ENGINE_SAMPLER_H
#define DS_ENGINE_SAMPLER_H

#include "common/status.h"

#include <stdint.h>

typedef struct smp_params {
	float temperature;        /* 0 = greedy */
	int top_k;                /* 0 = off */
	float top_p;              /* 1 = off */
	float min_p;              /* 0 = off */
	uint64_t seed;
	int has_seed;             /* 0: seed from the OS */
	float repetition_penalty; /* 1 = off */
	float presence_penalty;   /* 0 = off */
	float frequency_penalty;  /* 0 = off */
} smp_params;

typedef struct smp_state smp_state;

smp_params smp_default_params(void);
/* Validates the params (ranges named in the error). */
int smp_params_check(const smp_params *p, ds_err *err);

smp_state *smp_new(const smp_params *p, int vocab_size, ds_err *err);
void smp_free(smp_state *s);

/* Records prompt tokens (they count for the repetition penalty only). */
void smp_add_prompt(smp_state *s, const int32_t *ids, int64_t n);
/* Samples from logits[vocab_size] (modified in place) and records the token. */
int32_t smp_sample(smp_state *s, float *logits);

#endif
