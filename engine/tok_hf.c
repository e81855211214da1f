/*
 * tok_hf.c - tok_load_hf: a Hugging Face tokenizer.json (+ tokenizer_config.json)
 * turned into tok_build_params for tok_new.
 *
 * Callers: the engine's model loader, tests/tools/tok_tool.c.  Calls jansson
 * (through common/jsonx) and tok_new.  Thread rule: no shared state.
 *
 * What is accepted (everything else is rejected with the offending type or
 * value named, never silently approximated):
 *   model        BPE; vocab {token: id}; merges as "a b" strings or [a, b]
 *                pairs; dropout null; byte_fallback false; no subword prefix /
 *                suffix; unk_token null or a vocab entry; ignore_merges.
 *   added_tokens id, content, special, lstrip, rstrip, normalized, single_word.
 *   normalizer   null or a Sequence with no normalizers (the identity).
 *   pre_tokenizer ByteLevel (add_prefix_space false; use_regex true = the GPT-2
 *                pattern), or a Sequence of Split (Regex pattern, behavior
 *                Isolated, invert false) ending in ByteLevel as above.
 *   decoder      ByteLevel (or null: same bytes).
 *   post_processor ignored: BOS is added by TOK_ADD_BOS from the config.
 * Config: bos_token / eos_token (a string or an AddedToken object; looked up
 * with tok_find_token), add_bos_token, chat_template (a string, or a list of
 * {name, template} whose "default" entry is used).
 */
#include "common/fileutil.h"
#include "common/jsonx.h"
#include "engine/tok_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* tokenizer.json / tokenizer_config.json are read whole (ds_file_read_all)
 * under this cap: large vocabularies make files of tens of MiB (Llama 3:
 * 9 MiB, DeepSeek-V3: 8 MiB); a larger file is refused, never truncated. */
#define HF_MAX_FILE ((size_t)256 << 20)
#define HF_MAX_DEPTH 64
#define HF_MAX_SPLITS 16

static json_t *load_json(const char *path, ds_err *err)
{
	char *text = NULL;
	size_t len = 0;
	if (ds_file_read_all(path, HF_MAX_FILE, &text, &len, err) != 0)
		return NULL;
	json_t *root = jsonx_parse(text, len, HF_MAX_DEPTH, err);
	free(text);
	if (!root) {
		ds_err_wrap(err, "%s", path);
		return NULL;
	}
	if (!json_is_object(root)) {
		ds_err_set(err, DS_EFORMAT, "%s: the top level is not an object", path);
		json_decref(root);
		return NULL;
	}
	return root;
}

static const char *type_of(const json_t *obj)
{
	const json_t *t = json_object_get(obj, "type");
	return json_is_string(t) ? json_string_value(t) : NULL;
}

/* true/false field that must hold `want` when present */
static int want_bool(const json_t *obj, const char *key, int want, const char *where, ds_err *err)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return ds_err_set(err, DS_EFORMAT, "%s.%s must be a boolean", where, key);
	if (json_is_true(v) != want)
		return ds_err_set(err, DS_EUNSUPPORTED, "%s.%s = %s is not supported", where, key,
				  want ? "false" : "true");
	return 0;
}

static int check_byte_level(const json_t *bl, int *use_regex, const char *where, ds_err *err)
{
	int rc;
	if ((rc = want_bool(bl, "add_prefix_space", 0, where, err)) != 0)
		return rc;
	const json_t *ur = json_object_get(bl, "use_regex");
	*use_regex = ur ? json_is_true(ur) : 1; /* the reference's default is true */
	return 0;
}

/* Fills pats[] (borrowed from the JSON) from the pre_tokenizer object. */
static int parse_pretok(const json_t *pt, const char **pats, size_t *n, ds_err *err)
{
	const char *type = type_of(pt);
	int use_regex = 0, rc;
	*n = 0;
	if (!pt || json_is_null(pt))
		return ds_err_set(err, DS_EUNSUPPORTED,
				  "pre_tokenizer null: only byte-level BPE is supported");
	if (!type)
		return ds_err_set(err, DS_EFORMAT, "pre_tokenizer has no type");
	if (strcmp(type, "ByteLevel") == 0) {
		if ((rc = check_byte_level(pt, &use_regex, "pre_tokenizer", err)) != 0)
			return rc;
		if (use_regex)
			pats[(*n)++] = tok_pattern_gpt2;
		return 0;
	}
	if (strcmp(type, "Sequence") != 0)
		return ds_err_set(err, DS_EUNSUPPORTED, "pre_tokenizer type '%s' is not supported", type);
	const json_t *list = json_object_get(pt, "pretokenizers");
	if (!json_is_array(list) || json_array_size(list) == 0)
		return ds_err_set(err, DS_EFORMAT, "pre_tokenizer Sequence needs a non-empty 'pretokenizers'");
	size_t count = json_array_size(list);
	for (size_t i = 0; i < count; i++) {
		const json_t *p = json_array_get(list, i);
		const char *pty = type_of(p);
		if (!pty)
			return ds_err_set(err, DS_EFORMAT, "pre_tokenizer %zu has no type", i);
		if (strcmp(pty, "ByteLevel") == 0) {
			if (i + 1 != count)
				return ds_err_set(err, DS_EUNSUPPORTED,
						  "pre_tokenizer %zu: ByteLevel must come last", i);
			if ((rc = check_byte_level(p, &use_regex, "pre_tokenizer ByteLevel", err)) != 0)
				return rc;
			if (use_regex) {
				if (*n >= HF_MAX_SPLITS)
					return ds_err_set(err, DS_EUNSUPPORTED, "more than %d splits", HF_MAX_SPLITS);
				pats[(*n)++] = tok_pattern_gpt2;
			}
			return 0;
		}
		if (strcmp(pty, "Split") != 0)
			return ds_err_set(err, DS_EUNSUPPORTED, "pre_tokenizer %zu: type '%s' is not supported",
					  i, pty);
		const json_t *pat = json_object_get(p, "pattern");
		const json_t *re = json_object_get(pat, "Regex");
		const char *beh = json_string_value(json_object_get(p, "behavior"));
		if (!json_is_string(re)) {
			if (json_is_string(json_object_get(pat, "String")))
				return ds_err_set(err, DS_EUNSUPPORTED,
						  "pre_tokenizer %zu: Split on a literal String is not supported", i);
			return ds_err_set(err, DS_EFORMAT, "pre_tokenizer %zu: Split has no pattern.Regex", i);
		}
		if (!beh || strcmp(beh, "Isolated") != 0)
			return ds_err_set(err, DS_EUNSUPPORTED,
					  "pre_tokenizer %zu: Split behavior '%s' is not supported (only Isolated)",
					  i, beh ? beh : "(none)");
		if ((rc = want_bool(p, "invert", 0, "pre_tokenizer Split", err)) != 0)
			return rc;
		const char *re_s = json_string_value(re);
		if (!tok_pretok_known(re_s))
			return ds_err_set(err, DS_EUNSUPPORTED, "pre_tokenizer %zu: Split pattern not supported: \"%s\"",
					  i, re_s);
		if (*n >= HF_MAX_SPLITS)
			return ds_err_set(err, DS_EUNSUPPORTED, "more than %d splits", HF_MAX_SPLITS);
		pats[(*n)++] = re_s;
	}
	return ds_err_set(err, DS_EUNSUPPORTED,
			  "pre_tokenizer Sequence does not end in ByteLevel: only byte-level BPE is supported");
}

static int check_normalizer(const json_t *nm, ds_err *err)
{
	if (!nm || json_is_null(nm))
		return 0;
	const char *type = type_of(nm);
	if (type && strcmp(type, "Sequence") == 0) {
		const json_t *l = json_object_get(nm, "normalizers");
		if (json_is_array(l) && json_array_size(l) == 0)
			return 0;
		const char *inner = json_is_array(l) ? type_of(json_array_get(l, 0)) : NULL;
		return ds_err_set(err, DS_EUNSUPPORTED,
				  "normalizer Sequence with members (first: '%s') is not supported; only none "
				  "or an empty Sequence",
				  inner ? inner : "?");
	}
	return ds_err_set(err, DS_EUNSUPPORTED,
			  "normalizer '%s' is not supported; only none or an empty Sequence",
			  type ? type : "?");
}

static int parse_model(const json_t *model, tok_build_params *p, tok_str **vocab_out,
		       tok_str **merges_out, ds_err *err)
{
	const char *type = type_of(model);
	if (!json_is_object(model))
		return ds_err_set(err, DS_EFORMAT, "no 'model' object");
	if (type && strcmp(type, "BPE") != 0)
		return ds_err_set(err, DS_EUNSUPPORTED, "model type '%s' is not supported (only BPE)", type);
	const json_t *v;
	if ((v = json_object_get(model, "dropout")) && !json_is_null(v))
		return ds_err_set(err, DS_EUNSUPPORTED, "model.dropout is not supported");
	int rc;
	if ((rc = want_bool(model, "byte_fallback", 0, "model", err)) != 0)
		return rc;
	const char *const affixes[] = { "continuing_subword_prefix", "end_of_word_suffix" };
	for (size_t i = 0; i < 2; i++) {
		v = json_object_get(model, affixes[i]);
		if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
			return ds_err_set(err, DS_EUNSUPPORTED, "model.%s is not supported", affixes[i]);
	}
	p->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));

	const json_t *vocab = json_object_get(model, "vocab");
	if (!json_is_object(vocab) || json_object_size(vocab) == 0)
		return ds_err_set(err, DS_EFORMAT, "model.vocab must be a non-empty object");
	size_t n = 0;
	const char *key;
	json_t *val;
	json_object_foreach((json_t *)vocab, key, val) {
		json_int_t id = json_is_integer(val) ? json_integer_value(val) : -1;
		if (id < 0 || id >= (json_int_t)(1 << 30))
			return ds_err_set(err, DS_EFORMAT, "model.vocab[\"%s\"]: id must be an integer in [0, 2^30)",
					  key);
		if ((size_t)id + 1 > n)
			n = (size_t)id + 1;
	}
	tok_str *vs = calloc(n, sizeof *vs);
	if (!vs)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	*vocab_out = vs;
	json_object_foreach((json_t *)vocab, key, val) {
		size_t id = (size_t)json_integer_value(val);
		if (vs[id].len)
			return ds_err_set(err, DS_EFORMAT, "model.vocab: id %zu is used twice", id);
		vs[id].s = key;
		vs[id].len = strlen(key);
		if (vs[id].len == 0)
			return ds_err_set(err, DS_EFORMAT, "model.vocab: id %zu is the empty string", id);
	}
	p->vocab = vs;
	p->n_vocab = n;

	const json_t *unk = json_object_get(model, "unk_token");
	if (unk && !json_is_null(unk)) {
		const json_t *uid = json_is_string(unk) ? json_object_get(vocab, json_string_value(unk)) : NULL;
		if (!uid)
			return ds_err_set(err, DS_EFORMAT, "model.unk_token is not in the vocab");
		p->unk_id = (int32_t)json_integer_value(uid);
	}

	const json_t *merges = json_object_get(model, "merges");
	if (!json_is_array(merges))
		return ds_err_set(err, DS_EFORMAT, "model.merges must be an array");
	size_t nm = json_array_size(merges);
	tok_str *ms = calloc(nm ? 2 * nm : 1, sizeof *ms);
	if (!ms)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	*merges_out = ms;
	for (size_t k = 0; k < nm; k++) {
		const json_t *m = json_array_get(merges, k);
		if (json_is_string(m)) {
			const char *s = json_string_value(m);
			const char *sp = strchr(s, ' ');
			if (!sp || sp == s || !sp[1] || strchr(sp + 1, ' '))
				return ds_err_set(err, DS_EFORMAT, "model.merges[%zu] \"%s\" is not \"a b\"", k, s);
			ms[2 * k] = (tok_str){ s, (size_t)(sp - s) };
			ms[2 * k + 1] = (tok_str){ sp + 1, strlen(sp + 1) };
		} else if (json_is_array(m) && json_array_size(m) == 2 &&
			   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
			const json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
			ms[2 * k] = (tok_str){ json_string_value(a), json_string_length(a) };
			ms[2 * k + 1] = (tok_str){ json_string_value(b), json_string_length(b) };
		} else {
			return ds_err_set(err, DS_EFORMAT, "model.merges[%zu] is neither \"a b\" nor [a, b]", k);
		}
	}
	p->merges = ms;
	p->n_merges = nm;
	return 0;
}

static int parse_added(const json_t *list, tok_build_params *p, tok_added_token **out, ds_err *err)
{
	*out = NULL;
	if (!list || json_is_null(list))
		return 0;
	if (!json_is_array(list))
		return ds_err_set(err, DS_EFORMAT, "added_tokens must be an array");
	size_t n = json_array_size(list);
	tok_added_token *a = calloc(n ? n : 1, sizeof *a);
	if (!a)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	*out = a;
	static const struct {
		const char *key;
		unsigned flag;
	} flags[] = {
		{ "special", TOK_ADDED_SPECIAL },     { "lstrip", TOK_ADDED_LSTRIP },
		{ "rstrip", TOK_ADDED_RSTRIP },       { "normalized", TOK_ADDED_NORMALIZED },
		{ "single_word", TOK_ADDED_SINGLE_WORD },
	};
	for (size_t i = 0; i < n; i++) {
		const json_t *t = json_array_get(list, i);
		const json_t *id = json_object_get(t, "id"), *content = json_object_get(t, "content");
		if (!json_is_integer(id) || json_integer_value(id) < 0 ||
		    json_integer_value(id) >= (json_int_t)(1 << 30) || !json_is_string(content) ||
		    json_string_length(content) == 0)
			return ds_err_set(err, DS_EFORMAT,
					  "added_tokens[%zu] needs an integer id in [0, 2^30) and a non-empty content", i);
		a[i].id = (int32_t)json_integer_value(id);
		a[i].content = (tok_str){ json_string_value(content), json_string_length(content) };
		for (size_t f = 0; f < sizeof flags / sizeof flags[0]; f++) {
			const json_t *v = json_object_get(t, flags[f].key);
			if (v && !json_is_boolean(v))
				return ds_err_set(err, DS_EFORMAT, "added_tokens[%zu].%s must be a boolean", i,
						  flags[f].key);
			if (json_is_true(v))
				a[i].flags |= flags[f].flag;
		}
	}
	p->added = a;
	p->n_added = n;
	return 0;
}

/* bos_token / eos_token: "text" or {"content": "text", ...}; NULL when absent. */
static const char *token_string(const json_t *cfg, const char *key)
{
	const json_t *v = json_object_get(cfg, key);
	if (json_is_string(v))
		return json_string_value(v);
	if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
		return json_string_value(json_object_get(v, "content"));
	return NULL;
}

static const char *chat_template_of(const json_t *cfg)
{
	const json_t *v = json_object_get(cfg, "chat_template");
	if (json_is_string(v))
		return json_string_value(v);
	if (json_is_array(v)) {
		size_t i;
		const json_t *e;
		json_array_foreach(v, i, e) {
			const char *name = json_string_value(json_object_get(e, "name"));
			if (name && strcmp(name, "default") == 0)
				return json_string_value(json_object_get(e, "template"));
		}
	}
	return NULL;
}

static int build_tok(const tok_build_params *p, tok **out, ds_err *err)
{
	*out = tok_new(p, err);
	return *out ? 0 : err->code;
}

static int find_config_token(tok *t, const json_t *cfg, const char *key, const char *path,
			     int32_t *out, ds_err *err)
{
	const char *s = token_string(cfg, key);
	*out = -1;
	if (!s)
		return 0;
	*out = tok_find_token(t, s, strlen(s));
	if (*out < 0)
		return ds_err_set(err, DS_EFORMAT, "%s: %s \"%s\" is not a token of the vocabulary", path,
				  key, s);
	return 0;
}

static int load_hf(const char *path, const char *config_path, tok **out, ds_err *err)
{
	json_t *root = NULL, *cfg = NULL;
	tok_str *vocab = NULL, *merges = NULL;
	tok_added_token *added = NULL;
	const char *pats[HF_MAX_SPLITS + 1];
	tok_build_params p;
	tok *t = NULL;
	int rc = 0;
	*out = NULL;
	tok_build_default_params(&p);

	if (!(root = load_json(path, err)) || (config_path && !(cfg = load_json(config_path, err)))) {
		rc = err->code;
		goto out;
	}
	if ((rc = check_normalizer(json_object_get(root, "normalizer"), err)) != 0 ||
	    (rc = parse_pretok(json_object_get(root, "pre_tokenizer"), pats, &p.n_splits, err)) != 0)
		goto fail;
	const json_t *dec = json_object_get(root, "decoder");
	if (dec && !json_is_null(dec) && (!type_of(dec) || strcmp(type_of(dec), "ByteLevel") != 0)) {
		rc = ds_err_set(err, DS_EUNSUPPORTED, "decoder '%s' is not supported (only ByteLevel)",
				type_of(dec) ? type_of(dec) : "?");
		goto fail;
	}
	p.splits = pats;
	if ((rc = parse_model(json_object_get(root, "model"), &p, &vocab, &merges, err)) != 0 ||
	    (rc = parse_added(json_object_get(root, "added_tokens"), &p, &added, err)) != 0)
		goto fail;
	if (cfg) {
		p.add_bos = json_is_true(json_object_get(cfg, "add_bos_token"));
		p.chat_template = chat_template_of(cfg);
	}
	if ((rc = build_tok(&p, &t, err)) != 0)
		goto fail;
	if (cfg) {
		int32_t bos, eos;
		if ((rc = find_config_token(t, cfg, "bos_token", config_path, &bos, err)) != 0 ||
		    (rc = find_config_token(t, cfg, "eos_token", config_path, &eos, err)) != 0)
			goto out;
		tok_set_special_ids(t, bos, eos);
	}
	*out = t;
	t = NULL;
	goto out;
fail:
	ds_err_wrap(err, "%s", path);
out:
	tok_free(t);
	free(added);
	free(merges);
	free(vocab);
	json_decref(cfg);
	json_decref(root);
	return rc;
}

tok *tok_load_hf(const char *path, const char *config_path, ds_err *err)
{
	ds_err local = { 0 };
	tok *t;
	if (load_hf(path, config_path, &t, err ? err : &local) != 0)
		return NULL;
	return t;
}
