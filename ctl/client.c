/*
 * client.c - libcurl requests to the agent's control API (see client.h).
 * Not thread-safe (dsctl is single-threaded); curl_global_init is done lazily.
 */
#include "ctl/client.h"

#include <curl/curl.h>
#include <stdio.h>
#include <string.h>

static size_t on_data(char *p, size_t size, size_t n, void *ud)
{
	return buf_append(ud, p, size * n) == DS_OK ? size * n : 0;
}

int ctl_request(const ctl_client *c, const char *method, const char *path, const char *body,
		long *status, buf *out, ds_err *err)
{
	static int inited;
	if (!inited) {
		curl_global_init(CURL_GLOBAL_DEFAULT);
		inited = 1;
	}
	int rc = DS_OK;
	char url[2048], auth[1024];
	struct curl_slist *hdr = NULL;
	CURL *h = curl_easy_init();
	if (!h)
		return ds_err_set(err, DS_ENOMEM, "cannot create an HTTP client");
	size_t blen = strlen(c->base_url);
	while (blen > 0 && c->base_url[blen - 1] == '/')
		blen--;
	snprintf(url, sizeof url, "%.*s%s", (int)blen, c->base_url, path);
	curl_easy_setopt(h, CURLOPT_URL, url);
	curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_data);
	curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
	curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, c->timeout_ms > 0 ? c->timeout_ms : 10000L);
	curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
	if (c->token) {
		snprintf(auth, sizeof auth, "Authorization: Bearer %s", c->token);
		hdr = curl_slist_append(hdr, auth);
	}
	if (body) {
		hdr = curl_slist_append(hdr, "Content-Type: application/json");
		curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
	}
	if (hdr)
		curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
	CURLcode cc = curl_easy_perform(h);
	if (cc != CURLE_OK) {
		rc = ds_err_set(err, DS_EIO, "cannot reach the agent at %.*s: %s", (int)blen,
				c->base_url, curl_easy_strerror(cc));
		goto out;
	}
	curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
out:
	curl_slist_free_all(hdr);
	curl_easy_cleanup(h);
	return rc;
}
