/*
 * fileutil.h - the one way each file job is done: reading a whole file under
 * a size cap (config.json, tokenizer.json, the small private files an agent
 * keeps: node id, cluster key, key-hash secret, admin token), writing a
 * private file atomically, and mapping the large files a model is made of.
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

/* Reads the whole regular file at path into a new buffer (*data, freed by the
 * caller with free; a NUL follows the last byte so text can be parsed in
 * place); *len gets the size.  Never truncates: a file larger than cap is
 * DS_ERANGE naming the file, its size and the cap.  DS_ENOTFOUND when it does
 * not exist, DS_EPERM when it is not a regular file, DS_ENOMEM, DS_EIO. */
int ds_file_read_all(const char *path, size_t cap, char **data, size_t *len, ds_err *err);

enum {
	DS_WRITE_EXCL = 1, /* DS_EBUSY (nothing written) when path exists already */
};

/* Writes data to path as a private file (mode 0600), atomically: a reader
 * sees the old file or the whole new one, never a part.  The bytes go to a
 * temporary file beside path, which is fsync'ed, then renamed over path
 * (DS_WRITE_EXCL: linked to path, which fails if it exists), and the
 * directory is fsync'ed so that the new name survives a power loss.
 * DS_EBUSY (DS_WRITE_EXCL and path exists), DS_EINVAL (path too long),
 * DS_EIO with the step that failed; on error path is unchanged and no
 * temporary file is left behind. */
int ds_file_write_private(const char *path, const void *data, size_t len, int flags,
			  ds_err *err);

/* How ds_file_map holds a file's bytes. */
enum ds_map_mode {
	DS_MAP_FILE = 0, /* mmap of the file: page cache, 4 KiB pages, shared */
	/* anonymous memory in 2 MiB transparent huge pages, filled with pread and
	 * then made read-only: a decode step streams every weight once, and with
	 * 4 KiB pages each 4 KiB costs a TLB miss whose page walk the hardware
	 * prefetchers do not run ahead of (docs/engine.md) */
	DS_MAP_HUGE_COPY = 1,
};

/* Maps size bytes of the open file fd (path for messages) read-only;
 * *map_len is what ds_file_unmap needs.  DS_EIO (mmap, read errors, a file
 * shorter than size), DS_ENOMEM. */
int ds_file_map(int fd, const char *path, size_t size, enum ds_map_mode mode, void **map,
		size_t *map_len, ds_err *err);
void ds_file_unmap(void *map, size_t map_len); /* NULL is a no-op */

/* Anonymous read-write memory of at least bytes, 2 MiB aligned and advised
 * for transparent huge pages (plain pages where the kernel has none, and
 * advised against them under DS_THP=never, see ds_thp_usable);
 * *len (a multiple of 2 MiB) is what ds_huge_free needs.  NULL when mmap
 * fails (errno set). */
void *ds_huge_alloc(size_t bytes, size_t *len);
void ds_huge_free(void *p, size_t len); /* NULL is a no-op */

/* 1 when transparent huge pages can back a madvise'd mapping
 * (/sys/kernel/mm/transparent_hugepage/enabled is [always] or [madvise]).
 * DS_THP=never in the environment makes this process act as if the file
 * said [never]: ds_thp_usable is 0 and ds_huge_alloc advises against huge
 * pages, so a machine without them can be reproduced on one that has them;
 * any other value is an error of the caller's making and reads the file. */
int ds_thp_usable(void);

/* This process's peak resident memory in bytes: VmHWM of /proc/self/status
 * (0 when it cannot be read).  Not getrusage's ru_maxrss: Linux carries the
 * high-water mark of the memory the process had before exec into it, so a
 * program started by a large parent (a benchmark script that has just
 * written a checkpoint) would report the parent's peak as its own. */
size_t ds_peak_rss_bytes(void);

/* This process's executable path (/proc/self/exe) into out.  DS_EIO naming
 * the file when it cannot be read, DS_ERANGE when it does not fit. */
int ds_self_exe(char *out, size_t cap, ds_err *err);

#endif
