/*
 * status.c - error slots and code names (see status.h).
 * Thread rule: a ds_err belongs to one caller at a time; nothing here is shared.
 */
#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int ds_err_set(ds_err *err, int code, const char *fmt, ...)
{
	if (!err)
		return code;
	err->code = code;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof err->msg, fmt, ap);
	va_end(ap);
	return code;
}

int ds_err_wrap(ds_err *err, const char *fmt, ...)
{
	if (!err)
		return DS_EINTERNAL;
	char prefix[DS_ERR_MSG_MAX];
	char old[DS_ERR_MSG_MAX];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(prefix, sizeof prefix, fmt, ap);
	va_end(ap);
	memcpy(old, err->msg, sizeof old);
	snprintf(err->msg, sizeof err->msg, "%s: %s", prefix, old);
	return err->code;
}

void ds_err_clear(ds_err *err)
{
	if (!err)
		return;
	err->code = DS_OK;
	err->msg[0] = '\0';
}

const char *ds_status_name(int code)
{
	switch (code) {
	case DS_OK: return "OK";
	case DS_EINVAL: return "EINVAL";
	case DS_ENOMEM: return "ENOMEM";
	case DS_EIO: return "EIO";
	case DS_ENOTFOUND: return "ENOTFOUND";
	case DS_EFORMAT: return "EFORMAT";
	case DS_EUNSUPPORTED: return "EUNSUPPORTED";
	case DS_ERANGE: return "ERANGE";
	case DS_EBUSY: return "EBUSY";
	case DS_ETIMEOUT: return "ETIMEOUT";
	case DS_EAUTH: return "EAUTH";
	case DS_EPERM: return "EPERM";
	case DS_EINTERNAL: return "EINTERNAL";
	case DS_ENODEV: return "ENODEV";
	case DS_ECONFLICT: return "ECONFLICT";
	}
	return "EUNKNOWN";
}
