/*
 * store_proc.c - see store_proc.h.  The child starts comm_store_server on
 * an ephemeral loopback port, writes its address to a pipe, and serves
 * until the parent closes its end of a second pipe (or dies).
 */
#include "tests/unit/store_proc.h"

#include "comm/comm.h"
#include "tests/unit/unit.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static void serve(int addr_w, int ctl_r)
{
	ds_err err = {0};
	char b;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	comm_store_server *s = comm_store_server_start("127.0.0.1", 0, &err);
	const char *msg = s ? comm_store_server_addr(s) : err.msg;
	char line[sizeof ((store_proc *)0)->addr + 256];
	int n = snprintf(line, sizeof line, "%c%s", s ? '+' : '-', msg);
	if (write(addr_w, line, (size_t)n) != n)
		_exit(2);
	close(addr_w);
	while (read(ctl_r, &b, 1) < 0 && errno == EINTR)
		;
	comm_store_server_stop(s);
	_exit(s ? 0 : 1);
}

int store_proc_start(store_proc *sp)
{
	int ap[2], cp[2];
	memset(sp, 0, sizeof *sp);
	sp->ctl = -1;
	if (pipe(ap) != 0) {
		ut_fail(__FILE__, __LINE__, "pipe: %s", strerror(errno));
		return -1;
	}
	if (pipe(cp) != 0) {
		ut_fail(__FILE__, __LINE__, "pipe: %s", strerror(errno));
		close(ap[0]);
		close(ap[1]);
		return -1;
	}
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		close(ap[0]);
		close(cp[1]);
		serve(ap[1], cp[0]);
	}
	close(ap[1]);
	close(cp[0]);
	if (pid < 0) {
		ut_fail(__FILE__, __LINE__, "fork: %s", strerror(errno));
		close(ap[0]);
		close(cp[1]);
		return -1;
	}
	sp->pid = pid;
	sp->ctl = cp[1];
	char line[sizeof sp->addr + 256];
	size_t got = 0;
	for (;;) { /* the child writes once and closes: read to EOF */
		ssize_t r = read(ap[0], line + got, sizeof line - 1 - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		got += (size_t)r;
		if (got == sizeof line - 1)
			break;
	}
	close(ap[0]);
	line[got] = '\0';
	if (got < 2 || line[0] != '+' || got - 1 >= sizeof sp->addr) {
		ut_fail(__FILE__, __LINE__, "store server process: %s",
			got > 1 ? line + 1 : "exited without an address");
		store_proc_stop(sp);
		return -1;
	}
	memcpy(sp->addr, line + 1, got);
	return 0;
}

void store_proc_stop(store_proc *sp)
{
	if (sp->ctl >= 0)
		close(sp->ctl);
	sp->ctl = -1;
	if (sp->pid > 0)
		waitpid(sp->pid, NULL, 0);
	sp->pid = 0;
}
