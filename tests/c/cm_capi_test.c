/*
 * cm_capi_test: checks the rdmasafe C API (include/rdmasafe.h) from C.
 *
 * Events are only ever taken with the rdmasafe calls: this file contains no
 * rdma_get_cm_event / rdma_ack_cm_event call at all.
 *
 * Part 1 needs no RDMA device beyond /dev/infiniband/rdma_cm: argument
 * errors, event names, counters, timeouts on empty channels.
 * Part 2 needs a device at $RDMASAFE_TEST_ADDR (rxe0 in the test guest):
 * private data both ways at the transport limits, oversized private data,
 * reject with data, connect to a port nobody listens on, 100 held copies
 * while their ids are destroyed, the destroy barrier (kept while a copy is
 * held, bounded by the ack deadline, which fires with no further call),
 * errno untouched on success, the limit on held copies, batch gets, and the
 * copy counters.
 *
 * Prints one line per check ("ok   ..." or "FAIL ..."), then
 * "cm_capi_test: N passed, M failed"; exits 0 only if M is 0.
 * A SIGALRM watchdog turns a hang into a failure (exit 3).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#include <rdma/rdma_cma.h>

#include "check.h"

#include "rdmasafe.h"

/* Transport limits for RDMA_PS_TCP over IB / RoCE (user-visible bytes). */
#define REQ_PDATA_MAX 56  /* 92 bytes of REQ private data - 36 of CMA header */
#define REP_PDATA_MAX 196 /* IB_CM_REP_PRIVATE_DATA_SIZE */
#define REJ_PDATA_MAX 148 /* IB_CM_REJ_PRIVATE_DATA_SIZE */

#define HOLD_IDS 100
#define BATCH_IDS 50
#define BATCH_MAX 16
#define BLOCKING_BATCH_IDS 30
#define STEP_MS 30000 /* how long any one expected CM event may take (a hang, not a timing check) */

/* ---------------------------------------------------------------- output */

/* A call of the -1/errno convention failed with exactly `want`. */
#define CHECK_ERRNO(call, want, what)                                         \
	do {                                                                  \
		errno = 0;                                                    \
		int r_ = (call);                                              \
		int e_ = errno;                                               \
		CHECK(r_ == -1 && e_ == (want), "%s -> %d/%s (want -1/%s)",   \
		      what, r_, r_ == -1 ? ename(e_) : "-",          \
		      ename(want));                                 \
	} while (0)

/* --------------------------------------------------------------- watchdog */

/* ---------------------------------------------------------------- helpers */

static uint8_t pat(unsigned seed, unsigned i)
{
	return (uint8_t)(seed * 29u + i * 7u + (i >> 4) + 1u);
}

static void fill(uint8_t *buf, unsigned seed, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		buf[i] = pat(seed, i);
}

/* Checks n pattern bytes of received private data; one line. */
static void check_bytes(const void *data, unsigned len, unsigned seed,
			unsigned n, const char *what)
{
	const uint8_t *p = data;
	unsigned i;

	if (!p || len < n) {
		CHECK(0, "%s: private data %p len %u, want at least %u bytes",
		      what, data, len, n);
		return;
	}
	for (i = 0; i < n; i++)
		if (p[i] != pat(seed, i))
			break;
	if (i == n)
		CHECK(1, "%s: all %u bytes match byte by byte (private_data_len %u)",
		      what, n, len);
	else
		CHECK(0, "%s: byte %u is 0x%02x, want 0x%02x", what, i, p[i],
		      pat(seed, i));
}

static int set_nonblocking(struct rdma_event_channel *ch)
{
	int fl = fcntl(ch->fd, F_GETFL);

	return fl < 0 ? -1 : fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK);
}

static struct rdma_event_channel *new_channel(int nonblocking)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();

	if (!ch) {
		perror("rdma_create_event_channel");
		return NULL;
	}
	if (nonblocking && set_nonblocking(ch)) {
		perror("fcntl");
		rdma_destroy_event_channel(ch);
		return NULL;
	}
	return ch;
}

/*
 * Gets the next event and checks its type (and id, if given). Returns the
 * copy (caller frees it) or NULL after a failed check.
 */
static struct rdma_cm_event *expect(struct rdma_event_channel *ch, int type,
				    struct rdma_cm_id *id, const char *what)
{
	struct rdma_cm_event *ev = NULL;

	if (rdmasafe_get_event_timeout(ch, &ev, STEP_MS)) {
		int e = errno;
		CHECK(0, "%s: no %s within %d ms (%s)", what,
		      rdmasafe_event_str(type), STEP_MS, ename(e));
		return NULL;
	}
	if (!CHECK(ev && (int)ev->event == type && (!id || ev->id == id),
		   "%s: %s (status %d)", what, rdmasafe_event_str(ev->event),
		   ev->status)) {
		if (ev && (int)ev->event != type)
			info("%s: wanted %s", what, rdmasafe_event_str(type));
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

/* Frees a copy, checking the result. */
static void free_ok(struct rdma_cm_event *ev, const char *what)
{
	errno = 0;
	int r = rdmasafe_event_free(ev);
	if (r)
		CHECK(0, "rdmasafe_event_free(%s) -> %d/%s", what, r,
		      ename(errno));
}

static struct sockaddr_storage test_addr;
static socklen_t test_addr_len;

static int parse_addr(const char *s)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;
	int r = getaddrinfo(s, NULL, &hints, &res);

	if (r) {
		fprintf(stderr, "getaddrinfo(%s): %s\n", s, gai_strerror(r));
		return -1;
	}
	memcpy(&test_addr, res->ai_addr, res->ai_addrlen);
	test_addr_len = res->ai_addrlen;
	freeaddrinfo(res);
	return 0;
}

/* test_addr with the given port (host order). */
static struct sockaddr *addr_port(struct sockaddr_storage *ss, uint16_t port)
{
	memcpy(ss, &test_addr, sizeof *ss);
	if (ss->ss_family == AF_INET)
		((struct sockaddr_in *)ss)->sin_port = htons(port);
	else
		((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
	return (struct sockaddr *)ss;
}

static void counters(struct rdmasafe_cm_counters *c)
{
	memset(c, 0, sizeof *c);
	c->size = sizeof *c;
	if (rdmasafe_cm_get_counters(c))
		CHECK(0, "rdmasafe_cm_get_counters failed");
}

/* ======================================================= part 1: no device */

static void test_arguments(struct rdma_event_channel *ch)
{
	struct rdma_cm_event *ev, *evs[4];
	struct rdma_cm_event stack_event;
	void *sentinel = (void *)&stack_event;
	int flags_before = fcntl(ch->fd, F_GETFL);

	phase = "argument errors";
	ev = sentinel;
	CHECK_ERRNO(rdmasafe_get_event(NULL, &ev), EINVAL,
		    "rdmasafe_get_event(NULL channel)");
	CHECK(ev == sentinel, "rdmasafe_get_event(NULL channel) leaves *event untouched");
	CHECK_ERRNO(rdmasafe_get_event(ch, NULL), EINVAL,
		    "rdmasafe_get_event(NULL out pointer)");
	CHECK_ERRNO(rdmasafe_get_event(NULL, NULL), EINVAL,
		    "rdmasafe_get_event(NULL, NULL)");

	CHECK_ERRNO(rdmasafe_get_event_timeout(NULL, &ev, 0), EINVAL,
		    "rdmasafe_get_event_timeout(NULL channel)");
	CHECK_ERRNO(rdmasafe_get_event_timeout(ch, NULL, 0), EINVAL,
		    "rdmasafe_get_event_timeout(NULL out pointer)");
	CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &ev, -2), EINVAL,
		    "rdmasafe_get_event_timeout(timeout -2)");
	CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &ev, INT_MIN), EINVAL,
		    "rdmasafe_get_event_timeout(timeout INT_MIN)");
	CHECK(ev == sentinel, "failed timeout gets leave *event untouched");

	evs[0] = sentinel;
	CHECK_ERRNO(rdmasafe_get_events(NULL, evs, 4, 0), EINVAL,
		    "rdmasafe_get_events(NULL channel)");
	CHECK_ERRNO(rdmasafe_get_events(ch, NULL, 4, 0), EINVAL,
		    "rdmasafe_get_events(NULL array)");
	CHECK_ERRNO(rdmasafe_get_events(ch, evs, 0, 0), EINVAL,
		    "rdmasafe_get_events(max 0)");
	CHECK_ERRNO(rdmasafe_get_events(ch, evs, -1, 0), EINVAL,
		    "rdmasafe_get_events(max -1)");
	CHECK_ERRNO(rdmasafe_get_events(ch, evs, 4, -2), EINVAL,
		    "rdmasafe_get_events(timeout -2)");
	CHECK(evs[0] == sentinel, "failed batch gets store nothing");

	CHECK(rdmasafe_event_free(NULL) == 0, "rdmasafe_event_free(NULL) -> 0");
	memset(&stack_event, 0, sizeof stack_event);
	CHECK_ERRNO(rdmasafe_event_free(&stack_event), EINVAL,
		    "rdmasafe_event_free(stack pointer)");
	{
		/* a heap block laid out like an event but never handed out */
		struct rdma_cm_event *fake = calloc(1, 4096);
		CHECK_ERRNO(rdmasafe_event_free(fake), EINVAL,
			    "rdmasafe_event_free(foreign heap pointer)");
		free(fake);
	}
	CHECK_ERRNO(rdmasafe_event_free((struct rdma_cm_event *)(uintptr_t)1),
		    EINVAL, "rdmasafe_event_free((void *)1)");

	CHECK(rdmasafe_cm_get_counters(NULL) == -EINVAL, "rdmasafe_cm_get_counters(NULL) -> -EINVAL");
	CHECK(rdmasafe_cm_reserve(-1) == -EINVAL, "rdmasafe_cm_reserve(-1) -> -EINVAL");
	{
		int r = rdmasafe_cm_reserve(0);
		CHECK(r >= 0, "rdmasafe_cm_reserve(0) -> %d (>= 0)", r);
	}
	{
		int r = rdmasafe_cm_reserve(INT_MAX);
		CHECK(r == 4096, "rdmasafe_cm_reserve(INT_MAX) -> %d (capped at 4096, no abort)", r);
	}
	CHECK(fcntl(ch->fd, F_GETFL) == flags_before,
	      "argument errors leave the channel fd's flags alone");
}

static void on_usr1(int sig)
{
	(void)sig;
}

/*
 * A signal caught without SA_RESTART ends a blocking get with EINTR, as it
 * ends rdma_get_cm_event: a C program can break out of its event loop. A
 * timed wait is a poll(), which the kernel never restarts: EINTR with
 * SA_RESTART too (the header says so; a wait of -1 on a blocking channel
 * is librdmacm's own, restarted).
 */
static void test_eintr(struct rdma_event_channel *blocking)
{
	struct sigaction sa, old;
	struct rdma_cm_event *ev = NULL;
	int i;
	static const char *const what[] = {
		"rdmasafe_get_event",
		"rdmasafe_get_event_timeout(-1)",
		"rdmasafe_get_event_timeout(60000), SA_RESTART",
	};

	phase = "EINTR";
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1; /* no SA_RESTART */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, &old);
	for (i = 0; i < 3; i++) {
		pid_t child;
		int r, e;

		if (i == 2) {
			sa.sa_flags = SA_RESTART;
			sigaction(SIGUSR1, &sa, NULL);
		}
		child = fork();

		if (child == 0) {
			/* again and again until killed: a signal that lands before
			 * the parent is in the call (a slow machine) only runs the
			 * handler; a later one interrupts the call */
			for (;;) {
				usleep(200 * 1000);
				kill(getppid(), SIGUSR1);
			}
		}
		if (i == 0)
			r = rdmasafe_get_event(blocking, &ev);
		else
			r = rdmasafe_get_event_timeout(blocking, &ev, i == 1 ? -1 : 60000);
		e = errno;
		kill(child, SIGKILL);
		waitpid(child, NULL, 0);
		CHECK(r == -1 && e == EINTR, "%s on an empty blocking channel + signal -> %d/%s (want -1/EINTR)",
		      what[i], r, ename(e));
	}
	sigaction(SIGUSR1, &old, NULL);
}

static void test_event_str(void)
{
	int known_ok = 1, v;

	phase = "event names";
	for (v = RDMA_CM_EVENT_ADDR_RESOLVED; v <= RDMA_CM_EVENT_TIMEWAIT_EXIT; v++) {
		const char *a = rdmasafe_event_str(v), *b = rdma_event_str(v);
		if (!a || strcmp(a, b)) {
			CHECK(0, "rdmasafe_event_str(%d) = %s, rdma_event_str says %s",
			      v, a ? a : "(null)", b);
			known_ok = 0;
		}
	}
	if (known_ok)
		CHECK(1, "rdmasafe_event_str(0..%d) equal rdma_event_str's names",
		      RDMA_CM_EVENT_TIMEWAIT_EXIT);
	CHECK(!strcmp(rdmasafe_event_str(RDMA_CM_EVENT_ESTABLISHED),
		      "RDMA_CM_EVENT_ESTABLISHED"),
	      "rdmasafe_event_str(9) = %s", rdmasafe_event_str(9));
	for (v = 16; v <= 19; v++) {
		const char *s = rdmasafe_event_str(v);
		CHECK(s && !strncmp(s, "RDMA_CM_EVENT_", 14),
		      "rdmasafe_event_str(%d) = %s (newer rdma-core type)", v,
		      s ? s : "(null)");
	}
	{
		static const int unknown[] = { -1, 20, 255, 1000, INT_MAX, INT_MIN };
		for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
			const char *s = rdmasafe_event_str(unknown[i]);
			CHECK(s && !strcmp(s, "RDMA_CM_EVENT_UNKNOWN"),
			      "rdmasafe_event_str(%d) = %s", unknown[i],
			      s ? s : "(null)");
		}
	}
}

/* Timeouts on a channel with nothing queued, in its current mode. */
static void test_empty_channel(struct rdma_event_channel *ch, const char *mode)
{
	struct rdma_cm_event *ev, *evs[8];
	int flags_before = fcntl(ch->fd, F_GETFL);
	void *sentinel = (void *)&ev;
	double t0, dt;
	char what[128];

	phase = "timeouts on an empty channel";
	ev = sentinel;
	snprintf(what, sizeof what, "%s channel: rdmasafe_get_event_timeout(0)", mode);
	CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &ev, 0), EAGAIN, what);

	t0 = now_ms();
	errno = 0;
	int r = rdmasafe_get_event_timeout(ch, &ev, 50);
	int e = errno;
	dt = now_ms() - t0;
	CHECK(r == -1 && e == ETIMEDOUT,
	      "%s channel: rdmasafe_get_event_timeout(50) -> %d/%s (want -1/ETIMEDOUT)",
	      mode, r, ename(e));
	/* at least its timeout; at most: it returned (a busy machine stretches it) */
	CHECK(dt >= 49.0 && dt < 20000.0,
	      "%s channel: the 50 ms timeout took %.1f ms", mode, dt);

	snprintf(what, sizeof what, "%s channel: rdmasafe_get_events(max 8, 0)", mode);
	evs[0] = sentinel;
	CHECK_ERRNO(rdmasafe_get_events(ch, evs, 8, 0), EAGAIN, what);
	t0 = now_ms();
	errno = 0;
	r = rdmasafe_get_events(ch, evs, 8, 30);
	e = errno;
	dt = now_ms() - t0;
	CHECK(r == -1 && e == ETIMEDOUT && dt >= 29.0,
	      "%s channel: rdmasafe_get_events(max 8, 30) -> %d/%s after %.1f ms",
	      mode, r, ename(e), dt);
	if (flags_before & O_NONBLOCK) {
		snprintf(what, sizeof what, "%s channel: rdmasafe_get_event", mode);
		CHECK_ERRNO(rdmasafe_get_event(ch, &ev), EAGAIN, what);
	}
	CHECK(ev == sentinel && evs[0] == sentinel,
	      "%s channel: failed gets store nothing", mode);
	CHECK(fcntl(ch->fd, F_GETFL) == flags_before,
	      "%s channel: fd flags unchanged (O_NONBLOCK %s)", mode,
	      (flags_before & O_NONBLOCK) ? "set" : "clear");
}

/* ===================================================== part 2: on a device */

struct side {
	struct ibv_pd *pd;
	struct ibv_cq *cq;
};

static int make_qp(struct rdma_cm_id *id, struct side *s)
{
	struct ibv_qp_init_attr attr;

	s->pd = ibv_alloc_pd(id->verbs);
	if (!s->pd)
		return -1;
	s->cq = ibv_create_cq(id->verbs, 8, NULL, NULL, 0);
	if (!s->cq)
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = s->cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	return rdma_create_qp(id, s->pd, &attr);
}

static void free_side(struct rdma_cm_id *id, struct side *s)
{
	if (id && id->qp)
		rdma_destroy_qp(id);
	if (s->cq)
		ibv_destroy_cq(s->cq);
	if (s->pd)
		ibv_dealloc_pd(s->pd);
	s->cq = NULL;
	s->pd = NULL;
}

/* resolve addr + route of a fresh id on ch to test_addr:port */
static int resolve(struct rdma_event_channel *ch, struct rdma_cm_id *id,
		   uint16_t port, const char *who)
{
	struct sockaddr_storage ss;
	struct rdma_cm_event *ev;
	char what[96];

	if (!CHECK(rdma_resolve_addr(id, NULL, addr_port(&ss, port), 2000) == 0,
		   "%s: rdma_resolve_addr", who))
		return -1;
	snprintf(what, sizeof what, "%s: address resolved", who);
	if (!(ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id, what)))
		return -1;
	free_ok(ev, "ADDR_RESOLVED");
	if (!CHECK(rdma_resolve_route(id, 2000) == 0, "%s: rdma_resolve_route", who))
		return -1;
	snprintf(what, sizeof what, "%s: route resolved", who);
	if (!(ev = expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, id, what)))
		return -1;
	free_ok(ev, "ROUTE_RESOLVED");
	return 0;
}

static void conn_param(struct rdma_conn_param *p, const void *data, unsigned len)
{
	memset(p, 0, sizeof *p);
	p->private_data = data;
	p->private_data_len = (uint8_t)len;
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

/*
 * Listener on a blocking channel, client on a non-blocking one: 57 bytes
 * refused, 56 bytes delivered, 196 back on accept, clean disconnect; the
 * CONNECT_REQUEST copy outlives its id.
 */
static void test_connect(struct rdma_event_channel *sch,
			 struct rdma_event_channel *cch,
			 struct rdma_cm_id *listener, uint16_t port)
{
	struct rdma_cm_id *cid = NULL, *sid = NULL;
	struct side cs = { 0 }, ss = { 0 };
	struct rdma_conn_param p;
	struct rdma_cm_event *req = NULL, *ev;
	uint8_t hello[REQ_PDATA_MAX + 1], welcome[REP_PDATA_MAX];

	phase = "connect with private data";
	if (!CHECK(rdma_create_id(cch, &cid, NULL, RDMA_PS_TCP) == 0, "client: rdma_create_id"))
		return;
	if (resolve(cch, cid, port, "client"))
		goto out;
	if (!CHECK(make_qp(cid, &cs) == 0, "client: PD, CQ and RC QP created"))
		goto out;

	/* 57 bytes: one more than a REQ carries under the 36-byte CMA header */
	fill(hello, 1, sizeof hello);
	conn_param(&p, hello, REQ_PDATA_MAX + 1);
	CHECK_ERRNO(rdma_connect(cid, &p), EINVAL, "rdma_connect with 57 bytes of private data");
	errno = 0;
	int r = rdmasafe_get_event_timeout(sch, &ev, 200);
	int e = errno;
	CHECK(r == -1 && e == ETIMEDOUT,
	      "no CONNECT_REQUEST reached the listener after the refused connect (%s)",
	      r == 0 ? rdmasafe_event_str(ev->event) : ename(e));
	if (r == 0)
		free_ok(ev, "stray event");

	/* 56 bytes: the maximum; the same id is usable after the refusal */
	conn_param(&p, hello, REQ_PDATA_MAX);
	if (!CHECK(rdma_connect(cid, &p) == 0, "rdma_connect with 56 bytes (same id, after the refused one)"))
		goto out;

	phase = "server: connect request";
	if (!(req = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, "server: connect request")))
		goto out;
	sid = req->id;
	CHECK(req->listen_id == listener, "server: request names the listener as listen_id");
	CHECK(sid && sid != listener && sid != cid, "server: request carries a new id");
	CHECK(req->param.conn.private_data_len == REQ_PDATA_MAX,
	      "server: CONNECT_REQUEST private_data_len is %u (the padded maximum, 56)",
	      req->param.conn.private_data_len);
	check_bytes(req->param.conn.private_data, req->param.conn.private_data_len,
		    1, REQ_PDATA_MAX, "server: CONNECT_REQUEST private data");
	if (!sid)
		goto out;
	if (!CHECK(make_qp(sid, &ss) == 0, "server: PD, CQ and RC QP on the new id"))
		goto out;
	fill(welcome, 2, sizeof welcome);
	conn_param(&p, welcome, REP_PDATA_MAX);
	if (!CHECK(rdma_accept(sid, &p) == 0, "server: rdma_accept with 196 bytes of private data"))
		goto out;

	phase = "established";
	if ((ev = expect(cch, RDMA_CM_EVENT_ESTABLISHED, cid, "client: established"))) {
		CHECK(ev->status == 0, "client: ESTABLISHED status %d", ev->status);
		info("client: ESTABLISHED private_data_len %u", ev->param.conn.private_data_len);
		check_bytes(ev->param.conn.private_data, ev->param.conn.private_data_len,
			    2, REP_PDATA_MAX, "client: ESTABLISHED private data (accept's 196)");
		free_ok(ev, "client ESTABLISHED");
	}
	if ((ev = expect(sch, RDMA_CM_EVENT_ESTABLISHED, sid, "server: established")))
		free_ok(ev, "server ESTABLISHED");

	phase = "disconnect";
	CHECK(rdma_disconnect(cid) == 0, "client: rdma_disconnect");
	if ((ev = expect(sch, RDMA_CM_EVENT_DISCONNECTED, sid, "server: disconnected"))) {
		free_ok(ev, "server DISCONNECTED");
		/* the passive side answers with its own disconnect (DREP) */
		CHECK(rdma_disconnect(sid) == 0, "server: rdma_disconnect after DISCONNECTED");
	}
	if ((ev = expect(cch, RDMA_CM_EVENT_DISCONNECTED, cid, "client: disconnected")))
		free_ok(ev, "client DISCONNECTED");

out:
	phase = "connect teardown";
	alarm(60);
	free_side(cid, &cs);
	if (cid)
		CHECK(rdma_destroy_id(cid) == 0, "client: rdma_destroy_id");
	free_side(sid, &ss);
	if (sid)
		CHECK(rdma_destroy_id(sid) == 0, "server: rdma_destroy_id of the accepted id (its request copy still held)");
	alarm(120);
	if (req) {
		/* the copy is rdmasafe's: still intact after its id is gone */
		CHECK(req->event == RDMA_CM_EVENT_CONNECT_REQUEST && req->id == sid,
		      "server: request copy still readable after its id was destroyed");
		check_bytes(req->param.conn.private_data, req->param.conn.private_data_len,
			    1, REQ_PDATA_MAX, "server: request copy's private data after rdma_destroy_id");
		CHECK(rdmasafe_event_free(req) == 0, "rdmasafe_event_free(request copy) after its id was destroyed -> 0");
	}
}

/* Reject with 148 bytes (149 refused); the client sees them on REJECTED. */
static void test_reject(struct rdma_event_channel *sch,
			struct rdma_event_channel *cch, uint16_t port)
{
	struct rdma_cm_id *cid = NULL;
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	uint8_t hello[16], rej[REJ_PDATA_MAX + 1];

	phase = "reject with private data";
	if (!CHECK(rdma_create_id(cch, &cid, NULL, RDMA_PS_TCP) == 0, "reject client: rdma_create_id"))
		return;
	if (resolve(cch, cid, port, "reject client"))
		goto out;
	fill(hello, 3, sizeof hello);
	conn_param(&p, hello, sizeof hello); /* no QP: qp_num 0 is fine for a reject */
	if (!CHECK(rdma_connect(cid, &p) == 0, "reject client: rdma_connect (no QP)"))
		goto out;
	if ((ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, "server: request to reject"))) {
		struct rdma_cm_id *rid = ev->id;
		check_bytes(ev->param.conn.private_data, ev->param.conn.private_data_len,
			    3, sizeof hello, "server: request-to-reject private data");
		free_ok(ev, "CONNECT_REQUEST to reject"); /* copy gone, id is ours */
		fill(rej, 4, sizeof rej);
		CHECK_ERRNO(rdma_reject(rid, rej, REJ_PDATA_MAX + 1), EINVAL,
			    "server: rdma_reject with 149 bytes");
		CHECK(rdma_reject(rid, rej, REJ_PDATA_MAX) == 0, "server: rdma_reject with 148 bytes");
		CHECK(rdma_destroy_id(rid) == 0, "server: rdma_destroy_id of the rejected id");
	}
	if ((ev = expect(cch, RDMA_CM_EVENT_REJECTED, cid, "reject client: rejected"))) {
		info("reject client: REJECTED status %d (28 = IB_CM_REJ_CONSUMER_DEFINED), private_data_len %u",
		     ev->status, ev->param.conn.private_data_len);
		CHECK(ev->status == 28, "reject client: REJECTED status %d is the consumer reject reason", ev->status);
		check_bytes(ev->param.conn.private_data, ev->param.conn.private_data_len,
			    4, REJ_PDATA_MAX, "reject client: REJECTED private data (148)");
		free_ok(ev, "REJECTED");
	}
out:
	CHECK(rdma_destroy_id(cid) == 0, "reject client: rdma_destroy_id");
}

/* A port nobody listens on: REJECTED (no listener for the service id). */
static void test_no_listener(struct rdma_event_channel *cch)
{
	struct rdma_cm_id *tmp = NULL, *cid = NULL;
	struct sockaddr_storage ss;
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	uint8_t hello[8];
	uint16_t port;

	phase = "connect to a port nobody listens on";
	/* a port that was free a moment ago: bind port 0, read it, release it */
	if (!CHECK(rdma_create_id(cch, &tmp, NULL, RDMA_PS_TCP) == 0, "no-listener: rdma_create_id (only to pick a port)"))
		return;
	if (!CHECK(rdma_bind_addr(tmp, addr_port(&ss, 0)) == 0, "no-listener: bind port 0")) {
		rdma_destroy_id(tmp);
		return;
	}
	port = ntohs(rdma_get_src_port(tmp));
	rdma_destroy_id(tmp);
	if (!CHECK(rdma_create_id(cch, &cid, NULL, RDMA_PS_TCP) == 0, "no-listener: rdma_create_id"))
		return;
	if (resolve(cch, cid, port, "no-listener client"))
		goto out;
	fill(hello, 5, sizeof hello);
	conn_param(&p, hello, sizeof hello);
	if (!CHECK(rdma_connect(cid, &p) == 0, "no-listener: rdma_connect to port %u", port))
		goto out;
	if ((ev = expect(cch, RDMA_CM_EVENT_REJECTED, cid, "no-listener: rejected"))) {
		info("no-listener: REJECTED status %d (8 = IB_CM_REJ_INVALID_SERVICE_ID), private_data_len %u",
		     ev->status, ev->param.conn.private_data_len);
		free_ok(ev, "REJECTED (no listener)");
	}
out:
	CHECK(rdma_destroy_id(cid) == 0, "no-listener: rdma_destroy_id");
}

/*
 * 100 ids resolved, their 100 ADDR_RESOLVED copies held while every id is
 * destroyed: with the raw API each destroy would wait forever for an ack.
 */
static void test_hold_copies(void)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *ids[HOLD_IDS] = { 0 };
	struct rdma_cm_event *evs[HOLD_IDS] = { 0 };
	struct rdmasafe_cm_counters c0 = { .size = sizeof c0 }, c1 = { .size = sizeof c1 }, c2 = { .size = sizeof c2 };
	struct sockaddr_storage ss;
	int i, n = 0, created = 0, destroyed = 0, good = 1;
	double t0;

	phase = "hold 100 copies";
	if (!CHECK((ch = new_channel(1)) != NULL, "hold: non-blocking channel"))
		return;
	{
		int r = rdmasafe_cm_reserve(HOLD_IDS + 28);
		CHECK(r >= HOLD_IDS + 28, "rdmasafe_cm_reserve(%d) -> %d free slots", HOLD_IDS + 28, r);
	}
	counters(&c0);
	for (i = 0; i < HOLD_IDS; i++) {
		if (rdma_create_id(ch, &ids[i], (void *)(uintptr_t)(i + 1), RDMA_PS_TCP))
			break;
		created++;
		if (rdma_resolve_addr(ids[i], NULL, addr_port(&ss, 0), 2000))
			break;
	}
	if (!CHECK(created == HOLD_IDS && i == HOLD_IDS, "hold: %d ids created, addresses resolving", created))
		goto out;
	for (n = 0; n < HOLD_IDS; n++) {
		struct rdma_cm_event *ev;
		if (rdmasafe_get_event_timeout(ch, &ev, STEP_MS))
			break;
		uintptr_t k = (uintptr_t)ev->id->context;
		if (ev->event != RDMA_CM_EVENT_ADDR_RESOLVED || ev->status ||
		    k < 1 || k > HOLD_IDS || ids[k - 1] != ev->id || evs[k - 1]) {
			info("hold: unexpected %s status %d", rdmasafe_event_str(ev->event), ev->status);
			good = 0;
			rdmasafe_event_free(ev);
			continue;
		}
		evs[k - 1] = ev;
	}
	CHECK(n == HOLD_IDS && good, "hold: %d ADDR_RESOLVED copies held, one per id", n);
	counters(&c1);
	CHECK(c1.outstanding - c0.outstanding == (uint64_t)n,
	      "hold: counters say %llu more outstanding (want %d)",
	      (unsigned long long)(c1.outstanding - c0.outstanding), n);
	CHECK(c1.slots_allocated == c0.slots_allocated,
	      "hold: no slot allocated while holding them after rdmasafe_cm_reserve (%llu -> %llu)",
	      (unsigned long long)c0.slots_allocated, (unsigned long long)c1.slots_allocated);

	phase = "rdma_destroy_id of 100 ids whose event copies are held";
	alarm(60);
	t0 = now_ms();
	for (i = 0; i < HOLD_IDS; i++)
		if (rdma_destroy_id(ids[i]) == 0)
			destroyed++;
	alarm(120);
	CHECK(destroyed == HOLD_IDS,
	      "hold: rdma_destroy_id returned for all %d ids while their copies were held (%.1f ms)",
	      destroyed, now_ms() - t0);
	for (i = 0; i < HOLD_IDS; i++)
		ids[i] = NULL;

	phase = "free copies after their ids";
	good = 1;
	for (i = 0; i < HOLD_IDS; i++)
		if (evs[i] && (evs[i]->event != RDMA_CM_EVENT_ADDR_RESOLVED || !evs[i]->id))
			good = 0;
	CHECK(good, "hold: copies still readable after their ids were destroyed");
	if (evs[0]) {
		CHECK(rdmasafe_event_free(evs[0]) == 0, "rdmasafe_event_free(copy) after its id was destroyed -> 0");
		CHECK_ERRNO(rdmasafe_event_free(evs[0]), EINVAL, "rdmasafe_event_free of the same copy again (double free)");
		evs[0] = NULL;
	}
	good = 1;
	for (i = 1; i < HOLD_IDS; i++)
		if (evs[i] && rdmasafe_event_free(evs[i]))
			good = 0;
	CHECK(good, "hold: the other %d copies freed -> 0 each", HOLD_IDS - 1);
	counters(&c2);
	CHECK(c2.outstanding == c0.outstanding, "hold: outstanding back to %llu",
	      (unsigned long long)c0.outstanding);
out:
	for (i = 0; i < HOLD_IDS; i++)
		if (ids[i])
			rdma_destroy_id(ids[i]);
	rdma_destroy_event_channel(ch);
}

/* ================================= part 3: the destroy barrier, errno, limit */

#define SENTINEL 4242

/* One id on ch with its address resolving: its ADDR_RESOLVED comes next. */
static struct rdma_cm_id *resolving_id(struct rdma_event_channel *ch, uintptr_t tag)
{
	struct rdma_cm_id *id = NULL;
	struct sockaddr_storage ss;

	if (rdma_create_id(ch, &id, (void *)tag, RDMA_PS_TCP))
		return NULL;
	if (rdma_resolve_addr(id, NULL, addr_port(&ss, 0), 2000)) {
		rdma_destroy_id(id);
		return NULL;
	}
	return id;
}

static struct {
	struct rdma_cm_id *id;
	atomic_int returned;
} destroyer;

static void *destroy_thread(void *arg)
{
	(void)arg;
	rdma_destroy_id(destroyer.id);
	atomic_store(&destroyer.returned, 1);
	return NULL;
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static void test_barrier(void)
{
	struct rdma_event_channel *ch, *bch;
	struct rdma_cm_id *id;
	struct rdma_cm_event *ev = NULL, *evs[4];
	struct rdmasafe_cm_counters c0 = { .size = sizeof c0 }, c1 = { .size = sizeof c1 };
	pthread_t t;
	int r, prev, e;
	double t0;

	phase = "errno untouched on success";
	if (!CHECK((ch = new_channel(1)) && (bch = new_channel(0)), "barrier: non-blocking and blocking channels"))
		return;
	prev = rdmasafe_cm_set_ack_deadline(0);
	CHECK(prev == 1000, "rdmasafe_cm_set_ack_deadline: the default was 1000 ms (got %d)", prev);
	/* The wait first sees EAGAIN inside (nothing resolved yet), then polls. */
	id = resolving_id(ch, 1);
	errno = SENTINEL;
	r = rdmasafe_get_event_timeout(ch, &ev, STEP_MS);
	e = errno;
	CHECK(r == 0 && e == SENTINEL, "rdmasafe_get_event_timeout success leaves errno alone (%d, errno %s)", r,
	      ename(e));
	errno = SENTINEL;
	r = rdmasafe_event_free(r == 0 ? ev : NULL);
	e = errno;
	CHECK(r == 0 && e == SENTINEL, "rdmasafe_event_free success leaves errno alone (errno %s)", ename(e));
	rdma_destroy_id(id);
	id = resolving_id(bch, 2);
	errno = SENTINEL;
	r = rdmasafe_get_event(bch, &ev);
	e = errno;
	CHECK(r == 0 && e == SENTINEL, "rdmasafe_get_event success leaves errno alone (errno %s)", ename(e));
	if (r == 0)
		rdmasafe_event_free(ev);
	rdma_destroy_id(id);
	id = resolving_id(ch, 3);
	errno = SENTINEL;
	r = rdmasafe_get_events(ch, evs, 4, STEP_MS);
	e = errno;
	CHECK(r == 1 && e == SENTINEL, "rdmasafe_get_events success leaves errno alone (%d, errno %s)", r, ename(e));
	if (r == 1)
		rdmasafe_event_free(evs[0]);
	rdma_destroy_id(id);

	phase = "barrier kept: rdma_destroy_id waits for the copy";
	rdmasafe_cm_set_ack_deadline(60000);
	counters(&c0);
	id = resolving_id(ch, 4);
	if (!CHECK(id && (ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id, "barrier")) != NULL,
		   "barrier: a held ADDR_RESOLVED copy"))
		goto out;
	destroyer.id = id;
	atomic_store(&destroyer.returned, 0);
	pthread_create(&t, NULL, destroy_thread, NULL);
	sleep_ms(300);
	/* Not a timing guess: with the original un-acked, librdmacm's destroy
	 * cannot return before the free below (the deadline is a minute). */
	CHECK(!atomic_load(&destroyer.returned),
	      "barrier: rdma_destroy_id on another thread still waits while the copy is held");
	CHECK(ev->id == id && ev->id->context == (void *)4,
	      "barrier: ev->id can still be dereferenced while the copy is held");
	alarm(20);
	free_ok(ev, "the held copy");
	pthread_join(t, NULL);
	alarm(120);
	CHECK(atomic_load(&destroyer.returned), "barrier: rdma_destroy_id returned once the copy was freed");
	counters(&c1);
	CHECK(c1.acks_deferred - c0.acks_deferred == 1 && c1.acked_at_free - c0.acked_at_free == 1,
	      "barrier: counters: 1 original held, 1 acked at free (%llu, %llu)",
	      (unsigned long long)(c1.acks_deferred - c0.acks_deferred),
	      (unsigned long long)(c1.acked_at_free - c0.acked_at_free));

	phase = "barrier bounded: a held copy's destroy returns without a free";
	rdmasafe_cm_set_ack_deadline(300);
	counters(&c0);
	id = resolving_id(ch, 5);
	if (!CHECK(id && (ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id, "bound")) != NULL,
		   "bound: a held ADDR_RESOLVED copy"))
		goto out;
	alarm(20);
	t0 = now_ms();
	r = rdma_destroy_id(id);
	alarm(120);
	CHECK(r == 0, "bound: rdma_destroy_id returned while the copy is still held");
	printf("measure held_destroy_ms=%.1f\n", now_ms() - t0);
	counters(&c1);
	CHECK(c1.acked_at_deadline - c0.acked_at_deadline == 1, "bound: the original was acked at its deadline (%llu)",
	      (unsigned long long)(c1.acked_at_deadline - c0.acked_at_deadline));
	CHECK(ev->event == RDMA_CM_EVENT_ADDR_RESOLVED && ev->status == 0,
	      "bound: the copy is still valid after its id is gone");
	free_ok(ev, "the copy past its id");

	phase = "the deadline fires with no further call";
	counters(&c0);
	id = resolving_id(ch, 6);
	if (!CHECK(id && (ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id, "idle")) != NULL,
		   "idle: a held ADDR_RESOLVED copy"))
		goto out;
	sleep_ms(150);
	counters(&c1);
	CHECK(c1.oldest_age_ms >= 130, "counters: the oldest copy is at least 130 ms old after 150 ms (%llu)",
	      (unsigned long long)c1.oldest_age_ms);
	CHECK(c1.high_water >= 1, "counters: high water %llu", (unsigned long long)c1.high_water);
	for (int i = 0; i < 200 && c1.acked_at_deadline == c0.acked_at_deadline; i++) {
		sleep_ms(100);
		counters(&c1);
	}
	CHECK(c1.acked_at_deadline - c0.acked_at_deadline == 1,
	      "idle: the original was acked at its deadline without another rdmasafe call");
	alarm(20);
	CHECK(rdma_destroy_id(id) == 0, "idle: rdma_destroy_id returns");
	alarm(120);
	free_ok(ev, "the idle copy");

	phase = "limit on held copies";
	rdmasafe_cm_set_ack_deadline(0);
	counters(&c0);
	{
		struct rdma_cm_id *a = resolving_id(ch, 7), *b = NULL;
		struct rdma_cm_event *ea = NULL, *eb = NULL;
		CHECK(rdmasafe_cm_set_limit(c0.outstanding + 1) == 0, "rdmasafe_cm_set_limit(outstanding + 1)");
		ea = a ? expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, a, "limit") : NULL;
		/* Nothing queued: a get at the limit is refused at once, it
		   neither waits nor says EAGAIN / ETIMEDOUT. */
		CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &eb, 0), ENOBUFS, "get at the limit, nothing queued");
		CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &eb, 100), ENOBUFS,
			    "timed get at the limit, nothing queued");
		CHECK_ERRNO(rdmasafe_get_events(ch, evs, 4, 100), ENOBUFS, "batch get at the limit, nothing queued");
		/* The same on a blocking-mode channel, where a timed get polls
		   before it gets: refused before the poll. */
		CHECK_ERRNO(rdmasafe_get_event_timeout(bch, &eb, 100), ENOBUFS,
			    "timed get at the limit, blocking channel, nothing queued");
		CHECK_ERRNO(rdmasafe_get_events(bch, evs, 4, 100), ENOBUFS,
			    "batch get at the limit, blocking channel, nothing queued");
		b = resolving_id(ch, 8);
		sleep_ms(200); /* b's event may or may not be queued: either way */
		CHECK_ERRNO(rdmasafe_get_event_timeout(ch, &eb, 0), ENOBUFS, "get at the limit");
		CHECK_ERRNO(rdmasafe_get_events(ch, evs, 4, 0), ENOBUFS, "batch get at the limit");
		counters(&c1);
		CHECK(c1.refused_at_limit - c0.refused_at_limit == 7, "limit: 7 gets refused (%llu)",
		      (unsigned long long)(c1.refused_at_limit - c0.refused_at_limit));
		free_ok(ea, "the copy at the limit");
		/* Two queued (b's and c's, waited for: each id's event comes
		   within STEP_MS), room for one: the batch returns one of them
		   and stops at the bound, which is no refused get (the call
		   succeeded); the other stays in the kernel. */
		struct rdma_cm_id *cid = resolving_id(ch, 9);
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		sleep_ms(200);
		counters(&c0);
		int got = rdmasafe_get_events(ch, evs, 4, STEP_MS);
		CHECK(got == 1 && (evs[0]->id == b || evs[0]->id == cid),
		      "limit: a batch with room for one returns one of the two events (%d)", got);
		eb = got >= 1 ? evs[0] : NULL;
		counters(&c1);
		CHECK(c1.refused_at_limit == c0.refused_at_limit,
		      "limit: a batch that stops at the bound counts no refused get (%llu)",
		      (unsigned long long)(c1.refused_at_limit - c0.refused_at_limit));
		CHECK(eb != NULL, "limit: the refused event stayed in the kernel and comes after a free");
		struct rdma_cm_id *other = eb && eb->id == b ? cid : b;
		if (eb)
			free_ok(eb, "the second copy");
		for (int i = 0; i < STEP_MS / 10 && poll(&pfd, 1, 0) == 0; i++)
			sleep_ms(10);
		CHECK(poll(&pfd, 1, 0) == 1, "limit: the event past the batch's bound is queued");
		ea = other ? expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, other, "limit") : NULL;
		CHECK(ea != NULL, "limit: the event past the batch's bound stayed in the kernel");
		if (ea)
			free_ok(ea, "the third copy");
		rdmasafe_cm_set_limit(0);
		if (a)
			rdma_destroy_id(a);
		if (b)
			rdma_destroy_id(b);
		if (cid)
			rdma_destroy_id(cid);
	}
out:
	rdmasafe_cm_set_ack_deadline(prev);
	rdma_destroy_event_channel(ch);
	rdma_destroy_event_channel(bch);
}

/*
 * nids ids resolve their address on ch; once a marker id, resolved after
 * them on another channel, has its event, theirs are queued too (address
 * resolution runs on one ordered kernel workqueue). Then batches of at most
 * `max` are taken until all nids came: nothing lost, nothing extra.
 */
static void test_batch(int nonblocking, int nids, int max)
{
	struct rdma_event_channel *ch, *mch;
	struct rdma_cm_id *ids[64] = { 0 }, *marker = NULL;
	struct rdma_cm_event *evs[64], *ev;
	struct sockaddr_storage ss;
	char sizes[256] = "", *sp = sizes;
	int seen[64] = { 0 }, i, total = 0, calls = 0, first = 0, over = 0, bad = 0;
	const char *mode = nonblocking ? "non-blocking" : "blocking";

	phase = "batch gets";
	ch = new_channel(nonblocking);
	mch = new_channel(1);
	if (!CHECK(ch && mch, "batch (%s): channels", mode))
		return;
	for (i = 0; i < nids; i++)
		if (rdma_create_id(ch, &ids[i], (void *)(uintptr_t)(i + 1), RDMA_PS_TCP) ||
		    rdma_resolve_addr(ids[i], NULL, addr_port(&ss, 0), 2000))
			break;
	if (!CHECK(i == nids, "batch (%s): %d ids resolving", mode, i))
		goto out;
	if (rdma_create_id(mch, &marker, NULL, RDMA_PS_TCP) == 0 &&
	    rdma_resolve_addr(marker, NULL, addr_port(&ss, 0), 2000) == 0 &&
	    (ev = expect(mch, RDMA_CM_EVENT_ADDR_RESOLVED, marker, "batch: marker id resolved after the others")))
		free_ok(ev, "marker");

	while (total < nids) {
		int n = rdmasafe_get_events(ch, evs, max, STEP_MS);
		if (n < 0) {
			info("batch (%s): rdmasafe_get_events -> -1/%s after %d events",
			     mode, ename(errno), total);
			break;
		}
		calls++;
		if (calls == 1)
			first = n;
		if (n > max)
			over = 1;
		sp += snprintf(sp, sizes + sizeof sizes - sp, "%s%d", calls > 1 ? " " : "", n);
		for (i = 0; i < n && i < 64; i++) {
			uintptr_t k = (uintptr_t)evs[i]->id->context;
			if (evs[i]->event != RDMA_CM_EVENT_ADDR_RESOLVED ||
			    k < 1 || k > (uintptr_t)nids || ids[k - 1] != evs[i]->id || seen[k - 1]++)
				bad++;
			if (rdmasafe_event_free(evs[i]))
				bad++;
		}
		total += n;
	}
	info("batch (%s, max %d): %d events in %d calls, batch sizes: %s", mode, max, total, calls, sizes);
	CHECK(total == nids && !bad, "batch (%s): all %d ADDR_RESOLVED events came, each id once, none lost", mode, nids);
	CHECK(!over, "batch (%s): no batch larger than max %d", mode, max);
	CHECK(first > 1, "batch (%s): the first call after %d were queued returned %d (> 1)", mode, nids, first);
	errno = 0;
	int r = rdmasafe_get_events(ch, evs, max, 100);
	int e = errno;
	CHECK(r == -1 && e == ETIMEDOUT, "batch (%s): nothing extra afterwards (-> %d/%s)", mode, r, ename(e));
	if (r > 0)
		for (i = 0; i < r; i++)
			rdmasafe_event_free(evs[i]);
out:
	phase = "batch teardown";
	alarm(60);
	for (i = 0; i < nids; i++)
		if (ids[i])
			rdma_destroy_id(ids[i]);
	if (marker)
		rdma_destroy_id(marker);
	alarm(120);
	rdma_destroy_event_channel(ch);
	rdma_destroy_event_channel(mch);
}

static void test_device(const char *addr)
{
	struct rdma_event_channel *sch, *cch;
	struct rdma_cm_id *listener = NULL;
	struct sockaddr_storage ss;
	uint16_t port;

	phase = "listener";
	if (!CHECK(parse_addr(addr) == 0, "test address %s parsed", addr))
		return;
	sch = new_channel(0); /* the listener's channel stays blocking */
	cch = new_channel(1);
	if (!CHECK(sch && cch, "server channel (blocking) and client channel (non-blocking)"))
		return;
	if (!CHECK(rdma_create_id(sch, &listener, NULL, RDMA_PS_TCP) == 0, "listener: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, addr_port(&ss, 0)) == 0, "listener: rdma_bind_addr %s", addr) ||
	    !CHECK(rdma_listen(listener, 8) == 0, "listener: rdma_listen"))
		return;
	port = ntohs(rdma_get_src_port(listener));
	info("listening on %s port %u (device %s)", addr, port,
	     listener->verbs ? ibv_get_device_name(listener->verbs->device) : "?");

	test_connect(sch, cch, listener, port);
	test_reject(sch, cch, port);
	test_no_listener(cch);

	phase = "listener teardown";
	alarm(60);
	CHECK(rdma_destroy_id(listener) == 0, "listener: rdma_destroy_id");
	alarm(120);
	test_empty_channel(sch, "used blocking");
	test_empty_channel(cch, "used non-blocking");
	rdma_destroy_event_channel(sch);
	rdma_destroy_event_channel(cch);

	test_hold_copies();
	test_barrier();
	test_batch(1, BATCH_IDS, BATCH_MAX);
	test_batch(0, BLOCKING_BATCH_IDS, 64);
}

int main(void)
{
	struct rdma_event_channel *blocking, *nonblocking;
	struct rdmasafe_cm_counters c = { .size = sizeof c };
	const char *addr = getenv("RDMASAFE_TEST_ADDR");

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(120);

	counters(&c);
	CHECK(c.outstanding == 0 && c.copied == 0, "counters start at 0 (copied %llu, outstanding %llu)",
	      (unsigned long long)c.copied, (unsigned long long)c.outstanding);

	blocking = new_channel(0);
	nonblocking = new_channel(1);
	if (!CHECK(blocking && nonblocking, "rdma_create_event_channel (blocking and non-blocking)"))
		goto done;
	test_arguments(blocking);
	test_event_str();
	test_empty_channel(blocking, "blocking");
	test_eintr(blocking);
	test_empty_channel(nonblocking, "non-blocking");
	rdma_destroy_event_channel(blocking);
	rdma_destroy_event_channel(nonblocking);

	if (CHECK(addr && *addr, "RDMASAFE_TEST_ADDR is set (%s)", addr ? addr : "unset"))
		test_device(addr);

done:
	phase = "end";
	counters(&c);
	info("counters: copied %llu freed %llu outstanding %llu slots_allocated %llu",
	     (unsigned long long)c.copied, (unsigned long long)c.freed,
	     (unsigned long long)c.outstanding, (unsigned long long)c.slots_allocated);
	CHECK(c.outstanding == 0 && c.copied == c.freed && c.copied > 0,
	      "counters at the end: outstanding %llu, copied %llu == freed %llu",
	      (unsigned long long)c.outstanding, (unsigned long long)c.copied,
	      (unsigned long long)c.freed);
	printf("cm_capi_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
