/*
 * clusterkey_file.c - reads the agent's cluster key file (see
 * clusterkey_file.h).
 *
 * Callers: agent/main.c (the keys gossip seals with) and
 * agent/cluster/cluster.c (the keys agent-to-agent requests are signed with).
 * Calls: common/fileutil (one capped read, refusing group/other permission
 * bits) and common/clusterkey (the format).
 *
 * Invariant: the file's text lives only in a stack buffer that is wiped
 * before returning, whatever the outcome.
 *
 * Threading: no state; safe from any thread.
 */
#include "agent/auth/clusterkey_file.h"
#include "common/fileutil.h"

#include <string.h>

#define KEY_FILE_MAX 4096 /* a few key lines and comments */

int clusterkey_file_load(const char *path, clusterkey_ring *out, ds_err *err)
{
	char text[KEY_FILE_MAX];
	size_t len = 0;
	memset(out, 0, sizeof *out);
	int rc = ds_file_read_small(path, DS_FILE_PRIVATE, text, sizeof text - 1, &len, err);
	if (rc != DS_OK)
		goto out;
	text[len] = '\0';
	if ((rc = clusterkey_parse(text, len, out, err)) != DS_OK)
		ds_err_wrap(err, "cluster key file %s", path);
out:
	explicit_bzero(text, sizeof text);
	return rc;
}
