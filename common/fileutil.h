/*
 * fileutil.h - reading the small files an agent keeps beside its data: the
 * node id, the cluster key, the key-hash secret, the admin token.
 */
#ifndef DS_FILEUTIL_H
#define DS_FILEUTIL_H

#include "common/status.h"

#include <stddef.h>

enum {
	DS_FILE_PRIVATE = 1,  /* refuse group/other permission bits (it holds a secret) */
	DS_FILE_NOFOLLOW = 2, /* refuse a symbolic link as the last component */
};

/* Reads the whole regular file at path (at most cap bytes) into out; *len
 * gets its size.  DS_ENOTFOUND when it does not exist, DS_EPERM when it is
 * not a regular file or (DS_FILE_PRIVATE) others may read it, DS_EFORMAT
 * when it is larger than cap, DS_EIO otherwise; err names the file and says
 * how to fix it. */
int ds_file_read_small(const char *path, int flags, void *out, size_t cap, size_t *len,
		       ds_err *err);

#endif
