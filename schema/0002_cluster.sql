-- 0002_cluster.sql - the cluster record: node inventories, membership events,
-- elections and this node's votes (docs/cluster.md, "Cluster inventory" and
-- "Election").
--
-- Every node keeps its own inventory here; the head keeps every member's.
-- Node ids are the 32 lowercase hex digits of DATA_DIR/node.id.  A node's
-- rows in gpus, ib_ports, nics, links and gpu_nic are replaced together with
-- its nodes row in one transaction.  Columns mirror the inventory JSON of
-- agent/node/discover.h field for field (JSON null = SQL NULL, booleans 0/1);
-- nodes.inventory holds the whole document as received, health included.
-- Times are Unix seconds (UTC).

CREATE TABLE nodes (
	id                  TEXT    PRIMARY KEY,     -- node id (32 hex digits)
	name                TEXT    NOT NULL,
	addr                TEXT,                    -- gossip address (IPv4)
	control_port        INTEGER,
	api_port            INTEGER,
	status              TEXT    NOT NULL,        -- alive | suspect | dead | left
	role                TEXT,                    -- none | follower | candidate | head
	epoch               INTEGER,                 -- highest epoch it advertised
	hostname            TEXT,
	cpu_model           TEXT,
	cpus                INTEGER,
	sockets             INTEGER,
	memory_bytes        INTEGER,
	compute_kind        TEXT,                    -- gpu | cpu
	ranks               INTEGER,
	gpu_source          TEXT,                    -- nvml | fake | none
	driver_version      TEXT,
	cuda_driver_version INTEGER,
	digest              TEXT,                    -- disc_digest of the inventory
	inventory           TEXT,                    -- the inventory document (JSON)
	first_seen          INTEGER NOT NULL,
	last_seen           INTEGER NOT NULL,        -- last time it was known alive
	inventory_at        INTEGER,                 -- when the inventory was written
	health_at           INTEGER                  -- when the health readings were
);
CREATE INDEX nodes_name ON nodes(name);

CREATE TABLE gpus (
	node_id                     TEXT    NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
	idx                         INTEGER NOT NULL,  -- "index": bus id order
	nvml_index                  INTEGER,
	uuid                        TEXT,
	name                        TEXT,
	bus_id                      TEXT,
	numa_node                   INTEGER,
	compute_capability          TEXT,
	memory_total_bytes          INTEGER,
	nvlinks                     INTEGER,
	nvswitch                    INTEGER,
	temperature_c               INTEGER,
	power_mw                    INTEGER,
	memory_used_bytes           INTEGER,
	ecc_uncorrected_volatile    INTEGER,
	ecc_uncorrected_aggregate   INTEGER,
	retired_pages_sbe           INTEGER,
	retired_pages_dbe           INTEGER,
	remapped_rows_correctable   INTEGER,
	remapped_rows_uncorrectable INTEGER,
	remapped_rows_pending       INTEGER,
	remapped_rows_failed        INTEGER,
	PRIMARY KEY (node_id, idx)
) WITHOUT ROWID;

CREATE TABLE ib_ports (
	node_id    TEXT    NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
	device     TEXT    NOT NULL,
	port       INTEGER NOT NULL,
	bus_id     TEXT,
	numa_node  INTEGER,
	hca_type   TEXT,
	fw_ver     TEXT,
	link_layer TEXT,
	state      TEXT,
	phys_state TEXT,
	rate_gbps  REAL,
	width      INTEGER,
	speed      TEXT,
	netdev     TEXT,
	gid_index  INTEGER,
	usable     INTEGER,
	PRIMARY KEY (node_id, device, port)
) WITHOUT ROWID;

CREATE TABLE nics (
	node_id TEXT    NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
	pos     INTEGER NOT NULL,                 -- order in the inventory
	name    TEXT    NOT NULL,
	ipv4    TEXT    NOT NULL,                 -- JSON array of "a.b.c.d/len"
	ipv6    TEXT    NOT NULL,                 -- JSON array of "addr/len"
	PRIMARY KEY (node_id, pos)
) WITHOUT ROWID;

-- Pairwise GPU topology (one row per pair a < b).
CREATE TABLE links (
	node_id  TEXT    NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
	a        INTEGER NOT NULL,
	b        INTEGER NOT NULL,
	level    TEXT,                            -- NV18, PIX, PXB, PHB, NODE, SYS, unknown
	nvlinks  INTEGER,
	nvswitch INTEGER,
	source   TEXT,
	PRIMARY KEY (node_id, a, b)
) WITHOUT ROWID;

-- GPU to RDMA device distance (one row per GPU x device).
CREATE TABLE gpu_nic (
	node_id TEXT    NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
	gpu     INTEGER NOT NULL,
	nic     TEXT    NOT NULL,
	level   TEXT,
	source  TEXT,
	PRIMARY KEY (node_id, gpu, nic)
) WITHOUT ROWID;

-- Membership changes as this node's gossip saw them.
CREATE TABLE member_events (
	id          INTEGER PRIMARY KEY,
	ts          REAL    NOT NULL,             -- Unix seconds with a fraction
	node_id     TEXT    NOT NULL,
	name        TEXT    NOT NULL,
	addr        TEXT,
	kind        TEXT    NOT NULL,             -- member_join, member_dead, ...
	state       TEXT    NOT NULL,
	prev_state  TEXT,
	incarnation INTEGER
);
CREATE INDEX member_events_node ON member_events(node_id, id);

-- One row per epoch this node knows of: the head (NULL while unknown or when
-- nobody won), who stood, and, when this node stood, the votes it got.
CREATE TABLE elections (
	epoch     INTEGER PRIMARY KEY,
	head_id   TEXT,
	candidate TEXT,
	votes     INTEGER,                        -- votes received (this node's candidacy)
	quorum    INTEGER,                        -- votes it needed
	outcome   TEXT    NOT NULL,               -- won | lost | followed | learned | single
	ts        INTEGER NOT NULL,
	decided   INTEGER                         -- when head_id became known
);

-- This node's vote per epoch: at most one, written (and synced) before the
-- reply that grants it leaves.
CREATE TABLE votes (
	epoch     INTEGER PRIMARY KEY,
	candidate TEXT    NOT NULL,
	ts        INTEGER NOT NULL
);
