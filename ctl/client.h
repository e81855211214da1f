/*
 * client.h - dsctl's HTTP client of the agent (libcurl).
 * One request at a time; the response body is capped (DS_ERANGE beyond).
 */
#ifndef DS_CTL_CLIENT_H
#define DS_CTL_CLIENT_H

#include "common/buf.h"
#include "common/status.h"

typedef struct ctl_client {
	const char *base_url; /* e.g. http://127.0.0.1:7481 */
	const char *token;    /* bearer token or NULL */
	long timeout_ms;
} ctl_client;

/* Performs METHOD base_url+path with an optional JSON body.  On success
 * *status is the HTTP status and out holds the body.  DS_EIO with a clear
 * message when the agent cannot be reached. */
int ctl_request(const ctl_client *c, const char *method, const char *path, const char *body,
		long *status, buf *out, ds_err *err);

#endif
