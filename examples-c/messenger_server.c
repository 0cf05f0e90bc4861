/*
 * messenger_server: the server side of the messenger (see messenger.h).
 *
 *   messenger_server -a ADDR -p PORT -n EXPECTED_CLIENTS [-t WATCHDOG_SECS]
 *
 * Two threads, the shape of a real server whose connections come and go:
 *
 *  - The main thread handles the CM: poll() on the CM channel fd
 *    (O_NONBLOCK), then rdmasafe_get_events in batches without waiting.
 *    Every CM event is an rdmasafe copy, freed with rdmasafe_event_free as
 *    soon as it is handled; a connection that ended is torn down after the
 *    batch's copies are freed (rdma_destroy_id waits while a copy of one of
 *    its events is held, as with librdmacm).
 *
 *  - The CQ loop thread runs one rdmasafe_cq_loop (event mode) for the
 *    server's lifetime: rdmasafe_cq_loop_run, from the start (the listener
 *    names the device) until the main thread stops it at the end. Every
 *    connection has a CQ of its own, created on the loop's one completion
 *    channel. The main thread adds it to the running loop when it accepts
 *    the connection (rdmasafe_cq_loop_add_cq, the connection as the
 *    callback's context). When the connection ends, the main thread drains
 *    its QP (rdmasafe_cq_loop_drain_qp: every completion of it delivered to
 *    the callback), destroys the QP (no QP can raise an event on the CQ any
 *    more), then takes the CQ out of the loop and destroys it
 *    (rdmasafe_cq_loop_destroy_cq), all while the loop keeps serving the
 *    other connections. The loop's callback handles the completions: a
 *    PING is answered with a PONG.
 *
 * Shared state: the callback reads a connection's fields and writes its
 * progress (PONG posted, state), and keeps counters; all of that is under
 * one mutex, `lock`. The main thread fills a connection in under it before
 * the CQ joins the loop, and never holds it while it calls into the loop
 * (drain, destroy_cq wait for the loop's current cycle, whose callback may
 * be waiting for the lock). SIGINT / SIGTERM are blocked on the loop thread,
 * so they interrupt the main thread's poll().
 *
 * Per connection the server keeps what the client's hello said (client id,
 * connection index, name, nonce), assigns a session id, and answers in the
 * accept private data with a welcome. The client then sends one PING over a
 * SEND; the server answers with a PONG built from its per-connection state.
 * The passive side calls rdma_disconnect on DISCONNECTED (that sends the
 * DREP the client's disconnect waits for), then tears the connection down.
 *
 * Exits after EXPECTED_CLIENTS connections ended, or on SIGINT/SIGTERM
 * (disconnects every live connection, waits for them, tears all down).
 * Then it stops the loop, joins its thread, destroys it, and prints the
 * rdmasafe CM copy counters and the loop's figures (CQs added and removed,
 * completions, ...) next to its own. Exit status 0 only if every expected
 * client was served (or the stop was a signal), nothing failed (teardown
 * included), no event copy is outstanding, and the loop ended with no CQ
 * left in it and nothing unacked.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "messenger.h"
#include "rdmasafe.h"

#define MAX_CONNS 256
#define BATCH 32
#define SHUTDOWN_MS 5000
#define QP_DEPTH 4
#define CQ_DEPTH 16      /* both queues of one QP, and the drain's two markers */
#define DRAIN_MS 30000   /* a hang guard: a drain is a local flush */

enum { WR_RECV = 0, WR_SEND = 1 };
enum cstate { FREE = 0, ACCEPTING, ESTABLISHED, CLOSING };

struct conn {
	/* The main thread's alone. */
	struct ibv_cq *cq;       /* this connection's, in the loop from accept to teardown */
	struct ibv_mr *rx_mr, *tx_mr;
	const char *how;         /* set when it ended: torn down after the event batch */
	/* Written by the main thread (under `lock`) before the CQ joins the
	 * loop, read by the callback: constant while the CQ is in the loop. */
	struct rdma_cm_id *id;
	uint32_t client_id, conn_index; /* from the client's hello */
	uint64_t nonce;
	char name[MSGR_NAME_LEN];
	uint64_t session;        /* ours */
	uint32_t number;
	/* Under `lock`: both threads. */
	enum cstate state;
	int closed;              /* teardown began: the callback posts nothing more */
	int replied;             /* PONG posted */
	int send_done;           /* PONG send completed */
	uint64_t cb_calls;       /* callback calls for this CQ */
	struct msgr_msg rx, tx;  /* rx: the NIC writes it, the callback reads it */
};

static struct conn *conns;
static struct rdma_event_channel *ch;
static struct rdma_cm_id *listener;
static struct msgr_dev dev; /* PD and the completion channel, no shared CQ */
static const char *banner_dev = "?";
static volatile sig_atomic_t stop_signal;

/* The main thread's. */
static uint32_t accepted, served, failed, refused, finished, expected;
static unsigned long cm_events, cm_calls, cm_largest;
static uint32_t cqs_added, cqs_removed, qps_drained, removed_while_running, teardown_errors;
static struct conn *ending[MAX_CONNS];
static int nending;

/* The loop and its thread. */
static struct rdmasafe_cq_loop *loop;
static pthread_t loop_thread;
static int loop_started;          /* main thread */
static int loop_rc;               /* the loop thread's, read after the join */
static atomic_int loop_ended;     /* rdmasafe_cq_loop_run returned */
static _Thread_local int on_loop_thread;

/* Under `lock`. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct cb_counts {
	uint64_t calls, completions, receives, sends, errors, off_loop_thread;
} cb;

static void on_stop(int sig)
{
	stop_signal = sig;
}

static void refuse(struct rdma_cm_id *id, const char *reason)
{
	struct msgr_refusal r;

	memset(&r, 0, sizeof r);
	snprintf(r.reason, sizeof r.reason, "%s", reason);
	msgr_refusal_encode(&r);
	printf("server: refusing a connection: %s\n", reason);
	if (rdma_reject(id, &r, (uint8_t)le16toh(r.len)))
		printf("server: rdma_reject: %s\n", msgr_errname(errno));
	if (rdma_destroy_id(id))
		printf("server: rdma_destroy_id: %s\n", msgr_errname(errno));
	refused++;
}

/* ------------------------------------------------------ the loop's thread */

/* Under `lock`, from the callback: a PING came; answer it. */
static void on_recv(struct conn *c, const struct ibv_wc *wc)
{
	struct msgr_msg m;
	const char *why = msgr_msg_decode(&c->rx, wc->byte_len, &m);

	if (!why && m.type != MSGR_PING)
		why = "not a PING";
	if (!why && (m.session_id != c->session || m.client_id != c->client_id || m.conn_index != c->conn_index))
		why = "session, client id or connection index do not match the hello";
	if (why) {
		printf("server: session %#" PRIx64 ": bad message (%s), disconnecting\n", c->session, why);
		if (c->state != CLOSING && !c->closed) {
			c->state = CLOSING;
			rdma_disconnect(c->id);
		}
		return;
	}
	printf("server: message from client %" PRIu32 " conn %" PRIu32 " session %#" PRIx64
	       " seq %" PRIu32 " (%u bytes): \"%s\"\n",
	       m.client_id, m.conn_index, m.session_id, m.seq, wc->byte_len, m.text);
	if (c->closed) {
		printf("server: session %#" PRIx64 ": its teardown began, not answered\n", c->session);
		return;
	}

	memset(&c->tx, 0, sizeof c->tx);
	c->tx.type = MSGR_PONG;
	c->tx.session_id = c->session;
	c->tx.client_id = c->client_id;
	c->tx.conn_index = c->conn_index;
	c->tx.seq = m.seq;
	snprintf(c->tx.text, sizeof c->tx.text, "pong to %s (client %" PRIu32 " conn %" PRIu32 ", number %" PRIu32 "): %.120s",
		 c->name, c->client_id, c->conn_index, c->number, m.text);
	uint32_t len = MSGR_MSG_LEN(&c->tx);
	msgr_msg_encode(&c->tx);
	if (msgr_post_send(c->id, c->tx_mr, &c->tx, len, WR_SEND)) {
		printf("server: session %#" PRIx64 ": post send: %s\n", c->session, msgr_errname(errno));
		if (c->state != CLOSING) {
			c->state = CLOSING;
			rdma_disconnect(c->id);
		}
		return;
	}
	c->replied = 1;
}

/* The loop's callback for one connection's CQ (ctx: the connection). */
static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct conn *c = ctx;

	pthread_mutex_lock(&lock);
	cb.calls++;
	c->cb_calls++;
	if (!on_loop_thread)
		cb.off_loop_thread++;
	for (int i = 0; i < n; i++) {
		cb.completions++;
		if (wc[i].status != IBV_WC_SUCCESS) {
			cb.errors++;
			if (c->state != CLOSING && wc[i].status != IBV_WC_WR_FLUSH_ERR)
				printf("server: session %#" PRIx64 ": %s completion: %s\n", c->session,
				       wc[i].wr_id == WR_SEND ? "send" : "receive", ibv_wc_status_str(wc[i].status));
			continue;
		}
		if (wc[i].wr_id == WR_SEND) {
			cb.sends++;
			c->send_done = 1;
		} else {
			cb.receives++;
			on_recv(c, &wc[i]);
		}
	}
	pthread_mutex_unlock(&lock);
}

static void *loop_main(void *arg)
{
	(void)arg;
	on_loop_thread = 1;
	loop_rc = rdmasafe_cq_loop_run(loop); /* until the main thread stops it */
	if (loop_rc < 0)
		printf("server: rdmasafe_cq_loop_run: %s\n", msgr_errname(-loop_rc));
	atomic_store(&loop_ended, 1);
	return NULL;
}

/* PD and completion channel on `verbs`, a loop on the channel, and its
 * thread. -1 on failure (printed), nothing left behind. */
static int start_loop(struct ibv_context *verbs)
{
	struct rdmasafe_cq_loop_options o = { .size = sizeof o, .mode = RDMASAFE_MODE_EVENT };
	sigset_t block, old;
	int r;

	if (msgr_dev_open_channel(&dev, verbs)) {
		printf("server: verbs resources on %s: %s\n", ibv_get_device_name(verbs->device), msgr_errname(errno));
		return -1;
	}
	r = rdmasafe_cq_loop_create(dev.comp, &o, &loop);
	if (r < 0) {
		printf("server: rdmasafe_cq_loop_create: %s\n", msgr_errname(-r));
		msgr_dev_close(&dev);
		return -1;
	}
	/* The loop thread never takes SIGINT / SIGTERM: they go to the main
	 * thread, whose poll() they interrupt. */
	sigemptyset(&block);
	sigaddset(&block, SIGINT);
	sigaddset(&block, SIGTERM);
	r = pthread_sigmask(SIG_BLOCK, &block, &old);
	if (!r) {
		r = pthread_create(&loop_thread, NULL, loop_main, NULL);
		int r2 = pthread_sigmask(SIG_SETMASK, &old, NULL);
		if (r2)
			printf("server: pthread_sigmask: %s\n", msgr_errname(r2));
	}
	if (r) {
		printf("server: starting the CQ loop thread: %s\n", msgr_errname(r));
		if ((r = rdmasafe_cq_loop_destroy(loop)) < 0)
			printf("server: rdmasafe_cq_loop_destroy: %s\n", msgr_errname(-r));
		loop = NULL;
		msgr_dev_close(&dev);
		return -1;
	}
	loop_started = 1;
	banner_dev = ibv_get_device_name(verbs->device);
	printf("server: CQ loop on %s running on its own thread; each connection's CQ joins it at accept "
	       "and leaves it at teardown\n", banner_dev);
	return 0;
}

/* Stops the loop, joins its thread, reads its figures, destroys it. */
static int stop_loop(struct rdmasafe_cq_loop_stats *st)
{
	int r, bad = 0;

	if (!loop_started)
		return 0;
	if ((r = rdmasafe_cq_loop_stop(loop)) < 0) {
		printf("server: rdmasafe_cq_loop_stop: %s\n", msgr_errname(-r));
		bad = 1;
	}
	if ((r = pthread_join(loop_thread, NULL))) {
		printf("server: joining the CQ loop thread: %s\n", msgr_errname(r));
		return -1; /* it may still run the loop: leave it alone */
	}
	loop_started = 0;
	if (loop_rc < 0)
		bad = 1;
	if ((r = rdmasafe_cq_loop_get_stats(loop, st)) < 0) {
		printf("server: rdmasafe_cq_loop_get_stats: %s\n", msgr_errname(-r));
		bad = 1;
	}
	if ((r = rdmasafe_cq_loop_destroy(loop)) < 0) {
		printf("server: rdmasafe_cq_loop_destroy: %s\n", msgr_errname(-r));
		bad = 1;
	}
	loop = NULL;
	return bad ? -1 : 0;
}

/* --------------------------------------------------------- the main thread */

/* The connection is over: marked now, torn down once the CM event batch
 * that said so is freed (finish_ended). */
static void end_conn(struct conn *c, const char *how)
{
	if (!c->how) {
		c->how = how;
		ending[nending++] = c;
	}
}

/* Tears a connection down while the loop runs. */
static void finish(struct conn *c)
{
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	struct rdma_cm_id *id = c->id;
	int r, ok, clean = 1, running;

	/* From now on the callback posts nothing on this QP. */
	pthread_mutex_lock(&lock);
	c->closed = 1;
	pthread_mutex_unlock(&lock);

	/* The only safe order, never under `lock` (these wait for the loop's
	 * current cycle): drain the QP (error state; every completion of it
	 * delivered to the callback, the CQ events acked; the drain's own
	 * markers are the loop's and never reach the callback), destroy it (no
	 * QP can raise an event on the CQ any more), then take the CQ out of
	 * the loop and destroy it. */
	r = rdmasafe_cq_loop_drain_qp(loop, id->qp, 0, DRAIN_MS);
	if (r) {
		printf("server: session %#" PRIx64 ": rdmasafe_cq_loop_drain_qp: %s\n", c->session, msgr_errname(-r));
		clean = 0;
	} else {
		qps_drained++;
	}
	rdma_destroy_qp(id);
	running = !atomic_load(&loop_ended);
	r = rdmasafe_cq_loop_destroy_cq(loop, c->cq);
	if (r) {
		printf("server: session %#" PRIx64 ": rdmasafe_cq_loop_destroy_cq: %s\n", c->session, msgr_errname(-r));
		clean = 0;
	} else {
		cqs_removed++;
		removed_while_running += running;
	}
	c->cq = NULL;
	if (c->rx_mr && (r = ibv_dereg_mr(c->rx_mr))) {
		printf("server: ibv_dereg_mr: %s\n", msgr_errname(r));
		clean = 0;
	}
	if (c->tx_mr && (r = ibv_dereg_mr(c->tx_mr))) {
		printf("server: ibv_dereg_mr: %s\n", msgr_errname(r));
		clean = 0;
	}
	c->rx_mr = c->tx_mr = NULL;
	if ((r = rdmasafe_cq_loop_get_stats(loop, &st)) < 0)
		printf("server: rdmasafe_cq_loop_get_stats: %s\n", msgr_errname(-r));

	pthread_mutex_lock(&lock); /* the callback never runs for it again: for the reads */
	ok = c->replied && !strcmp(c->how, "disconnected");
	printf("server: session %#" PRIx64 ": QP drained and destroyed, CQ removed from the %s loop and destroyed "
	       "(callback calls %" PRIu64 ", CQs left in the loop %" PRIu64 ")\n",
	       c->session, running ? "running" : "stopped", c->cb_calls, (uint64_t)st.cqs);
	printf("server: client %" PRIu32 " conn %" PRIu32 " (%s) session %#" PRIx64 " %s%s\n",
	       c->client_id, c->conn_index, c->name, c->session, c->how,
	       ok ? ", served" : c->replied ? "" : " before its message was answered");
	c->state = FREE;
	c->id = NULL;
	pthread_mutex_unlock(&lock);

	if (rdma_destroy_id(id)) {
		printf("server: rdma_destroy_id: %s\n", msgr_errname(errno));
		clean = 0;
	}
	if (ok)
		served++;
	else
		failed++;
	if (!clean)
		teardown_errors++;
	c->how = NULL;
	finished++;
}

/* Tears down the connections that ended in the batch just freed. */
static void finish_ended(void)
{
	for (int i = 0; i < nending; i++)
		finish(ending[i]);
	nending = 0;
}

/* The connection's verbs resources, its CQ added to the running loop last.
 * 0, or an errno (nothing of it is left then). */
static int setup_conn(struct conn *c, struct rdma_cm_id *id)
{
	int e = 0, r;

	if (!(c->cq = ibv_create_cq(dev.verbs, CQ_DEPTH, c, dev.comp, 0)) ||
	    msgr_create_qp_on(id, dev.pd, c->cq, QP_DEPTH) ||
	    !(c->rx_mr = ibv_reg_mr(dev.pd, &c->rx, sizeof c->rx, IBV_ACCESS_LOCAL_WRITE)) ||
	    !(c->tx_mr = ibv_reg_mr(dev.pd, &c->tx, sizeof c->tx, 0)) ||
	    msgr_post_recv(id, c->rx_mr, &c->rx, sizeof c->rx, WR_RECV))
		e = errno ? errno : EIO;
	else if ((r = rdmasafe_cq_loop_add_cq(loop, c->cq, on_wc, c)) < 0)
		e = -r;
	if (!e) {
		cqs_added++;
		return 0;
	}
	/* not in the loop: destroyed directly */
	if (id->qp)
		rdma_destroy_qp(id);
	if (c->rx_mr)
		ibv_dereg_mr(c->rx_mr);
	if (c->tx_mr)
		ibv_dereg_mr(c->tx_mr);
	if (c->cq && (r = ibv_destroy_cq(c->cq)))
		printf("server: ibv_destroy_cq: %s\n", msgr_errname(r));
	c->rx_mr = c->tx_mr = NULL;
	c->cq = NULL;
	return e;
}

static void on_connect_request(struct rdma_cm_event *ev)
{
	struct rdma_cm_id *id = ev->id;
	struct msgr_hello h;
	struct msgr_welcome w;
	struct rdma_conn_param p;
	struct conn *c = NULL;
	const char *why;
	int i, e;

	why = msgr_hello_decode(ev->param.conn.private_data, ev->param.conn.private_data_len, &h);
	if (why) {
		refuse(id, why);
		return;
	}
	if (stop_signal) {
		refuse(id, "server shutting down");
		return;
	}
	if (!loop && start_loop(id->verbs)) { /* a listener on a wildcard address */
		refuse(id, "server has no verbs resources");
		return;
	}
	if (id->verbs != dev.verbs) {
		refuse(id, "request on a second device");
		return;
	}
	/* A free slot's previous CQ left the loop at its teardown: no callback
	 * runs for it. It is filled in under `lock`, which the callback takes. */
	pthread_mutex_lock(&lock);
	for (i = 0; i < MAX_CONNS && !c; i++)
		if (conns[i].state == FREE)
			c = &conns[i];
	if (!c) {
		pthread_mutex_unlock(&lock);
		refuse(id, "too many connections");
		return;
	}
	c->id = id;
	c->client_id = h.client_id;
	c->conn_index = h.conn_index;
	c->nonce = h.nonce;
	snprintf(c->name, sizeof c->name, "%s", h.name);
	c->number = ++accepted;
	c->session = ((uint64_t)(getpid() & 0xffff) << 40) | ((uint64_t)0x5e55 << 16) | c->number;
	c->replied = c->send_done = c->closed = 0;
	c->cb_calls = 0;
	c->state = ACCEPTING;
	pthread_mutex_unlock(&lock);
	id->context = c;
	printf("server: hello from client_id=%" PRIu32 " conn=%" PRIu32 " name=\"%s\" nonce=%#" PRIx64
	       " (hello len %u, private_data_len %u) -> session %#" PRIx64 " number %" PRIu32 "\n",
	       h.client_id, h.conn_index, h.name, h.nonce, h.len, ev->param.conn.private_data_len,
	       c->session, c->number);

	e = setup_conn(c, id);
	if (e) {
		printf("server: setting up session %#" PRIx64 ": %s\n", c->session, msgr_errname(e));
		pthread_mutex_lock(&lock);
		c->state = FREE;
		c->id = NULL;
		pthread_mutex_unlock(&lock);
		refuse(id, "server could not set up the connection");
		return;
	}
	printf("server: session %#" PRIx64 ": its CQ added to the %s loop\n", c->session,
	       atomic_load(&loop_ended) ? "stopped" : "running");

	memset(&w, 0, sizeof w);
	w.session_id = c->session;
	w.nonce = c->nonce;
	w.client_id = c->client_id;
	w.conn_index = c->conn_index;
	w.conn_number = c->number;
	w.max_msg = sizeof(struct msgr_msg);
	snprintf(w.banner, sizeof w.banner, "rdmasafe messenger on %s welcomes %s", banner_dev, c->name);
	msgr_welcome_encode(&w);
	memset(&p, 0, sizeof p);
	p.private_data = &w;
	p.private_data_len = (uint8_t)le16toh(w.len);
	p.responder_resources = 1;
	p.initiator_depth = 1;
	p.rnr_retry_count = 7;
	if (rdma_accept(id, &p)) {
		printf("server: rdma_accept: %s\n", msgr_errname(errno));
		end_conn(c, "failed to accept");
	}
}

static void on_cm_event(struct rdma_cm_event *ev)
{
	struct conn *c = ev->id && ev->id != listener ? ev->id->context : NULL;

	if (c && c->how)
		return; /* ended in this batch already */
	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST:
		on_connect_request(ev);
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		if (c) {
			pthread_mutex_lock(&lock);
			if (c->state == ACCEPTING) /* the callback may have set CLOSING */
				c->state = ESTABLISHED;
			pthread_mutex_unlock(&lock);
			printf("server: session %#" PRIx64 " established\n", c->session);
		}
		break;
	case RDMA_CM_EVENT_DISCONNECTED:
		if (c) {
			/* answer the peer's DREQ (or complete ours) */
			pthread_mutex_lock(&lock);
			if (c->state != CLOSING) {
				c->state = CLOSING;
				rdma_disconnect(c->id);
			}
			pthread_mutex_unlock(&lock);
			end_conn(c, "disconnected");
		}
		break;
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
		if (c) {
			printf("server: session %#" PRIx64 ": %s (status %d)\n", c->session,
			       rdmasafe_event_str(ev->event), ev->status);
			end_conn(c, "failed");
		}
		break;
	case RDMA_CM_EVENT_TIMEWAIT_EXIT:
		break;
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		printf("server: device removed, stopping\n");
		stop_signal = SIGTERM;
		break;
	default:
		printf("server: unexpected %s (status %d)\n", rdmasafe_event_str(ev->event), ev->status);
		break;
	}
}

/* Drains the CM channel in batches: handles each event, frees the batch's
 * copies, then tears down the connections that ended (rdma_destroy_id of
 * an id would wait while a copy of its event is held). -1 on a real error. */
static int drain_cm(void)
{
	struct rdma_cm_event *evs[BATCH];

	for (;;) {
		int n = rdmasafe_get_events(ch, evs, BATCH, 0);
		if (n < 0) {
			if (errno == EAGAIN)
				return 0;
			printf("server: rdmasafe_get_events: %s\n", msgr_errname(errno));
			return -1;
		}
		cm_calls++;
		cm_events += n;
		if ((unsigned long)n > cm_largest)
			cm_largest = n;
		for (int i = 0; i < n; i++)
			on_cm_event(evs[i]);
		for (int i = 0; i < n; i++)
			if (rdmasafe_event_free(evs[i]))
				printf("server: rdmasafe_event_free: %s\n", msgr_errname(errno));
		finish_ended();
	}
}

static uint32_t live(void)
{
	uint32_t n = 0;

	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_CONNS; i++)
		n += conns[i].state != FREE;
	pthread_mutex_unlock(&lock);
	return n;
}

static void shutdown_all(void)
{
	double deadline;
	uint32_t n = live();

	printf("server: %s: disconnecting %" PRIu32 " live connection(s)\n",
	       stop_signal == SIGINT ? "SIGINT" : "SIGTERM", n);
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_CONNS; i++) {
		struct conn *c = &conns[i];
		if (c->state == FREE || c->state == CLOSING)
			continue;
		c->state = CLOSING;
		if (rdma_disconnect(c->id))
			printf("server: rdma_disconnect(session %#" PRIx64 "): %s\n", c->session, msgr_errname(errno));
	}
	pthread_mutex_unlock(&lock);
	/* wait for their DISCONNECTED (the peers answer with DREP) */
	deadline = msgr_now_ms() + SHUTDOWN_MS;
	while (live() && msgr_now_ms() < deadline) {
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		if (poll(&pfd, 1, 100) < 0 && errno != EINTR)
			break;
		if (drain_cm())
			break;
	}
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_CONNS; i++)
		if (conns[i].state != FREE)
			end_conn(&conns[i], "destroyed at shutdown without DISCONNECTED");
	pthread_mutex_unlock(&lock);
	finish_ended(); /* no CM event copy is held here */
}

static void usage(const char *argv0)
{
	fprintf(stderr, "usage: %s -a ADDR -p PORT -n EXPECTED_CLIENTS [-t WATCHDOG_SECS]\n", argv0);
	exit(2);
}

int main(int argc, char **argv)
{
	const char *addr = NULL, *port = NULL;
	unsigned watchdog = 60;
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE }, *res;
	struct rdmasafe_cm_counters cnt = { .size = sizeof cnt };
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	struct sigaction sa;
	struct cb_counts seen;
	int op, r, status = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((op = getopt(argc, argv, "a:p:n:t:")) != -1) {
		switch (op) {
		case 'a': addr = optarg; break;
		case 'p': port = optarg; break;
		case 'n': expected = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 't': watchdog = (unsigned)strtoul(optarg, NULL, 0); break;
		default: usage(argv[0]);
		}
	}
	if (!addr || !port || !expected)
		usage(argv[0]);
	msgr_watchdog("server", watchdog);
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop; /* no SA_RESTART: poll() returns EINTR */
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	conns = calloc(MAX_CONNS, sizeof *conns);
	r = getaddrinfo(addr, port, &hints, &res);
	if (!conns || r) {
		fprintf(stderr, "server: %s:%s: %s\n", addr, port, r ? gai_strerror(r) : "no memory");
		return 1;
	}
	ch = rdma_create_event_channel();
	if (!ch || fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK) ||
	    rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(listener, res->ai_addr) || rdma_listen(listener, 64)) {
		printf("server: listening on %s:%s: %s\n", addr, port, msgr_errname(errno));
		return 1;
	}
	freeaddrinfo(res);
	/* Bound to a device's address: the loop runs from now on (on a
	 * wildcard address it starts at the first connect request). */
	if (listener->verbs && start_loop(listener->verbs))
		return 1;
	printf("server: listening on %s port %u for %" PRIu32 " clients (pid %d)\n", addr,
	       ntohs(rdma_get_src_port(listener)), expected, (int)getpid());

	while (!stop_signal && finished < expected && !atomic_load(&loop_ended)) {
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		if (poll(&pfd, 1, 1000) < 0 && errno != EINTR) {
			printf("server: poll: %s\n", msgr_errname(errno));
			status = 1;
			break;
		}
		if (drain_cm()) {
			status = 1;
			break;
		}
	}
	if (atomic_load(&loop_ended)) {
		printf("server: the CQ loop ended before it was stopped\n");
		status = 1;
	}
	if (stop_signal || live())
		shutdown_all();

	if (listener && rdma_destroy_id(listener))
		printf("server: rdma_destroy_id(listener): %s\n", msgr_errname(errno));
	drain_cm(); /* nothing should be left; free whatever is */
	if (stop_loop(&st))
		status = 1;
	if (dev.verbs && msgr_dev_close(&dev)) {
		printf("server: closing the device resources: %s\n", msgr_errname(errno));
		status = 1;
	}
	rdma_destroy_event_channel(ch);
	free(conns);

	if ((r = rdmasafe_cm_get_counters(&cnt)) < 0) {
		printf("server: rdmasafe_cm_get_counters: %s\n", msgr_errname(-r));
		status = 1;
	}
	printf("server: CM events %lu in %lu rdmasafe_get_events calls (largest batch %lu), CQ events %llu\n",
	       cm_events, cm_calls, cm_largest, (unsigned long long)st.cq_events);
	printf("server: done: %" PRIu32 " served, %" PRIu32 " failed, %" PRIu32 " refused, %s\n",
	       served, failed, refused, stop_signal ? "stopped by signal" : "all expected clients finished");
	printf("server: counters copied=%llu freed=%llu outstanding=%llu slots_allocated=%llu acked_at_deadline=%llu\n",
	       (unsigned long long)cnt.copied, (unsigned long long)cnt.freed,
	       (unsigned long long)cnt.outstanding, (unsigned long long)cnt.slots_allocated,
	       (unsigned long long)cnt.acked_at_deadline);
	pthread_mutex_lock(&lock);
	seen = cb;
	pthread_mutex_unlock(&lock);
	/* The loop's own figures, then the same story as the server saw it. */
	printf("server: CQ loop figures cqs_added=%llu cqs_removed=%llu cqs=%llu completions=%llu error_completions=%llu"
	       " cq_events=%llu acked_events=%llu unacked_now=%llu foreign_cq_events=%llu wakeups=%llu"
	       " empty_wakeups=%llu arm_calls=%llu ack_calls=%llu\n",
	       (unsigned long long)st.cqs_added, (unsigned long long)st.cqs_removed, (unsigned long long)st.cqs,
	       (unsigned long long)st.completions, (unsigned long long)st.error_completions,
	       (unsigned long long)st.cq_events, (unsigned long long)st.acked_events,
	       (unsigned long long)st.unacked_now, (unsigned long long)st.foreign_cq_events,
	       (unsigned long long)st.wakeups, (unsigned long long)st.empty_wakeups,
	       (unsigned long long)st.arm_calls, (unsigned long long)st.ack_calls);
	printf("server: CQ loop seen by the server run=%d accepted=%" PRIu32 " added=%" PRIu32 " removed=%" PRIu32
	       " removed_while_running=%" PRIu32 " drained=%" PRIu32 " teardown_errors=%" PRIu32
	       " callback_calls=%llu callback_completions=%llu receives=%llu sends=%llu errors=%llu"
	       " off_loop_thread=%llu\n",
	       loop_rc, accepted, cqs_added, cqs_removed, removed_while_running, qps_drained, teardown_errors,
	       (unsigned long long)seen.calls, (unsigned long long)seen.completions,
	       (unsigned long long)seen.receives, (unsigned long long)seen.sends, (unsigned long long)seen.errors,
	       (unsigned long long)seen.off_loop_thread);
	if (cnt.outstanding || failed || teardown_errors || (!stop_signal && served != expected) ||
	    st.cqs || st.cqs_removed != st.cqs_added || st.unacked_now)
		status = 1;
	printf("server: exit %d\n", status);
	return status;
}
