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
	{"name", CFG_STR, O(name), NULL, 1, 0, "node name (default: the hostname)"},
	{"bind", CFG_STR, O(bind), "127.0.0.1", 1, 0, "IPv4 address the control API listens on"},
	{"control-port", CFG_INT, O(control_port), "7481", 0, 65535,
	 "port of the control API (0 = any free port, printed at start)"},
	{"data-dir", CFG_STR, O(data_dir), "/var/lib/dsagent", 1, 0,
	 "directory of the agent's state (database, admin token)"},
	{"backend", CFG_STR, O(backend), "auto", 1, 0, "compute backend: auto, cpu or cuda"},
	{"log-level", CFG_STR, O(log_level), "info", 1, 0, "debug, info, warn or error"},
	{"model", CFG_STR, O(model), NULL, 1, 0,
	 "model to serve: checkpoint directory or .gguf file (default: the embedded default "
	 "model, models/default.gguf)"},
	{"served-model-name", CFG_STR, O(served_model_name), NULL, 1, 0,
	 "NAME[,ALIAS...] clients may use as 'model' (default: the model file's base name)"},
	{"api-bind", CFG_STR, O(api_bind), "127.0.0.1", 1, 0,
	 "IPv4 address the OpenAI API listens on"},
	{"api-port", CFG_INT, O(api_port), "8000", 0, 65535,
	 "port of the OpenAI API (0 = any free port, printed at start)"},
	{"insecure-no-auth", CFG_BOOL, O(insecure_no_auth), "false", 1, 0,
	 "serve without API keys (refused otherwise on a non-loopback address with no key)"},
	{"metrics-auth", CFG_BOOL, O(metrics_auth), "false", 1, 0,
	 "require an API key on GET /metrics too"},
	{"cors-origin", CFG_STR, O(cors_origin), NULL, 1, 0,
	 "send CORS headers allowing this origin ('*' for any; default: no CORS headers)"},
	{"chat-template", CFG_STR, O(chat_template), NULL, 1, 0,
	 "chat template override: deepseek-v3, deepseek-r1, chatml, smollm2, llama3"},
	{"threads", CFG_INT, O(threads), "0", 0, 1024, "CPU compute threads (0 = one per core)"},
	{"ctx", CFG_INT, O(ctx), "0", 0, 1 << 24,
	 "longest sequence, prompt + output (0 = the model's, at most 4096)"},
	{"max-running", CFG_INT, O(max_running), "64", 1, 4096,
	 "sequences decoded together (continuous batching)"},
	{"max-waiting", CFG_INT, O(max_waiting), "256", 0, 1 << 20,
	 "queued requests beyond which new ones get 503 + Retry-After"},
	{"max-batch-tokens", CFG_INT, O(max_batch_tokens), "512", 16, 1 << 16,
	 "tokens per engine step (decode tokens + prefill chunks)"},
	{"prefill-chunk", CFG_INT, O(prefill_chunk), "256", 1, 1 << 16,
	 "prompt tokens of one request per step (chunked prefill)"},
	{"page-size", CFG_INT, O(page_size), "16", 1, 4096, "positions per KV-cache page"},
	{"kv-cache-mb", CFG_INT, O(kv_cache_mb), "1024", 1, 1 << 24,
	 "KV-cache memory cap in MiB (pages beyond it preempt)"},
	{"max-body-kb", CFG_INT, O(max_body_kb), "2048", 1, 1 << 20,
	 "largest request body in KiB (413 beyond)"},
	{"max-n", CFG_INT, O(max_n), "16", 1, 128, "largest 'n' (choices per request)"},
	{"max-logprobs", CFG_INT, O(max_logprobs), "20", 0, 20, "largest 'top_logprobs'"},
	{"sysroot", CFG_STR, O(sysroot), "/", 1, 0,
	 "discovery reads /proc, /sys and /etc under this directory (tests: a fixture tree)"},
	{"fake-gpus", CFG_STR, O(fake_gpus), NULL, 1, 0,
	 "replace NVML by N fake GPUs: NxMODEL-MEMGB[:nvswitch|nvlink|pcie] "
	 "(e.g. 8xH100-80GB:nvswitch) or 0 (docs/cluster.md)"},
	{"nvml-lib", CFG_STR, O(nvml_lib), NULL, 1, 0,
	 "NVML library to dlopen (default libnvidia-ml.so.1, not loaded under a --sysroot; "
	 "tests pass a fake)"},
	{"discover", CFG_BOOL, O(discover), "false", 1, 0,
	 "print this node's inventory (host, GPUs, IB ports, NICs, links) as JSON and exit"},
	{"cluster-key", CFG_STR, O(cluster_key), NULL, 1, 0,
	 "cluster key file (mode 0600; `dsctl cluster init` makes one): turns on gossip "
	 "membership; without it the agent runs as a single node"},
	{"gossip-bind", CFG_STR, O(gossip_bind), "0.0.0.0", 1, 0,
	 "IPv4 address of the gossip UDP and TCP sockets"},
	{"gossip-port", CFG_INT, O(gossip_port), "7946", 0, 65535,
	 "gossip UDP and TCP port (0 = any free port, printed at start)"},
	{"join", CFG_STR, O(join), NULL, 1, 0,
	 "HOST:PORT[,HOST:PORT...] of members to join (retried with backoff)"},
	{"advertise-addr", CFG_STR, O(advertise_addr), NULL, 1, 0,
	 "IPv4 address other members reach this node's gossip port at (default: "
	 "--gossip-bind, or the first non-loopback address when that is 0.0.0.0)"},
	{"gossip-profile", CFG_STR, O(gossip_profile), "lan", 1, 0,
	 "gossip timers: lan (memberlist LAN defaults) or test (fast, for tests on one machine)"},
	{"test-fault-injection", CFG_BOOL, O(test_fault_injection), "false", 1, 0,
	 "TEST ONLY: enable POST /v1/cluster/test/drop (cuts gossip with named peers) and "
	 "POST /v1/test/fail-steps (makes engine steps fail)"},
	{"expect", CFG_INT, O(expect), "0", 0, 1000,
	 "cluster size N: no head before N members are alive, and a head needs the votes of a "
	 "majority of N (0 = no election; without --cluster-key the node is its own head)"},
	{"settle-ms", CFG_INT, O(settle_ms), "3000", 0, 600000,
	 "formation: the member list must not change for this long before the first election"},
	{"lease-ms", CFG_INT, O(lease_ms), "5000", 100, 600000,
	 "head lease: the head renews it every lease/3 with a majority's acks and steps down "
	 "without them; followers stand only after this long without a heartbeat"},
	{"eligible", CFG_BOOL, O(eligible), "true", 1, 0,
	 "this node may become head (--eligible=false: it only votes)"},
	{"priority", CFG_INT, O(priority), "0", -1000000, 1000000,
	 "head candidacy order: higher priority first, then the lower node id"},
	{"health-ms", CFG_INT, O(health_ms), "10000", 200, 3600000,
	 "how often the node rediscovers itself and the head refreshes every member's health"},
	{"print-config", CFG_BOOL, O(print_config), "false", 1, 0,
	 "print the effective configuration as 'key = value' lines and exit"},
	{"version", CFG_BOOL, O(version), "false", 1, 0, "print the version and exit"},
	{"help", CFG_BOOL, O(help), "false", 1, 0, "this help"},
	{0},
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
