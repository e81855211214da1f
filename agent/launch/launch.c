/*
 * launch.c - the rank processes of a plan on this node (launch.h).
 *
 * Callers: agent/api/control.c (POST, GET, DELETE /v1/ranks), agent/main.c
 * (new, free).  Calls: fork/execve/waitpid/kill, jansson.
 *
 * Lifecycle of a rank:
 *   launcher_start ──check, write the job's files, fork (child: PDEATHSIG, parent check, fds, execve)──> RUNNING
 *   RUNNING ──reap: waitpid says it exited──> EXITED (exit_code) | KILLED (signal)
 *   RUNNING ──launcher_stop / a newer job / launcher_free: SIGTERM, SIGKILL
 *             after the grace, reap──> EXITED | KILLED
 *
 * Invariants:
 *   1. everything a child needs (argv, envp, the log path) is built before
 *      fork; the child calls only async-signal-safe functions (prctl,
 *      getppid, open, dup2, close_range, execve, write, _exit): the agent has
 *      threads, and a child of a threaded process may not malloc.
 *   2. a pid is waited for only while its slot says running, so a reaped pid
 *      (which the kernel may reuse) is never signalled or waited again.
 *   3. one job at a time: start stops the running job before forking.
 *   4. every fork happens on the spawner thread, which lives as long as the
 *      launcher: PR_SET_PDEATHSIG fires when the *thread* that forked ends,
 *      and the HTTP server's threads end with their connections.
 *   5. a job's files (a rank's "files": {"VAR": content}) are one file per
 *      variable for all its ranks on this node, DATA_DIR/ranks/<job>.<var in
 *      lower case>.<xml|txt>, mode 0600, written whole (rename) after the
 *      running job is stopped and before the first fork, so no rank ever
 *      reads a half-written file or another job's.
 */
#include "agent/launch/launch.h"
#include "common/fileutil.h"
#include "common/log.h"
#include "common/strutil.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum rank_state { RANK_RUNNING = 1, RANK_EXITED, RANK_KILLED };

typedef struct rank_proc {
	int rank;
	pid_t pid;
	enum rank_state state;
	int code;            /* exit code (EXITED) or signal (KILLED) */
	int64_t started, ended;
	char log[PATH_MAX];
} rank_proc;

/* One batch of forks handed to the spawner thread. */
typedef struct spawn_req {
	size_t n;
	char ***argv, ***envp;
	rank_proc *procs;   /* [n]: log in, pid out (-1 and err_no when fork failed) */
	int err_no;
	int done;
} spawn_req;

struct launcher {
	pthread_mutex_t mu;
	pthread_cond_t req_cv, done_cv;
	pthread_t spawner;
	spawn_req *req;      /* the batch waiting for the spawner, NULL when none */
	int quit;
	char exe[PATH_MAX];
	char dir[PATH_MAX];  /* DATA_DIR/ranks */
	char job[LAUNCH_JOB_MAX + 1];
	uint64_t epoch;
	rank_proc ranks[LAUNCH_RANKS_MAX];
	int n;
	/* the job's files (invariant 5): variable and path */
	char file_var[LAUNCH_FILES_MAX][LAUNCH_VAR_MAX + 1];
	char file_path[LAUNCH_FILES_MAX][PATH_MAX];
	int n_files;
};

/* One file of the job being started; var and data borrowed from the request. */
typedef struct job_file {
	const char *var;
	const char *data;
	size_t len;
	char path[PATH_MAX];
} job_file;

static int64_t unix_now(void)
{
	return (int64_t)time(NULL);
}

static void child(const char *exe, char **argv, char **envp, const char *log, pid_t parent);

/* Invariant 4: forks each batch it is handed, under l->mu. */
static void *spawner_main(void *arg)
{
	launcher *l = arg;
	pid_t parent = getpid();
	pthread_mutex_lock(&l->mu);
	for (;;) {
		while (!l->req && !l->quit)
			pthread_cond_wait(&l->req_cv, &l->mu);
		if (l->quit)
			break;
		spawn_req *q = l->req;
		for (size_t i = 0; i < q->n; i++) {
			fflush(NULL);
			pid_t pid = fork();
			if (pid == 0)
				child(l->exe, q->argv[i], q->envp[i], q->procs[i].log, parent);
			q->procs[i].pid = pid;
			if (pid < 0) {
				q->err_no = errno;
				break;
			}
		}
		q->done = 1;
		l->req = NULL;
		pthread_cond_broadcast(&l->done_cv);
	}
	pthread_mutex_unlock(&l->mu);
	return NULL;
}

launcher *launcher_new(const char *data_dir, ds_err *err)
{
	launcher *l = calloc(1, sizeof *l);
	if (!l) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	if (ds_self_exe(l->exe, sizeof l->exe, err) != DS_OK) {
		free(l);
		return NULL;
	}
	if (snprintf(l->dir, sizeof l->dir, "%s/ranks", data_dir) >= (int)sizeof l->dir ||
	    (mkdir(l->dir, 0700) != 0 && errno != EEXIST)) {
		ds_err_set(err, DS_EIO, "cannot create %s/ranks: %s", data_dir, strerror(errno));
		free(l);
		return NULL;
	}
	pthread_mutex_init(&l->mu, NULL);
	pthread_cond_init(&l->req_cv, NULL);
	pthread_cond_init(&l->done_cv, NULL);
	if (pthread_create(&l->spawner, NULL, spawner_main, l) != 0) {
		ds_err_set(err, DS_EIO, "cannot start the rank spawner thread");
		pthread_cond_destroy(&l->req_cv);
		pthread_cond_destroy(&l->done_cv);
		pthread_mutex_destroy(&l->mu);
		free(l);
		return NULL;
	}
	return l;
}

/* Invariant 2: waits for running slots only; 1 when p is no longer running. */
static int reap_one(rank_proc *p, int block)
{
	if (p->state != RANK_RUNNING)
		return 1;
	int st = 0;
	pid_t r = waitpid(p->pid, &st, block ? 0 : WNOHANG);
	if (r == 0)
		return 0;
	if (r < 0) { /* not our child any more (should not happen): count it gone */
		p->state = RANK_EXITED;
		p->code = -1;
	} else if (WIFSIGNALED(st)) {
		p->state = RANK_KILLED;
		p->code = WTERMSIG(st);
	} else {
		p->state = RANK_EXITED;
		p->code = WEXITSTATUS(st);
	}
	p->ended = unix_now();
	log_info("launch", "rank ended", "rank=%d pid=%d state=%s code=%d", p->rank, (int)p->pid,
		 p->state == RANK_KILLED ? "killed" : "exited", p->code);
	return 1;
}

static void reap_all(launcher *l)
{
	for (int i = 0; i < l->n; i++)
		reap_one(&l->ranks[i], 0);
}

/* SIGTERM to every running rank, SIGKILL to those left after grace_ms. */
static void stop_locked(launcher *l, int grace_ms)
{
	int left = 0;
	for (int i = 0; i < l->n; i++)
		if (!reap_one(&l->ranks[i], 0)) {
			kill(l->ranks[i].pid, grace_ms > 0 ? SIGTERM : SIGKILL);
			left++;
		}
	for (int waited = 0; left && waited < grace_ms; waited += 10) {
		usleep(10 * 1000);
		left = 0;
		for (int i = 0; i < l->n; i++)
			left += !reap_one(&l->ranks[i], 0);
	}
	for (int i = 0; i < l->n; i++)
		if (l->ranks[i].state == RANK_RUNNING) {
			kill(l->ranks[i].pid, SIGKILL);
			reap_one(&l->ranks[i], 1);
		}
}

void launcher_free(launcher *l)
{
	if (!l)
		return;
	pthread_mutex_lock(&l->mu);
	stop_locked(l, 0);
	l->quit = 1;
	pthread_cond_broadcast(&l->req_cv);
	pthread_mutex_unlock(&l->mu);
	pthread_join(l->spawner, NULL);
	pthread_cond_destroy(&l->req_cv);
	pthread_cond_destroy(&l->done_cv);
	pthread_mutex_destroy(&l->mu);
	free(l);
}

static int job_ok(const char *job)
{
	size_t n = job ? strlen(job) : 0;
	if (n == 0 || n > LAUNCH_JOB_MAX)
		return 0;
	for (const char *c = job; *c; c++)
		if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
		      *c == '.' || *c == '_' || *c == '-'))
			return 0;
	return 1;
}

static int var_name_ok(const char *s)
{
	if (!s || !((*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z') || *s == '_'))
		return 0;
	for (const char *c = s; *c; c++)
		if (!((*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') ||
		      *c == '_'))
			return 0;
	return strlen(s) <= LAUNCH_VAR_MAX;
}

/* The "files" of ranks[i]: an object of at most LAUNCH_FILES_MAX variable
 * names, none also in "env", each with a string of at most LAUNCH_FILE_MAX
 * bytes without NUL, the same as any earlier rank's for that variable
 * (invariant 5); at most LAUNCH_FILES_MAX variables over the job. */
static int files_check(const json_t *ranks, size_t i, ds_err *err)
{
	const json_t *r = json_array_get(ranks, i), *files = json_object_get(r, "files");
	const json_t *env = json_object_get(r, "env"), *v;
	long long rk = (long long)json_integer_value(json_object_get(r, "rank"));
	const char *name;
	if (!files)
		return DS_OK;
	if (!json_is_object(files))
		return ds_err_set(err, DS_EINVAL, "rank %lld: \"files\" must be an object of "
				  "variable names to file contents", rk);
	if (json_object_size(files) > LAUNCH_FILES_MAX)
		return ds_err_set(err, DS_EINVAL, "rank %lld: %zu files, more than %d", rk,
				  json_object_size(files), LAUNCH_FILES_MAX);
	json_object_foreach((json_t *)files, name, v)
	{
		if (!var_name_ok(name))
			return ds_err_set(err, DS_EINVAL, "rank %lld: files: '%.80s' is not a variable "
					  "name (letters, digits and _, not starting with a digit, at "
					  "most %d)", rk, name, LAUNCH_VAR_MAX);
		if (!json_is_string(v))
			return ds_err_set(err, DS_EINVAL, "rank %lld: files: %s must be a string (the "
					  "file's content)", rk, name);
		size_t len = json_string_length(v);
		if (len > LAUNCH_FILE_MAX)
			return ds_err_set(err, DS_EINVAL, "rank %lld: files: %s is %zu bytes, more than "
					  "the limit of %d", rk, name, len, LAUNCH_FILE_MAX);
		if (memchr(json_string_value(v), '\0', len))
			return ds_err_set(err, DS_EINVAL, "rank %lld: files: %s contains a NUL byte",
					  rk, name);
		if (json_object_get(env, name))
			return ds_err_set(err, DS_EINVAL, "rank %lld: %s is both in \"env\" and in "
					  "\"files\"", rk, name);
		for (size_t j = 0; j < i; j++) {
			const json_t *o = json_array_get(ranks, j);
			const json_t *w = json_object_get(json_object_get(o, "files"), name);
			if (w && (json_string_length(w) != len ||
				  memcmp(json_string_value(w), json_string_value(v), len) != 0))
				return ds_err_set(err, DS_EINVAL, "rank %lld: files: %s differs from rank "
						  "%lld's (the ranks of a job on a node share one file "
						  "per variable)", rk, name,
						  (long long)json_integer_value(json_object_get(o, "rank")));
		}
	}
	/* every variable of the job so far, this rank's included */
	int n = 0;
	char seen[LAUNCH_FILES_MAX][LAUNCH_VAR_MAX + 1];
	for (size_t j = 0; j <= i; j++) {
		json_object_foreach(json_object_get(json_array_get(ranks, j), "files"), name, v)
		{
			int dup = 0;
			for (int k = 0; k < n; k++)
				dup |= strcmp(seen[k], name) == 0;
			if (dup)
				continue;
			if (n == LAUNCH_FILES_MAX)
				return ds_err_set(err, DS_EINVAL, "rank %lld: the job's ranks name more "
						  "than %d files", rk, LAUNCH_FILES_MAX);
			ds_strlcpy(seen[n++], name, sizeof seen[0]);
		}
	}
	return DS_OK;
}

/* Checks the whole request before anything starts. */
static int ranks_check(const json_t *ranks, ds_err *err)
{
	if (!json_is_array(ranks) || json_array_size(ranks) == 0 ||
	    json_array_size(ranks) > LAUNCH_RANKS_MAX)
		return ds_err_set(err, DS_EINVAL, "\"ranks\" must be an array of 1..%d rank objects",
				  LAUNCH_RANKS_MAX);
	size_t i;
	const json_t *r;
	json_array_foreach(ranks, i, r)
	{
		const json_t *rk = json_object_get(r, "rank"), *args = json_object_get(r, "args"),
			     *env = json_object_get(r, "env");
		if (!json_is_object(r) || !json_is_integer(rk) || json_integer_value(rk) < 0 ||
		    json_integer_value(rk) > 65535)
			return ds_err_set(err, DS_EINVAL, "ranks[%zu]: \"rank\" must be 0..65535", i);
		for (size_t j = 0; j < i; j++)
			if (json_integer_value(json_object_get(json_array_get(ranks, j), "rank")) ==
			    json_integer_value(rk))
				return ds_err_set(err, DS_EINVAL, "rank %lld appears twice",
						  (long long)json_integer_value(rk));
		if (!json_is_array(args) || json_array_size(args) > LAUNCH_ARGS_MAX)
			return ds_err_set(err, DS_EINVAL, "rank %lld: \"args\" must be an array of at "
					  "most %d options", (long long)json_integer_value(rk),
					  LAUNCH_ARGS_MAX);
		size_t k;
		const json_t *a;
		json_array_foreach(args, k, a)
		{
			const char *s = json_string_value(a);
			if (!s || !s[0] || strlen(s) > LAUNCH_STR_MAX)
				return ds_err_set(err, DS_EINVAL, "rank %lld: args[%zu] must be a non-empty "
						  "string of at most %d bytes",
						  (long long)json_integer_value(rk), k, LAUNCH_STR_MAX);
		}
		if (env && !json_is_object(env))
			return ds_err_set(err, DS_EINVAL, "rank %lld: \"env\" must be an object of "
					  "strings", (long long)json_integer_value(rk));
		if (json_object_size(env) > LAUNCH_ENV_MAX)
			return ds_err_set(err, DS_EINVAL, "rank %lld: more than %d variables",
					  (long long)json_integer_value(rk), LAUNCH_ENV_MAX);
		const char *name;
		const json_t *v;
		json_object_foreach((json_t *)env, name, v)
		{
			const char *s = json_string_value(v);
			if (!var_name_ok(name) || !s || strlen(s) > LAUNCH_STR_MAX)
				return ds_err_set(err, DS_EINVAL, "rank %lld: variable '%s' must be a name "
						  "of letters, digits and _ with a string value",
						  (long long)json_integer_value(rk), name);
		}
		int rc = files_check(ranks, i, err);
		if (rc)
			return rc;
	}
	return DS_OK;
}

/* argv and envp of one rank, built before fork (invariant 1); freed by
 * the caller with free_vec. */
static char **argv_of(const char *exe, const json_t *args)
{
	size_t n = json_array_size(args);
	char **v = calloc(n + 3, sizeof *v);
	if (!v)
		return NULL;
	v[0] = strdup(exe);
	v[1] = strdup("worker");
	for (size_t i = 0; i < n; i++)
		v[i + 2] = strdup(json_string_value(json_array_get(args, i)));
	for (size_t i = 0; i < n + 2; i++)
		if (!v[i])
			return v; /* the caller sees the hole */
	return v;
}

/* NAME=value as a new string (NULL on ENOMEM). */
static char *var_dup(const char *name, const char *value)
{
	size_t len = strlen(name) + 1 + strlen(value) + 1;
	char *s = malloc(len);
	if (s)
		snprintf(s, len, "%s=%s", name, value);
	return s;
}

/* The path of the job file of var (files_of put it in jf). */
static const char *file_path_of(const job_file *jf, int n_jf, const char *var)
{
	for (int i = 0; i < n_jf; i++)
		if (strcmp(jf[i].var, var) == 0)
			return jf[i].path;
	return NULL;
}

/* The agent's environment, less what the plan sets, plus the plan's
 * variables and each of the rank's files as VAR=its path; NULL when an
 * allocation fails. */
static char **envp_of(const json_t *env, const json_t *files, const job_file *jf, int n_jf)
{
	size_t ne = 0;
	while (environ && environ[ne])
		ne++;
	char **v = calloc(ne + json_object_size(env) + json_object_size(files) + 1, sizeof *v);
	if (!v)
		return NULL;
	size_t k = 0;
	for (size_t i = 0; i < ne; i++) {
		const char *eq = strchr(environ[i], '=');
		size_t len = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
		int overridden = 0;
		const char *name;
		const json_t *val;
		json_object_foreach((json_t *)env, name, val)
		{
			if (strlen(name) == len && strncmp(name, environ[i], len) == 0)
				overridden = 1;
		}
		json_object_foreach((json_t *)files, name, val)
		{
			if (strlen(name) == len && strncmp(name, environ[i], len) == 0)
				overridden = 1;
		}
		if (!overridden)
			v[k++] = strdup(environ[i]);
	}
	const char *name;
	const json_t *val;
	json_object_foreach((json_t *)env, name, val)
		v[k++] = var_dup(name, json_string_value(val));
	json_object_foreach((json_t *)files, name, val)
		v[k++] = var_dup(name, file_path_of(jf, n_jf, name));
	for (size_t i = 0; i < k; i++)
		if (!v[i]) { /* a hole would end the environment there */
			for (size_t j = 0; j < k; j++)
				free(v[j]);
			free(v);
			return NULL;
		}
	return v;
}

/* The job's files (invariant 5), in first-seen order, and their paths:
 * DATA_DIR/ranks/<job>.<var in lower case>.xml when the content starts
 * with '<' (after blanks), else .txt.  DS_EINVAL when a path is too long. */
static int files_of(const launcher *l, const char *job, const json_t *ranks, job_file *jf,
		    int *n_jf, ds_err *err)
{
	size_t i;
	const json_t *r;
	*n_jf = 0;
	json_array_foreach(ranks, i, r)
	{
		const char *name;
		const json_t *v;
		json_object_foreach(json_object_get(r, "files"), name, v)
		{
			if (file_path_of(jf, *n_jf, name))
				continue;
			job_file *f = &jf[(*n_jf)++]; /* files_check: at most LAUNCH_FILES_MAX */
			f->var = name;
			f->data = json_string_value(v);
			f->len = json_string_length(v);
			char lower[LAUNCH_VAR_MAX + 1];
			size_t k = 0;
			for (; name[k] && k < LAUNCH_VAR_MAX; k++)
				lower[k] = (name[k] >= 'A' && name[k] <= 'Z') ? (char)(name[k] - 'A' + 'a')
									      : name[k];
			lower[k] = '\0';
			const char *c = f->data;
			while (c < f->data + f->len && (*c == ' ' || *c == '\t' || *c == '\n' || *c == '\r'))
				c++;
			const char *ext = c < f->data + f->len && *c == '<' ? "xml" : "txt";
			if (snprintf(f->path, sizeof f->path, "%s/%s.%s.%s", l->dir, job, lower, ext) >=
			    (int)sizeof f->path)
				return ds_err_set(err, DS_EINVAL, "files: the path of %s under %s is too "
						  "long", name, l->dir);
		}
	}
	return DS_OK;
}

static void free_vec(char **v)
{
	for (size_t i = 0; v && v[i]; i++)
		free(v[i]);
	free(v);
}

static int vec_whole(char **v, size_t n)
{
	if (!v)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!v[i])
			return 0;
	return 1;
}

static void child(const char *exe, char **argv, char **envp, const char *log, pid_t parent)
{
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
		_exit(126);
	int nul = open("/dev/null", O_RDWR);
	int lf = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (nul < 0 || dup2(nul, 0) < 0 || dup2(nul, 1) < 0 || dup2(lf >= 0 ? lf : nul, 2) < 0)
		_exit(126);
	close_range(3, ~0u, 0);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL); /* the agent blocks SIGTERM for sigwait */
	execve(exe, argv, envp);
	static const char msg[] = "launch: cannot run this agent's binary\n";
	ssize_t w = write(2, msg, sizeof msg - 1);
	(void)w;
	_exit(127);
}

int launcher_start(launcher *l, const char *job, uint64_t epoch, const json_t *ranks,
		   ds_err *err)
{
	if (!job_ok(job))
		return ds_err_set(err, DS_EINVAL, "job id '%s': 1..%d characters of letters, digits, "
				  ". _ -", job ? job : "", LAUNCH_JOB_MAX);
	int rc = ranks_check(ranks, err), n_jf = 0;
	if (rc)
		return rc;
	size_t n = json_array_size(ranks);
	char **argvs[LAUNCH_RANKS_MAX] = {0}, **envps[LAUNCH_RANKS_MAX] = {0};
	rank_proc *fresh = calloc(n, sizeof *fresh); /* PATH_MAX logs: not on the stack */
	job_file *jf = calloc(LAUNCH_FILES_MAX, sizeof *jf);
	if (!fresh || !jf) {
		free(fresh);
		free(jf);
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	}
	rc = files_of(l, job, ranks, jf, &n_jf, err);
	for (size_t i = 0; i < n && !rc; i++) {
		const json_t *r = json_array_get(ranks, i);
		const json_t *args = json_object_get(r, "args"), *env = json_object_get(r, "env");
		argvs[i] = argv_of(l->exe, args);
		envps[i] = envp_of(env, json_object_get(r, "files"), jf, n_jf);
		fresh[i].rank = (int)json_integer_value(json_object_get(r, "rank"));
		if (!vec_whole(argvs[i], json_array_size(args) + 2) || !envps[i] ||
		    snprintf(fresh[i].log, sizeof fresh[i].log, "%s/%s.rank%d.log", l->dir, job,
			     fresh[i].rank) >= (int)sizeof fresh[i].log)
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
	}
	pthread_mutex_lock(&l->mu);
	reap_all(l);
	int running = 0;
	for (int i = 0; i < l->n; i++)
		running += l->ranks[i].state == RANK_RUNNING;
	if (!rc && running && l->epoch > epoch)
		rc = ds_err_set(err, DS_EPERM, "job %s of epoch %llu runs here: a job of epoch %llu "
				"may not replace it", l->job, (unsigned long long)l->epoch,
				(unsigned long long)epoch);
	if (!rc) {
		if (running)
			log_info("launch", "replacing a job", "old=%s new=%s", l->job, job);
		stop_locked(l, 2000);
		/* invariant 5: the files, whole, before the first fork */
		for (int i = 0; i < n_jf && !rc; i++)
			if ((rc = ds_file_write_private(jf[i].path, jf[i].data, jf[i].len, 0, err)))
				ds_err_wrap(err, "files: %s", jf[i].var);
	}
	if (!rc) {
		l->n_files = n_jf;
		for (int i = 0; i < n_jf; i++) {
			ds_strlcpy(l->file_var[i], jf[i].var, sizeof l->file_var[i]);
			ds_strlcpy(l->file_path[i], jf[i].path, sizeof l->file_path[i]);
		}
		ds_strlcpy(l->job, job, sizeof l->job);
		l->epoch = epoch;
		l->n = 0;
		spawn_req q = {.n = n, .argv = argvs, .envp = envps, .procs = fresh};
		l->req = &q;
		pthread_cond_signal(&l->req_cv);
		while (!q.done)
			pthread_cond_wait(&l->done_cv, &l->mu);
		for (size_t i = 0; i < n && fresh[i].pid > 0; i++) {
			fresh[i].state = RANK_RUNNING;
			fresh[i].started = unix_now();
			l->ranks[l->n++] = fresh[i];
			log_info("launch", "rank started", "job=%s rank=%d pid=%d log=%s", job,
				 fresh[i].rank, (int)fresh[i].pid, fresh[i].log);
		}
		if (q.err_no) {
			rc = ds_err_set(err, DS_EIO, "fork of rank %d: %s", fresh[l->n].rank,
					strerror(q.err_no));
			stop_locked(l, 0);
		}
	}
	pthread_mutex_unlock(&l->mu);
	for (size_t i = 0; i < n; i++) {
		free_vec(argvs[i]);
		free_vec(envps[i]);
	}
	free(fresh);
	free(jf);
	return rc;
}

int launcher_stop(launcher *l, const char *job, int grace_ms, ds_err *err)
{
	int rc = DS_OK;
	pthread_mutex_lock(&l->mu);
	if (job && strcmp(job, l->job) != 0)
		rc = ds_err_set(err, DS_ENOTFOUND, "job %s does not run here (%s%s)", job,
				l->job[0] ? "the last job is " : "no job yet", l->job);
	else
		stop_locked(l, grace_ms);
	pthread_mutex_unlock(&l->mu);
	return rc;
}

/* The last error line of an ended rank's log (the last line when none
 * says level=error), at most 512 bytes of it, into out ("" when none). */
static void log_last_error(const char *path, char *out, size_t n)
{
	char buf[8192];
	out[0] = '\0';
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	long at = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
	size_t len = 0;
	if (at >= 0 && fseek(f, at > (long)sizeof buf - 1 ? at - (long)(sizeof buf - 1) : 0,
			     SEEK_SET) == 0)
		len = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[len] = '\0';
	const char *best = NULL, *last = NULL;
	for (char *line = buf, *next; line && *line; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = '\0';
		if (!*line)
			continue;
		last = line;
		if (strstr(line, "level=error"))
			best = line;
	}
	if (best || last)
		snprintf(out, n, "%.512s", best ? best : last);
}

json_t *launcher_json(launcher *l)
{
	pthread_mutex_lock(&l->mu);
	reap_all(l);
	json_t *ranks = json_array();
	for (int i = 0; ranks && i < l->n; i++) {
		const rank_proc *p = &l->ranks[i];
		const char *st = p->state == RANK_RUNNING ? "running"
				 : p->state == RANK_KILLED ? "killed" : "exited";
		json_t *o = json_pack("{s:i,s:i,s:s,s:I,s:s}", "rank", p->rank, "pid", (int)p->pid,
				      "state", st, "started", (json_int_t)p->started, "log", p->log);
		if (o && p->state == RANK_EXITED)
			json_object_set_new(o, "exit_code", json_integer(p->code));
		if (o && p->state == RANK_KILLED)
			json_object_set_new(o, "signal", json_integer(p->code));
		if (o && p->state != RANK_RUNNING) {
			char tail[520];
			json_object_set_new(o, "ended", json_integer((json_int_t)p->ended));
			log_last_error(p->log, tail, sizeof tail);
			if (tail[0])
				json_object_set_new(o, "last_error", json_string(tail));
		}
		json_array_append_new(ranks, o);
	}
	json_t *files = json_object();
	for (int i = 0; files && i < l->n_files; i++)
		json_object_set_new(files, l->file_var[i], json_string(l->file_path[i]));
	json_t *out = json_pack("{s:s?,s:I,s:o,s:o}", "job", l->job[0] ? l->job : NULL, "epoch",
				(json_int_t)l->epoch, "ranks", ranks ? ranks : json_array(),
				"files", files ? files : json_object());
	pthread_mutex_unlock(&l->mu);
	return out;
}
