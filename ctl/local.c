/*
 * local.c - the agents of `dsctl cluster up --local N` and `dsctl cluster
 * down --local` (see local.h for the directory and the agents' options).
 * Called by ctl/main.c; calls ctl/keyfile.c for the key.  Single-threaded.
 *
 *   local_up:  DIR/cluster.json names N live agents? ──yes──> reuse them
 *                 │ no (none live; some live: DS_EBUSY)
 *                 v
 *              key (kept if DIR has one) -> start node1 -> its ports from its log
 *              -> start node2..N (--join node1) -> their ports -> cluster.json
 *              (an agent that exits or stays silent: its log tail, stop the
 *              started ones, DS_EIO)
 *   local_down: SIGTERM the live ones -> grace -> SIGKILL -> rm cluster.json
 *
 * Invariants: a signal goes only to a pid whose /proc/PID/cmdline is a
 * dsagent with the agent's --data-dir (is_ours), or to a child this
 * process forked; cluster.json is written whole (ds_file_write_private) and
 * only once every agent printed its ports.
 */
#include "ctl/local.h"

#include "common/fileutil.h"
#include "common/jsonx.h"
#include "common/strutil.h"
#include "ctl/keyfile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { LOG_SCAN_MAX = 1 << 20, TAIL_BYTES = 2400, STEP_MS = 20, CHILD_GRACE_MS = 10000 };

local_params local_default_params(void)
{
	return (local_params){.start_ms = 60000, .diag = stderr};
}

void local_cluster_free(local_cluster *lc)
{
	if (!lc)
		return;
	free(lc->agents);
	lc->agents = NULL;
	lc->n = 0;
}

/* 1 when pid is a dsagent running with --data-dir data_dir. */
static int is_ours(int pid, const char *data_dir)
{
	static char b[32768];
	char path[64];
	if (pid <= 0)
		return 0;
	snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, b, sizeof b - 1);
	close(fd);
	if (n <= 0) /* a zombie has an empty command line: it has ended */
		return 0;
	b[n] = '\0';
	const char *base = strrchr(b, '/');
	if (strcmp(base ? base + 1 : b, "dsagent") != 0)
		return 0;
	for (const char *s = b; s < b + n; s += strlen(s) + 1) {
		const char *next = s + strlen(s) + 1;
		if (strcmp(s, "--data-dir") == 0 && next < b + n && strcmp(next, data_dir) == 0)
			return 1;
	}
	return 0;
}

/* ---- cluster.json ---- */

static int json_path(const char *dir, char *out, size_t n, ds_err *err)
{
	if ((size_t)snprintf(out, n, "%s/cluster.json", dir) >= n)
		return ds_err_set(err, DS_EINVAL, "directory name too long: %s", dir);
	return DS_OK;
}

static int copy_field(const json_t *a, const char *k, char *out, size_t n, int required,
		      const char *path, ds_err *err)
{
	const json_t *v = json_object_get(a, k);
	if (!json_is_string(v)) {
		if (!required) {
			out[0] = '\0';
			return DS_OK;
		}
		return ds_err_set(err, DS_EFORMAT, "%s is not a local cluster file: an agent has no "
				  "\"%s\"", path, k);
	}
	if (ds_strlcpy(out, json_string_value(v), n) >= n)
		return ds_err_set(err, DS_EFORMAT, "%s: \"%s\" is too long", path, k);
	return DS_OK;
}

static int read_json(const char *path, local_cluster *lc, ds_err *err)
{
	char *text = NULL;
	size_t len = 0;
	int rc = ds_file_read_all(path, 1 << 20, &text, &len, err);
	if (rc)
		return rc;
	json_t *j = jsonx_parse(text, len, 8, err);
	free(text);
	if (!j)
		return ds_err_wrap(err, "%s", path);
	const json_t *as = json_object_get(j, "agents");
	size_t n = json_array_size(as);
	if (!json_is_array(as) || n < 1 || n > LOCAL_MAX) {
		rc = ds_err_set(err, DS_EFORMAT, "%s is not a local cluster file: no \"agents\" list "
				"of 1..%d", path, LOCAL_MAX);
		goto out;
	}
	if (!(lc->agents = calloc(n, sizeof *lc->agents))) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	lc->n = (int)n;
	ds_strlcpy(lc->key_file, json_is_string(json_object_get(j, "key_file")) ?
		   json_string_value(json_object_get(j, "key_file")) : "", sizeof lc->key_file);
	for (size_t i = 0; i < n && rc == DS_OK; i++) {
		const json_t *a = json_array_get(as, i);
		local_agent *x = &lc->agents[i];
		const json_t *pid = json_object_get(a, "pid");
		if (!json_is_integer(pid) || json_integer_value(pid) <= 0 ||
		    json_integer_value(pid) > INT32_MAX) {
			rc = ds_err_set(err, DS_EFORMAT, "%s is not a local cluster file: agent %zu "
					"has no valid \"pid\"", path, i + 1);
			break;
		}
		x->pid = (int)json_integer_value(pid);
		if ((rc = copy_field(a, "name", x->name, sizeof x->name, 1, path, err)) ||
		    (rc = copy_field(a, "control_url", x->control_url, sizeof x->control_url, 1,
				     path, err)) ||
		    (rc = copy_field(a, "api_url", x->api_url, sizeof x->api_url, 1, path, err)) ||
		    (rc = copy_field(a, "data_dir", x->data_dir, sizeof x->data_dir, 1, path, err)) ||
		    (rc = copy_field(a, "log", x->log, sizeof x->log, 1, path, err)) ||
		    (rc = copy_field(a, "gossip", x->gossip, sizeof x->gossip, 0, path, err)) ||
		    (rc = copy_field(a, "node_id", x->node_id, sizeof x->node_id, 0, path, err)))
			break;
	}
out:
	json_decref(j);
	return rc;
}

static int write_json(const local_cluster *lc, ds_err *err)
{
	char path[PATH_MAX];
	int rc = json_path(lc->dir, path, sizeof path, err);
	if (rc)
		return rc;
	json_t *as = json_array();
	json_t *j = json_pack("{s:s,s:s,s:I,s:o}", "dir", lc->dir, "key_file", lc->key_file,
			      "created", (json_int_t)time(NULL), "agents", as);
	if (!j)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	for (int i = 0; i < lc->n; i++) {
		const local_agent *a = &lc->agents[i];
		json_array_append_new(as, json_pack("{s:s,s:i,s:s,s:s,s:s,s:s,s:s,s:s}", "name",
						    a->name, "pid", a->pid, "control_url",
						    a->control_url, "api_url", a->api_url, "gossip",
						    a->gossip, "node_id", a->node_id, "data_dir",
						    a->data_dir, "log", a->log));
	}
	char *text = json_dumps(j, JSON_INDENT(2));
	json_decref(j);
	size_t len = text ? strlen(text) : 0;
	char *t = text ? realloc(text, len + 2) : NULL;
	if (!t) {
		free(text);
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	}
	t[len++] = '\n';
	t[len] = '\0';
	rc = ds_file_write_private(path, t, len, 0, err);
	free(t);
	return rc;
}

/* ---- starting agents ---- */

/* The dsagent beside this program's binary. */
static int dsagent_path(char *out, size_t n, ds_err *err)
{
	char self[PATH_MAX];
	ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
	if (k <= 0)
		return ds_err_set(err, DS_EIO, "cannot find dsctl's own binary: %s", strerror(errno));
	self[k] = '\0';
	char *slash = strrchr(self, '/');
	if (slash)
		*slash = '\0';
	if ((size_t)snprintf(out, n, "%s/dsagent", slash ? self : ".") >= n)
		return ds_err_set(err, DS_EINVAL, "path too long: %s/dsagent", self);
	if (access(out, X_OK) != 0)
		return ds_err_set(err, DS_ENOTFOUND, "no dsagent beside dsctl: %s: %s (build both "
				  "with make)", out, strerror(errno));
	return DS_OK;
}

/* Forks argv[0] detached: own session, stdin /dev/null, stdout and stderr
 * appended to log (whose size before is *off). */
static int spawn(char *const argv[], const char *log, off_t *off, int *pid, ds_err *err)
{
	struct stat st;
	int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (lfd < 0)
		return ds_err_set(err, DS_EIO, "cannot open %s: %s", log, strerror(errno));
	int nfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (nfd < 0 || fstat(lfd, &st) != 0) {
		int e = errno;
		close(lfd);
		if (nfd >= 0)
			close(nfd);
		return ds_err_set(err, DS_EIO, "cannot start %s: %s", argv[0], strerror(e));
	}
	*off = st.st_size;
	fflush(NULL);
	pid_t k = fork();
	if (k == 0) { /* the child: async-signal-safe calls only */
		setsid();
		dup2(nfd, 0);
		dup2(lfd, 1);
		dup2(lfd, 2);
		close_range(3, ~0U, 0); /* nothing of dsctl's (its caller's pipes) stays open */
		execv(argv[0], argv);
		static const char m[] = "dsctl: cannot execute dsagent\n";
		ssize_t w = write(2, m, sizeof m - 1);
		(void)w;
		_exit(127);
	}
	int e = errno;
	close(lfd);
	close(nfd);
	if (k < 0)
		return ds_err_set(err, DS_EIO, "cannot start %s: fork: %s", argv[0], strerror(e));
	*pid = (int)k;
	return DS_OK;
}

/* Reads log from off (at most LOG_SCAN_MAX bytes) into a new string. */
static char *read_from(const char *log, off_t off, size_t *len)
{
	int fd = open(log, O_RDONLY | O_CLOEXEC);
	char *b = NULL;
	*len = 0;
	if (fd < 0)
		return NULL;
	if ((b = malloc(LOG_SCAN_MAX + 1))) {
		ssize_t n;
		while (*len < LOG_SCAN_MAX &&
		       (n = pread(fd, b + *len, LOG_SCAN_MAX - *len, off + (off_t)*len)) > 0)
			*len += (size_t)n;
		b[*len] = '\0';
	}
	close(fd);
	return b;
}

/* 1 when the log (from off) has both lines of the agent's ports. */
static int parse_ports(local_agent *a, off_t off)
{
	size_t len;
	char *b = read_from(a->log, off, &len);
	int gossip = 0, listening = 0;
	for (char *s = b, *nl; s && *s; s = nl ? nl + 1 : s + strlen(s)) {
		char h1[64], h2[64], id[40];
		int p1, p2;
		nl = strchr(s, '\n');
		if (nl)
			*nl = '\0';
		else
			break; /* a line still being written */
		if (sscanf(s, "dsagent gossip=%63[^:]:%d node_id=%39s", h1, &p1, id) == 3) {
			snprintf(a->gossip, sizeof a->gossip, "%s:%d", h1, p1);
			snprintf(a->node_id, sizeof a->node_id, "%s", id);
			gossip = 1;
		} else if (sscanf(s, "dsagent listening control=%63[^:]:%d api=%63[^:]:%d", h1, &p1,
				  h2, &p2) == 4) {
			snprintf(a->control_url, sizeof a->control_url, "http://%s:%d", h1, p1);
			snprintf(a->api_url, sizeof a->api_url, "http://%s:%d", h2, p2);
			listening = 1;
		}
	}
	free(b);
	return gossip && listening;
}

/* The last lines of log after off, to diag. */
static void log_tail(const local_agent *a, off_t off, FILE *diag)
{
	size_t len;
	char *b = read_from(a->log, off, &len);
	if (!diag)
		goto out;
	const char *s = b ? b : "";
	if (len > TAIL_BYTES) {
		s = b + len - TAIL_BYTES;
		const char *nl = strchr(s, '\n');
		s = nl ? nl + 1 : s;
	}
	fprintf(diag, "--- the end of %s ---\n%s%s--- end ---\n", a->log, s,
		len && s[strlen(s) - 1] != '\n' ? "\n" : "");
	fflush(diag);
out:
	free(b);
}

static int wait_ports(const local_params *p, local_agent *a, off_t off, ds_err *err)
{
	double end = ds_now_s() + (double)p->start_ms / 1000.0;
	for (;;) {
		if (parse_ports(a, off))
			return DS_OK;
		int st = 0;
		pid_t w = waitpid(a->pid, &st, WNOHANG);
		if (w == a->pid) {
			a->pid = 0; /* reaped */
			log_tail(a, off, p->diag);
			if (WIFEXITED(st))
				return ds_err_set(err, DS_EIO, "%s exited with status %d during "
						  "start-up (its log: %s)", a->name, WEXITSTATUS(st),
						  a->log);
			return ds_err_set(err, DS_EIO, "%s was killed by signal %d during start-up "
					  "(its log: %s)", a->name, WTERMSIG(st), a->log);
		}
		if (ds_now_s() > end) {
			log_tail(a, off, p->diag);
			return ds_err_set(err, DS_EIO, "%s did not print its ports within %ld ms (its "
					  "log: %s)", a->name, p->start_ms, a->log);
		}
		ds_sleep_ms(STEP_MS);
	}
}

/* SIGTERM to the children among the first n agents, SIGKILL after the grace. */
static void stop_children(local_cluster *lc, int n)
{
	for (int i = 0; i < n; i++)
		if (lc->agents[i].pid > 0)
			kill(lc->agents[i].pid, SIGTERM);
	double end = ds_now_s() + CHILD_GRACE_MS / 1000.0;
	for (int i = 0; i < n; i++) {
		local_agent *a = &lc->agents[i];
		while (a->pid > 0 && waitpid(a->pid, NULL, WNOHANG) == 0) {
			if (ds_now_s() > end) {
				kill(a->pid, SIGKILL);
				waitpid(a->pid, NULL, 0);
				break;
			}
			ds_sleep_ms(STEP_MS);
		}
		a->pid = 0;
	}
}

static int start_one(const local_params *p, const char *exe, local_cluster *lc, int k,
		     off_t *off, ds_err *err)
{
	local_agent *a = &lc->agents[k];
	char expect[16], join[96];
	const char *argv[40];
	int n = 0;
	snprintf(expect, sizeof expect, "%d", p->n);
	snprintf(join, sizeof join, "%s", lc->agents[0].gossip);
	const char *fixed[] = {"--name", a->name, "--bind", "127.0.0.1", "--api-bind",
			       "127.0.0.1", "--control-port", "0", "--api-port", "0", "--data-dir",
			       a->data_dir, "--cluster-key", lc->key_file, "--gossip-bind",
			       "127.0.0.1", "--gossip-port", "0", "--expect", expect, "--backend",
			       "cpu",
			       /* one machine's loopback: the timers measured for it
				* (docs/cluster.md, "Timing") */
			       "--gossip-profile", "test", "--settle-ms", "300", "--lease-ms",
			       "1500"};
	argv[n++] = exe;
	for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
		argv[n++] = fixed[i];
	if (k == 0) { /* node1 first in the head candidacy order */
		argv[n++] = "--priority";
		argv[n++] = "1";
	} else {
		argv[n++] = "--join";
		argv[n++] = join;
	}
	if (p->fake_gpus) {
		argv[n++] = "--fake-gpus";
		argv[n++] = p->fake_gpus;
	}
	argv[n] = NULL;
	return spawn((char *const *)argv, a->log, off, &a->pid, err);
}

int local_up(const local_params *p, local_cluster *lc, ds_err *err)
{
	char path[PATH_MAX], exe[PATH_MAX];
	struct stat st;
	off_t *offs = NULL;
	int rc, started = 0;
	memset(lc, 0, sizeof *lc);
	if (p->n < 1 || p->n > LOCAL_MAX)
		return ds_err_set(err, DS_EINVAL, "--local %d is not in 1..%d", p->n, LOCAL_MAX);
	if (keyfile_mkdirs(p->dir) != 0)
		return ds_err_set(err, DS_EIO, "cannot create %s: %s", p->dir, strerror(errno));
	if (!realpath(p->dir, lc->dir))
		return ds_err_set(err, DS_EIO, "%s: %s", p->dir, strerror(errno));
	if ((rc = json_path(lc->dir, path, sizeof path, err)))
		return rc;
	if (stat(path, &st) == 0) {
		local_cluster old = {0};
		if ((rc = read_json(path, &old, err))) {
			local_cluster_free(&old);
			return rc;
		}
		int live = 0;
		for (int i = 0; i < old.n; i++)
			live += is_ours(old.agents[i].pid, old.agents[i].data_dir);
		if (live == old.n && old.n == p->n) {
			memcpy(lc->key_file, old.key_file, sizeof lc->key_file);
			lc->agents = old.agents;
			lc->n = old.n;
			lc->reused = 1;
			return DS_OK;
		}
		int had = old.n;
		local_cluster_free(&old);
		if (live > 0)
			return ds_err_set(err, DS_EBUSY, "%s holds a local cluster of %d agent(s), %d "
					  "of them running; stop it first: dsctl cluster down --local "
					  "--local-dir %s", lc->dir, had, live, p->dir);
		/* none of them runs (a reboot, a kill): start afresh over its data */
	}
	if ((rc = dsagent_path(exe, sizeof exe, err)))
		return rc;
	if ((size_t)snprintf(lc->key_file, sizeof lc->key_file, "%s/cluster.key", lc->dir) >=
	    sizeof lc->key_file)
		return ds_err_set(err, DS_EINVAL, "directory name too long: %s", lc->dir);
	if (stat(lc->key_file, &st) != 0 && (rc = keyfile_write(lc->key_file, 0, NULL, err)))
		return ds_err_wrap(err, "cluster key");
	lc->agents = calloc((size_t)p->n, sizeof *lc->agents);
	offs = calloc((size_t)p->n, sizeof *offs);
	if (!lc->agents || !offs) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	lc->n = p->n;
	for (int k = 0; k < p->n; k++) {
		local_agent *a = &lc->agents[k];
		snprintf(a->name, sizeof a->name, "node%d", k + 1);
		if ((size_t)snprintf(a->data_dir, sizeof a->data_dir, "%s/%s", lc->dir, a->name) >=
			    sizeof a->data_dir ||
		    (size_t)snprintf(a->log, sizeof a->log, "%s/agent.log", a->data_dir) >=
			    sizeof a->log) {
			rc = ds_err_set(err, DS_EINVAL, "directory name too long: %s", lc->dir);
			goto out;
		}
		if (mkdir(a->data_dir, 0700) != 0 && errno != EEXIST) {
			rc = ds_err_set(err, DS_EIO, "cannot create %s: %s", a->data_dir,
					strerror(errno));
			goto out;
		}
	}
	/* node1 first: the others join its gossip port */
	if ((rc = start_one(p, exe, lc, 0, &offs[0], err)))
		goto out;
	started = 1;
	if ((rc = wait_ports(p, &lc->agents[0], offs[0], err)))
		goto out;
	for (int k = 1; k < p->n; k++) {
		if ((rc = start_one(p, exe, lc, k, &offs[k], err)))
			goto out;
		started = k + 1;
	}
	for (int k = 1; k < p->n; k++)
		if ((rc = wait_ports(p, &lc->agents[k], offs[k], err)))
			goto out;
	rc = write_json(lc, err);
out:
	if (rc && started)
		stop_children(lc, started);
	free(offs);
	return rc;
}

/* ---- stopping ---- */

int local_down(const char *dir, long grace_ms, local_cluster *out, ds_err *err)
{
	local_cluster lc = {0};
	char path[PATH_MAX];
	int rc;
	if (!realpath(dir, lc.dir))
		return ds_err_set(err, errno == ENOENT ? DS_ENOTFOUND : DS_EIO,
				  "no local cluster in %s: %s/cluster.json cannot be read: %s", dir,
				  dir, strerror(errno));
	if ((rc = json_path(lc.dir, path, sizeof path, err)))
		return rc;
	rc = read_json(path, &lc, err);
	if (rc == DS_ENOTFOUND)
		rc = ds_err_set(err, DS_ENOTFOUND, "no local cluster in %s: %s does not exist", dir,
				path);
	if (rc)
		goto out;
	int left = 0;
	for (int i = 0; i < lc.n; i++) {
		local_agent *a = &lc.agents[i];
		if (is_ours(a->pid, a->data_dir) && kill(a->pid, SIGTERM) == 0) {
			a->outcome = LOCAL_TERMINATED;
			left++;
		} else {
			a->outcome = LOCAL_GONE;
		}
	}
	for (int pass = 0; pass < 2 && left; pass++) {
		double end = ds_now_s() + (pass == 0 ? grace_ms : 5000) / 1000.0;
		while (left && ds_now_s() < end) {
			ds_sleep_ms(50);
			left = 0;
			for (int i = 0; i < lc.n; i++)
				if (lc.agents[i].outcome != LOCAL_GONE)
					left += is_ours(lc.agents[i].pid, lc.agents[i].data_dir);
		}
		for (int i = 0; i < lc.n && left; i++) {
			local_agent *a = &lc.agents[i];
			if (a->outcome == LOCAL_GONE || !is_ours(a->pid, a->data_dir))
				continue;
			if (pass == 0) {
				kill(a->pid, SIGKILL);
				a->outcome = LOCAL_KILLED;
			} else {
				a->outcome = LOCAL_STUCK;
			}
		}
	}
	if (left) {
		rc = ds_err_set(err, DS_EBUSY, "%d agent(s) of %s are still running after SIGKILL; "
				"%s is kept", left, dir, path);
		goto out;
	}
	if (unlink(path) != 0 && errno != ENOENT)
		rc = ds_err_set(err, DS_EIO, "cannot remove %s: %s", path, strerror(errno));
out:
	if (out)
		*out = lc;
	else
		local_cluster_free(&lc);
	return rc;
}
