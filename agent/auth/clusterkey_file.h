/*
 * clusterkey_file.h - the agent's cluster key file (--cluster-key): the
 * file checks of docs/cluster.md "Cluster key" on top of the format of
 * common/clusterkey.h.  The auth room holds the agent's secrets: API keys
 * and the admin token (keys.h), the cluster key (here).
 */
#ifndef DS_AGENT_CLUSTERKEY_FILE_H
#define DS_AGENT_CLUSTERKEY_FILE_H

#include "common/clusterkey.h"
#include "common/status.h"

/* Loads the key file at path into *out (wipe it with clusterkey_wipe).
 * DS_ENOTFOUND (missing), DS_EPERM (a regular file readable or writable by
 * group or others, or not a regular file: the message suggests chmod 600),
 * DS_EFORMAT (clusterkey_parse's message, after the file's name), DS_EIO.
 * Thread-safe; reads the file once, keeps no copy of its text. */
int clusterkey_file_load(const char *path, clusterkey_ring *out, ds_err *err);

#endif
