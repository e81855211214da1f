/*
 * log.c - level filter, stderr and journald sinks (see log.h).
 *
 * Threading: any thread may log; the level is an atomic int, the write is done
 * under one mutex so lines never interleave.  The sink is chosen on first use:
 * journald when JOURNAL_STREAM is set (we were started by systemd with stderr
 * connected to the journal), else stderr.
 */
#include "common/log.h"
#include "common/status.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define SD_JOURNAL_SUPPRESS_LOCATION
#include <systemd/sd-journal.h>
/* sd-journal.h pulls in <syslog.h>, whose LOG_DEBUG (7) and LOG_INFO (6)
 * macros would replace our enum log_level values in the rest of this file
 * (the default level became 6, past LOG_OFF: nothing was logged).  Journald
 * priorities are written as numbers below. */
#undef LOG_DEBUG
#undef LOG_INFO

enum log_sink { LOG_SINK_AUTO = 0, LOG_SINK_STDERR, LOG_SINK_JOURNALD };

static int g_level = -1;
static int g_sink = LOG_SINK_AUTO;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *level_names[] = {"debug", "info", "warn", "error", "off"};

int log_level_parse(const char *s, enum log_level *out)
{
	for (int i = 0; i <= LOG_OFF; i++) {
		if (s && strcasecmp(s, level_names[i]) == 0) {
			*out = (enum log_level)i;
			return DS_OK;
		}
	}
	return DS_EINVAL;
}

enum log_level log_get_level(void)
{
	int lv = __atomic_load_n(&g_level, __ATOMIC_RELAXED);
	if (lv < 0) {
		enum log_level parsed = LOG_INFO;
		const char *env = getenv("DS_LOG_LEVEL");
		if (env && log_level_parse(env, &parsed) != DS_OK)
			parsed = LOG_INFO;
		lv = (int)parsed;
		__atomic_store_n(&g_level, lv, __ATOMIC_RELAXED);
	}
	return (enum log_level)lv;
}

void log_set_level(enum log_level level)
{
	__atomic_store_n(&g_level, (int)level, __ATOMIC_RELAXED);
}

static int resolve_sink(void)
{
	int s = __atomic_load_n(&g_sink, __ATOMIC_RELAXED);
	if (s == LOG_SINK_AUTO) {
		s = getenv("JOURNAL_STREAM") ? LOG_SINK_JOURNALD : LOG_SINK_STDERR;
		__atomic_store_n(&g_sink, s, __ATOMIC_RELAXED);
	}
	return s;
}

void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...)
{
	if (level < log_get_level() || level >= LOG_OFF)
		return;
	char kv[1024] = "";
	if (fields && fields[0]) {
		va_list ap;
		va_start(ap, fields);
		vsnprintf(kv, sizeof kv, fields, ap);
		va_end(ap);
	}
	if (resolve_sink() == LOG_SINK_JOURNALD) {
		static const int prio[] = {7, 6, 4, 3}; /* syslog debug, info, warning, err */
		sd_journal_send("PRIORITY=%d", prio[level], "DS_MODULE=%s", mod ? mod : "-",
				"MESSAGE=%s%s%s", msg ? msg : "", kv[0] ? " " : "", kv, NULL);
		return;
	}
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	char when[32];
	strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
	pthread_mutex_lock(&g_mu);
	fprintf(stderr, "%s.%03ldZ level=%s mod=%s msg=\"%s\"%s%s\n", when, ts.tv_nsec / 1000000,
		level_names[level], mod ? mod : "-", msg ? msg : "", kv[0] ? " " : "", kv);
	pthread_mutex_unlock(&g_mu);
}
