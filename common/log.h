/*
 * log.h - the one logging module.
 *
 * A log line is a level, a module name, an event message and key=value fields:
 *
 *     log_info("gossip", "member joined", "name=%s addr=%s", name, addr);
 *
 * On stderr this prints
 *
 *     2026-11-30T13:20:01.123Z level=info mod=gossip msg="member joined" name=a addr=...
 *
 * Under systemd (JOURNAL_STREAM set) the same record goes to journald with PRIORITY, DS_MODULE and MESSAGE fields.
 * Thread-safe: one write per line, under a mutex.
 */
#ifndef DS_LOG_H
#define DS_LOG_H

enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3, LOG_OFF = 4 };

/* Lines below level are dropped.  Default LOG_INFO, or $DS_LOG_LEVEL. */
void log_set_level(enum log_level level);
enum log_level log_get_level(void);

/* Parses "debug|info|warn|error|off"; returns 0 or DS_EINVAL. */
int log_level_parse(const char *s, enum log_level *out);

/* fields is a printf format producing "k=v k=v" (may be NULL or ""). */
void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...)
	__attribute__((format(printf, 4, 5)));

#define log_debug(mod, msg, ...) log_write(LOG_DEBUG, mod, msg, __VA_ARGS__)
#define log_info(mod, msg, ...) log_write(LOG_INFO, mod, msg, __VA_ARGS__)
#define log_warn(mod, msg, ...) log_write(LOG_WARN, mod, msg, __VA_ARGS__)
#define log_error(mod, msg, ...) log_write(LOG_ERROR, mod, msg, __VA_ARGS__)

#endif
