-- 0001_init.sql - named API keys, their daily usage, and the agent's event log.
--
-- Times are Unix seconds (UTC).  A NULL or 0 limit means unlimited.  The key
-- text itself is never stored: `hash` is BLAKE2b-256 keyed with the cluster
-- secret (DATA_DIR/keys.secret) over the whole key, `prefix` is the first 8
-- characters after "dsk-" so operators can tell keys apart.

CREATE TABLE api_keys (
	id              INTEGER PRIMARY KEY,
	name            TEXT    NOT NULL,
	prefix          TEXT    NOT NULL,
	hash            BLOB    NOT NULL UNIQUE,
	created         INTEGER NOT NULL,
	expires         INTEGER,           -- NULL = never
	rpm             INTEGER,           -- requests per minute
	tpm             INTEGER,           -- tokens (prompt + completion) per minute
	max_concurrency INTEGER,           -- requests in flight at once
	revoked_at      INTEGER,           -- NULL = active
	last_used       INTEGER
);

-- A name is unique among the keys that are not revoked.
CREATE UNIQUE INDEX api_keys_active_name ON api_keys(name) WHERE revoked_at IS NULL;

CREATE TABLE key_usage (
	key_id            INTEGER NOT NULL REFERENCES api_keys(id),
	day               TEXT    NOT NULL,  -- 'YYYY-MM-DD', UTC
	requests          INTEGER NOT NULL DEFAULT 0,
	prompt_tokens     INTEGER NOT NULL DEFAULT 0,
	completion_tokens INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (key_id, day)
) WITHOUT ROWID;

CREATE TABLE events (
	id     INTEGER PRIMARY KEY,
	ts     INTEGER NOT NULL,
	kind   TEXT    NOT NULL,             -- e.g. 'key.created', 'key.revoked'
	detail TEXT                          -- a JSON object, or NULL
);
CREATE INDEX events_ts ON events(ts);
