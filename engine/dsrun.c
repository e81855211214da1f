/*
 * dsrun.c - the single-process engine CLI.
 *
 * Today: --version, --backends (what is compiled in and usable here).  It grows
 * into generate / tokenize / dump-logits / bench over a loaded model (issue 3).
 * Options come from one table in the style of common/config.h.
 */
#include "common/config.h"
#include "common/log.h"
#include "engine/engine.h"
#include "kernels/cpu/cpu.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

struct run_cfg {
	int version;
	int backends;
	char *backend;
	int help;
};

static const cfg_opt opts[] = {
	{"version", CFG_BOOL, offsetof(struct run_cfg, version), "false", 1, 0, "print the version"},
	{"backends", CFG_BOOL, offsetof(struct run_cfg, backends), "false", 1, 0,
	 "list compute backends and whether each is usable here"},
	{"backend", CFG_STR, offsetof(struct run_cfg, backend), "auto", 1, 0,
	 "compute backend: auto, cpu or cuda"},
	{"help", CFG_BOOL, offsetof(struct run_cfg, help), "false", 1, 0, "this help"},
	{0},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: dsrun [options]\n");
	cfg_print_help(opts, "DSRUN", f);
}

static int list_backends(void)
{
	for (int i = 0; i < kb_backend_count(); i++) {
		ds_err err = {0};
		const char *name = kb_backend_name_at(i);
		const kb_backend *b = kb_backend_get(name, &err);
		if (b)
			printf("%-5s usable    %s\n", name, b->describe());
		else
			printf("%-5s absent    %s\n", name, err.msg);
	}
	printf("cpu isa: detected %s, active %s\n", kc_isa_name(kc_isa_detect()),
	       kc_isa_name(kc_isa_active()));
	return 0;
}

int main(int argc, char **argv)
{
	struct run_cfg cfg;
	ds_err err = {0};
	int next = 0, rc = 0;
	if (cfg_load(opts, &cfg, "DSRUN", argc, argv, 1, &next, &err) != DS_OK) {
		fprintf(stderr, "dsrun: %s\n", err.msg);
		rc = 2;
		goto out;
	}
	if (next < argc) {
		fprintf(stderr, "dsrun: unexpected argument '%s' (see --help)\n", argv[next]);
		rc = 2;
		goto out;
	}
	if (cfg.help) {
		usage(stdout);
	} else if (cfg.version) {
		printf("dsrun %s\n", eng_version());
	} else if (cfg.backends) {
		rc = list_backends();
	} else {
		const kb_backend *b = eng_backend_choose(cfg.backend, &err);
		if (!b) {
			fprintf(stderr, "dsrun: %s\n", err.msg);
			rc = 1;
			goto out;
		}
		log_info("dsrun", "backend ready", "backend=%s detail=\"%s\"", b->name, b->describe());
		fprintf(stderr, "dsrun: no model loading yet; try --backends or --help\n");
		rc = 2;
	}
out:
	cfg_free(opts, &cfg);
	return rc;
}
