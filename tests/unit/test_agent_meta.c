/*
 * test_agent_meta.c - what peers see of a real dsagent's gossip metadata
 * (docs/cluster.md, "Gossip"; agent/cluster/cluster.c invariant 5).
 *
 * An in-process gossip instance is the seed; a real dsagent process joins it
 * with --eligible 0 --priority 7.  The seed's event callback records every
 * version of the agent's metadata it ever receives, from the first join on,
 * and each one must say eligible 0 and priority 7: there is no window in
 * which the agent advertises the defaults (eligible 1, priority 0).
 *
 * The binary comes from $DS_BUILD (default build/), the model from
 * models/default.gguf, both relative to the working directory (the
 * repository root, as for the integration tests); without them the test is
 * skipped.  Names start with agent_meta_.
 */
#include "agent/auth/clusterkey_file.h"
#include "agent/cluster/gossip.h"
#include "tests/unit/unit.h"

#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WATCHED "watched"

/* Every metadata version of the member named WATCHED the seed received. */
struct meta_log {
	pthread_mutex_t mu;
	int versions;   /* events that carried its metadata */
	int bad;        /* ... of which not eligible 0 / priority 7 */
	int no_meta;    /* ... events with no metadata at all */
	int with_ports; /* ... versions that carry the control port */
	int first_eligible, first_priority;
};

static void on_seed_event(void *ud, const gossip_event *ev)
{
	struct meta_log *l = ud;
	gossip_meta md;
	if (strcmp(ev->member.name, WATCHED) != 0)
		return;
	pthread_mutex_lock(&l->mu);
	if (!ev->member.meta_len) {
		l->no_meta++;
	} else if (gossip_meta_decode(ev->member.meta, ev->member.meta_len, &md, NULL) != DS_OK) {
		l->bad++;
	} else {
		if (l->versions == 0) {
			l->first_eligible = md.eligible;
			l->first_priority = md.priority;
		}
		l->versions++;
		l->bad += md.eligible != 0 || md.priority != 7;
		l->with_ports += md.control_port != 0;
	}
	pthread_mutex_unlock(&l->mu);
}

static void sleep_ms(int ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static int write_key(const char *path, const uint8_t key[32])
{
	char b64[64], text[128];
	sodium_bin2base64(b64, sizeof b64, key, 32, sodium_base64_VARIANT_ORIGINAL);
	int n = snprintf(text, sizeof text, "dsck1:2a:%s\n", b64);
	FILE *f = fopen(path, "w");
	if (!f)
		return -1;
	chmod(path, 0600);
	int ok = fwrite(text, 1, (size_t)n, f) == (size_t)n;
	return fclose(f) == 0 && ok ? 0 : -1;
}

/* Starts DS_BUILD/dsagent joining seed_port; its output goes to files in dir. */
static pid_t spawn_agent(const char *bin, const char *dir, const char *key, int seed_port)
{
	char data[600], join[64], out[600];
	snprintf(data, sizeof data, "%s/data", dir);
	snprintf(join, sizeof join, "127.0.0.1:%d", seed_port);
	snprintf(out, sizeof out, "%s/agent.log", dir);
	mkdir(data, 0700);
	pid_t pid = fork();
	if (pid != 0)
		return pid;
	FILE *f = freopen(out, "w", stdout);
	if (f)
		dup2(fileno(stdout), 2);
	char *argv[] = {(char *)bin, "--name", WATCHED, "--bind", "127.0.0.1",
			"--control-port", "0", "--api-port", "0", "--data-dir", data,
			"--backend", "cpu", "--threads", "1", "--kv-cache-mb", "8",
			"--model", "models/default.gguf", "--cluster-key", (char *)key,
			"--gossip-bind", "127.0.0.1", "--gossip-port", "0",
			"--gossip-profile", "test", "--join", join,
			"--eligible=false", "--priority", "7", NULL};
	execv(bin, argv);
	_exit(127);
}

static void print_log(const char *dir)
{
	char path[600], line[512];
	snprintf(path, sizeof path, "%s/agent.log", dir);
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	while (fgets(line, sizeof line, f))
		fprintf(stderr, "    dsagent: %s", line);
	fclose(f);
}

TEST(agent_meta_peers_never_see_defaults)
{
	const char *build = getenv("DS_BUILD");
	char bin[512];
	snprintf(bin, sizeof bin, "%s/dsagent", build && *build ? build : "build");
	if (access(bin, X_OK) != 0)
		UT_SKIP("%s is not built", bin);
	if (access("models/default.gguf", R_OK) != 0)
		UT_SKIP("models/default.gguf is missing (`make model`)");
	CHECK(sodium_init() >= 0);
	char *dir = ut_tmpdir_new("agent-meta");
	if (!dir)
		return;
	char key_path[600];
	snprintf(key_path, sizeof key_path, "%s/cluster.key", dir);
	uint8_t key[32];
	for (size_t i = 0; i < sizeof key; i++)
		key[i] = (uint8_t)ut_rand_u64();
	CHECK_EQ(write_key(key_path, key), 0);
	clusterkey_ring ring;
	ds_err e = {0};
	CHECK_EQ(clusterkey_file_load(key_path, &ring, &e), DS_OK);

	struct meta_log log = {.first_eligible = -1, .first_priority = -1};
	pthread_mutex_init(&log.mu, NULL);
	gossip_params p = gossip_default_params();
	CHECK_EQ(gossip_timing_profile("test", &p.timing, NULL), DS_OK);
	p.bind_addr = "127.0.0.1";
	p.port = 0;
	for (size_t i = 0; i < sizeof p.node_id; i++)
		p.node_id[i] = (uint8_t)ut_rand_u64();
	p.node_name = "seed";
	p.keys = &ring;
	p.on_event = on_seed_event;
	p.ud = &log;
	gossip *seed = gossip_new(&p, &e);
	CHECK(seed != NULL);
	pid_t pid = -1;
	if (!seed)
		goto out;
	pid = spawn_agent(bin, dir, key_path, gossip_port(seed));
	CHECK(pid > 0);
	/* until the version with the ports arrived, then a little longer for
	 * whatever the election publishes next */
	for (int t = 0; t < 400; t++) {
		pthread_mutex_lock(&log.mu);
		int ports = log.with_ports;
		pthread_mutex_unlock(&log.mu);
		if (ports)
			break;
		if (pid > 0 && waitpid(pid, NULL, WNOHANG) == pid) {
			pid = -1;
			break;
		}
		sleep_ms(50);
	}
	sleep_ms(500);
out:
	if (pid > 0) {
		kill(pid, SIGTERM);
		waitpid(pid, NULL, 0);
	}
	gossip_free(seed);
	clusterkey_wipe(&ring);
	pthread_mutex_lock(&log.mu);
	CHECK(log.versions >= 1);
	CHECK(log.with_ports >= 1);
	CHECK_EQ(log.no_meta, 0);
	CHECK_EQ(log.bad, 0);
	CHECK_EQ(log.first_eligible, 0);
	CHECK_EQ(log.first_priority, 7);
	int seen = log.versions;
	pthread_mutex_unlock(&log.mu);
	pthread_mutex_destroy(&log.mu);
	if (!seen) /* show why the agent did not join */
		print_log(dir);
	ut_tmpdir_free(dir);
}
