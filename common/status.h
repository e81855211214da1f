/*
 * status.h - the one status convention of dsagent.
 *
 * Every fallible function returns 0 (DS_OK) or a negative DS_E* code and, when
 * the caller passes a ds_err, fills it with a message a person can act on
 * ("tensor blk.0.attn_q.weight: expected [64,32], found [64,31]").  Codes are
 * stable and small so they can cross process boundaries and be mapped to HTTP
 * statuses; the message carries the detail.
 *
 * Used by every module: common, kernels, engine, agent and ctl.
 */
#ifndef DS_STATUS_H
#define DS_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
	DS_OK = 0,
	DS_EINVAL = -1,       /* bad argument, flag, request field or value */
	DS_ENOMEM = -2,       /* allocation failed */
	DS_EIO = -3,          /* read/write/socket failure (errno in the message) */
	DS_ENOTFOUND = -4,    /* file, tensor, key, route, model not found */
	DS_EFORMAT = -5,      /* malformed input: JSON, safetensors header, packet */
	DS_EUNSUPPORTED = -6, /* valid but not supported here (dtype, op, field) */
	DS_ERANGE = -7,       /* a bound was hit: buffer cap, context length */
	DS_EBUSY = -8,        /* queue full, resource in use; retry later */
	DS_ETIMEOUT = -9,     /* deadline passed */
	DS_EAUTH = -10,       /* missing or wrong credentials */
	DS_EPERM = -11,       /* not allowed (file mode, revoked key) */
	DS_EINTERNAL = -12,   /* our own bug or an unexpected library failure */
	DS_ENODEV = -13,      /* backend or device not present */
	DS_ECONFLICT = -14,   /* clashes with work in progress (a deployment still starting) */
};

#define DS_ERR_MSG_MAX 512

/* An error slot: code plus message.  Zero-initialise it; ds_err_set fills it. */
typedef struct ds_err {
	int code;
	char msg[DS_ERR_MSG_MAX];
} ds_err;

/* Fills err (when not NULL) with code and a printf-style message; returns code
 * so that callers can write `return ds_err_set(err, DS_EINVAL, "...")`. */
int ds_err_set(ds_err *err, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Prepends "prefix: " to an existing message (context as the error bubbles up);
 * returns err->code, or DS_EINTERNAL when err is NULL. */
int ds_err_wrap(ds_err *err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Clears err back to DS_OK with an empty message. */
void ds_err_clear(ds_err *err);

/* Short stable name of a code: "EINVAL", "ENOTFOUND" ... */
const char *ds_status_name(int code);

#ifdef __cplusplus
}
#endif

#endif
