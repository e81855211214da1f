/*
 * fileutil.c - small private files and mapped model files (see fileutil.h).
 * Thread-safe.
 */
#include "common/fileutil.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
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

#define HUGE_PAGE ((size_t)2 << 20)

int ds_file_map(int fd, const char *path, size_t size, enum ds_map_mode mode, void **map,
		size_t *map_len, ds_err *err)
{
	*map = NULL;
	*map_len = 0;
	if (mode == DS_MAP_FILE) {
		void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
		if (p == MAP_FAILED)
			return ds_err_set(err, DS_EIO, "%s: mmap of %zu bytes: %s", path, size,
					  strerror(errno));
		*map = p;
		*map_len = size;
		return DS_OK;
	}
	size_t len;
	char *p = ds_huge_alloc(size, &len);
	if (!p)
		return ds_err_set(err, DS_ENOMEM, "%s: no memory for a copy of %zu bytes: %s", path, size,
				  strerror(errno));
	size_t got = 0;
	while (got < size) {
		ssize_t r = pread(fd, p + got, size - got, (off_t)got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			int e = r < 0 ? errno : 0;
			munmap(p, len);
			return e ? ds_err_set(err, DS_EIO, "%s: read at byte %zu: %s", path, got, strerror(e))
				 : ds_err_set(err, DS_EIO, "%s: the file ended at byte %zu of %zu while it "
							   "was read", path, got, size);
		}
		got += (size_t)r;
	}
	if (mprotect(p, len, PROT_READ) != 0) {
		int e = errno;
		munmap(p, len);
		return ds_err_set(err, DS_EIO, "%s: mprotect: %s", path, strerror(e));
	}
	*map = p;
	*map_len = len;
	return DS_OK;
}

void *ds_huge_alloc(size_t bytes, size_t *len)
{
	/* a huge-page-aligned stretch: map one huge page more, trim both ends */
	size_t n = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
	if (n == 0)
		n = HUGE_PAGE;
	char *raw = mmap(NULL, n + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (raw == MAP_FAILED)
		return NULL;
	char *p = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
	if (p > raw)
		munmap(raw, (size_t)(p - raw));
	if (raw + n + HUGE_PAGE > p + n)
		munmap(p + n, (size_t)(raw + n + HUGE_PAGE - (p + n)));
	(void)madvise(p, n, MADV_HUGEPAGE); /* a hint: without THP, plain pages */
	*len = n;
	return p;
}

void ds_huge_free(void *p, size_t len)
{
	if (p)
		munmap(p, len);
}

void ds_file_unmap(void *map, size_t map_len)
{
	if (map)
		munmap(map, map_len);
}

int ds_thp_usable(void)
{
	char buf[128] = {0};
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	return strstr(buf, "[always]") != NULL || strstr(buf, "[madvise]") != NULL;
}
