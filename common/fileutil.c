/*
 * fileutil.c - small private files (see fileutil.h).  Thread-safe.
 */
#include "common/fileutil.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int ds_file_read_small(const char *path, int flags, void *out, size_t cap, size_t *len,
		       ds_err *err)
{
	int rc = DS_OK;
	int fd = open(path, O_RDONLY | O_CLOEXEC | (flags & DS_FILE_NOFOLLOW ? O_NOFOLLOW : 0));
	if (fd < 0) {
		if (errno == ENOENT)
			return ds_err_set(err, DS_ENOTFOUND, "%s does not exist", path);
		return ds_err_set(err, DS_EIO, "cannot open %s: %s", path, strerror(errno));
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = ds_err_set(err, DS_EIO, "cannot stat %s: %s", path, strerror(errno));
		goto out;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = ds_err_set(err, DS_EPERM, "%s is not a regular file", path);
		goto out;
	}
	if ((flags & DS_FILE_PRIVATE) && (st.st_mode & 077)) {
		rc = ds_err_set(err, DS_EPERM,
				"%s is accessible to group or others (mode %04o); it holds a "
				"secret: run `chmod 600 %s`",
				path, (unsigned)(st.st_mode & 07777), path);
		goto out;
	}
	if ((size_t)st.st_size > cap) {
		rc = ds_err_set(err, DS_EFORMAT, "%s is %lld bytes; at most %zu expected", path,
				(long long)st.st_size, cap);
		goto out;
	}
	size_t got = 0;
	while (got < (size_t)st.st_size) {
		ssize_t r = read(fd, (char *)out + got, (size_t)st.st_size - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			rc = ds_err_set(err, DS_EIO, "cannot read %s: %s", path,
					r < 0 ? strerror(errno) : "file shrank");
			goto out;
		}
		got += (size_t)r;
	}
	*len = got;
out:
	close(fd);
	return rc;
}
