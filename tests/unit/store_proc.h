/*
 * store_proc.h - a rendezvous store server in a process of its own, for the
 * unit tests that fork rank processes.
 *
 * Why a process: a child forked while another thread of the parent holds
 * an allocator lock inherits the lock held and deadlocks on its first
 * malloc (ASan's allocator is not fork-safe; a store thread that is
 * freeing the last run's connections is enough).  With the server in its
 * own process the test process has one thread whenever it forks.
 */
#ifndef DS_TESTS_UNIT_STORE_PROC_H
#define DS_TESTS_UNIT_STORE_PROC_H

#include <sys/types.h>

typedef struct store_proc {
	pid_t pid;
	int ctl;       /* write end: closing it stops the server */
	char addr[64]; /* "host:port" the ranks open */
} store_proc;

/* Forks the server process and waits for its address; 0 or -1 (after
 * ut_fail naming why).  Call it while the test process has one thread. */
int store_proc_start(store_proc *sp);

/* Stops the server and reaps it (a zeroed or failed sp is a no-op). */
void store_proc_stop(store_proc *sp);

#endif
