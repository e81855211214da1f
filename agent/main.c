/*
 * main.c - dsagent: the per-node agent.
 *
 * Start-up order (teardown is the reverse):
 *   options -> compute backend -> store (DATA_DIR/dsagent.db) -> key service
 *   -> admin token -> auth rule (no key on a non-loopback API address =
 *   refuse, unless --insecure-no-auth) -> cluster (discovery of this node
 *   into the store, the election: without --cluster-key a single-node
 *   cluster, its own head) -> gossip (only with --cluster-key;
 *   joins the --join seeds in the background, membership events go to the
 *   store) -> control API -> OpenAI API (503
 *   "loading") -> cluster threads (election, inventory) -> load model +
 *   scheduler -> ready -> sd_notify(READY=1) ->
 *   wait for SIGINT/SIGTERM -> stop: refuse new requests (503), leave the
 *   cluster, give running requests --shutdown-grace-ms to finish (a second
 *   signal cuts it short), end what still runs (streams with an error event
 *   and [DONE], unstreamed requests with 503), stop HTTP, stop the
 *   scheduler, free the model -> exit 0.
 * (docs/architecture.md, docs/cluster.md, docs/serving.md "Start-up and
 * shutdown").
 */
#include "agent/cluster/cluster.h"
#include "agent/api/control.h"
#include "agent/api/deploy.h"
#include "agent/cluster/gossip.h"
#include "agent/node/discover.h"
#include "agent/api/http.h"
#include "agent/auth/clusterkey_file.h"
#include "agent/auth/keys.h"
#include "agent/options.h"
#include "agent/launch/launch.h"
#include "agent/plan/plan.h"
#include "agent/api/serve.h"
#include "agent/store/store.h"
#include "common/log.h"
#include "common/strutil.h"
#include "engine/engine.h"
#include "worker/worker.h"

#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <systemd/sd-daemon.h>

static void usage(FILE *f)
{
	fprintf(f, "usage: dsagent [options]\n"
		   "       dsagent worker [options]   (a rank process: dsagent worker --help)\n"
		   "       dsagent plan [options]     (a shard plan from inventories: dsagent plan --help)\n\n"
		   "Options (each also DSAGENT_<NAME> or 'name = value' in --config FILE):\n");
	cfg_print_help(agent_opts_table, "DSAGENT", f);
}

static void print_config(const agent_opts *o)
{
	char v[1024];
	for (const cfg_opt *t = agent_opts_table; t->name; t++) {
		if (cfg_get(agent_opts_table, o, t->name, v, sizeof v) == DS_OK)
			printf("%s = %s\n", t->name, v);
	}
}

/* --model, else the embedded default model (models/default.gguf, which
 * `make model` fetches, relative to the working directory). */
static const char *model_path(const agent_opts *o)
{
	return o->model ? o->model : "models/default.gguf";
}

/* The limits of both HTTP servers (docs/serving.md, "Timeouts and limits of
 * the HTTP servers"). */
static void http_limits(const agent_opts *o, const char *name, http_params *p)
{
	p->name = name;
	p->max_conns = o->http_max_conns;
	p->max_conns_per_addr = o->http_max_conns_per_addr;
	p->header_timeout_s = o->http_header_timeout_s;
	p->keepalive_timeout_s = o->http_keepalive_timeout_s;
	p->timeout_s = o->http_timeout_s;
	p->max_body_total = (size_t)o->http_max_body_total_mb << 20;
}

/* Every HTTP connection holds a descriptor: the soft limit (often 1024) is
 * raised to the hard one so both servers' connections fit; a warning when
 * even the hard limit is short of them. */
static void raise_nofile(const agent_opts *o)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
		return;
	rlim_t want = 2 * ((rlim_t)o->http_max_conns + (rlim_t)o->http_max_conns / 4 + 16) + 256;
	if (rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
			getrlimit(RLIMIT_NOFILE, &rl);
	}
	if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want)
		log_warn("agent", "the descriptor limit is below what the HTTP servers may hold",
			 "nofile=%llu wanted=%llu (raise the hard limit, or lower "
			 "--http-max-conns)",
			 (unsigned long long)rl.rlim_cur, (unsigned long long)want);
}

/* Where membership events go: the store's event log and the cluster's
 * member_events (gossip logs them itself). */
struct member_sink {
	store *st;
	cluster *cl;
};

static void on_member_event(void *ud, const gossip_event *ev)
{
	const struct member_sink *sink = ud;
	char detail[512];
	ds_err e = {0};
	gossip_event_json(ev, detail, sizeof detail);
	if (store_event_add(sink->st, (int64_t)time(NULL), gossip_event_name(ev->kind), detail,
			    &e))
		log_warn("agent", "cannot record a membership event", "error=\"%s\"", e.msg);
	cluster_member_event(sink->cl, ev);
}

/* Gossip membership (--cluster-key): key file, node id, seeds, and the
 * metadata the cluster builds (the cluster is its only writer).  NULL with
 * err when it cannot start (the agent then refuses to start). */
static gossip *start_gossip(const agent_opts *o, cluster *cl, struct member_sink *sink,
			    ds_err *err)
{
	clusterkey_ring keys;
	gossip_params gp = gossip_default_params();
	uint8_t mb[GOSSIP_META_MAX];
	gossip *g = NULL;
	if (clusterkey_file_load(o->cluster_key, &keys, err) != DS_OK)
		return NULL;
	if (gossip_node_id_load(o->data_dir, gp.node_id, NULL, err) == DS_OK &&
	    gossip_timing_profile(o->gossip_profile, &gp.timing, err) == DS_OK &&
	    cluster_meta_initial(cl, mb, sizeof mb, &gp.meta_len, err) == DS_OK) {
		gp.bind_addr = o->gossip_bind;
		gp.port = o->gossip_port;
		gp.advertise_addr = o->advertise_addr;
		gp.node_name = o->name;
		gp.keys = &keys;
		gp.seeds = o->join;
		gp.meta = mb;
		gp.on_event = on_member_event;
		gp.ud = sink;
		g = gossip_new(&gp, err);
	}
	clusterkey_wipe(&keys);
	return g;
}

/* The shutdown grace: returns once no request is in progress, grace_ms
 * passed, or a second stop signal came. */
static void wait_grace(serve *sv, const sigset_t *stop, int grace_ms)
{
	double t0 = ds_now_s(), until = t0 + grace_ms / 1000.0;
	while (serve_busy(sv) > 0 && ds_now_s() < until) {
		struct timespec ts = {0, 50 * 1000 * 1000};
		int sig = sigtimedwait(stop, NULL, &ts);
		if (sig > 0) {
			log_info("agent", "second stop signal: ending the requests now",
				 "signal=%d requests=%d", sig, serve_busy(sv));
			return;
		}
	}
	if (serve_busy(sv) > 0)
		log_info("agent", "grace period over: ending the requests still running",
			 "requests=%d waited_s=%.1f", serve_busy(sv), ds_now_s() - t0);
}

int main(int argc, char **argv)
{
	/* `dsagent worker ...` is the rank process (worker/worker.h), not an agent */
	if (argc > 1 && strcmp(argv[1], "worker") == 0)
		return worker_main(argc - 1, argv + 1);
	/* `dsagent plan ...` prints a shard plan and exits (agent/plan/plan.h) */
	if (argc > 1 && strcmp(argv[1], "plan") == 0)
		return plan_main(argc - 1, argv + 1);

	agent_opts opts;
	ds_err err = {0};
	http_server *control = NULL, *api = NULL;
	store *st = NULL;
	keys_svc *keys = NULL;
	serve *sv = NULL;
	gossip *gos = NULL;
	cluster *cl = NULL;
	launcher *lr = NULL;
	deploy *dep = NULL;
	struct member_sink sink = {0};
	char admin_token[KEYS_TOKEN_SIZE] = "";
	int rc = 0;

	/* Vocabulary-sized per-request buffers (sampler state) are allocated on
	 * many HTTP threads: served by mmap they return to the OS when freed
	 * instead of fragmenting per-thread arenas (steady RSS drift under load). */
	mallopt(M_MMAP_THRESHOLD, 128 * 1024);
	mallopt(M_ARENA_MAX, 4);
	if (agent_opts_load(&opts, argc, argv, &err) != DS_OK) {
		fprintf(stderr, "dsagent: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	if (opts.help) {
		usage(stdout);
		goto out;
	}
	if (opts.version) {
		printf("dsagent %s\n", eng_version());
		goto out;
	}
	if (opts.print_config) {
		print_config(&opts);
		goto out;
	}
	if (opts.discover) { /* the inventory as JSON on stdout, then exit */
		disc_params dp = disc_default_params();
		dp.sysroot = opts.sysroot;
		dp.fake_gpus = opts.fake_gpus;
		dp.nvml_lib = opts.nvml_lib;
		if ((rc = disc_print(&dp, stdout, &err)) != DS_OK) {
			fprintf(stderr, "dsagent: discovery: %s\n", err.msg);
			rc = rc == DS_EINVAL ? 2 : 1;
		}
		goto out;
	}

	raise_nofile(&opts);
	const kb_backend *be = eng_backend_choose(opts.backend, &err);
	if (!be) {
		fprintf(stderr, "dsagent: %s\n", err.msg);
		rc = 1;
		goto out;
	}

	if (!(st = store_open(opts.data_dir, &err)) || !(keys = keys_new(st, opts.data_dir, &err)) ||
	    keys_admin_token_load(opts.data_dir, admin_token, NULL, &err) != DS_OK) {
		fprintf(stderr, "dsagent: data directory %s: %s\n", opts.data_dir, err.msg);
		rc = 1;
		goto out;
	}
	log_info("agent", "store open", "db=%s admin_token=%s/admin.token keys=%zu",
		 store_path(st), opts.data_dir, keys_count(keys));
	if (!opts.insecure_no_auth && keys_count(keys) == 0 && !http_addr_is_loopback(opts.api_bind)) {
		fprintf(stderr,
			"dsagent: refusing to serve on %s with no API key: create one with "
			"`dsctl keys create NAME` (against an agent bound to 127.0.0.1), or pass "
			"--insecure-no-auth\n",
			opts.api_bind);
		rc = 1;
		goto out;
	}

	/* Block the stop signals before any thread starts, so only sigwait sees them. */
	sigset_t stop;
	sigemptyset(&stop);
	sigaddset(&stop, SIGINT);
	sigaddset(&stop, SIGTERM);
	pthread_sigmask(SIG_BLOCK, &stop, NULL);

	cluster_params cp = cluster_default_params();
	cp.node_name = opts.name;
	cp.data_dir = opts.data_dir;
	cp.version = eng_version();
	cp.store = st;
	cp.cluster_key = opts.cluster_key;
	cp.disc.sysroot = opts.sysroot;
	cp.disc.fake_gpus = opts.fake_gpus;
	cp.disc.nvml_lib = opts.nvml_lib;
	cp.expect = opts.expect;
	cp.settle_ms = opts.settle_ms;
	cp.lease_ms = opts.lease_ms;
	cp.health_ms = opts.health_ms;
	cp.eligible = opts.eligible;
	cp.priority = opts.priority;
	if (!(cl = cluster_new(&cp, &err))) {
		fprintf(stderr, "dsagent: cluster: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	sink.st = st;
	sink.cl = cl;
	if (opts.cluster_key && !(gos = start_gossip(&opts, cl, &sink, &err))) {
		fprintf(stderr, "dsagent: gossip: %s\n", err.msg);
		rc = 1;
		goto out;
	}

	if (!(lr = launcher_new(opts.data_dir, &err))) {
		fprintf(stderr, "dsagent: rank processes: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	control_ctx ctx = {
		.node_name = opts.name,
		.backend = be->name,
		.backend_desc = kb_describe(be),
		.started_s = ds_now_s(),
		.keys = keys, /* the admin routes of `dsctl keys` */
		.admin_token = admin_token,
		.gossip = gos,
		.test_faults = opts.test_fault_injection,
		.cluster = cl,
		.launcher = lr,
	};
	http_params hp = http_default_params();
	hp.bind_addr = opts.bind;
	hp.port = opts.control_port;
	hp.routes = control_routes;
	hp.ud = &ctx;
	http_limits(&opts, "control", &hp);
	control = http_server_new(&hp, &err);
	if (!control) {
		fprintf(stderr, "dsagent: control API: %s\n", err.msg);
		rc = 1;
		goto out;
	}

	serve_params sp = {0};
	/* a cluster member without --model waits for `dsctl cluster up` */
	int wait_deploy = opts.cluster_key && !opts.model;
	sp.model_path = wait_deploy ? NULL : model_path(&opts);
	sp.names = opts.served_model_name;
	sp.chat_template = opts.chat_template;
	sp.backend = opts.backend;
	sp.threads = opts.threads;
	sp.tp = opts.tp;
	sp.pp = opts.pp;
	sp.ep = opts.ep;
	sp.ctx = opts.ctx;
	sp.max_running = opts.max_running;
	sp.max_waiting = opts.max_waiting;
	sp.max_batch_tokens = opts.max_batch_tokens;
	sp.prefill_chunk = opts.prefill_chunk;
	sp.page_size = opts.page_size;
	sp.prefix_caching = opts.enable_prefix_caching;
	sp.kv_bytes = (size_t)opts.kv_cache_mb << 20;
	sp.kv_cache_dtype = opts.kv_cache_dtype;
	sp.auth = !opts.insecure_no_auth;
	sp.metrics_auth = opts.metrics_auth;
	sp.max_n = opts.max_n;
	sp.max_logprobs = opts.max_logprobs;
	sp.stats_log_ms = opts.stats_log_ms;
	sp.keys = keys;
	if (!(sv = serve_new(&sp, &err))) {
		fprintf(stderr, "dsagent: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	__atomic_store_n(&ctx.serve, sv, __ATOMIC_RELEASE);
	http_params ap = http_default_params();
	ap.bind_addr = opts.api_bind;
	ap.port = opts.api_port;
	ap.routes = serve_routes;
	ap.ud = sv;
	ap.max_body = (size_t)opts.max_body_kb << 10;
	http_limits(&opts, "api", &ap);
	ap.cors_origin = opts.cors_origin;
	if (!(api = http_server_new(&ap, &err))) {
		fprintf(stderr, "dsagent: OpenAI API: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	if (opts.insecure_no_auth)
		log_warn("agent", "serving without API keys", "api=%s:%d", opts.api_bind,
			 http_server_port(api));
	if (gos) { /* its own line, so parsers of the listening line keep working */
		char idh[GOSSIP_ID_HEX];
		gossip_member self;
		gossip_members(gos, &self, 1);
		gossip_id_hex(self.id, idh);
		printf("dsagent gossip=%s:%d node_id=%s\n", gossip_advertise_addr(gos),
		       gossip_port(gos), idh);
	}
	if (cluster_start(cl, gos, http_server_port(control), http_server_port(api), &err) !=
	    DS_OK) {
		fprintf(stderr, "dsagent: cluster: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	deploy_params dpp = {
		.cl = cl,
		.lr = lr,
		.sv = sv,
		.st = st,
		.data_dir = opts.data_dir,
		.control_host = opts.bind,
		.api_host = opts.api_bind,
		.control_port = http_server_port(control),
		.api_port = http_server_port(api),
		.threads = opts.threads,
		.ctx = opts.ctx,
		.max_running = opts.max_running,
	};
	if (!(dep = deploy_new(&dpp, &err))) {
		fprintf(stderr, "dsagent: deployments: %s\n", err.msg);
		rc = 1;
		goto out;
	}
	__atomic_store_n(&ctx.deploy, dep, __ATOMIC_RELEASE);
	/* One machine-readable line for scripts and tests that asked for port 0. */
	printf("dsagent listening control=%s:%d api=%s:%d\n", opts.bind,
	       http_server_port(control), opts.api_bind, http_server_port(api));
	fflush(stdout);
	if (wait_deploy) {
		log_info("agent", "ready", "name=%s control=%s:%d api=%s:%d model=none (waiting for "
			 "dsctl cluster up)", opts.name, opts.bind, http_server_port(control),
			 opts.api_bind, http_server_port(api));
		printf("dsagent waiting for a deployment (dsctl cluster up)\n");
		fflush(stdout);
		sd_notify(0, "READY=1");
	} else if (serve_load(sv, &err) != DS_OK) {
		fprintf(stderr, "dsagent: model %s: %s\n", sp.model_path, err.msg);
		rc = 1;
		goto out;
	} else {
		log_info("agent", "ready", "name=%s control=%s:%d api=%s:%d model=%s backend=%s",
			 opts.name, opts.bind, http_server_port(control), opts.api_bind,
			 http_server_port(api), sv->names[0], be->name);
		printf("dsagent serving model=%s\n", sv->names[0]);
		fflush(stdout);
		sd_notify(0, "READY=1");
	}

	int sig = 0;
	sigwait(&stop, &sig);
	sd_notify(0, "STOPPING=1");
	serve_drain(sv); /* new requests get 503 from now on */
	log_info("agent", "stopping", "signal=%d requests=%d grace_ms=%d", sig, serve_busy(sv),
		 opts.shutdown_grace_ms);
	if (gos)
		gossip_leave(gos, 250); /* the others mark us left, not failed */
	wait_grace(sv, &stop, opts.shutdown_grace_ms);
out:
	serve_stop(sv); /* what still runs ends: an error event + [DONE], or a 503 */
	if (sv && !serve_wait_idle(sv, 3000))
		log_warn("agent", "requests still open after the stop", "requests=%d",
			 serve_busy(sv));
	http_server_free(api);
	http_server_free(control);
	deploy_free(dep); /* the deployment's ranks on every node stop */
	launcher_free(lr); /* the ranks of a plan go with the agent */
	cluster_free(cl); /* its threads use gossip: stopped first */
	gossip_free(gos);
	serve_free(sv);
	keys_free(keys);
	store_close(st);
	sodium_memzero(admin_token, sizeof admin_token);
	agent_opts_free(&opts);
	return rc;
}
