/*
 * options.c - the dsagent option table (see options.h).  The table is the
 * single source for flag parsing, the config file, DSAGENT_* variables,
 * --help and --print-config.  Called once from main before anything starts.
 */
#include "agent/options.h"
#include "agent/node/discover.h"
#include "common/log.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define O(f) offsetof(agent_opts, f)

const cfg_opt agent_opts_table[] = {
	{.name = "name", .type = CFG_STR, .offset = O(name), .def = NULL, .min = 1, .max = 0,
	 .help = "node name (default: the hostname)"},
	{.name = "bind", .type = CFG_STR, .offset = O(bind), .def = "127.0.0.1", .min = 1,
	 .max = 0, .help = "IPv4 address the control API listens on"},
	{.name = "control-port", .type = CFG_INT, .offset = O(control_port), .def = "7481",
	 .min = 0, .max = 65535,
	 .help = "port of the control API (0 = any free port, printed at start)"},
	{.name = "data-dir", .type = CFG_STR, .offset = O(data_dir), .def = "/var/lib/dsagent",
	 .min = 1, .max = 0, .help = "directory of the agent's state (database, admin token)"},
	{.name = "backend", .type = CFG_STR, .offset = O(backend), .def = "auto", .min = 1,
	 .max = 0, .help = "compute backend: auto, cpu or cuda"},
	{.name = "log-level", .type = CFG_STR, .offset = O(log_level), .def = "info", .min = 1,
	 .max = 0, .help = "debug, info, warn or error"},
	{.name = "model", .type = CFG_STR, .offset = O(model), .def = NULL, .min = 1, .max = 0,
	 .help = "model to serve: checkpoint directory or .gguf file (default: the embedded "
		 "default model, models/default.gguf)"},
	{.name = "served-model-name", .type = CFG_STR, .offset = O(served_model_name), .def = NULL,
	 .min = 1, .max = 0,
	 .help = "NAME[,ALIAS...] clients may use as 'model' (default: the model file's base "
		 "name)"},
	{.name = "api-bind", .type = CFG_STR, .offset = O(api_bind), .def = "127.0.0.1", .min = 1,
	 .max = 0, .help = "IPv4 address the OpenAI API listens on"},
	{.name = "api-port", .type = CFG_INT, .offset = O(api_port), .def = "8000", .min = 0,
	 .max = 65535, .help = "port of the OpenAI API (0 = any free port, printed at start)"},
	{.name = "insecure-no-auth", .type = CFG_BOOL, .offset = O(insecure_no_auth),
	 .def = "false", .min = 1, .max = 0,
	 .help = "serve without API keys (refused otherwise on a non-loopback address with no "
		 "key)"},
	{.name = "metrics-auth", .type = CFG_BOOL, .offset = O(metrics_auth), .def = "false",
	 .min = 1, .max = 0, .help = "require an API key on GET /metrics too"},
	{.name = "cors-origin", .type = CFG_STR, .offset = O(cors_origin), .def = NULL, .min = 1,
	 .max = 0,
	 .help = "send CORS headers allowing this origin ('*' for any; default: no CORS headers)"},
	{.name = "chat-template", .type = CFG_STR, .offset = O(chat_template), .def = NULL,
	 .min = 1, .max = 0,
	 .help = "chat template override: deepseek-v3, deepseek-r1, chatml, smollm2, llama3"},
	{.name = "threads", .type = CFG_INT, .offset = O(threads), .def = "0", .min = 0,
	 .max = 1024, .help = "CPU compute threads (0 = one per core)"},
	{.name = "tp", .type = CFG_INT, .offset = O(tp), .def = "1", .min = 1, .max = 256,
	 .help = "serve the model as rank processes on this machine: tensor-parallel ranks"},
	{.name = "pp", .type = CFG_INT, .offset = O(pp), .def = "1", .min = 1, .max = 256,
	 .help = "pipeline stages (rank processes on this machine)"},
	{.name = "ep", .type = CFG_INT, .offset = O(ep), .def = "1", .min = 1, .max = 256,
	 .help = "expert-parallel groups (rank processes on this machine)"},
	{.name = "ctx", .type = CFG_INT, .offset = O(ctx), .def = "0", .min = 0, .max = 1 << 24,
	 .help = "longest sequence, prompt + output (0 = the model's, at most 4096)"},
	{.name = "max-running", .type = CFG_INT, .offset = O(max_running), .def = "64", .min = 1,
	 .max = 4096, .help = "sequences decoded together (continuous batching)"},
	{.name = "max-waiting", .type = CFG_INT, .offset = O(max_waiting), .def = "256", .min = 0,
	 .max = 1 << 20, .help = "queued requests beyond which new ones get 503 + Retry-After"},
	{.name = "max-batch-tokens", .type = CFG_INT, .offset = O(max_batch_tokens), .def = "512",
	 .min = 16, .max = 1 << 16,
	 .help = "tokens per engine step (decode tokens + prefill chunks)"},
	{.name = "prefill-chunk", .type = CFG_INT, .offset = O(prefill_chunk), .def = "256",
	 .min = 1, .max = 1 << 16,
	 .help = "prompt tokens of one request per step (chunked prefill)"},
	{.name = "page-size", .type = CFG_INT, .offset = O(page_size), .def = "16", .min = 1,
	 .max = 4096, .help = "positions per KV-cache page"},
	{.name = "enable-prefix-caching", .type = CFG_BOOL, .offset = O(enable_prefix_caching),
	 .def = "true", .min = 1, .max = 0,
	 .help = "reuse the KV pages of earlier prompts that start the same way (automatic "
		 "prefix caching; --no-enable-prefix-caching turns it off)"},
	{.name = "kv-cache-dtype", .type = CFG_STR, .offset = O(kv_cache_dtype), .def = "auto", .min = 1,
	 .help = "KV cache elements: auto (llama-family K/V in f16, as llama.cpp's default cache; "
		 "DeepSeek's MLA latent rows in f32), f16 or f32"},
	{.name = "kv-cache-mb", .type = CFG_INT, .offset = O(kv_cache_mb), .def = "1024", .min = 1,
	 .max = 1 << 24, .help = "KV-cache memory cap in MiB (pages beyond it preempt)"},
	{.name = "max-body-kb", .type = CFG_INT, .offset = O(max_body_kb), .def = "2048", .min = 1,
	 .max = 1 << 20, .help = "largest request body in KiB (413 beyond)"},
	{.name = "http-max-conns", .type = CFG_INT, .offset = O(http_max_conns), .def = "1024",
	 .min = 1, .max = 65536,
	 .help = "connections each HTTP server (API, control) holds at once; when full, the "
		 "oldest one that has not sent a whole request yet is closed to make room"},
	{.name = "http-max-conns-per-addr", .type = CFG_INT, .offset = O(http_max_conns_per_addr),
	 .def = "256", .min = 0, .max = 65536,
	 .help = "connections one client address holds on each HTTP server (0 = no limit)"},
	{.name = "http-header-timeout-s", .type = CFG_INT, .offset = O(http_header_timeout_s),
	 .def = "10", .min = 1, .max = 3600,
	 .help = "request headers must be complete this long after the connection opened or "
		 "its previous response ended (else 408 and closed)"},
	{.name = "http-keepalive-timeout-s", .type = CFG_INT,
	 .offset = O(http_keepalive_timeout_s), .def = "5", .min = 1, .max = 3600,
	 .help = "a connection idle this long between requests is closed"},
	{.name = "http-timeout-s", .type = CFG_INT, .offset = O(http_timeout_s), .def = "600",
	 .min = 1, .max = 86400,
	 .help = "a request whose upload or answer moves no byte this long is dropped"},
	{.name = "http-max-body-total-mb", .type = CFG_INT, .offset = O(http_max_body_total_mb),
	 .def = "256", .min = 1, .max = 1 << 20,
	 .help = "request bodies each HTTP server buffers at once, all connections (503 + "
		 "Retry-After beyond)"},
	{.name = "max-n", .type = CFG_INT, .offset = O(max_n), .def = "16", .min = 1, .max = 128,
	 .help = "largest 'n' (choices per request)"},
	{.name = "max-logprobs", .type = CFG_INT, .offset = O(max_logprobs), .def = "20", .min = 0,
	 .max = 20, .help = "largest 'top_logprobs'"},
	{.name = "shutdown-grace-ms", .type = CFG_INT, .offset = O(shutdown_grace_ms),
	 .def = "5000", .min = 0, .max = 3600000,
	 .help = "on SIGTERM/SIGINT: new requests get 503 at once, running ones get this long "
		 "to finish, then each open stream ends with an error event and [DONE] (a second "
		 "signal ends them at once)"},
	{.name = "stats-log-ms", .type = CFG_INT, .offset = O(stats_log_ms), .def = "10000",
	 .min = 0, .max = 3600000,
	 .help = "while requests run, log a throughput line (tokens/s in and out, running, "
		 "waiting) this often (0 = never)"},
	{.name = "sysroot", .type = CFG_STR, .offset = O(sysroot), .def = "/", .min = 1, .max = 0,
	 .help = "discovery reads /proc, /sys and /etc under this directory (tests: a fixture "
		 "tree)"},
	{.name = "fake-gpus", .type = CFG_STR, .offset = O(fake_gpus), .def = NULL, .min = 1,
	 .max = 0,
	 .help = "replace NVML by N fake GPUs: NxMODEL-MEMGB[:nvswitch|nvlink|pcie] (e.g. "
		 "8xH100-80GB:nvswitch) or 0 (docs/cluster.md)"},
	{.name = "nvml-lib", .type = CFG_STR, .offset = O(nvml_lib), .def = NULL, .min = 1,
	 .max = 0,
	 .help = "NVML library to dlopen (default libnvidia-ml.so.1, not loaded under a "
		 "--sysroot; tests pass a fake)"},
	{.name = "discover", .type = CFG_BOOL, .offset = O(discover), .def = "false", .min = 1,
	 .max = 0,
	 .help = "print this node's inventory (host, GPUs, IB ports, NICs, links) as JSON and "
		 "exit"},
	{.name = "cluster-key", .type = CFG_STR, .offset = O(cluster_key), .def = NULL, .min = 1,
	 .max = 0,
	 .help = "cluster key file (mode 0600; `dsctl cluster init` makes one): turns on gossip "
		 "membership; without it the agent runs as a single node"},
	{.name = "gossip-bind", .type = CFG_STR, .offset = O(gossip_bind), .def = "0.0.0.0",
	 .min = 1, .max = 0, .help = "IPv4 address of the gossip UDP and TCP sockets"},
	{.name = "gossip-port", .type = CFG_INT, .offset = O(gossip_port), .def = "7946", .min = 0,
	 .max = 65535, .help = "gossip UDP and TCP port (0 = any free port, printed at start)"},
	{.name = "join", .type = CFG_STR, .offset = O(join), .def = NULL, .min = 1, .max = 0,
	 .help = "HOST:PORT[,HOST:PORT...] of members to join (retried with backoff)"},
	{.name = "advertise-addr", .type = CFG_STR, .offset = O(advertise_addr), .def = NULL,
	 .min = 1, .max = 0,
	 .help = "IPv4 address other members reach this node's gossip port at (default: "
		 "--gossip-bind, or the first non-loopback address when that is 0.0.0.0)"},
	{.name = "gossip-profile", .type = CFG_STR, .offset = O(gossip_profile), .def = "lan",
	 .min = 1, .max = 0,
	 .help = "gossip timers: lan (memberlist LAN defaults) or test (fast, for tests on one "
		 "machine)"},
	{.name = "test-fault-injection", .type = CFG_BOOL, .offset = O(test_fault_injection),
	 .def = "false", .min = 1, .max = 0,
	 .help = "TEST ONLY: enable POST /v1/cluster/test/drop (cuts gossip with named peers) "
		 "and POST /v1/test/fail-steps (makes engine steps fail)"},
	{.name = "expect", .type = CFG_INT, .offset = O(expect), .def = "0", .min = 0, .max = 1000,
	 .help = "cluster size N: no head before N members are alive, and a head needs the votes "
		 "of a majority of N (0 = no election; without --cluster-key the node is its own "
		 "head)"},
	{.name = "settle-ms", .type = CFG_INT, .offset = O(settle_ms), .def = "3000", .min = 0,
	 .max = 600000,
	 .help = "formation: the member list must not change for this long before the first "
		 "election"},
	{.name = "lease-ms", .type = CFG_INT, .offset = O(lease_ms), .def = "5000", .min = 100,
	 .max = 600000,
	 .help = "head lease: the head renews it every lease/3 with a majority's acks and steps "
		 "down without them; followers stand only after this long without a heartbeat"},
	{.name = "eligible", .type = CFG_BOOL, .offset = O(eligible), .def = "true", .min = 1,
	 .max = 0, .help = "this node may become head (--eligible=false: it only votes)"},
	{.name = "priority", .type = CFG_INT, .offset = O(priority), .def = "0", .min = -1000000,
	 .max = 1000000,
	 .help = "head candidacy order: higher priority first, then the lower node id"},
	{.name = "health-ms", .type = CFG_INT, .offset = O(health_ms), .def = "10000", .min = 200,
	 .max = 3600000,
	 .help = "how often the node rediscovers itself and the head refreshes every member's "
		 "health"},
	{.name = "print-config", .type = CFG_BOOL, .offset = O(print_config), .def = "false",
	 .min = 1, .max = 0,
	 .help = "print the effective configuration as 'key = value' lines and exit"},
	{.name = "version", .type = CFG_BOOL, .offset = O(version), .def = "false", .min = 1,
	 .max = 0, .help = "print the version and exit"},
	{.name = "help", .type = CFG_BOOL, .offset = O(help), .def = "false", .min = 1, .max = 0,
	 .help = "this help", .short_flag = 'h'},
	{.name = NULL},
};

int agent_opts_load(agent_opts *o, int argc, char **argv, ds_err *err)
{
	int next = 0;
	int rc = cfg_load(agent_opts_table, o, "DSAGENT", argc, argv, 1, &next, err);
	if (rc)
		return rc;
	if (next < argc)
		return ds_err_set(err, DS_EINVAL, "unexpected argument '%s' (see --help)",
				  argv[next]);
	enum log_level lv;
	if (log_level_parse(o->log_level, &lv) != DS_OK)
		return ds_err_set(err, DS_EINVAL,
				  "--log-level=%s is not one of debug, info, warn, error, off",
				  o->log_level);
	log_set_level(lv);
	if (!o->cluster_key && o->join)
		return ds_err_set(err, DS_EINVAL,
				  "--join needs --cluster-key FILE (gossip runs only with a cluster "
				  "key; `dsctl cluster init` makes one)");
	if (!o->cluster_key && o->expect > 1)
		return ds_err_set(err, DS_EINVAL,
				  "--expect %d needs --cluster-key FILE (without it the agent is a "
				  "single-node cluster)",
				  o->expect);
	if (strcmp(o->gossip_profile, "lan") != 0 && strcmp(o->gossip_profile, "test") != 0)
		return ds_err_set(err, DS_EINVAL, "--gossip-profile=%s is not one of lan, test",
				  o->gossip_profile);
	disc_fake_spec fake;
	if (o->fake_gpus && disc_fake_parse(o->fake_gpus, &fake, err) != DS_OK)
		return ds_err_wrap(err, "--fake-gpus");
	if (!o->name) {
		char host[256] = "";
		if (gethostname(host, sizeof host - 1) != 0 || !host[0])
			strncpy(host, "node", sizeof host - 1);
		return cfg_set(agent_opts_table, o, "name", host, "hostname", err);
	}
	return DS_OK;
}

void agent_opts_free(agent_opts *o)
{
	cfg_free(agent_opts_table, o);
}
