/*
 * comm_gloo.cc - the Gloo backend of comm.h: CPU ranks over TCP, host
 * buffers.  The one C++ file of comm/: a C constructor (comm_gloo_new) and
 * a comm_ops table; no exception ever leaves it.
 *
 * Callers: through comm.c only (comm_gloo_new is the constructor).
 * Calls: Gloo's own algorithms over its TCP transport, rendezvous through
 * the caller's comm_store (StoreAdapter): on the sync mesh AllreduceRing /
 * AllreduceRingChunked, AllgatherRing, BroadcastOneToAll; on the unbound
 * mesh gloo::allreduce (ring), allgather, broadcast, alltoallv, barrier and
 * unbound-buffer send/recv.
 *
 * Threading: a group is used by one thread at a time (comm.h); Gloo's TCP
 * device runs one background loop thread per group, which serves the
 * unbound mesh only.
 *
 * Two meshes (with more than one rank a group connects twice):
 *   unbound  Gloo's options-style calls on unbound buffers.  Every message
 *            is a rendezvous (the sender announces, the receiver answers
 *            ready, then the data) carried by the device's loop thread,
 *            which wakes the caller through a condition variable: about
 *            three thread wake-ups per message.  On 2 shared cores a 2048
 *            float all-reduce took ~400 us, 10x a loopback round trip.
 *   sync     the same ranks connected again, every pair switched to Gloo's
 *            sync mode (Pair::setSync): the calling thread writes and reads
 *            the sockets itself (blocking recv with the group's timeout as
 *            SO_RCVTIMEO), no loop thread, no rendezvous; Gloo's bound-
 *            buffer algorithms run on it.  Their objects bind their memory
 *            when made, so they are cached per call shape (Cached, at most
 *            CACHE_MAX, least recently used goes) with staging buffers the
 *            caller's data is copied through; a decode step makes the same
 *            calls every time and so allocates nothing once warm.
 *   The sync mesh takes all_reduce (and so reduce_scatter), all_gather and
 *   broadcast when the largest message is at most SYNC_MAX_BYTES and the
 *   timeout is the one the group connected with; everything else (larger
 *   messages, all_to_allv, send / recv, barrier) takes the unbound mesh.
 *   Both choices depend only on what every rank passes alike.  Gloo's
 *   busy-poll (spinning on the socket instead of sleeping in recv) is on
 *   when comm_params.spin asks for it (the worker's --comm-spin): a decode
 *   step waits on ~12 collectives, and a rank woken from sleep on each
 *   lost 15-20% of a tp2 step on 2 cores (docs/benchmarks.md); with more
 *   ranks than cores it stalls the ranks that compute (4 ranks on 2
 *   cores: over 100x slower in tests/bench/bench_comm.c), so it is off by
 *   default.
 *   DS_COMM_SYNC=0 in the environment leaves the sync mesh out (for
 *   comparing; docs/benchmarks.md).
 *
 * Rendezvous (keys under "<prefix>/", comm.h's scheme):
 *   <rank>/host      this rank's listening host (set before connecting; the
 *                    keys that are missing name the ranks that never came)
 *   gloo/...         Gloo's own keys (its pair addresses, one value per
 *                    rank; values longer than COMM_STORE_VALUE_MAX are cut
 *                    into parts "<key>#<i>" behind a header "<key>")
 *   sync/gloo/...    the sync mesh's keys, likewise
 *   <rank>/ready     set once connected and after a one-byte all-to-all
 *                    (so every pair is up on both ends): line i is the
 *                    local address of this rank's connection to rank i
 *                    (unbound mesh, space, sync mesh), so that a peer's
 *                    error message ("... [127.0.0.1]:40312") names a rank;
 *                    so does the address rank i published in gloo/<i> for
 *                    us, which Gloo names when it accepted the connection
 *                    before its connect() ran
 *
 * Reductions (the order is fixed so results never depend on timing):
 *   all_reduce      sync mesh: make_all_reduce says why AllreduceRing and
 *                   AllreduceRingChunked give every rank the same bits.
 *                   Unbound mesh: gloo::allreduce, ring chosen explicitly.  The
 *                   ring cuts the buffer into segments and each segment is
 *                   summed along the ring starting from a rank fixed by its
 *                   position; which rank adds when depends only on W and
 *                   the byte count, never on arrival times, and the second
 *                   phase copies the finished segments, so every rank gets
 *                   the same bits and a rerun gets the same bits.
 *   reduce_scatter  the same all_reduce over the whole W * count buffer
 *                   (into the group's scratch), then this rank's slice: one
 *                   order for both calls; W times the traffic of a true
 *                   reduce-scatter, acceptable for the small tensors of CPU
 *                   groups (Gloo's ReduceScatterHalvingDoubling is an older
 *                   pair-based algorithm without per-call timeouts).
 *   bf16 / f16      widened to f32 in scratch, reduced in f32 as above,
 *                   rounded once to nearest-even.
 *   i32 / u8        wrapping sums (two's complement), exact in any order.
 *
 * Failures: every Gloo call runs inside guarded(), which catches every
 * exception: a message that says it timed out ("Timed out ...", "Connect
 * timeout", "Read timeout": a sync-mesh recv past SO_RCVTIMEO) is
 * DS_ETIMEOUT, anything else DS_EIO, naming the peer rank when the message
 * holds one of its addresses (above).  Gloo's TCP loop thread cannot report
 * everything to the caller: a malformed frame on an established connection
 * fails a GLOO_ENFORCE on that thread, and the exception ends the process
 * (std::terminate).  We install a terminate handler that logs what Gloo
 * said before the abort (docs/distributed.md: the transport is for a
 * trusted network; the peers see the process die as DS_EIO).  Gloo writes
 * with writev (no MSG_NOSIGNAL), so the constructor ignores SIGPIPE when
 * the process still has the default action, else a peer's death would
 * kill this rank.
 */
extern "C" {
#include "comm/comm_impl.h"
#include "common/log.h"
#include "common/strutil.h"
}

#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using ms = std::chrono::milliseconds;

/* A failure of the C store, carried through Gloo's rendezvous. */
struct StoreError : std::runtime_error {
	int code;
	StoreError(int c, const std::string &m) : std::runtime_error(m), code(c) {}
};

/* gloo::rendezvous::Store over a comm_store: keys under "<prefix>/gloo/",
 * gets wait at most the deadline set by the constructor. */
class StoreAdapter : public gloo::rendezvous::Store {
public:
	StoreAdapter(const comm_store *st, const std::string &prefix, int timeout_ms)
		: st_(st), prefix_(prefix + "/gloo/"), timeout_ms_(timeout_ms)
	{
	}

	void set(const std::string &key, const std::vector<char> &data) override
	{
		const size_t part = COMM_STORE_VALUE_MAX;
		size_t parts = (data.size() + part - 1) / part;
		char hdr[32];
		/* header: the number of parts and the total length */
		int n = snprintf(hdr, sizeof hdr, "%zu %zu", parts, data.size());
		for (size_t i = 0; i < parts; i++) {
			size_t off = i * part, len = std::min(part, data.size() - off);
			put(prefix_ + key + "#" + std::to_string(i), data.data() + off, len);
		}
		put(prefix_ + key, hdr, (size_t)n);
	}

	std::vector<char> get(const std::string &key) override
	{
		char buf[COMM_STORE_VALUE_MAX];
		size_t len = fetch(prefix_ + key, buf, sizeof buf - 1, timeout_ms_);
		buf[len] = '\0';
		unsigned long long parts = 0, total = 0;
		if (sscanf(buf, "%llu %llu", &parts, &total) != 2 || total > (1u << 20) ||
		    parts != (total + COMM_STORE_VALUE_MAX - 1) / COMM_STORE_VALUE_MAX)
			throw StoreError(DS_EFORMAT, "comm store: gloo key " + key +
							     ": malformed part header");
		std::vector<char> out;
		out.reserve(total);
		for (unsigned long long i = 0; i < parts; i++) {
			size_t got = fetch(prefix_ + key + "#" + std::to_string(i), buf, sizeof buf,
					   timeout_ms_);
			out.insert(out.end(), buf, buf + got);
		}
		if (out.size() != total)
			throw StoreError(DS_EFORMAT, "comm store: gloo key " + key +
							     ": parts do not add up to the header's length");
		return out;
	}

	void wait(const std::vector<std::string> &keys) override
	{
		wait(keys, ms(timeout_ms_));
	}

	void wait(const std::vector<std::string> &keys, const ms &timeout) override
	{
		char buf[COMM_STORE_VALUE_MAX];
		auto deadline = std::chrono::steady_clock::now() + timeout;
		for (const auto &k : keys) {
			auto left = std::chrono::duration_cast<ms>(deadline -
								   std::chrono::steady_clock::now());
			fetch(prefix_ + k, buf, sizeof buf, left.count() > 0 ? (int)left.count() : 0);
		}
	}

private:
	void put(const std::string &key, const void *p, size_t n)
	{
		ds_err e = {};
		int rc = st_->set(st_->ctx, key.c_str(), p, n, &e);
		if (rc)
			throw StoreError(rc, e.msg);
	}

	size_t fetch(const std::string &key, char *buf, size_t cap, int timeout_ms)
	{
		ds_err e = {};
		size_t len = 0;
		int rc = st_->get(st_->ctx, key.c_str(), buf, cap, &len, timeout_ms, &e);
		if (rc)
			throw StoreError(rc, e.msg);
		return len;
	}

	const comm_store *st_;
	std::string prefix_;
	int timeout_ms_;
};

/* The collectives of the sync mesh (file note, "Two meshes"). */
enum class Kind { ALL_REDUCE, ALL_GATHER, BROADCAST };

/* One algorithm object of the sync mesh with the staging memory its bound
 * buffers point at, kept while calls of the same shape come (a decode step
 * makes the same calls every time).  Declared so that the algorithm goes
 * before the memory it points into. */
struct Cached {
	Kind kind;
	comm_dtype dt;  /* all_reduce: the dtype as called (bf16 / f16 run as f32) */
	comm_op op;     /* all_reduce */
	size_t count;   /* elements (all_reduce), bytes per rank (all_gather), bytes (broadcast) */
	int root;       /* broadcast */
	uint64_t used;  /* last use, for eviction */
	std::vector<char> in, out;
	std::unique_ptr<gloo::Algorithm> algo;
};

/* What the C struct points at (C++ members stay out of the C layout). */
struct Impl {
	std::shared_ptr<gloo::transport::Device> dev;
	std::shared_ptr<gloo::rendezvous::Context> ctx;  /* unbound buffers, the device's loop */
	std::shared_ptr<gloo::rendezvous::Context> sctx; /* sync pairs; null for one rank */
	int sync_timeout_ms;                /* the sync pairs' timeout (fixed at connect) */
	bool spin = false;                  /* comm_params.spin: the sync pairs busy-poll */
	/* [rank]: its end of our connection (ctx), the same for sctx, and the
	 * address it listened on for us (Gloo names either in its messages: a
	 * pair that accepted the connection before connect() was called keeps
	 * the published one) */
	std::vector<std::string> peer_addr, speer_addr, peer_listen, speer_listen;
	std::vector<std::unique_ptr<Cached>> cache; /* at most CACHE_MAX */
	uint64_t clock = 0;
	std::vector<char> scratch;          /* widening, reduce_scatter, all_to_allv */
	std::vector<char> scratch2;
	std::string prefix;
};

/* Sync mesh limits: a message larger than SYNC_MAX_BYTES takes the unbound
 * path (a blocking write of a large message can wait on the peer's reads,
 * which in sync mode only its own waits make); CACHE_MAX algorithm objects
 * per group. */
const size_t SYNC_MAX_BYTES = (size_t)256 << 10;
const size_t CACHE_MAX = 8;

/* Slot of point-to-point messages: a prefix no Gloo collective uses
 * (theirs are small), so sends and recvs match per pair in call order. */
const uint64_t P2P_SLOT = (uint64_t)0xD5 << 56;

std::once_flag process_setup;
std::terminate_handler prev_terminate;

/* Logs what ended the process (an exception on Gloo's loop thread), then
 * lets the previous handler abort. */
void on_terminate()
{
	const char *what = "unknown";
	try {
		if (auto ex = std::current_exception())
			std::rethrow_exception(ex);
	} catch (const std::exception &e) {
		what = e.what();
	} catch (...) {
	}
	log_error("comm_gloo", "unrecoverable failure inside Gloo's transport thread: the process "
		  "aborts (peers see it as a dead rank)", "what=\"%s\"", what);
	if (prev_terminate)
		prev_terminate();
	std::abort();
}

void setup_process()
{
	struct sigaction sa = {};
	if (sigaction(SIGPIPE, nullptr, &sa) == 0 && sa.sa_handler == SIG_DFL) {
		signal(SIGPIPE, SIG_IGN);
		log_info("comm_gloo", "ignoring SIGPIPE (Gloo writes without MSG_NOSIGNAL)", "%s", "");
	}
	prev_terminate = std::set_terminate(on_terminate);
}

} // namespace

struct gloo_group {
	comm_group g; /* first: comm.c sees only this */
	Impl *impl;
};

static gloo_group *gg(comm_group *g)
{
	return reinterpret_cast<gloo_group *>(g);
}

/* Turns an exception out of Gloo into DS_ETIMEOUT / DS_EIO with a message
 * that names the call, the group and (when found) the peer. */
static int failure(comm_group *g, const char *call, const char *what, ds_err *err)
{
	Impl *im = gg(g)->impl;
	std::string w = what ? what : "";
	int peer = -1;
	for (size_t r = 0; peer < 0 && r < im->peer_addr.size(); r++) {
		if ((!im->peer_addr[r].empty() && w.find(im->peer_addr[r]) != std::string::npos) ||
		    (!im->peer_listen[r].empty() && w.find(im->peer_listen[r]) != std::string::npos))
			peer = (int)r;
		else if ((r < im->speer_addr.size() && !im->speer_addr[r].empty() &&
			  w.find(im->speer_addr[r]) != std::string::npos) ||
			 (r < im->speer_listen.size() && !im->speer_listen[r].empty() &&
			  w.find(im->speer_listen[r]) != std::string::npos))
			peer = (int)r;
	}
	bool timeout = w.find("Timed out") != std::string::npos ||
		       w.find("timeout") != std::string::npos;
	if (timeout)
		return ds_err_set(err, DS_ETIMEOUT, "comm %s (group %s, gloo, rank %d of %d): no answer "
			"within %d ms%s%s (%s)", call, g->name, g->rank, g->size, g->timeout_ms,
			peer >= 0 ? " from rank " : "", peer >= 0 ? std::to_string(peer).c_str() : "",
			w.c_str());
	if (peer >= 0)
		return ds_err_set(err, DS_EIO, "comm %s (group %s, gloo, rank %d of %d): rank %d is dead "
			"or unreachable (%s)", call, g->name, g->rank, g->size, peer, w.c_str());
	return ds_err_set(err, DS_EIO, "comm %s (group %s, gloo, rank %d of %d): transport failure "
		"(%s)", call, g->name, g->rank, g->size, w.c_str());
}

/* Runs f (Gloo calls) and converts every exception (invariant: none leaves
 * this file). */
template <class F>
static int guarded(comm_group *g, const char *call, ds_err *err, F f)
{
	try {
		f();
		return DS_OK;
	} catch (const gloo::IoException &e) {
		return failure(g, call, e.what(), err);
	} catch (const gloo::EnforceNotMet &e) {
		return failure(g, call, e.what(), err);
	} catch (const std::bad_alloc &) {
		return failure(g, call, "out of memory inside the collective", err);
	} catch (const std::exception &e) {
		return failure(g, call, e.what(), err);
	} catch (...) {
		return failure(g, call, "unknown exception", err);
	}
}

/* Scratch of at least n bytes (kept for the group's life: no allocation
 * per call once warm); NULL when it cannot grow. */
static char *scratch(std::vector<char> &v, size_t n)
{
	try {
		if (v.size() < n)
			v.resize(n);
	} catch (...) {
		return nullptr;
	}
	return v.data();
}

/* ---- element types ---- */

static float bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static uint16_t f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7FFFFFFFu) > 0x7F800000u)
		return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
	u += 0x7FFFu + ((u >> 16) & 1u);    /* round to nearest even */
	return (uint16_t)(u >> 16);
}

static float f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FFu, u;
	if (exp == 0x1F) {
		u = sign | 0x7F800000u | (mant << 13);
	} else if (exp) {
		u = sign | ((exp + 112) << 23) | (mant << 13);
	} else if (!mant) {
		u = sign;
	} else { /* subnormal: normalise */
		int e = 113;
		while (!(mant & 0x400u)) {
			mant <<= 1;
			e--;
		}
		u = sign | ((uint32_t)e << 23) | ((mant & 0x3FFu) << 13);
	}
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static uint16_t f32_to_f16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint32_t sign = (u >> 16) & 0x8000u, mant = u & 0x7FFFFFu;
	int exp = (int)((u >> 23) & 0xFF);
	if (exp == 0xFF)
		return (uint16_t)(sign | 0x7C00u | (mant ? 0x200u : 0));
	exp = exp - 127 + 15;
	if (exp >= 31)
		return (uint16_t)(sign | 0x7C00u);
	if (exp <= 0) {
		if (exp < -10)
			return (uint16_t)sign;
		mant |= 0x800000u;
		int shift = 14 - exp;
		uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
		if (rem > half || (rem == half && (h & 1)))
			h++;
		return (uint16_t)(sign | h);
	}
	uint32_t h = ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1FFFu;
	if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
		h++; /* a carry into the exponent is the right rounding, up to inf */
	return (uint16_t)(sign | h);
}

/* The reductions: out[i] = a[i] op b[i]; a is the local partial, b what
 * came from the ring.  Sums of integers wrap. */
template <class T> static T op_apply(comm_op op, T a, T b)
{
	switch (op) {
	case COMM_MAX:
		return b > a ? b : a;
	case COMM_MIN:
		return b < a ? b : a;
	default:
		return a + b;
	}
}

template <> int32_t op_apply<int32_t>(comm_op op, int32_t a, int32_t b)
{
	if (op == COMM_SUM)
		return (int32_t)((uint32_t)a + (uint32_t)b);
	return op == COMM_MAX ? (b > a ? b : a) : (b < a ? b : a);
}

template <> uint8_t op_apply<uint8_t>(comm_op op, uint8_t a, uint8_t b)
{
	if (op == COMM_SUM)
		return (uint8_t)(a + b);
	return op == COMM_MAX ? (b > a ? b : a) : (b < a ? b : a);
}

template <class T> static gloo::AllreduceOptions::Func reducer(comm_op op)
{
	return [op](void *o, const void *a, const void *b, size_t n) {
		T *out = static_cast<T *>(o);
		const T *x = static_cast<const T *>(a), *y = static_cast<const T *>(b);
		for (size_t i = 0; i < n; i++)
			out[i] = op_apply<T>(op, x[i], y[i]);
	};
}

/* In-place ring all-reduce of n elements of T at buf (may throw). */
template <class T>
static void ring_all_reduce(comm_group *g, T *buf, size_t n, comm_op op)
{
	gloo::AllreduceOptions opts(gg(g)->impl->ctx);
	opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
	opts.setOutput(buf, n);
	opts.setReduceFunction(reducer<T>(op));
	opts.setTimeout(ms(g->timeout_ms));
	gloo::allreduce(opts);
}

/* ---- the sync mesh ---- */

/* Whether a call of `bytes` (the largest single message) takes the sync
 * mesh.  Every rank decides alike: the sizes are the same on every rank
 * (comm.h), and so is the timeout when comm_group_set_timeout is called
 * alike (comm.h: a changed timeout moves a Gloo group onto the unbound
 * path, whose waits take the timeout per call). */
static bool sync_path(comm_group *g, size_t bytes)
{
	const Impl *im = gg(g)->impl;
	return im->sctx && bytes > 0 && bytes <= SYNC_MAX_BYTES && g->timeout_ms == im->sync_timeout_ms;
}

template <class T, comm_op OP> static void reduce_fn(T *x, const T *y, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] = op_apply<T>(OP, x[i], y[i]);
}

template <class T> static const gloo::ReductionFunction<T> *reduction(comm_op op)
{
	static const gloo::ReductionFunction<T> sum(gloo::CUSTOM, &reduce_fn<T, COMM_SUM>),
		max(gloo::CUSTOM, &reduce_fn<T, COMM_MAX>), min(gloo::CUSTOM, &reduce_fn<T, COMM_MIN>);
	return op == COMM_MAX ? &max : op == COMM_MIN ? &min : &sum;
}

/* The all-reduce object for n elements of T at buf.  Two ranks summing:
 * AllreduceRing, one exchange each way (each rank adds the other's buffer
 * to its own: a + b and b + a are the same bits).  Otherwise
 * AllreduceRingChunked, where each chunk is reduced along the ring by
 * ranks fixed by its position and the finished chunk is copied around, so
 * every rank gets the same bits (max / min of -0 and +0, or of a NaN,
 * depend on the operand order, hence not the plain ring for them). */
template <class T>
static gloo::Algorithm *make_all_reduce(Impl *im, int W, char *buf, size_t n, comm_op op)
{
	std::vector<T *> ptrs{reinterpret_cast<T *>(buf)};
	if (W == 2 && op == COMM_SUM)
		return new gloo::AllreduceRing<T>(im->sctx, ptrs, (int)n, reduction<T>(op));
	return new gloo::AllreduceRingChunked<T>(im->sctx, ptrs, (int)n, reduction<T>(op));
}

/* The cached object of this shape, or a new one (made by `make` on the
 * Cached whose staging vectors it sized; may throw).  Every rank makes the
 * same calls in the same order, so every rank makes and evicts the same
 * objects in the same order, and the slots Gloo numbers them by agree. */
template <class F>
static Cached *cached(Impl *im, Kind kind, comm_dtype dt, comm_op op, size_t count, int root, F make)
{
	for (auto &c : im->cache)
		if (c->kind == kind && c->dt == dt && c->op == op && c->count == count && c->root == root) {
			c->used = ++im->clock;
			return c.get();
		}
	if (im->cache.size() >= CACHE_MAX) {
		auto lru = std::min_element(im->cache.begin(), im->cache.end(),
					    [](const std::unique_ptr<Cached> &a,
					       const std::unique_ptr<Cached> &b) { return a->used < b->used; });
		im->cache.erase(lru);
	}
	std::unique_ptr<Cached> c(new Cached());
	c->kind = kind;
	c->dt = dt;
	c->op = op;
	c->count = count;
	c->root = root;
	make(*c);
	c->used = ++im->clock;
	im->cache.push_back(std::move(c));
	return im->cache.back().get();
}

/* all_reduce on the sync mesh: send is staged (bf16 / f16 widened to f32),
 * reduced by Gloo, the result copied (rounded) to recv. */
static int sync_all_reduce(comm_group *g, const char *call, const void *send, void *recv, size_t n,
			   comm_dtype dt, comm_op op, ds_err *err)
{
	Impl *im = gg(g)->impl;
	const bool wide = dt == COMM_BF16 || dt == COMM_F16;
	const size_t es = wide ? sizeof(float) : comm_dtype_size(dt);
	Cached *c = nullptr;
	int rc = guarded(g, call, err, [&] {
		c = cached(im, Kind::ALL_REDUCE, dt, op, n, 0, [&](Cached &x) {
			x.in.resize(n * es);
			if (dt == COMM_I32)
				x.algo.reset(make_all_reduce<int32_t>(im, g->size, x.in.data(), n, op));
			else if (dt == COMM_U8)
				x.algo.reset(make_all_reduce<uint8_t>(im, g->size, x.in.data(), n, op));
			else
				x.algo.reset(make_all_reduce<float>(im, g->size, x.in.data(), n, op));
		});
	});
	if (rc)
		return rc;
	if (wide) {
		float *w = reinterpret_cast<float *>(c->in.data());
		const uint16_t *s = static_cast<const uint16_t *>(send);
		for (size_t i = 0; i < n; i++) {
			uint16_t h;
			memcpy(&h, s + i, 2);
			w[i] = dt == COMM_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
		}
	} else {
		memcpy(c->in.data(), send, n * es);
	}
	if ((rc = guarded(g, call, err, [&] { c->algo->run(); })))
		return rc;
	if (wide) {
		const float *w = reinterpret_cast<const float *>(c->in.data());
		uint16_t *r = static_cast<uint16_t *>(recv);
		for (size_t i = 0; i < n; i++) {
			uint16_t h = dt == COMM_BF16 ? f32_to_bf16(w[i]) : f32_to_f16(w[i]);
			memcpy(r + i, &h, 2);
		}
	} else {
		memcpy(recv, c->in.data(), n * es);
	}
	return DS_OK;
}

/* recv = op over ranks of send (n elements; send may equal recv), every
 * dtype, by the order of the file's note. */
static int reduce_into(comm_group *g, const char *call, const void *send, void *recv, size_t n,
		       comm_dtype dt, comm_op op, ds_err *err)
{
	size_t es = comm_dtype_size(dt);
	if (sync_path(g, n * (dt == COMM_BF16 || dt == COMM_F16 ? sizeof(float) : es)))
		return sync_all_reduce(g, call, send, recv, n, dt, op, err);
	if (dt == COMM_BF16 || dt == COMM_F16) {
		float *w = (float *)scratch(gg(g)->impl->scratch2, n * sizeof(float));
		if (!w)
			return ds_err_set(err, DS_ENOMEM, "comm %s (group %s): no memory for %zu f32 "
				"elements", call, g->name, n);
		const uint16_t *s = static_cast<const uint16_t *>(send);
		for (size_t i = 0; i < n; i++) {
			uint16_t h;
			memcpy(&h, s + i, 2);
			w[i] = dt == COMM_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
		}
		int rc = guarded(g, call, err, [&] { ring_all_reduce<float>(g, w, n, op); });
		if (rc)
			return rc;
		uint16_t *r = static_cast<uint16_t *>(recv);
		for (size_t i = 0; i < n; i++) {
			uint16_t h = dt == COMM_BF16 ? f32_to_bf16(w[i]) : f32_to_f16(w[i]);
			memcpy(r + i, &h, 2);
		}
		return DS_OK;
	}
	if (send != recv)
		memcpy(recv, send, n * es);
	return guarded(g, call, err, [&] {
		switch (dt) {
		case COMM_F32:
			ring_all_reduce<float>(g, static_cast<float *>(recv), n, op);
			break;
		case COMM_I32:
			ring_all_reduce<int32_t>(g, static_cast<int32_t *>(recv), n, op);
			break;
		default:
			ring_all_reduce<uint8_t>(g, static_cast<uint8_t *>(recv), n, op);
			break;
		}
	});
}

/* ---- the ops ---- */

static int gloo_all_reduce(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, comm_op op, ds_err *err)
{
	return reduce_into(g, "all_reduce", send, recv, (size_t)count, dt, op, err);
}

static int gloo_reduce_scatter(comm_group *g, const void *send, void *recv, int64_t count,
			       comm_dtype dt, comm_op op, ds_err *err)
{
	size_t es = comm_dtype_size(dt), n = (size_t)count * (size_t)g->size;
	char *all = scratch(gg(g)->impl->scratch, n * es);
	if (!all)
		return ds_err_set(err, DS_ENOMEM, "comm reduce_scatter (group %s): no memory for %zu "
			"bytes", g->name, n * es);
	int rc = reduce_into(g, "reduce_scatter", send, all, n, dt, op, err);
	if (!rc) /* recv may be send's own slice (in place): all is apart */
		memcpy(recv, all + (size_t)g->rank * (size_t)count * es, (size_t)count * es);
	return rc;
}

static int gloo_all_gather(comm_group *g, const void *send, void *recv, int64_t count,
			   comm_dtype dt, ds_err *err)
{
	size_t n = (size_t)count * comm_dtype_size(dt);
	if (sync_path(g, n)) { /* AllgatherRing: W - 1 rounds of one slice each */
		Impl *im = gg(g)->impl;
		const size_t W = (size_t)g->size;
		Cached *c = nullptr;
		int rc = guarded(g, "all_gather", err, [&] {
			c = cached(im, Kind::ALL_GATHER, COMM_U8, COMM_SUM, n, 0, [&](Cached &x) {
				x.in.resize(n);
				x.out.resize(n * W);
				std::vector<const uint8_t *> in{reinterpret_cast<const uint8_t *>(x.in.data())};
				x.algo.reset(new gloo::AllgatherRing<uint8_t>(
					im->sctx, in, reinterpret_cast<uint8_t *>(x.out.data()), (int)n));
			});
		});
		if (rc)
			return rc;
		memcpy(c->in.data(), send, n);
		if ((rc = guarded(g, "all_gather", err, [&] { c->algo->run(); })))
			return rc;
		memcpy(recv, c->out.data(), n * W);
		return DS_OK;
	}
	return guarded(g, "all_gather", err, [&] {
		gloo::AllgatherOptions opts(gg(g)->impl->ctx);
		char *mine = static_cast<char *>(recv) + (size_t)g->rank * n;
		if (send != mine) /* else in place: Gloo takes the output's own slice */
			opts.setInput(const_cast<uint8_t *>(static_cast<const uint8_t *>(send)), n);
		opts.setOutput(static_cast<uint8_t *>(recv), n * (size_t)g->size);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::allgather(opts);
	});
}

static int gloo_broadcast(comm_group *g, void *buf, int64_t count, comm_dtype dt, int root,
			  ds_err *err)
{
	size_t n = (size_t)count * comm_dtype_size(dt);
	if (sync_path(g, n)) { /* BroadcastOneToAll: clear-to-send, then the data */
		Impl *im = gg(g)->impl;
		Cached *c = nullptr;
		int rc = guarded(g, "broadcast", err, [&] {
			c = cached(im, Kind::BROADCAST, COMM_U8, COMM_SUM, n, root, [&](Cached &x) {
				x.in.resize(n);
				std::vector<uint8_t *> ptrs{reinterpret_cast<uint8_t *>(x.in.data())};
				x.algo.reset(new gloo::BroadcastOneToAll<uint8_t>(im->sctx, ptrs, n, root));
			});
		});
		if (rc)
			return rc;
		if (g->rank == root)
			memcpy(c->in.data(), buf, n);
		if ((rc = guarded(g, "broadcast", err, [&] { c->algo->run(); })))
			return rc;
		if (g->rank != root)
			memcpy(buf, c->in.data(), n);
		return DS_OK;
	}
	return guarded(g, "broadcast", err, [&] {
		gloo::BroadcastOptions opts(gg(g)->impl->ctx);
		opts.setOutput(static_cast<uint8_t *>(buf), n);
		opts.setRoot(root);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::broadcast(opts);
	});
}

/* Gloo's alltoallv takes contiguous per-rank ranges: the send ranges are
 * packed into scratch, the received ones unpacked to their displacements.
 * Sizes are passed in bytes (element type u8), which every dtype fits. */
static int gloo_all_to_allv(comm_group *g, const void *send, const int64_t *send_counts,
			    const int64_t *send_displs, void *recv, const int64_t *recv_counts,
			    const int64_t *recv_displs, comm_dtype dt, ds_err *err)
{
	size_t es = comm_dtype_size(dt), W = (size_t)g->size, sn = 0, rn = 0;
	for (size_t p = 0; p < W; p++) {
		sn += (size_t)send_counts[p] * es;
		rn += (size_t)recv_counts[p] * es;
	}
	Impl *im = gg(g)->impl;
	/* one byte more: a valid pointer when everything is empty */
	char *sb = scratch(im->scratch, sn + 1), *rb = sb ? scratch(im->scratch2, rn + 1) : nullptr;
	if (!sb || !rb)
		return ds_err_set(err, DS_ENOMEM, "comm all_to_allv (group %s): no memory for %zu "
			"bytes", g->name, sn + rn);
	std::vector<int64_t> sc(W), rc_(W);
	size_t off = 0;
	for (size_t p = 0; p < W; p++) {
		sc[p] = send_counts[p] * (int64_t)es;
		rc_[p] = recv_counts[p] * (int64_t)es;
		if (sc[p]) /* send may be NULL when nothing is sent */
			memcpy(sb + off, static_cast<const char *>(send) + (size_t)send_displs[p] * es,
			       (size_t)sc[p]);
		off += (size_t)sc[p];
	}
	int rc = guarded(g, "all_to_allv", err, [&] {
		gloo::AlltoallvOptions opts(im->ctx);
		opts.setInput(reinterpret_cast<uint8_t *>(sb), sc);
		opts.setOutput(reinterpret_cast<uint8_t *>(rb), rc_);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::alltoallv(opts);
	});
	if (rc)
		return rc;
	off = 0;
	for (size_t p = 0; p < W; p++) {
		if (rc_[p])
			memcpy(static_cast<char *>(recv) + (size_t)recv_displs[p] * es, rb + off,
			       (size_t)rc_[p]);
		off += (size_t)rc_[p];
	}
	return DS_OK;
}

static int p2p(comm_group *g, const char *call, void *buf, size_t n, int peer, bool sending,
	       ds_err *err)
{
	int rc = guarded(g, call, err, [&] {
		auto ub = gg(g)->impl->ctx->createUnboundBuffer(buf, n);
		bool done;
		if (sending) {
			ub->send(peer, P2P_SLOT);
			done = ub->waitSend(ms(g->timeout_ms));
		} else {
			ub->recv(peer, P2P_SLOT);
			done = ub->waitRecv(ms(g->timeout_ms));
		}
		if (!done)
			throw gloo::IoException("aborted before completion");
	});
	if (rc == DS_ETIMEOUT) /* the peer is known here even when Gloo's text has no address */
		ds_err_wrap(err, "peer rank %d", peer);
	return rc;
}

static int gloo_send(comm_group *g, const void *buf, int64_t count, comm_dtype dt, int peer,
		     ds_err *err)
{
	return p2p(g, "send", const_cast<void *>(buf), (size_t)count * comm_dtype_size(dt), peer,
		   true, err);
}

static int gloo_recv(comm_group *g, void *buf, int64_t count, comm_dtype dt, int peer,
		     ds_err *err)
{
	return p2p(g, "recv", buf, (size_t)count * comm_dtype_size(dt), peer, false, err);
}

static int gloo_barrier(comm_group *g, ds_err *err)
{
	return guarded(g, "barrier", err, [&] {
		gloo::BarrierOptions opts(gg(g)->impl->ctx);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::barrier(opts);
	});
}

static void gloo_free(comm_group *g)
{
	gloo_group *x = gg(g);
	try {
		if (x->impl) { /* reverse of setup: connections, then the device's thread */
			x->impl->cache.clear();
			x->impl->sctx.reset();
			x->impl->ctx.reset();
			x->impl->dev.reset();
		}
	} catch (...) {
		log_warn("comm_gloo", "exception while closing the group", "group=%s", g->name);
	}
	delete x->impl;
	free(x);
}

static const comm_ops gloo_ops = {
	.name = "gloo",
	.mem = COMM_MEM_HOST,
	.free = gloo_free,
	.all_reduce = gloo_all_reduce,
	.all_gather = gloo_all_gather,
	.reduce_scatter = gloo_reduce_scatter,
	.broadcast = gloo_broadcast,
	.all_to_allv = gloo_all_to_allv,
	.send = gloo_send,
	.recv = gloo_recv,
	.barrier = gloo_barrier,
	.sync = NULL,
};

/* The ranks whose "<rank>/host" is missing, as "2, 5" (probed with a short
 * wait: the caller already waited out the timeout). */
static std::string missing_ranks(const comm_store *st, const std::string &prefix, int W)
{
	std::string out;
	for (int r = 0; r < W; r++) {
		char buf[COMM_STORE_VALUE_MAX];
		size_t len;
		ds_err e = {};
		std::string key = prefix + "/" + std::to_string(r) + "/host";
		if (st->get(st->ctx, key.c_str(), buf, sizeof buf, &len, 1, &e) == DS_ETIMEOUT)
			out += (out.empty() ? "" : ", ") + std::to_string(r);
	}
	return out;
}

/* Connects the group (may throw). */
static void connect_group(comm_group *g, Impl *im, const comm_store *st, const char *host)
{
	std::string me = std::to_string(g->rank);
	ds_err e = {};
	int rc = st->set(st->ctx, (im->prefix + "/" + me + "/host").c_str(), host, strlen(host), &e);
	if (rc)
		throw StoreError(rc, e.msg);
	gloo::transport::tcp::attr attr(host);
	im->dev = gloo::transport::tcp::CreateDevice(attr);
	im->ctx = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
	im->ctx->setTimeout(ms(g->timeout_ms));
	StoreAdapter adapter(st, im->prefix, g->timeout_ms);
	im->ctx->connectFullMesh(adapter, im->dev);
	const char *sm = getenv("DS_COMM_SYNC");
	if (g->size > 1 && !(sm && sm[0] == '0')) { /* the sync mesh: its own keys, the same device */
		im->sctx = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
		im->sctx->setTimeout(ms(g->timeout_ms));
		StoreAdapter sadapter(st, im->prefix + "/sync", g->timeout_ms);
		im->sctx->connectFullMesh(sadapter, im->dev);
		for (int r = 0; r < g->size; r++)
			if (r != g->rank)
				im->sctx->getPair(r)->setSync(true, im->spin); /* busy-poll: note */
		im->sync_timeout_ms = g->timeout_ms;
	}

	/* One byte to and from every peer: afterwards every connection is
	 * established on both ends, so each pair's local address is final
	 * (a connecting pair learns it only once connected). */
	{
		std::vector<int64_t> ones((size_t)g->size, 1);
		std::vector<uint8_t> out((size_t)g->size, 1), in((size_t)g->size, 0);
		gloo::AlltoallvOptions opts(im->ctx);
		opts.setInput(out.data(), ones);
		opts.setOutput(in.data(), ones);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::alltoallv(opts);
	}
	/* ready: our end of every connection, one line per rank: the unbound
	 * mesh's address, then (with more than one rank) the sync mesh's */
	std::string ready;
	for (int r = 0; r < g->size; r++) {
		if (r != g->rank) {
			ready += im->ctx->getPair(r)->address().str();
			if (im->sctx)
				ready += " " + im->sctx->getPair(r)->address().str();
		}
		ready += "\n";
	}
	if (ready.size() > COMM_STORE_VALUE_MAX)
		ready.clear(); /* too many ranks to name peers by address: go without */
	rc = st->set(st->ctx, (im->prefix + "/" + me + "/ready").c_str(), ready.data(), ready.size(),
		     &e);
	if (rc)
		throw StoreError(rc, e.msg);
	im->peer_addr.assign((size_t)g->size, std::string());
	im->peer_listen.assign((size_t)g->size, std::string());
	im->speer_addr.assign((size_t)g->size, std::string());
	im->speer_listen.assign((size_t)g->size, std::string());
	StoreAdapter sync_adapter(st, im->prefix + "/sync", g->timeout_ms);
	for (int r = 0; r < g->size; r++) {
		if (r == g->rank)
			continue;
		char buf[COMM_STORE_VALUE_MAX + 1];
		size_t len = 0;
		std::string key = im->prefix + "/" + std::to_string(r) + "/ready";
		rc = st->get(st->ctx, key.c_str(), buf, sizeof buf - 1, &len, g->timeout_ms, &e);
		if (rc)
			throw StoreError(rc, e.msg);
		buf[len] = '\0';
		/* line g->rank of rank r's value; a malformed value only loses
		 * the naming of that peer */
		const char *line = buf;
		for (int i = 0; i < g->rank && line; i++) {
			line = strchr(line, '\n');
			if (line)
				line++;
		}
		if (line) {
			const char *end = strchr(line, '\n');
			std::string both(line, end ? (size_t)(end - line) : strlen(line));
			size_t sp = both.find(' ');
			im->peer_addr[(size_t)r] = both.substr(0, sp);
			if (sp != std::string::npos)
				im->speer_addr[(size_t)r] = both.substr(sp + 1);
		}
		/* rank r's published pair addresses skip r itself */
		std::vector<char> all = adapter.get(std::to_string(r));
		size_t per = all.size() / (size_t)(g->size - 1), idx = (size_t)(g->rank < r ? g->rank : g->rank - 1);
		if (per && all.size() % per == 0) {
			std::vector<char> one(all.begin() + (long)(idx * per), all.begin() + (long)((idx + 1) * per));
			im->peer_listen[(size_t)r] = gloo::transport::tcp::Address(one).str();
		}
		if (im->sctx) { /* the same for the sync mesh's listening ends */
			std::vector<char> sall = sync_adapter.get(std::to_string(r));
			size_t sper = sall.size() / (size_t)(g->size - 1);
			if (sper && sall.size() % sper == 0) {
				std::vector<char> one(sall.begin() + (long)(idx * sper),
						      sall.begin() + (long)((idx + 1) * sper));
				im->speer_listen[(size_t)r] = gloo::transport::tcp::Address(one).str();
			}
		}
		log_debug("comm_gloo", "peer address", "group=%s rank=%d peer=%d addr=%s listen=%s "
			  "sync_addr=%s sync_listen=%s", g->name, g->rank, r, im->peer_addr[(size_t)r].c_str(),
			  im->peer_listen[(size_t)r].c_str(), im->speer_addr[(size_t)r].c_str(),
			  im->speer_listen[(size_t)r].c_str());
	}
	/* no rank sends on the sync mesh before every rank has taken its pairs
	 * off the device's loop */
	if (im->sctx) {
		gloo::BarrierOptions opts(im->ctx);
		opts.setTimeout(ms(g->timeout_ms));
		gloo::barrier(opts);
	}
}

extern "C" comm_group *comm_gloo_new(const comm_params *p, const comm_store *store,
				     const char *key_prefix, const char *host, ds_err *err)
{
	comm_params def = comm_default_params();
	gloo_group *x = nullptr;
	int rc;
	if (!p)
		p = &def;
	if (!store || !store->set || !store->get) {
		ds_err_set(err, DS_EINVAL, "comm gloo: a rendezvous store is needed");
		return nullptr;
	}
	if (!key_prefix || !key_prefix[0] || strlen(key_prefix) > 128) {
		ds_err_set(err, DS_EINVAL, "comm gloo: key prefix must be 1..128 bytes (\"<job>/<group>\")");
		return nullptr;
	}
	if (!host || !host[0]) {
		ds_err_set(err, DS_EINVAL, "comm gloo: the host to listen on is needed (\"127.0.0.1\" "
			   "for local ranks)");
		return nullptr;
	}
	x = static_cast<gloo_group *>(calloc(1, sizeof *x));
	if (!x) {
		ds_err_set(err, DS_ENOMEM, "comm gloo: out of memory");
		return nullptr;
	}
	if ((rc = comm_group_init(&x->g, &gloo_ops, p, err))) {
		free(x);
		return nullptr;
	}
	try {
		x->impl = new Impl();
		x->impl->prefix = key_prefix;
		x->impl->spin = p->spin != 0;
	} catch (...) {
		free(x);
		ds_err_set(err, DS_ENOMEM, "comm gloo: out of memory");
		return nullptr;
	}
	std::call_once(process_setup, setup_process);
	comm_group *g = &x->g;
	try {
		connect_group(g, x->impl, store, host);
		log_info("comm_gloo", "group connected", "group=%s prefix=%s rank=%d size=%d host=%s",
			 g->name, key_prefix, g->rank, g->size, host);
		return g;
	} catch (const StoreError &e) {
		std::string miss = e.code == DS_ETIMEOUT ? missing_ranks(store, key_prefix, g->size) : "";
		if (!miss.empty())
			ds_err_set(err, DS_ETIMEOUT, "comm gloo (group %s, rank %d of %d): ranks %s never "
				   "arrived within %d ms (%s)", g->name, g->rank, g->size, miss.c_str(),
				   g->timeout_ms, e.what());
		else
			ds_err_set(err, e.code, "comm gloo (group %s, rank %d of %d): rendezvous: %s",
				   g->name, g->rank, g->size, e.what());
	} catch (const std::exception &e) {
		failure(g, "connect", e.what(), err);
	} catch (...) {
		failure(g, "connect", "unknown exception", err);
	}
	gloo_free(g);
	return nullptr;
}
