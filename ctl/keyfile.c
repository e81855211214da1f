/*
 * keyfile.c - writing a cluster key file (see keyfile.h).  Called by dsctl's
 * `cluster init` and `cluster up --local`; single-threaded like dsctl.
 */
#include "ctl/keyfile.h"

#include "common/clusterkey.h"
#include "common/fileutil.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

int keyfile_mkdirs(const char *dir)
{
	char d[PATH_MAX];
	if ((size_t)snprintf(d, sizeof d, "%s", dir) >= sizeof d) {
		errno = ENAMETOOLONG;
		return -1;
	}
	for (char *p = d + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(d, 0700) != 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	return mkdir(d, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* mkdir -p of path's parent. */
static int make_parents(const char *path)
{
	char dir[PATH_MAX];
	if ((size_t)snprintf(dir, sizeof dir, "%s", path) >= sizeof dir) {
		errno = ENAMETOOLONG;
		return -1;
	}
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = '\0';
	return keyfile_mkdirs(dir);
}

int keyfile_write(const char *path, int flags, uint8_t *kid, ds_err *err)
{
	uint8_t raw[CLUSTERKEY_LEN + 1]; /* the last byte: the key id */
	char line[CLUSTERKEY_LINE_MAX];
	struct stat st;
	int rc;
	if (!(flags & KEYFILE_FORCE) && stat(path, &st) == 0)
		return ds_err_set(err, DS_EBUSY, "%s exists", path);
	if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
		rc = ds_err_set(err, DS_EIO, "no random bytes: %s", strerror(errno));
		goto out;
	}
	uint8_t id = raw[CLUSTERKEY_LEN] ? raw[CLUSTERKEY_LEN] : 1; /* id 0: raw 32-byte files */
	rc = clusterkey_format(id, raw, line, sizeof line, err);
	if (rc == DS_OK && make_parents(path) != 0)
		rc = ds_err_set(err, DS_EIO, "cannot create the directories of %s: %s", path,
				strerror(errno));
	if (rc == DS_OK)
		rc = ds_file_write_private(path, line, strlen(line),
					   flags & KEYFILE_FORCE ? 0 : DS_WRITE_EXCL, err);
	if (rc == DS_OK && kid)
		*kid = id;
out:
	explicit_bzero(raw, sizeof raw);
	explicit_bzero(line, sizeof line);
	return rc;
}
