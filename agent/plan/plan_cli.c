/*
 * plan_cli.c - `dsagent plan`: a shard plan without a cluster, from
 * inventory files (what `dsagent --discover` prints) and a model (a
 * checkpoint directory or a .gguf file).
 *
 *   dsagent plan --inventory FILE [--addr IP] [--inventory FILE [--addr IP] ...]
 *                --model PATH [--tp N --pp N --ep N] [--mem-fraction F]
 *                [--max-ctx N] [--json]
 *
 * --addr gives the node's gossip address (the interface that carries it is
 * NCCL_SOCKET_IFNAME); it applies to the --inventory before it.
 * Called by agent/main.c.  Exit: 0 a plan that fits, 1 a plan that does not
 * fit (printed with its shortfall), 2 bad flags or files.
 */
#include "agent/plan/plan.h"
#include "common/strutil.h"

#include <string.h>

static void usage(FILE *f)
{
	fprintf(f,
		"usage: dsagent plan --inventory FILE [--addr IP] [--inventory FILE [--addr IP] ...]\n"
		"                    --model PATH [--tp N] [--pp N] [--ep N] [--mem-fraction F]\n"
		"                    [--max-ctx N] [--json]\n"
		"  --inventory FILE  a node's inventory (dsagent --discover > FILE); once per node\n"
		"  --addr IP         that node's gossip address (its interface = NCCL_SOCKET_IFNAME)\n"
		"  --model PATH      checkpoint directory (config.json, safetensors files optional)\n"
		"                    or a .gguf file (llama or deepseek2)\n"
		"  --tp/--pp/--ep N  fix a parallel size (the rest is chosen)\n"
		"  --mem-fraction F  share of each device's memory to plan (default 0.9)\n"
		"  --max-ctx N       context every sequence may reach (default min(model, 4096))\n"
		"  --json            the plan as JSON\n"
		"exit: 0 fits, 1 does not fit (with the shortfall), 2 bad flags or files\n");
}

int plan_main(int argc, char **argv)
{
	json_t *inv[PLAN_NODES_MAX] = {0};
	const char *addr[PLAN_NODES_MAX] = {0};
	int n = 0, as_json = 0, rc = 2;
	plan_params p = plan_default_params();
	plan *pl = NULL;
	ds_err err = {0};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			usage(stdout);
			rc = 0;
			goto out;
		}
		if (strcmp(a, "--json") == 0) {
			as_json = 1;
			continue;
		}
		if (!v) {
			fprintf(stderr, "dsagent plan: %s needs a value (dsagent plan --help)\n", a);
			goto out;
		}
		i++;
		if (strcmp(a, "--inventory") == 0) {
			json_error_t je;
			if (n == PLAN_NODES_MAX) {
				fprintf(stderr, "dsagent plan: more than %d inventories\n", PLAN_NODES_MAX);
				goto out;
			}
			if (!(inv[n] = json_load_file(v, 0, &je))) {
				fprintf(stderr, "dsagent plan: --inventory %s: %s (line %d)\n", v, je.text,
					je.line);
				goto out;
			}
			n++;
		} else if (strcmp(a, "--addr") == 0) {
			if (n == 0) {
				fprintf(stderr, "dsagent plan: --addr %s comes before any --inventory\n", v);
				goto out;
			}
			addr[n - 1] = v;
		} else if (strcmp(a, "--model") == 0) {
			p.model_path = v;
		} else if (strcmp(a, "--tp") == 0 || strcmp(a, "--pp") == 0 || strcmp(a, "--ep") == 0 ||
			   strcmp(a, "--max-ctx") == 0) {
			int x;
			int hi = strcmp(a, "--max-ctx") == 0 ? 1 << 30 : 4096;
			if (ds_parse_int(v, 1, hi, &x) != DS_OK) {
				fprintf(stderr, "dsagent plan: %s %s: not an integer in [1, %d]\n", a, v, hi);
				goto out;
			}
			*(a[2] == 't' ? &p.tp : a[2] == 'p' ? &p.pp : a[2] == 'e' ? &p.ep : &p.max_ctx) = x;
		} else if (strcmp(a, "--mem-fraction") == 0) {
			if (ds_parse_double(v, 0.01, 1.0, &p.mem_fraction) != DS_OK) {
				fprintf(stderr, "dsagent plan: --mem-fraction %s: not a number in [0.01, 1]\n", v);
				goto out;
			}
		} else {
			fprintf(stderr, "dsagent plan: unknown option %s (dsagent plan --help)\n", a);
			goto out;
		}
	}
	if (n == 0 || !p.model_path) {
		fprintf(stderr, "dsagent plan: %s is required (dsagent plan --help)\n",
			n == 0 ? "--inventory FILE" : "--model PATH");
		goto out;
	}
	p.inventories = inv;
	p.addresses = addr;
	p.n_nodes = n;
	if (plan_make(&p, &pl, &err) != DS_OK) {
		fprintf(stderr, "dsagent plan: %s\n", err.msg);
		rc = err.code == DS_ENOMEM ? 1 : 2;
		goto out;
	}
	if (as_json) {
		json_t *j = plan_to_json(pl);
		if (!j || json_dumpf(j, stdout, JSON_INDENT(2)) != 0) {
			json_decref(j);
			fprintf(stderr, "dsagent plan: out of memory\n");
			rc = 1;
			goto out;
		}
		fputc('\n', stdout);
		json_decref(j);
	} else {
		plan_print(pl, stdout);
	}
	rc = plan_fits(pl) ? 0 : 1;
out:
	plan_free(pl);
	for (int i = 0; i < n; i++)
		json_decref(inv[i]);
	return rc;
}
