/*
 * mpi_ring: a token passed around a ring of MPI ranks over RDMA SEND/RECV,
 * with connections set up through rdmasafe_get_event and completions
 * handled by an rdmasafe CQ loop.
 *
 *   mpirun -np 4 mpi_ring [-a ADDR] [-n TRIPS] [-m event|adaptive|both]
 *                         [-s SPIN_US] [-t WATCHDOG_SECS]
 *
 * MPI only bootstraps and keeps the phases in step: each rank binds an
 * RDMA CM listener on ADDR (default $RDMASAFE_TEST_ADDR) port 0, the ranks
 * exchange address and port with MPI_Allgather, and MPI_Barrier separates
 * the phases (connected, each mode, teardown). The token never goes
 * through MPI.
 *
 * Each rank connects to rank+1 and accepts rank-1 (a ring), all on one CM
 * event channel handled with rdmasafe_get_event_timeout/rdmasafe_event_free.
 * The connect request carries the rank (with its own length: the received
 * private_data_len is the transport's padded maximum). Both QPs get their
 * own CQ, both CQs are on one completion channel served by one CQ loop.
 *
 * Rank 0 sends the token; every rank forwards it from its receive
 * callback; when it is back at rank 0 a trip is done and rank 0 sends the
 * next, TRIPS times (default 100). Every completion is checked (status,
 * order, payload: mode, trip, hop count). Once a rank has seen all TRIPS
 * tokens and its sends have completed, its callback stops the loop. This
 * runs in event mode, then again in adaptive mode (-m both, the default),
 * a new loop per mode on the same QPs.
 *
 * Per rank and mode one line of figures:
 *   mpi_ring rank=R size=S mode=M trips=K tokens=K sends=K completions=C
 *     wakeups=W per_wakeup=X empty_wakeups=E cq_events=V ack_calls=A
 *     arm_calls=P unacked_now=0 ms=T
 * and from rank 0 per mode:
 *   mpi_ring: mode=M token made K of K trips around S ranks (... us per trip)
 *
 * Teardown: each rank disconnects its connection to rank+1 and answers
 * the disconnect from rank-1, drains both QPs through the loop
 * (rdmasafe_cq_loop_drain_qp: the flushed receives reach the callback, the
 * loop's own marker requests never do), destroys the
 * loop, the QPs and the CQs (SIGALRM watchdog), and checks that no CM event
 * copy is outstanding. Exit status 0 only if all of it went as expected.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <mpi.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "rdmasafe.h"

#define RING_MAGIC 0x474e4952u /* "RING" */
#define MSG_SIZE 64
#define RECVS 4       /* receives kept posted on the QP from rank-1 */
#define SEND_SLOTS 4  /* sends in flight at most on the QP to rank+1 */
#define CQE 64
#define STEP_MS 10000 /* how long connection setup may take */

/* The wr_ids of rdmasafe's drain markers: they must never reach a callback. */
#define DRAIN_SEND_WR_ID UINT64_MAX
#define DRAIN_RECV_WR_ID (UINT64_MAX - 1)

struct token {
	uint32_t magic;
	uint32_t mode;
	uint32_t trip;
	uint32_t hops; /* ranks that have sent it on this trip */
	uint8_t pad[MSG_SIZE - 16];
};
_Static_assert(sizeof(struct token) == MSG_SIZE, "token size");

/* Connect request private data: carries its own length. */
struct hello {
	uint32_t magic;
	uint16_t len;
	uint16_t pad;
	uint32_t rank;
	uint32_t size;
};

/* What MPI_Allgather exchanges (bytes). */
struct endpoint {
	char host[INET6_ADDRSTRLEN];
	uint16_t port;
};

static int rank, size, trips = 100, spin_us = 50;
static int failures;
static const char *phase = "start";

static struct rdma_event_channel *ch;
static struct rdma_cm_id *listener, *next_id, *prev_id;
static struct ibv_pd *pd;
static struct ibv_mr *mr;
static uint8_t *mem; /* RECVS receive slots, then SEND_SLOTS send slots */
static struct ibv_comp_channel *comp;
static struct ibv_cq *next_cq, *prev_cq;
static struct rdmasafe_cq_loop *loop;

/* cumulative over the modes (the QPs are reused) */
static uint64_t recv_posted, recv_done, send_posted, send_done;
/* this mode */
static uint32_t cur_mode, tokens, sends, trips_done;
static int draining, stopped;
static double t_first_send;
/* drain */
static uint64_t flushed_recvs, flushed_sends, markers_next, markers_prev;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...)
{
	va_list ap;

	failures++;
	printf("mpi_ring rank=%d: FAIL (%s) ", rank, phase);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	if (loop)
		rdmasafe_cq_loop_stop(loop);
}

/* A failure the ring cannot go on from: stop every rank. */
static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fatal(const char *fmt, ...)
{
	va_list ap;

	printf("mpi_ring rank=%d: FATAL (%s) ", rank, phase);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	MPI_Abort(MPI_COMM_WORLD, 2);
	exit(2);
}

static void on_alarm(int sig)
{
	char buf[160];
	int n = snprintf(buf, sizeof buf, "mpi_ring rank=%d: watchdog fired (hang) in phase %s\n", rank, phase);
	(void)sig;
	if (n > 0 && write(STDOUT_FILENO, buf, (size_t)n) < 0)
		_exit(4);
	_exit(3);
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char *mode_name(uint32_t m)
{
	return m == RDMASAFE_MODE_EVENT ? "event" : m == RDMASAFE_MODE_ADAPTIVE ? "adaptive" : "busy_poll";
}

/* ------------------------------------------------------------------ verbs */

static void post_recv(void)
{
	uint64_t k = recv_posted;
	struct ibv_sge sge = { .addr = (uintptr_t)(mem + (k % RECVS) * MSG_SIZE), .length = MSG_SIZE, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = k, .sg_list = &sge, .num_sge = 1 }, *bad;
	int r = ibv_post_recv(prev_id->qp, &wr, &bad);

	if (r) {
		fail("ibv_post_recv #%" PRIu64 ": %s", k, strerror(r));
		return;
	}
	recv_posted++;
}

static void send_token(uint32_t trip, uint32_t hops)
{
	uint64_t k = send_posted;
	struct token *t = (struct token *)(mem + (RECVS + k % SEND_SLOTS) * MSG_SIZE);
	struct ibv_sge sge = { .addr = (uintptr_t)t, .length = MSG_SIZE, .lkey = mr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = k, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
	}, *bad;
	int r;

	if (send_posted - send_done >= SEND_SLOTS) {
		fail("no free send slot (%" PRIu64 " sends in flight)", send_posted - send_done);
		return;
	}
	memset(t, 0, sizeof *t);
	t->magic = RING_MAGIC;
	t->mode = cur_mode;
	t->trip = trip;
	t->hops = hops;
	r = ibv_post_send(next_id->qp, &wr, &bad);
	if (r) {
		fail("ibv_post_send #%" PRIu64 ": %s", k, strerror(r));
		return;
	}
	send_posted++;
	sends++;
}

static void maybe_stop(void)
{
	if (!stopped && tokens == (uint32_t)trips && sends == (uint32_t)trips && send_done == send_posted) {
		stopped = 1;
		rdmasafe_cq_loop_stop(loop);
	}
}

/* ------------------------------------------------------------- callbacks */

static void drain_wc(const struct ibv_wc *wc, int from_prev)
{
	if (wc->wr_id == DRAIN_SEND_WR_ID || wc->wr_id == DRAIN_RECV_WR_ID) {
		/* counted, and the drain check below fails on any */
		if (from_prev)
			markers_prev++;
		else
			markers_next++;
		return;
	}
	/* flushed requests (on rxe with opcode 0: told apart by wr_id) */
	if (from_prev) {
		if (wc->wr_id != recv_done)
			fail("flushed receive wr_id %" PRIu64 ", want %" PRIu64, wc->wr_id, recv_done);
		recv_done = wc->wr_id + 1;
		flushed_recvs++;
	} else {
		if (wc->wr_id != send_done)
			fail("flushed send wr_id %" PRIu64 ", want %" PRIu64, wc->wr_id, send_done);
		send_done = wc->wr_id + 1;
		flushed_sends++;
	}
}

/* Receives from rank-1: check, repost, forward (or start the next trip). */
static void on_prev(void *ctx, const struct ibv_wc *wc, int n)
{
	(void)ctx;
	for (int i = 0; i < n; i++) {
		const struct ibv_wc *w = &wc[i];
		if (draining) {
			drain_wc(w, 1);
			continue;
		}
		if (w->status != IBV_WC_SUCCESS || w->opcode != IBV_WC_RECV) {
			fail("receive wr_id %" PRIu64 ": status %s opcode %d", w->wr_id, ibv_wc_status_str(w->status), w->opcode);
			continue;
		}
		if (w->wr_id != recv_done) {
			fail("receive wr_id %" PRIu64 ", want %" PRIu64 " (order)", w->wr_id, recv_done);
			continue;
		}
		const struct token *t = (const struct token *)(mem + (w->wr_id % RECVS) * MSG_SIZE);
		uint32_t want_hops = rank == 0 ? (uint32_t)size : (uint32_t)rank;
		struct token copy = *t;
		recv_done++;
		if (w->byte_len != MSG_SIZE || copy.magic != RING_MAGIC || copy.mode != cur_mode ||
		    copy.trip != tokens || copy.hops != want_hops) {
			fail("token #%u: %u bytes, magic %#x mode %u trip %u hops %u (want mode %u trip %u hops %u)",
			     tokens, w->byte_len, copy.magic, copy.mode, copy.trip, copy.hops, cur_mode, tokens, want_hops);
			continue;
		}
		tokens++;
		post_recv();
		if (rank != 0) {
			send_token(copy.trip, copy.hops + 1);
		} else {
			trips_done++;
			if (trips_done < (uint32_t)trips)
				send_token(trips_done, 1);
		}
	}
	if (!draining)
		maybe_stop();
}

/* Send completions of the QP to rank+1. */
static void on_next(void *ctx, const struct ibv_wc *wc, int n)
{
	(void)ctx;
	for (int i = 0; i < n; i++) {
		const struct ibv_wc *w = &wc[i];
		if (draining) {
			drain_wc(w, 0);
			continue;
		}
		if (w->status != IBV_WC_SUCCESS || w->opcode != IBV_WC_SEND)
			fail("send wr_id %" PRIu64 ": status %s opcode %d", w->wr_id, ibv_wc_status_str(w->status), w->opcode);
		else if (w->wr_id != send_done)
			fail("send completion wr_id %" PRIu64 ", want %" PRIu64 " (order)", w->wr_id, send_done);
		if (w->wr_id >= send_done && w->wr_id < send_posted)
			send_done = w->wr_id + 1;
	}
	if (!draining)
		maybe_stop();
}

/* ------------------------------------------------------------ connection */

static void make_qp(struct rdma_cm_id *id, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = cq;
	attr.cap.max_send_wr = SEND_SLOTS + 1; /* + the drain marker */
	attr.cap.max_recv_wr = RECVS + 1;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (rdma_create_qp(id, pd, &attr))
		fatal("rdma_create_qp: %s", strerror(errno));
}

static void conn_param(struct rdma_conn_param *p, const void *data, uint8_t len)
{
	memset(p, 0, sizeof *p);
	p->private_data = data;
	p->private_data_len = len;
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

/* Verbs resources, on the device the listener is bound to. */
static void open_verbs(struct ibv_context *ctx)
{
	size_t bytes = (RECVS + SEND_SLOTS) * MSG_SIZE;

	mem = aligned_alloc(4096, 4096);
	if (!mem || !(pd = ibv_alloc_pd(ctx)) ||
	    !(mr = ibv_reg_mr(pd, mem, bytes, IBV_ACCESS_LOCAL_WRITE)) ||
	    !(comp = ibv_create_comp_channel(ctx)) ||
	    !(next_cq = ibv_create_cq(ctx, CQE, NULL, comp, 0)) ||
	    !(prev_cq = ibv_create_cq(ctx, CQE, NULL, comp, 0)))
		fatal("PD, MR, completion channel, CQs: %s", strerror(errno));
	memset(mem, 0, 4096);
}

static void connect_ring(const struct endpoint *eps)
{
	const struct endpoint *ne = &eps[(rank + 1) % size];
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV }, *res;
	struct hello hello = { .magic = RING_MAGIC, .len = sizeof hello, .rank = (uint32_t)rank, .size = (uint32_t)size };
	struct rdma_conn_param p;
	char port[8];
	int next_up = 0, prev_up = 0, prev_rank = (rank + size - 1) % size;
	double deadline = now_ms() + STEP_MS;

	phase = "connect";
	snprintf(port, sizeof port, "%u", ne->port);
	if (getaddrinfo(ne->host, port, &hints, &res))
		fatal("getaddrinfo(%s, %s)", ne->host, port);
	if (rdma_create_id(ch, &next_id, NULL, RDMA_PS_TCP) ||
	    rdma_resolve_addr(next_id, NULL, res->ai_addr, 2000))
		fatal("rdma_create_id / rdma_resolve_addr to rank %d: %s", (rank + 1) % size, strerror(errno));
	freeaddrinfo(res);

	while (!(next_up && prev_up)) {
		struct rdma_cm_event *ev;
		int left = (int)(deadline - now_ms());

		if (left <= 0 || rdmasafe_get_event_timeout(ch, &ev, left))
			fatal("connection setup: %s (next %s, prev %s)", left <= 0 ? "timed out" : strerror(errno),
			      next_up ? "up" : "not up", prev_up ? "up" : "not up");
		switch (ev->event) {
		case RDMA_CM_EVENT_ADDR_RESOLVED:
			if (rdma_resolve_route(next_id, 2000))
				fatal("rdma_resolve_route: %s", strerror(errno));
			break;
		case RDMA_CM_EVENT_ROUTE_RESOLVED:
			make_qp(next_id, next_cq);
			conn_param(&p, &hello, sizeof hello);
			if (rdma_connect(next_id, &p))
				fatal("rdma_connect: %s", strerror(errno));
			break;
		case RDMA_CM_EVENT_CONNECT_REQUEST: {
			struct hello h = { 0 };
			const void *d = ev->param.conn.private_data;
			uint8_t len = ev->param.conn.private_data_len;

			if (d && len >= sizeof h)
				memcpy(&h, d, sizeof h);
			if (prev_id || h.magic != RING_MAGIC || h.len != sizeof h || h.rank != (uint32_t)prev_rank ||
			    h.size != (uint32_t)size) {
				printf("mpi_ring rank=%d: rejecting a connect request (magic %#x len %u rank %u of %u, private_data_len %u)\n",
				       rank, h.magic, h.len, h.rank, h.size, len);
				rdma_reject(ev->id, NULL, 0);
				rdma_destroy_id(ev->id);
				fail("unexpected connect request");
				break;
			}
			prev_id = ev->id;
			make_qp(prev_id, prev_cq);
			for (int i = 0; i < RECVS; i++)
				post_recv();
			conn_param(&p, NULL, 0);
			if (rdma_accept(prev_id, &p))
				fatal("rdma_accept: %s", strerror(errno));
			break;
		}
		case RDMA_CM_EVENT_ESTABLISHED:
			if (ev->id == next_id)
				next_up = 1;
			else if (ev->id == prev_id)
				prev_up = 1;
			break;
		default:
			fatal("%s (status %d) on the %s id", rdmasafe_event_str(ev->event), ev->status,
			      ev->id == next_id ? "next" : ev->id == prev_id ? "prev" : "listening");
		}
		rdmasafe_event_free(ev);
	}
	printf("mpi_ring rank=%d: connected to rank %d (next) and from rank %d (prev)\n", rank, (rank + 1) % size, prev_rank);
}

/* ----------------------------------------------------------------- modes */

static struct rdmasafe_cq_loop *new_loop(uint32_t mode)
{
	struct rdmasafe_cq_loop_options o = { .size = sizeof o };
	struct rdmasafe_cq_loop *l = NULL;
	int r;

	o.mode = (int)mode;
	o.adaptive_spin_us = spin_us;
	if ((r = rdmasafe_cq_loop_create(comp, &o, &l)) ||
	    (r = rdmasafe_cq_loop_add_cq(l, next_cq, on_next, NULL)) ||
	    (r = rdmasafe_cq_loop_add_cq(l, prev_cq, on_prev, NULL)))
		fatal("CQ loop (%s): %s", mode_name(mode), strerror(-r));
	return l;
}

static void run_mode(uint32_t mode)
{
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	double t0, t1;
	int r;

	phase = mode_name(mode);
	cur_mode = mode;
	tokens = sends = trips_done = 0;
	stopped = 0;
	loop = new_loop(mode);
	MPI_Barrier(MPI_COMM_WORLD); /* every rank has its loop for this mode */
	t0 = now_ms();
	if (rank == 0) {
		t_first_send = t0;
		send_token(0, 1);
	}
	r = rdmasafe_cq_loop_run(loop);
	t1 = now_ms();
	if (r)
		fail("rdmasafe_cq_loop_run: %s", strerror(-r));
	if (rdmasafe_cq_loop_get_stats(loop, &st))
		fail("rdmasafe_cq_loop_get_stats");
	if (tokens != (uint32_t)trips || sends != (uint32_t)trips || send_done != send_posted)
		fail("%s: %u tokens received, %u sent, %" PRIu64 " sends in flight (want %d each, none)",
		     mode_name(mode), tokens, sends, send_posted - send_done, trips);
	if (st.unacked_now != 0 || st.acked_events != st.cq_events)
		fail("%s: after the stop unacked_now %" PRIu64 ", acked %" PRIu64 " of %" PRIu64 " CQ events",
		     mode_name(mode), st.unacked_now, st.acked_events, st.cq_events);
	if (st.completions != 2ull * trips || st.error_completions)
		fail("%s: %" PRIu64 " completions (%" PRIu64 " errors), want %d", mode_name(mode), st.completions,
		     st.error_completions, 2 * trips);
	printf("mpi_ring rank=%d size=%d mode=%s trips=%d tokens=%u sends=%u completions=%" PRIu64 " wakeups=%" PRIu64
	       " per_wakeup=%.2f empty_wakeups=%" PRIu64 " cq_events=%" PRIu64 " ack_calls=%" PRIu64 " arm_calls=%" PRIu64
	       " unacked_now=%" PRIu64 " ms=%.1f\n",
	       rank, size, mode_name(mode), trips, tokens, sends, st.completions, st.wakeups,
	       st.wakeups ? (double)st.completions / st.wakeups : 0.0, st.empty_wakeups, st.cq_events, st.ack_calls,
	       st.arm_calls, st.unacked_now, t1 - t0);
	if (rank == 0)
		printf("mpi_ring: mode=%s token made %u of %d trips around %d ranks (%.1f us per trip, %.1f us per hop)\n",
		       mode_name(mode), trips_done, trips, size, (t1 - t_first_send) * 1e3 / (trips ? trips : 1),
		       (t1 - t_first_send) * 1e3 / (trips ? trips : 1) / size);
	fflush(stdout);
	r = rdmasafe_cq_loop_destroy(loop);
	loop = NULL;
	if (r)
		fail("rdmasafe_cq_loop_destroy: %s", strerror(-r));
}

/* -------------------------------------------------------------- teardown */

static void disconnect_ring(void)
{
	int next_down = 0, prev_down = 0;
	double deadline = now_ms() + STEP_MS;

	phase = "disconnect";
	if (rdma_disconnect(next_id))
		fail("rdma_disconnect (next): %s", strerror(errno));
	while (!(next_down && prev_down)) {
		struct rdma_cm_event *ev;
		int left = (int)(deadline - now_ms());

		if (left <= 0 || rdmasafe_get_event_timeout(ch, &ev, left)) {
			fail("disconnect: %s (next %s, prev %s)", left <= 0 ? "timed out" : strerror(errno),
			     next_down ? "down" : "up", prev_down ? "down" : "up");
			return;
		}
		if (ev->event == RDMA_CM_EVENT_DISCONNECTED && ev->id == next_id) {
			next_down = 1;
		} else if (ev->event == RDMA_CM_EVENT_DISCONNECTED && ev->id == prev_id) {
			prev_down = 1;
			if (rdma_disconnect(prev_id)) /* answer (DREP); the QP goes to error */
				fail("rdma_disconnect (prev): %s", strerror(errno));
		} else {
			fail("unexpected %s (status %d) while disconnecting", rdmasafe_event_str(ev->event), ev->status);
		}
		rdmasafe_event_free(ev);
	}
}

static void drain_ring(void)
{
	uint64_t pending = recv_posted - recv_done;
	int r;

	phase = "drain";
	draining = 1;
	loop = new_loop(RDMASAFE_MODE_EVENT);
	if ((r = rdmasafe_cq_loop_drain_qp(loop, next_id->qp, 0, 5000)))
		fail("rdmasafe_cq_loop_drain_qp (next): %s", strerror(-r));
	if ((r = rdmasafe_cq_loop_drain_qp(loop, prev_id->qp, 0, 5000)))
		fail("rdmasafe_cq_loop_drain_qp (prev): %s", strerror(-r));
	if (markers_next != 0 || markers_prev != 0 || flushed_recvs != pending || flushed_sends != 0)
		fail("drain: markers delivered %" PRIu64 " + %" PRIu64 " (want 0 + 0: the loop's own), flushed receives %" PRIu64
		     " (want %" PRIu64 "), flushed sends %" PRIu64,
		     markers_next, markers_prev, flushed_recvs, pending, flushed_sends);
	printf("mpi_ring rank=%d: drained: prev QP %" PRIu64 " flushed receives, no marker reached the callback\n", rank,
	       flushed_recvs);
	r = rdmasafe_cq_loop_destroy(loop);
	loop = NULL;
	if (r)
		fail("rdmasafe_cq_loop_destroy (drain loop): %s", strerror(-r));
}

static void teardown(void)
{
	struct rdmasafe_cm_counters c = { .size = sizeof c };

	phase = "teardown";
	alarm(20);
	rdma_destroy_qp(next_id);
	rdma_destroy_qp(prev_id);
	phase = "ibv_destroy_cq";
	if (ibv_destroy_cq(next_cq) || ibv_destroy_cq(prev_cq))
		fail("ibv_destroy_cq: %s", strerror(errno));
	if (ibv_destroy_comp_channel(comp))
		fail("ibv_destroy_comp_channel: %s", strerror(errno));
	phase = "rdma_destroy_id";
	if (rdma_destroy_id(next_id) || rdma_destroy_id(prev_id) || rdma_destroy_id(listener))
		fail("rdma_destroy_id: %s", strerror(errno));
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	free(mem);
	rdma_destroy_event_channel(ch);
	if (rdmasafe_cm_get_counters(&c) || c.outstanding)
		fail("CM copies outstanding: %" PRIu64, c.outstanding);
	printf("mpi_ring rank=%d: counters copied=%" PRIu64 " freed=%" PRIu64 " outstanding=%" PRIu64 "\n", rank, c.copied,
	       c.freed, c.outstanding);
}

/* ------------------------------------------------------------------ main */

static void usage(const char *argv0)
{
	fprintf(stderr, "usage: %s [-a ADDR] [-n TRIPS] [-m event|adaptive|both] [-s SPIN_US] [-t WATCHDOG_SECS]\n", argv0);
}

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR"), *modes = "both";
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;
	struct endpoint me, *eps;
	struct sockaddr *sa;
	unsigned watchdog = 60;
	int opt;

	setvbuf(stdout, NULL, _IOLBF, 0);
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	while ((opt = getopt(argc, argv, "a:n:m:s:t:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'n': trips = atoi(optarg); break;
		case 'm': modes = optarg; break;
		case 's': spin_us = atoi(optarg); break;
		case 't': watchdog = (unsigned)atoi(optarg); break;
		default:
			if (rank == 0)
				usage(argv[0]);
			MPI_Finalize();
			return 2;
		}
	}
	if (!addr || !*addr || trips < 1 || spin_us < 0 ||
	    (strcmp(modes, "event") && strcmp(modes, "adaptive") && strcmp(modes, "both"))) {
		if (rank == 0)
			usage(argv[0]);
		MPI_Finalize();
		return 2;
	}
	signal(SIGALRM, on_alarm);
	alarm(watchdog);

	/* listener on ADDR port 0 */
	phase = "listen";
	if (getaddrinfo(addr, NULL, &hints, &res))
		fatal("getaddrinfo(%s)", addr);
	if (!(ch = rdma_create_event_channel()) ||
	    rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(listener, res->ai_addr) || rdma_listen(listener, 4) || !listener->verbs)
		fatal("listener on %s: %s", addr, strerror(errno));
	freeaddrinfo(res);
	memset(&me, 0, sizeof me);
	sa = rdma_get_local_addr(listener);
	inet_ntop(sa->sa_family, sa->sa_family == AF_INET ? (void *)&((struct sockaddr_in *)sa)->sin_addr
							  : (void *)&((struct sockaddr_in6 *)sa)->sin6_addr,
		  me.host, sizeof me.host);
	me.port = ntohs(rdma_get_src_port(listener));
	open_verbs(listener->verbs);
	printf("mpi_ring rank=%d size=%d: listening on %s port %u (device %s)\n", rank, size, me.host, me.port,
	       ibv_get_device_name(listener->verbs->device));

	/* the only data MPI carries: where everybody listens */
	phase = "MPI_Allgather";
	eps = calloc((size_t)size, sizeof *eps);
	if (!eps)
		fatal("calloc");
	MPI_Allgather(&me, sizeof me, MPI_BYTE, eps, sizeof me, MPI_BYTE, MPI_COMM_WORLD);

	connect_ring(eps);
	MPI_Barrier(MPI_COMM_WORLD); /* the whole ring is up */

	if (strcmp(modes, "adaptive"))
		run_mode(RDMASAFE_MODE_EVENT);
	if (strcmp(modes, "event"))
		run_mode(RDMASAFE_MODE_ADAPTIVE);

	MPI_Barrier(MPI_COMM_WORLD); /* no token in flight anywhere */
	disconnect_ring();
	drain_ring();
	teardown();
	free(eps);
	alarm(0);
	printf("mpi_ring rank=%d: done %s\n", rank, failures ? "FAILED" : "OK");
	fflush(stdout);
	MPI_Finalize();
	return failures ? 1 : 0;
}
