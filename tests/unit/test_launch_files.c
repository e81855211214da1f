/*
 * test_launch_files.c - the launcher's checks of a rank's "files" that the
 * control API cannot reach (its 1 MiB body cap and JSON parser stop them
 * first), as the head's own node calls launcher_start directly: a file past
 * LAUNCH_FILE_MAX bytes and one holding a NUL byte are refused by name, and
 * nothing is written or started.  The HTTP side is tests/integration/
 * test_launch.py.
 */
#include "agent/launch/launch.h"
#include "common/status.h"
#include "tests/unit/unit.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

/* Entries of dir other than . and .. */
static int entries(const char *dir)
{
	DIR *d = opendir(dir);
	int n = 0;
	struct dirent *e;
	if (!d)
		return -1;
	while ((e = readdir(d)))
		n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
	closedir(d);
	return n;
}

static json_t *one_rank(json_t *content)
{
	return json_pack("[{s:i, s:[], s:{}, s:{s:o}}]", "rank", 1, "args", "env", "files",
			 "NCCL_TOPO_FILE", content);
}

TEST(launch_files_too_large_or_with_nul_are_refused)
{
	char *dir = ut_tmpdir_new("launch");
	if (!dir)
		return;
	ds_err err = {0};
	launcher *l = launcher_new(dir, &err);
	CHECK(l != NULL);
	if (!l) {
		ut_tmpdir_free(dir);
		return;
	}
	size_t big = (size_t)LAUNCH_FILE_MAX + 1;
	char *text = malloc(big);
	CHECK(text != NULL);
	if (text) {
		memset(text, 'x', big);
		json_t *ranks = one_rank(json_stringn(text, big));
		CHECK_EQ(launcher_start(l, "j1", 1, ranks, &err), DS_EINVAL);
		CHECK(strstr(err.msg, "rank 1: files: NCCL_TOPO_FILE is 1048577 bytes, more than "
			  "the limit of 1048576") != NULL);
		json_decref(ranks);
		free(text);
	}
	ds_err_clear(&err);
	json_t *ranks = one_rank(json_stringn("<system>\0</system>", 18));
	CHECK_EQ(launcher_start(l, "j2", 1, ranks, &err), DS_EINVAL);
	CHECK(strstr(err.msg, "NCCL_TOPO_FILE contains a NUL byte") != NULL);
	json_decref(ranks);
	char ranks_dir[4096];
	snprintf(ranks_dir, sizeof ranks_dir, "%s/ranks", dir);
	CHECK_EQ(entries(ranks_dir), 0);
	json_t *j = launcher_json(l);
	CHECK(json_is_null(json_object_get(j, "job")));
	json_decref(j);
	launcher_free(l);
	ut_tmpdir_free(dir);
}
