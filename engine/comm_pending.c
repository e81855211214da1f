/*
 * comm_pending.c - TEMPORARY: stand-ins for the TCP rendezvous store and the
 * Gloo group that comm/comm.h declares and branch h-comm implements, so the
 * driver and the rank process link and run one-rank plans before that
 * lands.  Each refuses with DS_EUNSUPPORTED.  Delete this file when main
 * carries comm's own definitions (the link then fails on duplicates if it
 * is forgotten).
 */
#include "comm/comm.h"

#include <stddef.h>

comm_store_server *comm_store_server_start(const char *host, int port, ds_err *err)
{
	ds_err_set(err, DS_EUNSUPPORTED, "the TCP rendezvous store is not built yet (comm, h-comm)");
	return NULL;
}

const char *comm_store_server_addr(const comm_store_server *s)
{
	return "";
}

void comm_store_server_stop(comm_store_server *s)
{
}

int comm_store_tcp_open(comm_store *st, const char *addr, int timeout_ms, ds_err *err)
{
	return ds_err_set(err, DS_EUNSUPPORTED, "the TCP rendezvous store is not built yet (comm, h-comm)");
}

void comm_store_tcp_close(comm_store *st)
{
}

comm_group *comm_gloo_new(const comm_params *p, const comm_store *store, const char *key_prefix,
			  const char *host, ds_err *err)
{
	ds_err_set(err, DS_EUNSUPPORTED, "the Gloo group is not built yet (comm, h-comm)");
	return NULL;
}
