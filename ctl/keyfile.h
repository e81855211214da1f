/*
 * keyfile.h - the cluster key file as dsctl writes it: `dsctl cluster init`
 * and `dsctl cluster up --local` (which makes one for its agents).  The text
 * format is common/clusterkey.h's; this module adds the random bytes and the
 * file: parent directories 0700, the file 0600, written atomically.
 */
#ifndef DS_CTL_KEYFILE_H
#define DS_CTL_KEYFILE_H

#include "common/status.h"

#include <stdint.h>

enum {
	KEYFILE_FORCE = 1, /* replace an existing file */
};

/* Writes a new random key (one line, key id 01..ff) to path, creating its
 * missing parent directories with mode 0700; *kid (may be NULL) gets the key
 * id.  DS_EBUSY (nothing written) when path exists and flags lacks
 * KEYFILE_FORCE; DS_EIO naming the step that failed.  Key material is wiped
 * from memory before returning. */
int keyfile_write(const char *path, int flags, uint8_t *kid, ds_err *err);

/* mkdir -p of dir, new directories (dir included) with mode 0700.  0, or -1
 * with errno set. */
int keyfile_mkdirs(const char *dir);

#endif
