/*
 * deploy.c - the head's deployment of one model over the cluster's nodes
 * (deploy.h): plan, launch through the agents, serve, watch the ranks.
 *
 * Two threads: the runner (launches: it blocks in serve_deploy while the
 * ranks load; stops) and the monitor (polls the ranks of every node).  One
 * mutex guards the deployment record; no call to another node or to the
 * serve is made under it.
 */
#include "agent/api/deploy.h"
#include "common/fileutil.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/driver.h"

#include <errno.h>
#include <stdarg.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NODES_MAX 64
#define RANKS_MAX DRIVER_MAX_RANKS
#define CALL_MS 5000       /* one call to another agent */
#define POLL_MS 500        /* the monitor's period */
#define UNREACHABLE_POLLS 6 /* a node silent this many polls in a row fails the deployment */
#define DRAIN_MS 5000      /* after a rank died: how long requests in flight get to end */
#define FENCE_WAIT_S 10.0  /* how long a follower may take to recognise this head */

enum { ST_NONE, ST_LAUNCHING, ST_LOADING, ST_SERVING, ST_FAILED, ST_STOPPED };
static const char *const state_names[] = {"none", "launching", "loading", "serving", "failed",
					  "stopped"};

enum { JOB_NONE, JOB_UP, JOB_DOWN, JOB_CLEANUP };

typedef struct dnode {
	char name[128], id[40], addr[64];
	int self;
	int silent; /* polls in a row without an answer */
} dnode;

typedef struct drank {
	int node;
	int pid;
	char proc[16]; /* the launcher's state: running | exited | killed | "" (not seen) */
	int exit_code, sig;
	char last_error[520]; /* its log's last error line, once ended */
	json_t *opts;  /* the options the driver gave it (start_remote) */
	int64_t loaded; /* weight bytes copied so far (-1 = not reported) */
	int64_t total;  /* the plan's weight bytes of its share (-1 = unknown) */
} drank;

struct deploy {
	deploy_params p;
	char token_file[PATH_MAX + 16];
	pthread_mutex_t mu;
	pthread_cond_t cv;
	pthread_t runner, monitor;
	int stop;
	int job, job_done; /* job_done counts finished jobs (deploy_down waits on it) */

	/* the current deployment */
	int64_t id;
	int state;
	uint64_t epoch;
	char job_id[64];
	char model[PATH_MAX];
	char names[512];
	int has_names;
	int tp, pp, ep, W, max_ctx, max_seqs, threads;
	json_t *plan;
	int n_nodes;
	dnode nodes[NODES_MAX];
	drank ranks[RANKS_MAX];
	int collected, dispatched;
	char error[1024], failed_node[128];
	int failed_rank;
	double t_post, t_ready;
	/* nodes of the deployment before (their ranks stop at the next launch) */
	int n_old;
	dnode old[NODES_MAX];
	/* the request of the newest deployment this node took part in, for a
	 * new head to relaunch (deploy_remember); NULL when none or forgotten */
	json_t *remembered;
	uint64_t remembered_epoch;
	uint64_t relaunched_epoch; /* the reign in which this node relaunched it */
	char *request_text;        /* the current deployment's request body */
};

/* The plan row's status (planned -> launching -> serving | failed | stopped). */
static void plan_status(deploy *d, int64_t id, uint64_t epoch, const char *status,
			const char *reason)
{
	ds_err e = {0};
	if (id > 0 && store_plan_set_status(d->p.st, id, (int64_t)epoch, status, reason,
					    (int64_t)time(NULL), &e) != DS_OK)
		log_warn("deploy", "cannot record the plan's status", "plan=%lld status=%s error=\"%s\"",
			 (long long)id, status, e.msg);
}

/* ---- calls to the nodes ---- */

/* DELETE /v1/ranks on every node of list (this node: its launcher); with
 * forget, the nodes also drop the deployment's request (no new head
 * relaunches a deployment that was stopped). */
static void stop_ranks(deploy *d, const dnode *list, int n, int forget)
{
	static const char forget_body[] = "{\"forget\":true}";
	for (int i = 0; i < n; i++) {
		ds_err e = {0};
		int status = 0;
		json_t *ans = NULL;
		if (list[i].self) {
			if (launcher_stop(d->p.lr, NULL, 2000, &e) != DS_OK)
				log_warn("deploy", "cannot stop this node's ranks", "error=\"%s\"", e.msg);
			if (forget)
				deploy_forget(d);
			continue;
		}
		if (cluster_node_call(d->p.cl, list[i].id, "DELETE", "/v1/ranks",
				      forget ? forget_body : NULL, forget ? sizeof forget_body - 1 : 0,
				      CALL_MS, &status, &ans, &e) != DS_OK || status != 200)
			log_warn("deploy", "cannot stop a node's ranks", "node=%s status=%d error=\"%s\"",
				 list[i].name, status, e.msg);
		json_decref(ans);
	}
}

/* The launcher's document of node i (GET /v1/ranks), or NULL with why. */
static json_t *node_ranks(deploy *d, const dnode *n, ds_err *e)
{
	if (n->self)
		return launcher_json(d->p.lr);
	int status = 0;
	json_t *ans = NULL;
	if (cluster_node_call(d->p.cl, n->id, "GET", "/v1/ranks", NULL, 0, CALL_MS / 2, &status,
			      &ans, e) != DS_OK)
		return NULL;
	if (status != 200) {
		ds_err_set(e, DS_EIO, "node %s answered GET /v1/ranks with %d", n->name, status);
		json_decref(ans);
		return NULL;
	}
	return ans;
}

/* ---- failing ---- */

/* Records the first failure; from then on new requests get 503 naming it.
 * The runner unloads and stops the ranks (JOB_CLEANUP), unless it is still
 * loading: then the ranks are stopped here so the load ends now. */
static void fail(deploy *d, int node, int rank, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void fail(deploy *d, int node, int rank, const char *fmt, ...)
{
	char msg[sizeof d->error];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	pthread_mutex_lock(&d->mu);
	int was = d->state;
	if (was != ST_LOADING && was != ST_SERVING && was != ST_LAUNCHING) {
		pthread_mutex_unlock(&d->mu);
		return;
	}
	d->state = ST_FAILED;
	ds_strlcpy(d->error, msg, sizeof d->error);
	ds_strlcpy(d->failed_node, node >= 0 ? d->nodes[node].name : "", sizeof d->failed_node);
	d->failed_rank = rank;
	dnode nodes[NODES_MAX];
	int n = d->n_nodes;
	memcpy(nodes, d->nodes, sizeof nodes);
	if (was == ST_SERVING) {
		d->job = JOB_CLEANUP;
		pthread_cond_broadcast(&d->cv);
	}
	int64_t id = d->id;
	uint64_t epoch = d->epoch;
	pthread_mutex_unlock(&d->mu);
	log_error("deploy", "deployment failed", "id=%lld error=\"%s\"", (long long)id, msg);
	plan_status(d, id, epoch, "failed", msg);
	serve_refuse(d->p.sv, "deployment_failed", msg);
	if (was != ST_SERVING) { /* the load ends now, not at rank 0's comm timeout */
		stop_ranks(d, nodes, n, 0);
		driver_signal_teardown();
	}
}

/* ---- the monitor ---- */

static void rank_from_json(drank *k, const json_t *j)
{
	const char *st = json_string_value(json_object_get(j, "state"));
	k->pid = (int)json_integer_value(json_object_get(j, "pid"));
	ds_strlcpy(k->proc, st ? st : "", sizeof k->proc);
	k->exit_code = (int)json_integer_value(json_object_get(j, "exit_code"));
	k->sig = (int)json_integer_value(json_object_get(j, "signal"));
	/* logfmt: the error="..." value when there is one, else the line */
	const char *le = json_string_value(json_object_get(j, "last_error"));
	const char *e = le ? strstr(le, "error=\"") : NULL;
	if (e) {
		e += 7;
		size_t n = strlen(e);
		snprintf(k->last_error, sizeof k->last_error, "%.*s", (int)(n && e[n - 1] == '"' ? n - 1 : n),
			 e);
	} else {
		snprintf(k->last_error, sizeof k->last_error, "%s", le ? le : "");
	}
}

/* 1 when pid is gone or a zombie (rank 0, the driver's child). */
static int pid_dead(int pid)
{
	char path[64], text[256];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 1;
	size_t n = fread(text, 1, sizeof text - 1, f);
	fclose(f);
	text[n] = 0;
	const char *p = strrchr(text, ')');
	return !p || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X';
}

static void monitor_round(deploy *d)
{
	pthread_mutex_lock(&d->mu);
	int state = d->state, dispatched = d->dispatched, n = d->n_nodes, W = d->W;
	char job[sizeof d->job_id];
	dnode nodes[NODES_MAX];
	memcpy(nodes, d->nodes, sizeof nodes);
	ds_strlcpy(job, d->job_id, sizeof job);
	int on_node[NODES_MAX] = {0};
	for (int r = 1; r < W; r++)
		on_node[d->ranks[r].node]++;
	pthread_mutex_unlock(&d->mu);
	if (!(state == ST_SERVING || (state == ST_LOADING && dispatched)))
		return;
	/* The rank to blame: one killed by a signal, then one that failed on
	 * its own, then one whose collective lost a peer, then rank 0 (which
	 * ends when a peer's connection breaks). */
	int blame = -1, blame_node = -1, blame_pri = 0, pid0 = 0;
	char why[512] = "";
	if (state == ST_SERVING) {
		pid0 = serve_rank_pid(d->p.sv, 0);
		if (pid0 > 0 && pid_dead(pid0)) {
			blame = 0;
			blame_node = 0;
			blame_pri = 1;
			snprintf(why, sizeof why, "rank 0 on node %s (pid %d) exited", nodes[0].name,
				 pid0);
		}
	}
	for (int i = 0; i < n; i++) {
		if (!on_node[i])
			continue;
		ds_err e = {0};
		json_t *doc = node_ranks(d, &nodes[i], &e);
		pthread_mutex_lock(&d->mu);
		int silent = doc ? (d->nodes[i].silent = 0) : ++d->nodes[i].silent;
		pthread_mutex_unlock(&d->mu);
		if (!doc) {
			if (silent >= UNREACHABLE_POLLS)
				fail(d, i, -1, "node %s stopped answering: %s", nodes[i].name, e.msg);
			continue;
		}
		const char *seen = json_string_value(json_object_get(doc, "job"));
		if (!seen || strcmp(seen, job) != 0) {
			if (blame_pri < 2) {
				blame = -1;
				blame_node = i;
				blame_pri = 2;
				snprintf(why, sizeof why, "node %s no longer runs this deployment's "
					 "ranks (its job: %s)", nodes[i].name, seen ? seen : "none");
			}
			json_decref(doc);
			continue;
		}
		size_t k;
		json_t *rj;
		pthread_mutex_lock(&d->mu);
		json_array_foreach(json_object_get(doc, "ranks"), k, rj) {
			json_int_t r = json_integer_value(json_object_get(rj, "rank"));
			if (r <= 0 || r >= W || d->ranks[r].node != i)
				continue;
			drank *dr = &d->ranks[r];
			rank_from_json(dr, rj);
			/* an exit with status 0 is a rank told to stop (STOP from rank 0);
			 * one whose error is a collective that lost its peer ("comm ...")
			 * ended because another did */
			int killed = strcmp(dr->proc, "killed") == 0;
			int failed = strcmp(dr->proc, "exited") == 0 && dr->exit_code;
			int echo = strncmp(dr->last_error, "comm ", 5) == 0 ||
				   strstr(dr->last_error, ": comm ") != NULL;
			int pri = killed ? 5 : failed ? (echo ? 3 : 4) : 0;
			if (pri <= blame_pri)
				continue;
			blame = (int)r;
			blame_node = i;
			blame_pri = pri;
			if (killed)
				snprintf(why, sizeof why, "rank %d on node %s (pid %d) was killed by "
					 "signal %d", (int)r, nodes[i].name, dr->pid, dr->sig);
			else
				snprintf(why, sizeof why, "rank %d on node %s (pid %d) exited with "
					 "status %d%s%s", (int)r, nodes[i].name, dr->pid, dr->exit_code,
					 dr->last_error[0] ? ": " : "", dr->last_error);
		}
		pthread_mutex_unlock(&d->mu);
		json_decref(doc);
	}
	if (blame_pri > 0)
		fail(d, blame_node, blame, "%s", why);
}

/* A new head relaunches the deployment the previous head ran (once per
 * reign): the request it remembered from that head's POST /v1/ranks. */
static void relaunch_check(deploy *d)
{
	uint64_t epoch = 0;
	if (!cluster_is_head(d->p.cl, &epoch))
		return;
	pthread_mutex_lock(&d->mu);
	int go = d->remembered && d->remembered_epoch < epoch && d->relaunched_epoch < epoch &&
		 d->epoch < epoch && d->state != ST_LAUNCHING && d->state != ST_LOADING &&
		 d->job == JOB_NONE;
	char *text = go ? json_dumps(d->remembered, JSON_COMPACT) : NULL;
	uint64_t from = d->remembered_epoch;
	pthread_mutex_unlock(&d->mu);
	if (!text)
		return;
	json_t *out = NULL;
	ds_err e = {0};
	int rc = deploy_up(d, text, strlen(text), &out, &e);
	if (rc == DS_EINVAL || rc == DS_ERANGE) {
		/* the sizes given no longer match the nodes left (one is gone):
		 * the planner chooses them */
		json_t *req = jsonx_parse(text, strlen(text), 8, NULL);
		json_object_del(req, "tp");
		json_object_del(req, "pp");
		json_object_del(req, "ep");
		char *auto_text = json_is_object(req) ? json_dumps(req, JSON_COMPACT) : NULL;
		json_decref(req);
		if (auto_text) {
			log_warn("deploy", "the previous plan's sizes do not fit the nodes left: "
				 "replanning without them", "error=\"%s\"", e.msg);
			json_decref(out);
			out = NULL;
			e = (ds_err){0};
			rc = deploy_up(d, auto_text, strlen(auto_text), &out, &e);
			free(auto_text);
		}
	}
	if (rc == DS_EBUSY) { /* inventories still coming in: the next round */
		json_decref(out);
		free(text);
		return;
	}
	pthread_mutex_lock(&d->mu);
	d->relaunched_epoch = epoch;
	pthread_mutex_unlock(&d->mu);
	log_info("deploy", "relaunched the previous head's deployment", "from_epoch=%llu epoch=%llu "
		 "rc=%d", (unsigned long long)from, (unsigned long long)epoch, rc);
	if (rc != DS_OK) {
		log_error("deploy", "cannot relaunch the previous head's deployment", "error=\"%s\"",
			  e.msg);
		pthread_mutex_lock(&d->mu);
		if (d->state == ST_NONE || d->state == ST_STOPPED || d->state == ST_SERVING) {
			d->state = ST_FAILED;
			d->epoch = epoch;
			d->failed_rank = -1;
			d->failed_node[0] = 0;
			snprintf(d->error, sizeof d->error, "relaunch as the new head: %s", e.msg);
		}
		pthread_mutex_unlock(&d->mu);
		serve_refuse(d->p.sv, "deployment_failed", e.msg);
	}
	json_decref(out);
	free(text);
}

static void *monitor_main(void *arg)
{
	deploy *d = arg;
	int ms = d->p.poll_ms > 0 ? d->p.poll_ms : POLL_MS;
	pthread_mutex_lock(&d->mu);
	while (!d->stop) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_sec += ms / 1000;
		ts.tv_nsec += (long)(ms % 1000) * 1000000L;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		pthread_cond_timedwait(&d->cv, &d->mu, &ts);
		if (d->stop)
			break;
		pthread_mutex_unlock(&d->mu);
		relaunch_check(d);
		monitor_round(d);
		pthread_mutex_lock(&d->mu);
	}
	pthread_mutex_unlock(&d->mu);
	return NULL;
}

/* ---- launching ---- */

/* The pids and states of node i's ranks from its launcher's document. */
static void ranks_seen(deploy *d, int i, const json_t *doc)
{
	size_t k;
	json_t *rj;
	pthread_mutex_lock(&d->mu);
	json_array_foreach(json_object_get(doc, "ranks"), k, rj) {
		json_int_t r = json_integer_value(json_object_get(rj, "rank"));
		if (r > 0 && r < d->W && d->ranks[r].node == i)
			rank_from_json(&d->ranks[r], rj);
	}
	pthread_mutex_unlock(&d->mu);
}

/* start_remote of the driver: collects each rank's options; with the last
 * one, every node gets its ranks (POST /v1/ranks, this node's launcher
 * directly).  Runs on the serve's loader thread. */
static int dispatch(deploy *d, ds_err *err)
{
	pthread_mutex_lock(&d->mu);
	int n = d->n_nodes, W = d->W;
	json_t *per[NODES_MAX] = {0};
	dnode nodes[NODES_MAX];
	memcpy(nodes, d->nodes, sizeof nodes);
	char job[sizeof d->job_id];
	ds_strlcpy(job, d->job_id, sizeof job);
	uint64_t epoch = d->epoch;
	json_t *request = d->request_text ? jsonx_parse(d->request_text, strlen(d->request_text),
							 8, NULL) : NULL;
	for (int r = 1; r < W; r++) {
		int i = d->ranks[r].node;
		const json_t *nd = json_array_get(json_object_get(d->plan, "nodes"), (size_t)i);
		json_t *env = json_object_get(nd, "env");
		const json_t *topo = json_object_get(nd, "nccl_topo_xml");
		if (!per[i])
			per[i] = json_array();
		json_t *e = json_pack("{s:i,s:O,s:O}", "rank", r, "args", d->ranks[r].opts, "env",
				      json_is_object(env) ? env : json_object());
		if (e && json_is_string(topo)) /* the node writes it and names it */
			json_object_set_new(e, "files", json_pack("{s:O}", "NCCL_TOPO_FILE", topo));
		json_array_append_new(per[i], e);
	}
	pthread_mutex_unlock(&d->mu);
	int rc = DS_OK;
	for (int i = 0; i < n && rc == DS_OK; i++) {
		if (!per[i])
			continue;
		if (nodes[i].self) {
			rc = launcher_start(d->p.lr, job, epoch, per[i], err);
			if (rc) {
				ds_err_wrap(err, "node %s (this node) cannot start its ranks", nodes[i].name);
			} else {
				json_t *doc = launcher_json(d->p.lr);
				ranks_seen(d, i, doc);
				json_decref(doc);
			}
			continue;
		}
		json_t *body = json_pack("{s:s,s:I,s:O}", "job", job, "epoch", (json_int_t)epoch,
					 "ranks", per[i]);
		if (body && json_is_object(request)) /* for a new head to relaunch */
			json_object_set(body, "deployment", request);
		char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
		json_decref(body);
		int status = 0;
		json_t *ans = NULL;
		/* a follower that has not heard of this head yet answers 503 (its
		 * fence): it learns with the next heartbeat, so ask again */
		double until = ds_now_s() + FENCE_WAIT_S;
		if (!text)
			rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		else
			while ((rc = cluster_node_call(d->p.cl, nodes[i].id, "POST", "/v1/ranks", text,
						       strlen(text), CALL_MS, &status, &ans,
						       err)) == DS_OK &&
			       status == 503 && ds_now_s() < until) {
				json_decref(ans);
				ans = NULL;
				ds_sleep_ms(100);
			}
		if (rc == DS_OK && status != 200) {
			const char *m = json_string_value(
				json_object_get(json_object_get(ans, "error"), "message"));
			rc = ds_err_set(err, DS_EIO, "node %s refused its ranks (%d): %s", nodes[i].name,
					status, m ? m : "no reason given");
		} else if (rc == DS_OK) {
			ranks_seen(d, i, ans); /* the answer is the launcher's document */
		}
		json_decref(ans);
		free(text);
	}
	for (int i = 0; i < n; i++)
		json_decref(per[i]);
	json_decref(request);
	pthread_mutex_lock(&d->mu);
	d->dispatched = rc == DS_OK;
	pthread_mutex_unlock(&d->mu);
	return rc;
}

/* The driver's load progress: weight bytes copied so far by rank. */
static void on_progress(void *ctx, int rank, uint64_t bytes)
{
	deploy *d = ctx;
	pthread_mutex_lock(&d->mu);
	if (rank >= 0 && rank < d->W)
		d->ranks[rank].loaded = (int64_t)bytes;
	pthread_mutex_unlock(&d->mu);
}

static int on_remote(void *ctx, int rank, const char *const *opts, ds_err *err)
{
	deploy *d = ctx;
	json_t *a = json_array();
	for (int i = 0; opts[i]; i++)
		json_array_append_new(a, json_string(opts[i]));
	pthread_mutex_lock(&d->mu);
	json_decref(d->ranks[rank].opts);
	d->ranks[rank].opts = a;
	int all = ++d->collected == d->W - 1;
	pthread_mutex_unlock(&d->mu);
	return all ? dispatch(d, err) : DS_OK;
}

static void run_up(deploy *d)
{
	ds_err err = {0};
	char exe_buf[PATH_MAX];
	const char *exe = ds_self_exe(exe_buf, sizeof exe_buf, &err) == DS_OK ? exe_buf : NULL;
	pthread_mutex_lock(&d->mu);
	dnode old[NODES_MAX];
	int n_old = d->n_old;
	memcpy(old, d->old, sizeof old);
	d->n_old = 0;
	int W = d->W, n = d->n_nodes;
	const char *hosts[RANKS_MAX];
	uint8_t remote[RANKS_MAX] = {0};
	char envs[64][512];
	const char *env[65];
	int n_env = 0;
	const char *k;
	json_t *v;
	json_object_foreach(json_object_get(json_array_get(json_object_get(d->plan, "nodes"), 0),
					    "env"), k, v) {
		if (n_env < 64 && json_is_string(v)) {
			snprintf(envs[n_env], sizeof envs[n_env], "%s=%s", k, json_string_value(v));
			env[n_env] = envs[n_env];
			n_env++;
		}
	}
	/* a node whose topology NCCL cannot see gets the plan's topology file:
	 * rank 0's is written here, the other ranks' by their launchers */
	char topo_env[PATH_MAX + 32];
	const char *topo = json_string_value(json_object_get(
		json_array_get(json_object_get(d->plan, "nodes"), 0), "nccl_topo_xml"));
	if (topo && n_env < 64) {
		char path[PATH_MAX];
		ds_err te = {0};
		snprintf(path, sizeof path, "%s/ranks/%s.rank0.nccl_topo.xml", d->p.data_dir,
			 d->job_id);
		if (ds_file_write_private(path, topo, strlen(topo), 0, &te) == DS_OK) {
			snprintf(topo_env, sizeof topo_env, "NCCL_TOPO_FILE=%s", path);
			env[n_env++] = topo_env;
		} else {
			log_warn("deploy", "cannot write rank 0's NCCL topology file", "error=\"%s\"",
				 te.msg);
		}
	}
	env[n_env] = NULL;
	for (int r = 0; r < W; r++) {
		hosts[r] = d->nodes[d->ranks[r].node].addr;
		remote[r] = r > 0;
	}
	driver_launch l = driver_default_launch();
	const char *argv[] = {exe, "worker", NULL};
	l.argv = argv;
	l.plan = (model_plan){.tp = d->tp, .pp = d->pp, .ep = d->ep};
	l.remote = remote;
	l.start_remote = on_remote;
	l.remote_ctx = d;
	l.store_host = d->nodes[0].addr;
	l.rank_hosts = hosts;
	l.env = env;
	l.on_progress = on_progress;
	l.progress_ctx = d;
	l.comm_timeout_ms = d->p.comm_timeout_ms;
	serve_spec sp = {.model_path = d->model, .names = d->has_names ? d->names : NULL,
			 .threads = d->threads, .max_ctx = d->max_ctx, .max_seqs = d->max_seqs,
			 .launch = &l};
	int64_t id = d->id;
	uint64_t epoch = d->epoch;
	d->state = ST_LOADING;
	pthread_mutex_unlock(&d->mu);

	stop_ranks(d, old, n_old, 0); /* the nodes the new plan leaves out */
	log_info("deploy", "launching", "id=%lld model=%s tp=%d pp=%d ep=%d world=%d threads=%d",
		 (long long)id, sp.model_path, l.plan.tp, l.plan.pp, l.plan.ep, W, sp.threads);
	int rc = exe ? serve_deploy(d->p.sv, &sp, &err) : DS_EIO;

	if (rc != DS_OK)
		monitor_round(d); /* a rank that ended elsewhere is the cause, not rank 0 */
	pthread_mutex_lock(&d->mu);
	int failed = d->state == ST_FAILED;
	if (rc == DS_OK && !failed) {
		d->state = ST_SERVING;
		d->t_ready = ds_now_s();
		pthread_mutex_unlock(&d->mu);
		log_info("deploy", "serving", "id=%lld load_s=%.2f", (long long)id,
			 d->t_ready - d->t_post);
		plan_status(d, id, epoch, "serving", NULL);
		return;
	}
	if (!failed) {
		d->state = ST_FAILED;
		ds_strlcpy(d->error, err.msg, sizeof d->error);
		d->failed_rank = -1;
		d->failed_node[0] = 0;
	}
	char why[sizeof d->error];
	ds_strlcpy(why, d->error, sizeof why);
	dnode nodes[NODES_MAX];
	memcpy(nodes, d->nodes, sizeof nodes);
	pthread_mutex_unlock(&d->mu);
	log_error("deploy", "launch failed", "id=%lld error=\"%s\"", (long long)id, why);
	if (!failed)
		plan_status(d, id, epoch, "failed", why);
	serve_undeploy(d->p.sv, "deployment_failed", why);
	stop_ranks(d, nodes, n, 0);
}

/* After a rank died while serving: requests in flight end with the
 * engine's error (the driver's step fails), then the model goes. */
static void run_cleanup(deploy *d)
{
	serve_wait_idle(d->p.sv, DRAIN_MS);
	pthread_mutex_lock(&d->mu);
	char why[sizeof d->error];
	ds_strlcpy(why, d->error, sizeof why);
	dnode nodes[NODES_MAX];
	int n = d->n_nodes;
	memcpy(nodes, d->nodes, sizeof nodes);
	pthread_mutex_unlock(&d->mu);
	serve_undeploy(d->p.sv, "deployment_failed", why);
	stop_ranks(d, nodes, n, 0);
}

static void run_down(deploy *d)
{
	pthread_mutex_lock(&d->mu);
	dnode nodes[NODES_MAX];
	int n = d->n_nodes;
	memcpy(nodes, d->nodes, sizeof nodes);
	pthread_mutex_unlock(&d->mu);
	serve_undeploy(d->p.sv, "no_model",
		       "the deployment was stopped (dsctl cluster down): run `dsctl cluster up`");
	stop_ranks(d, nodes, n, 1);
	pthread_mutex_lock(&d->mu);
	int was = d->state;
	d->state = ST_STOPPED;
	int64_t id = d->id;
	uint64_t epoch = d->epoch;
	pthread_mutex_unlock(&d->mu);
	log_info("deploy", "stopped", "id=%lld", (long long)id);
	if (was == ST_SERVING)
		plan_status(d, id, epoch, "stopped", "dsctl cluster down");
}

static void *runner_main(void *arg)
{
	deploy *d = arg;
	pthread_mutex_lock(&d->mu);
	while (!d->stop) {
		if (d->job == JOB_NONE) {
			pthread_cond_wait(&d->cv, &d->mu);
			continue;
		}
		int job = d->job;
		d->job = JOB_NONE;
		pthread_mutex_unlock(&d->mu);
		if (job == JOB_UP)
			run_up(d);
		else if (job == JOB_CLEANUP)
			run_cleanup(d);
		else
			run_down(d);
		pthread_mutex_lock(&d->mu);
		d->job_done++;
		pthread_cond_broadcast(&d->cv);
	}
	pthread_mutex_unlock(&d->mu);
	return NULL;
}

/* ---- public ---- */

deploy *deploy_new(const deploy_params *p, ds_err *err)
{
	deploy *d = calloc(1, sizeof *d);
	if (!d) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	d->p = *p;
	char abs[PATH_MAX];
	snprintf(d->token_file, sizeof d->token_file, "%s/admin.token",
		 realpath(p->data_dir, abs) ? abs : p->data_dir);
	pthread_mutex_init(&d->mu, NULL);
	pthread_cond_init(&d->cv, NULL);
	d->failed_rank = -1;
	if (pthread_create(&d->runner, NULL, runner_main, d) != 0) {
		ds_err_set(err, DS_EIO, "cannot start the deployment thread");
		pthread_cond_destroy(&d->cv);
		pthread_mutex_destroy(&d->mu);
		free(d);
		return NULL;
	}
	if (pthread_create(&d->monitor, NULL, monitor_main, d) != 0) {
		pthread_mutex_lock(&d->mu);
		d->stop = 1;
		pthread_cond_broadcast(&d->cv);
		pthread_mutex_unlock(&d->mu);
		pthread_join(d->runner, NULL);
		ds_err_set(err, DS_EIO, "cannot start the rank monitor thread");
		free(d);
		return NULL;
	}
	return d;
}

void deploy_free(deploy *d)
{
	if (!d)
		return;
	pthread_mutex_lock(&d->mu);
	d->stop = 1;
	pthread_cond_broadcast(&d->cv);
	dnode nodes[NODES_MAX];
	int n = d->state == ST_NONE ? 0 : d->n_nodes;
	memcpy(nodes, d->nodes, sizeof nodes);
	pthread_mutex_unlock(&d->mu);
	stop_ranks(d, nodes, n, 0);
	driver_signal_teardown(); /* a load in progress ends now: rank 0 goes */
	pthread_join(d->monitor, NULL);
	pthread_join(d->runner, NULL);
	for (int r = 0; r < RANKS_MAX; r++)
		json_decref(d->ranks[r].opts);
	json_decref(d->plan);
	json_decref(d->remembered);
	free(d->request_text);
	pthread_cond_destroy(&d->cv);
	pthread_mutex_destroy(&d->mu);
	free(d);
}

/* Threads per rank: this machine's cores over the most ranks any one
 * address of the plan runs (nodes that share an address share a machine). */
static int threads_per_rank(const deploy *d)
{
	if (d->p.threads > 0)
		return d->p.threads;
	int most = 1;
	for (int r = 0; r < d->W; r++) {
		int same = 0;
		for (int q = 0; q < d->W; q++)
			same += strcmp(d->nodes[d->ranks[r].node].addr,
				       d->nodes[d->ranks[q].node].addr) == 0;
		most = same > most ? same : most;
	}
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	return cpus / most > 1 ? (int)(cpus / most) : 1;
}

/* The plan document's nodes and ranks into the deployment (under mu). */
static int take_plan(deploy *d, json_t *doc, ds_err *err)
{
	const json_t *nodes = json_object_get(doc, "nodes"), *ranks = json_object_get(doc, "ranks");
	int n = (int)json_array_size(nodes), W = (int)json_array_size(ranks);
	if (n < 1 || n > NODES_MAX || W < 1 || W > RANKS_MAX)
		return ds_err_set(err, DS_EUNSUPPORTED, "a plan of %d ranks on %d nodes: a deployment "
				  "takes at most %d ranks on %d nodes", W, n, RANKS_MAX, NODES_MAX);
	char self[40] = "";
	for (int i = 0; i < n; i++) {
		const json_t *nd = json_array_get(nodes, (size_t)i);
		dnode *x = &d->nodes[i];
		memset(x, 0, sizeof *x);
		const char *name = json_string_value(json_object_get(nd, "name"));
		const char *id = json_string_value(json_object_get(nd, "node_id"));
		const char *addr = json_string_value(json_object_get(nd, "address"));
		ds_strlcpy(x->name, name ? name : "?", sizeof x->name);
		ds_strlcpy(x->id, id ? id : "", sizeof x->id);
		ds_strlcpy(x->addr, addr ? addr : "127.0.0.1", sizeof x->addr);
		if (i == 0)
			ds_strlcpy(self, x->id, sizeof self);
		x->self = i == 0; /* the head plans with itself first */
	}
	for (int r = 0; r < RANKS_MAX; r++) {
		json_decref(d->ranks[r].opts);
		memset(&d->ranks[r], 0, sizeof d->ranks[r]);
	}
	for (int r = 0; r < W; r++) {
		int node = (int)json_integer_value(json_object_get(json_array_get(ranks, (size_t)r),
								   "node"));
		if (node < 0 || node >= n)
			return ds_err_set(err, DS_EINTERNAL, "the plan puts rank %d on node %d of %d", r,
					  node, n);
		const json_t *mem = json_object_get(json_array_get(ranks, (size_t)r), "memory");
		d->ranks[r].node = node;
		d->ranks[r].loaded = -1;
		d->ranks[r].total = json_is_integer(json_object_get(mem, "weights"))
					    ? json_integer_value(json_object_get(mem, "weights")) : -1;
	}
	if (d->ranks[0].node != 0)
		return ds_err_set(err, DS_EINTERNAL, "the plan does not put rank 0 on the head");
	d->n_nodes = n;
	d->W = W;
	d->tp = (int)json_integer_value(json_object_get(doc, "tp"));
	d->pp = (int)json_integer_value(json_object_get(doc, "pp"));
	d->ep = (int)json_integer_value(json_object_get(doc, "ep"));
	return DS_OK;
}

int deploy_up(deploy *d, const char *body, size_t len, json_t **out, ds_err *err)
{
	*out = NULL;
	uint64_t epoch = 0;
	if (!cluster_is_head(d->p.cl, &epoch))
		return ds_err_set(err, DS_EBUSY, "this node is not the head");
	json_t *req = jsonx_parse(body, len, 8, err);
	const char *path = NULL, *names = NULL;
	int64_t max_ctx = 0;
	if (!json_is_object(req)) {
		json_decref(req);
		return ds_err_set(err, DS_EINVAL, "the body is not a JSON object");
	}
	if (jsonx_get_str(req, "model", 1, &path, err) ||
	    jsonx_get_str(req, "served_model_name", 0, &names, err) ||
	    jsonx_get_i64(req, "max_ctx", 0, 0, 1 << 24, &max_ctx, err)) {
		json_decref(req);
		return DS_EINVAL;
	}
	if (strlen(path) >= sizeof d->model || (names && strlen(names) >= sizeof d->names)) {
		json_decref(req);
		return ds_err_set(err, DS_EINVAL, "'model' or 'served_model_name' is too long");
	}
	pthread_mutex_lock(&d->mu);
	int busy = d->state == ST_LAUNCHING || d->state == ST_LOADING || d->job != JOB_NONE;
	pthread_mutex_unlock(&d->mu);
	if (busy) {
		json_decref(req);
		return ds_err_set(err, DS_ECONFLICT, "deployment %lld is still starting: wait for it, or "
				  "dsctl cluster down", (long long)d->id);
	}
	json_t *doc = NULL;
	int rc = cluster_plan_post(d->p.cl, 0, body, len, &doc, err);
	if (rc) {
		json_decref(req);
		*out = doc;
		return rc;
	}
	pthread_mutex_lock(&d->mu);
	if (d->state == ST_LAUNCHING || d->state == ST_LOADING || d->job != JOB_NONE) {
		pthread_mutex_unlock(&d->mu);
		json_decref(req);
		json_decref(doc);
		return ds_err_set(err, DS_ECONFLICT, "another deployment started meanwhile");
	}
	if (d->state != ST_NONE) { /* the running deployment's nodes: stopped at launch */
		d->n_old = d->n_nodes;
		memcpy(d->old, d->nodes, sizeof d->old);
	}
	rc = take_plan(d, doc, err);
	if (rc) {
		d->state = d->state == ST_NONE ? ST_NONE : ST_FAILED;
		pthread_mutex_unlock(&d->mu);
		json_decref(req);
		json_decref(doc);
		return rc;
	}
	json_decref(d->plan);
	d->plan = json_incref(doc);
	d->id = json_integer_value(json_object_get(doc, "version"));
	d->epoch = epoch;
	snprintf(d->job_id, sizeof d->job_id, "deploy-%lld-e%llu", (long long)d->id,
		 (unsigned long long)epoch);
	ds_strlcpy(d->model, path, sizeof d->model);
	d->has_names = names != NULL;
	ds_strlcpy(d->names, names ? names : "", sizeof d->names);
	const json_t *kv = json_object_get(doc, "kv");
	int plan_ctx = (int)json_integer_value(json_object_get(kv, "max_ctx"));
	int plan_seqs = (int)json_integer_value(json_object_get(kv, "concurrency"));
	d->max_ctx = max_ctx ? plan_ctx : (d->p.ctx > 0 && d->p.ctx < plan_ctx ? d->p.ctx : plan_ctx);
	d->max_seqs = plan_seqs > 0 && plan_seqs < d->p.max_running ? plan_seqs : d->p.max_running;
	d->threads = threads_per_rank(d);
	d->collected = 0;
	d->dispatched = 0;
	d->error[0] = 0;
	d->failed_node[0] = 0;
	d->failed_rank = -1;
	d->t_post = ds_now_s();
	d->t_ready = 0;
	free(d->request_text);
	d->request_text = strndup(body, len);
	json_decref(d->remembered); /* this node's own, for when it is head again */
	d->remembered = json_incref(req);
	d->remembered_epoch = epoch;
	d->state = ST_LAUNCHING;
	d->job = JOB_UP;
	pthread_cond_broadcast(&d->cv);
	int64_t id = d->id;
	pthread_mutex_unlock(&d->mu);
	plan_status(d, id, epoch, "launching", NULL);
	serve_refuse(d->p.sv, "deploying", "a deployment is starting: retry shortly");
	json_decref(req);
	*out = json_pack("{s:I,s:s,s:o,s:s}", "deployment", (json_int_t)id, "state", "launching",
			 "plan", doc, "source", "head");
	return DS_OK;
}

int deploy_down(deploy *d, json_t **out, ds_err *err)
{
	*out = NULL;
	if (!cluster_is_head(d->p.cl, NULL))
		return ds_err_set(err, DS_EBUSY, "this node is not the head");
	pthread_mutex_lock(&d->mu);
	int loading = d->state == ST_LAUNCHING || d->state == ST_LOADING;
	dnode nodes[NODES_MAX];
	int n = d->n_nodes;
	memcpy(nodes, d->nodes, sizeof nodes);
	if (loading) { /* the load ends with its ranks, then the stop runs */
		d->state = ST_FAILED;
		ds_strlcpy(d->error, "stopped while loading (dsctl cluster down)", sizeof d->error);
	}
	pthread_mutex_unlock(&d->mu);
	if (loading) {
		stop_ranks(d, nodes, n, 0);
		driver_signal_teardown(); /* rank 0 too: the load ends now */
	}
	pthread_mutex_lock(&d->mu);
	while (d->job != JOB_NONE) /* a queued job first */
		pthread_cond_wait(&d->cv, &d->mu);
	d->job = JOB_DOWN;
	int target = d->job_done + 1;
	pthread_cond_broadcast(&d->cv);
	while (d->job_done < target && !d->stop)
		pthread_cond_wait(&d->cv, &d->mu);
	pthread_mutex_unlock(&d->mu);
	*out = deploy_status(d);
	return DS_OK;
}

/* One rank's object (under mu). */
static json_t *rank_json(const deploy *d, int r)
{
	const drank *k = &d->ranks[r];
	const char *st;
	int pid = k->pid;
	if (r == 0) {
		st = d->state == ST_SERVING ? "ready" : d->state == ST_LOADING ? "loading"
			: d->state == ST_LAUNCHING ? "starting" : "stopped";
	} else if (!k->proc[0]) {
		st = d->dispatched && d->state != ST_FAILED ? "loading" : "starting";
	} else if (strcmp(k->proc, "running") == 0) {
		st = d->state == ST_SERVING ? "ready" : d->state == ST_LOADING ? "loading"
										: "running";
	} else {
		st = k->proc;
	}
	json_t *j = json_pack("{s:i,s:s}", "rank", r, "state", st);
	json_object_set_new(j, "loaded_bytes", k->loaded >= 0 ? json_integer(k->loaded) : json_null());
	json_object_set_new(j, "total_bytes", k->total >= 0 ? json_integer(k->total) : json_null());
	json_object_set_new(j, "pid", pid > 0 ? json_integer(pid) : json_null());
	if (strcmp(st, "exited") == 0)
		json_object_set_new(j, "exit_code", json_integer(k->exit_code));
	if (strcmp(st, "killed") == 0)
		json_object_set_new(j, "signal", json_integer(k->sig));
	return j;
}

static const char *url_host(const char *bind, const char *addr)
{
	return bind && strcmp(bind, "0.0.0.0") != 0 && bind[0] ? bind : addr;
}

json_t *deploy_status(deploy *d)
{
	int pid0 = serve_rank_pid(d->p.sv, 0);
	pthread_mutex_lock(&d->mu);
	if (d->state == ST_SERVING && pid0 > 0)
		d->ranks[0].pid = pid0;
	json_t *v = json_pack("{s:s,s:s}", "source", "head", "state", state_names[d->state]);
	if (d->state == ST_NONE) {
		json_object_set_new(v, "deployment", json_null());
		pthread_mutex_unlock(&d->mu);
		return v;
	}
	const char *addr = d->nodes[0].addr;
	char api[256], control[256];
	snprintf(api, sizeof api, "http://%s:%d/v1", url_host(d->p.api_host, addr), d->p.api_port);
	snprintf(control, sizeof control, "http://%s:%d", url_host(d->p.control_host, addr),
		 d->p.control_port);
	json_object_set_new(v, "deployment", json_integer(d->id));
	json_object_set_new(v, "model", json_string(d->model));
	json_object_set_new(v, "served_model_name",
			    d->has_names ? json_string(d->names) : json_null());
	json_object_set_new(v, "tp", json_integer(d->tp));
	json_object_set_new(v, "pp", json_integer(d->pp));
	json_object_set_new(v, "ep", json_integer(d->ep));
	json_object_set_new(v, "world", json_integer(d->W));
	json_object_set_new(v, "max_ctx", json_integer(d->max_ctx));
	json_object_set_new(v, "max_seqs", json_integer(d->max_seqs));
	json_object_set_new(v, "threads_per_rank", json_integer(d->threads));
	json_object_set_new(v, "epoch", json_integer((json_int_t)d->epoch));
	json_object_set_new(v, "job", json_string(d->job_id));
	json_object_set_new(v, "error", d->error[0] ? json_string(d->error) : json_null());
	json_object_set_new(v, "failed_node",
			    d->failed_node[0] ? json_string(d->failed_node) : json_null());
	json_object_set_new(v, "failed_rank",
			    d->failed_rank >= 0 ? json_integer(d->failed_rank) : json_null());
	json_object_set_new(v, "api_url", json_string(api));
	json_object_set_new(v, "control_url", json_string(control));
	json_object_set_new(v, "admin_token_file", json_string(d->token_file));
	json_object_set_new(v, "elapsed_s", json_real(ds_now_s() - d->t_post));
	json_object_set_new(v, "ready_s",
			    d->t_ready > 0 ? json_real(d->t_ready - d->t_post) : json_null());
	json_t *nodes = json_array();
	for (int i = 0; i < d->n_nodes; i++) {
		json_t *rs = json_array();
		for (int r = 0; r < d->W; r++)
			if (d->ranks[r].node == i)
				json_array_append_new(rs, rank_json(d, r));
		json_array_append_new(nodes, json_pack("{s:s,s:s,s:o}", "name", d->nodes[i].name,
						       "address", d->nodes[i].addr, "ranks", rs));
	}
	json_object_set_new(v, "nodes", nodes);
	pthread_mutex_unlock(&d->mu);
	return v;
}

json_t *deploy_node_ranks(deploy *d, const char *name)
{
	json_t *rs = NULL;
	pthread_mutex_lock(&d->mu);
	for (int i = 0; d->state != ST_NONE && i < d->n_nodes && !rs; i++) {
		if (strcmp(d->nodes[i].name, name) != 0)
			continue;
		rs = json_array();
		for (int r = 0; r < d->W; r++)
			if (d->ranks[r].node == i)
				json_array_append_new(rs, rank_json(d, r));
	}
	pthread_mutex_unlock(&d->mu);
	return rs;
}

void deploy_remember(deploy *d, const json_t *request, uint64_t epoch)
{
	if (!json_is_object(request) || !json_is_string(json_object_get(request, "model")))
		return;
	pthread_mutex_lock(&d->mu);
	if (epoch >= d->remembered_epoch) {
		json_decref(d->remembered);
		d->remembered = json_deep_copy(request);
		d->remembered_epoch = epoch;
	}
	pthread_mutex_unlock(&d->mu);
}

void deploy_forget(deploy *d)
{
	pthread_mutex_lock(&d->mu);
	json_decref(d->remembered);
	d->remembered = NULL;
	pthread_mutex_unlock(&d->mu);
}
