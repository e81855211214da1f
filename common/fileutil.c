/*
 * fileutil.c - whole-file reads under a cap, atomic private writes, mapped
 * model files (see fileutil.h).  Callers: every module that reads or writes a
 * file (engine config and tokenizer files, agent key and id files, dsctl's
 * cluster key).  Thread-safe: no state of its own.
 */
#include "common/fileutil.h"
#include "common/log.h"
#include "common/strutil.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Opens path for reading and checks it is a regular file (and private, with
 * DS_FILE_PRIVATE) of at most cap bytes (else the code too_big); *fd and
 * *size on success. */
static int open_checked(const char *path, int flags, size_t cap, int too_big, int *fd, size_t *size,
			ds_err *err)
{
	int rc = DS_OK;
	*fd = open(path, O_RDONLY | O_CLOEXEC | (flags & DS_FILE_NOFOLLOW ? O_NOFOLLOW : 0));
	if (*fd < 0) {
		if (errno == ENOENT)
			return ds_err_set(err, DS_ENOTFOUND, "%s does not exist", path);
		return ds_err_set(err, DS_EIO, "cannot open %s: %s", path, strerror(errno));
	}
	struct stat st;
	if (fstat(*fd, &st) != 0) {
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
	if ((uint64_t)st.st_size > (uint64_t)cap) {
		rc = ds_err_set(err, too_big, "%s is %lld bytes; at most %zu are accepted", path,
				(long long)st.st_size, cap);
		goto out;
	}
	*size = (size_t)st.st_size;
out:
	if (rc != DS_OK) {
		close(*fd);
		*fd = -1;
	}
	return rc;
}

/* Reads exactly size bytes of fd into out. */
static int read_exact(int fd, const char *path, void *out, size_t size, ds_err *err)
{
	size_t got = 0;
	while (got < size) {
		ssize_t r = read(fd, (char *)out + got, size - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return ds_err_set(err, DS_EIO, "cannot read %s: %s", path,
					  r < 0 ? strerror(errno) : "the file shrank while it was read");
		got += (size_t)r;
	}
	return DS_OK;
}

int ds_file_read_small(const char *path, int flags, void *out, size_t cap, size_t *len,
		       ds_err *err)
{
	int fd;
	size_t size = 0;
	int rc = open_checked(path, flags, cap, DS_EFORMAT, &fd, &size, err);
	if (rc != DS_OK)
		return rc;
	rc = read_exact(fd, path, out, size, err);
	close(fd);
	if (rc == DS_OK)
		*len = size;
	return rc;
}

int ds_file_read_all(const char *path, size_t cap, char **data, size_t *len, ds_err *err)
{
	int fd;
	size_t size = 0;
	*data = NULL;
	*len = 0;
	int rc = open_checked(path, 0, cap, DS_ERANGE, &fd, &size, err);
	if (rc != DS_OK)
		return rc;
	char *buf = malloc(size + 1);
	if (!buf) {
		close(fd);
		return ds_err_set(err, DS_ENOMEM, "no memory to read %s (%zu bytes)", path, size);
	}
	rc = read_exact(fd, path, buf, size, err);
	close(fd);
	if (rc != DS_OK) {
		free(buf);
		return rc;
	}
	buf[size] = '\0';
	*data = buf;
	*len = size;
	return DS_OK;
}

/* fsync of the directory that holds path, so that a new name in it is durable. */
static int sync_parent(const char *path, ds_err *err)
{
	char dir[PATH_MAX];
	if ((size_t)snprintf(dir, sizeof dir, "%s", path) >= sizeof dir)
		return ds_err_set(err, DS_EINVAL, "path too long: %s", path);
	char *slash = strrchr(dir, '/');
	if (!slash)
		ds_strlcpy(dir, ".", sizeof dir);
	else if (slash == dir)
		dir[1] = '\0';
	else
		*slash = '\0';
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return ds_err_set(err, DS_EIO, "cannot open directory %s: %s", dir, strerror(errno));
	int ok = fsync(dfd) == 0 || errno == EINVAL; /* some file systems cannot sync a directory */
	int e = errno;
	close(dfd);
	return ok ? DS_OK : ds_err_set(err, DS_EIO, "cannot sync directory %s: %s", dir, strerror(e));
}

int ds_file_write_private(const char *path, const void *data, size_t len, int flags,
			  ds_err *err)
{
	char tmp[PATH_MAX];
	if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid()) >= sizeof tmp)
		return ds_err_set(err, DS_EINVAL, "path too long: %s", path);
	if ((flags & DS_WRITE_EXCL) && access(path, F_OK) == 0)
		return ds_err_set(err, DS_EBUSY, "%s exists already", path);
	(void)unlink(tmp); /* a leftover of a crashed writer with our pid */
	int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0)
		return ds_err_set(err, DS_EIO, "cannot create %s: %s", tmp, strerror(errno));
	int rc = DS_OK;
	const char *p = data;
	size_t done = 0;
	if (fchmod(fd, 0600) != 0) /* whatever the umask */
		rc = ds_err_set(err, DS_EIO, "cannot chmod %s: %s", tmp, strerror(errno));
	while (rc == DS_OK && done < len) {
		ssize_t w = write(fd, p + done, len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			rc = ds_err_set(err, DS_EIO, "cannot write %s: %s", tmp,
					w < 0 ? strerror(errno) : "no progress");
		else
			done += (size_t)w;
	}
	if (rc == DS_OK && fsync(fd) != 0)
		rc = ds_err_set(err, DS_EIO, "cannot sync %s: %s", tmp, strerror(errno));
	close(fd);
	if (rc == DS_OK) {
		if (flags & DS_WRITE_EXCL) {
			/* link fails when path exists: two writers cannot both win */
			if (link(tmp, path) != 0)
				rc = errno == EEXIST
					     ? ds_err_set(err, DS_EBUSY, "%s exists already", path)
					     : ds_err_set(err, DS_EIO, "cannot create %s: %s", path,
							  strerror(errno));
		} else if (rename(tmp, path) != 0) {
			rc = ds_err_set(err, DS_EIO, "cannot replace %s: %s", path, strerror(errno));
		}
	}
	(void)unlink(tmp); /* after link, or on error; gone already after rename */
	return rc == DS_OK ? sync_parent(path, err) : rc;
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

/* 1 under DS_THP=never (fileutil.h, ds_thp_usable). */
static int thp_pretend_never(void)
{
	const char *v = getenv("DS_THP");
	return v && strcmp(v, "never") == 0;
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
	/* a hint: without THP, plain pages */
	(void)madvise(p, n, thp_pretend_never() ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
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
	const char *v = getenv("DS_THP");
	if (thp_pretend_never())
		return 0;
	if (v && *v)
		log_warn("fileutil", "DS_THP ignored", "value=\"%.40s\" understood=never", v);
	char buf[128] = {0};
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	return strstr(buf, "[always]") != NULL || strstr(buf, "[madvise]") != NULL;
}

size_t ds_peak_rss_bytes(void)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	unsigned long long kb = 0;
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, "VmHWM: %llu kB", &kb) == 1)
			break;
	if (f)
		fclose(f);
	return (size_t)kb * 1024;
}

int ds_self_exe(char *out, size_t cap, ds_err *err)
{
	ssize_t n = readlink("/proc/self/exe", out, cap);
	if (n <= 0)
		return ds_err_set(err, DS_EIO, "cannot read this binary's path (/proc/self/exe): %s",
				  strerror(errno));
	if ((size_t)n >= cap)
		return ds_err_set(err, DS_ERANGE, "this binary's path is longer than %zu bytes", cap);
	out[n] = '\0';
	return DS_OK;
}
