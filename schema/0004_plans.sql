-- 0004: shard plans (docs/cluster.md, "The shard plan in SQLite").
--
-- The head writes one plans row per plan it makes, with one plan_ranks row
-- per world rank and one comm_groups row per communicator, in one
-- transaction.  A plan's id is its version: ids only grow, and the newest
-- plan is the current one.  epoch is the election epoch of the head that
-- wrote it; a plan of an epoch older than the newest plan's is refused
-- (fencing: a deposed head cannot overwrite its successor's plan).
-- plans.document is the planner's whole output as received (JSON), the
-- columns are what the launch and `dsctl plan show` read.  Times are Unix
-- seconds (UTC).

CREATE TABLE plans (
	id          INTEGER PRIMARY KEY,            -- the plan's version
	epoch       INTEGER NOT NULL,               -- election epoch of its head
	created     INTEGER NOT NULL,
	head_id     TEXT,                           -- node id of the head (32 hex digits)
	model       TEXT    NOT NULL,               -- checkpoint path as the nodes see it
	tp          INTEGER NOT NULL,
	pp          INTEGER NOT NULL,
	ep          INTEGER NOT NULL,
	world_size  INTEGER NOT NULL,               -- tp * pp * ep
	max_ctx     INTEGER,                        -- longest sequence the KV budget allows
	max_seqs    INTEGER,                        -- sequences of max_ctx it allows at once
	status      TEXT    NOT NULL,               -- planned | launching | serving | failed | stopped | superseded
	status_at   INTEGER NOT NULL,
	reason      TEXT,                           -- why it failed or stopped
	document    TEXT    NOT NULL                -- the plan (JSON object)
);
CREATE INDEX plans_epoch ON plans(epoch);

CREATE TABLE plan_ranks (
	plan_id      INTEGER NOT NULL REFERENCES plans(id) ON DELETE CASCADE,
	rank         INTEGER NOT NULL,              -- world rank
	node_id      TEXT    NOT NULL,              -- where it runs (nodes.id)
	node_name    TEXT,
	device       INTEGER NOT NULL,              -- GPU index on its node; -1 = a CPU rank
	stage        INTEGER NOT NULL,
	tp_rank      INTEGER NOT NULL,
	ep_rank      INTEGER NOT NULL,
	layer_first  INTEGER NOT NULL,              -- its stage's layers [first, first + count)
	layer_count  INTEGER NOT NULL,
	expert_first INTEGER NOT NULL,              -- its routed experts [first, first + count)
	expert_count INTEGER NOT NULL,
	weight_bytes INTEGER,                       -- planned bytes of its weight share
	kv_bytes     INTEGER,                       -- planned KV cache bytes
	env          TEXT    NOT NULL,              -- its process environment (JSON object)
	PRIMARY KEY (plan_id, rank)
);

CREATE TABLE comm_groups (
	plan_id INTEGER NOT NULL REFERENCES plans(id) ON DELETE CASCADE,
	name    TEXT    NOT NULL,                   -- world, stage0, tp0.1, ...
	ranks   TEXT    NOT NULL,                   -- world ranks in group order (JSON array)
	PRIMARY KEY (plan_id, name)
);
