-- 0003: member_events.ts becomes INTEGER Unix seconds, the one type of every
-- stored timestamp (events.ts, nodes.inventory_at, elections.ts, ...).  It was
-- REAL (seconds with a fraction); the fraction is dropped.  SQLite cannot
-- change a column's type in place, so the table is rebuilt.
CREATE TABLE member_events_new (
	id          INTEGER PRIMARY KEY,
	ts          INTEGER NOT NULL,             -- Unix seconds
	node_id     TEXT    NOT NULL,
	name        TEXT    NOT NULL,
	addr        TEXT,
	kind        TEXT    NOT NULL,             -- member_join, member_dead, ...
	state       TEXT    NOT NULL,
	prev_state  TEXT,
	incarnation INTEGER
);
INSERT INTO member_events_new (id, ts, node_id, name, addr, kind, state, prev_state, incarnation)
	SELECT id, CAST(ts AS INTEGER), node_id, name, addr, kind, state, prev_state, incarnation
	FROM member_events;
DROP TABLE member_events;
ALTER TABLE member_events_new RENAME TO member_events;
CREATE INDEX member_events_node ON member_events(node_id, id);
