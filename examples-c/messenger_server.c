/*
 * messenger_server: the server side of the messenger (see messenger.h).
 *
 *   messenger_server -a ADDR -p PORT -n EXPECTED_CLIENTS [-t WATCHDOG_SECS]
 *
 * One thread, one event loop: poll() on the CM channel fd (O_NONBLOCK) and
 * the completion channel fd, then drain CM events with rdmasafe_get_events
 * (batches, no waiting) and the shared CQ. Every CM event is an rdmasafe
 * copy, freed with rdmasafe_event_free as soon as it is handled.
 *
 * Per connection the server keeps what the client's hello said (client id,
 * connection index, name, nonce), assigns a session id, and answers in the
 * accept private data with a welcome. The client then sends one PING over a
 * SEND; the server answers with a PONG built from its per-connection state.
 * The passive side calls rdma_disconnect on DISCONNECTED (that sends the
 * DREP the client's disconnect waits for), then tears the connection down.
 *
 * Exits after EXPECTED_CLIENTS connections ended, or on SIGINT/SIGTERM
 * (disconnects every live connection, waits for them, destroys all). Prints
 * the rdmasafe copy counters at the end; exit status 0 only if every
 * expected client was served (or the stop was a signal), nothing failed,
 * and no event copy is outstanding.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "messenger.h"
#include "rdmasafe.h"

#define MAX_CONNS 256
#define BATCH 32
#define SHUTDOWN_MS 5000

enum cstate { FREE = 0, ACCEPTING, ESTABLISHED, CLOSING };

struct conn {
	enum cstate state;
	uint32_t gen;            /* bumped on every reuse of the slot */
	struct rdma_cm_id *id;
	/* from the client's hello */
	uint32_t client_id, conn_index;
	uint64_t nonce;
	char name[MSGR_NAME_LEN];
	/* ours */
	uint64_t session;
	uint32_t number;
	int replied;             /* PONG posted */
	int send_done;           /* PONG send completed */
	struct ibv_mr *rx_mr, *tx_mr;
	struct msgr_msg rx, tx;
};

static struct conn *conns;
static struct rdma_event_channel *ch;
static struct rdma_cm_id *listener;
static struct msgr_dev dev;
static const char *banner_dev = "?";
static uint32_t accepted, served, failed, refused, finished, expected;
static unsigned long cm_events, cm_calls, cm_largest;
static volatile sig_atomic_t stop_signal;

static void on_stop(int sig)
{
	stop_signal = sig;
}

static uint64_t wr_id(struct conn *c, int send)
{
	return ((uint64_t)c->gen << 32) | ((uint64_t)(c - conns) << 1) | (send ? 1 : 0);
}

static struct conn *conn_of_wr(uint64_t id, int *send)
{
	uint32_t slot = (uint32_t)(id & 0xffffffffu) >> 1;

	*send = id & 1;
	if (slot >= MAX_CONNS || conns[slot].state == FREE || conns[slot].gen != (uint32_t)(id >> 32))
		return NULL; /* a late completion of a connection already gone */
	return &conns[slot];
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

static void handle_completions(void);

/* The connection is over: free everything of it. */
static void finish(struct conn *c, const char *how)
{
	int ok;

	handle_completions(); /* completions of this QP still queued */
	ok = c->replied && !strcmp(how, "disconnected");
	if (ok)
		served++;
	else
		failed++;
	printf("server: client %" PRIu32 " conn %" PRIu32 " (%s) session %#" PRIx64 " %s%s\n",
	       c->client_id, c->conn_index, c->name, c->session, how,
	       ok ? ", served" : c->replied ? "" : " before its message was answered");
	if (c->id->qp)
		rdma_destroy_qp(c->id);
	if (c->rx_mr)
		ibv_dereg_mr(c->rx_mr);
	if (c->tx_mr)
		ibv_dereg_mr(c->tx_mr);
	if (rdma_destroy_id(c->id))
		printf("server: rdma_destroy_id: %s\n", msgr_errname(errno));
	c->rx_mr = c->tx_mr = NULL;
	c->id = NULL;
	c->state = FREE;
	c->gen++;
	finished++;
}

static void on_connect_request(struct rdma_cm_event *ev)
{
	struct rdma_cm_id *id = ev->id;
	struct msgr_hello h;
	struct msgr_welcome w;
	struct rdma_conn_param p;
	struct conn *c = NULL;
	const char *why;
	int i;

	why = msgr_hello_decode(ev->param.conn.private_data, ev->param.conn.private_data_len, &h);
	if (why) {
		refuse(id, why);
		return;
	}
	if (stop_signal) {
		refuse(id, "server shutting down");
		return;
	}
	if (!dev.verbs) {
		if (msgr_dev_open(&dev, id->verbs, 4 * MAX_CONNS)) {
			printf("server: verbs resources on %s: %s\n",
			       ibv_get_device_name(id->verbs->device), msgr_errname(errno));
			refuse(id, "server has no verbs resources");
			return;
		}
		banner_dev = ibv_get_device_name(id->verbs->device);
	} else if (id->verbs != dev.verbs) {
		refuse(id, "request on a second device");
		return;
	}
	for (i = 0; i < MAX_CONNS && !c; i++)
		if (conns[i].state == FREE)
			c = &conns[i];
	if (!c) {
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
	c->replied = c->send_done = 0;
	c->state = ACCEPTING;
	id->context = c;
	printf("server: hello from client_id=%" PRIu32 " conn=%" PRIu32 " name=\"%s\" nonce=%#" PRIx64
	       " (hello len %u, private_data_len %u) -> session %#" PRIx64 " number %" PRIu32 "\n",
	       h.client_id, h.conn_index, h.name, h.nonce, h.len, ev->param.conn.private_data_len,
	       c->session, c->number);

	if (msgr_create_qp(id, &dev, 4) ||
	    !(c->rx_mr = ibv_reg_mr(dev.pd, &c->rx, sizeof c->rx, IBV_ACCESS_LOCAL_WRITE)) ||
	    !(c->tx_mr = ibv_reg_mr(dev.pd, &c->tx, sizeof c->tx, 0)) ||
	    msgr_post_recv(id, c->rx_mr, &c->rx, sizeof c->rx, wr_id(c, 0))) {
		printf("server: setting up session %#" PRIx64 ": %s\n", c->session, msgr_errname(errno));
		if (id->qp)
			rdma_destroy_qp(id);
		if (c->rx_mr)
			ibv_dereg_mr(c->rx_mr);
		if (c->tx_mr)
			ibv_dereg_mr(c->tx_mr);
		c->rx_mr = c->tx_mr = NULL;
		c->state = FREE;
		c->gen++;
		refuse(id, "server could not set up the connection");
		return;
	}

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
		finish(c, "failed to accept");
	}
}

static void on_cm_event(struct rdma_cm_event *ev)
{
	struct conn *c = ev->id && ev->id != listener ? ev->id->context : NULL;

	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST:
		on_connect_request(ev);
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		if (c) {
			c->state = ESTABLISHED;
			printf("server: session %#" PRIx64 " established\n", c->session);
		}
		break;
	case RDMA_CM_EVENT_DISCONNECTED:
		if (c) {
			/* answer the peer's DREQ (or complete ours) */
			if (c->state != CLOSING)
				rdma_disconnect(c->id);
			finish(c, "disconnected");
		}
		break;
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
		if (c) {
			printf("server: session %#" PRIx64 ": %s (status %d)\n", c->session,
			       rdmasafe_event_str(ev->event), ev->status);
			finish(c, "failed");
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

/* Drains the CM channel in batches; returns -1 on a real error. */
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
		for (int i = 0; i < n; i++) {
			on_cm_event(evs[i]);
			if (rdmasafe_event_free(evs[i]))
				printf("server: rdmasafe_event_free: %s\n", msgr_errname(errno));
		}
	}
}

static void on_recv(struct conn *c, struct ibv_wc *wc)
{
	struct msgr_msg m;
	const char *why = msgr_msg_decode(&c->rx, wc->byte_len, &m);

	if (!why && m.type != MSGR_PING)
		why = "not a PING";
	if (!why && (m.session_id != c->session || m.client_id != c->client_id || m.conn_index != c->conn_index))
		why = "session, client id or connection index do not match the hello";
	if (why) {
		printf("server: session %#" PRIx64 ": bad message (%s), disconnecting\n", c->session, why);
		c->state = CLOSING;
		rdma_disconnect(c->id);
		return;
	}
	printf("server: message from client %" PRIu32 " conn %" PRIu32 " session %#" PRIx64
	       " seq %" PRIu32 " (%u bytes): \"%s\"\n",
	       m.client_id, m.conn_index, m.session_id, m.seq, wc->byte_len, m.text);

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
	if (msgr_post_send(c->id, c->tx_mr, &c->tx, len, wr_id(c, 1))) {
		printf("server: session %#" PRIx64 ": post send: %s\n", c->session, msgr_errname(errno));
		c->state = CLOSING;
		rdma_disconnect(c->id);
		return;
	}
	c->replied = 1;
}

static void handle_completions(void)
{
	struct ibv_wc wc[16];
	int n;

	do {
		n = msgr_dev_poll(&dev, wc, 16);
		if (n < 0) {
			printf("server: polling the CQ failed\n");
			return;
		}
		for (int i = 0; i < n; i++) {
			int send;
			struct conn *c = conn_of_wr(wc[i].wr_id, &send);
			if (!c)
				continue;
			if (wc[i].status != IBV_WC_SUCCESS) {
				if (c->state != CLOSING && wc[i].status != IBV_WC_WR_FLUSH_ERR)
					printf("server: session %#" PRIx64 ": %s completion: %s\n", c->session,
					       send ? "send" : "receive", ibv_wc_status_str(wc[i].status));
				continue;
			}
			if (send)
				c->send_done = 1;
			else
				on_recv(c, &wc[i]);
		}
	} while (n == 16);
}

static uint32_t live(void)
{
	uint32_t n = 0;

	for (int i = 0; i < MAX_CONNS; i++)
		n += conns[i].state != FREE;
	return n;
}

static void shutdown_all(void)
{
	double deadline;
	uint32_t n = live();

	printf("server: %s: disconnecting %" PRIu32 " live connection(s)\n",
	       stop_signal == SIGINT ? "SIGINT" : "SIGTERM", n);
	for (int i = 0; i < MAX_CONNS; i++) {
		struct conn *c = &conns[i];
		if (c->state == FREE)
			continue;
		c->state = CLOSING;
		if (rdma_disconnect(c->id))
			printf("server: rdma_disconnect(session %#" PRIx64 "): %s\n", c->session, msgr_errname(errno));
	}
	/* wait for their DISCONNECTED (the peers answer with DREP) */
	deadline = msgr_now_ms() + SHUTDOWN_MS;
	while (live() && msgr_now_ms() < deadline) {
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		if (poll(&pfd, 1, 100) < 0 && errno != EINTR)
			break;
		if (drain_cm())
			break;
	}
	for (int i = 0; i < MAX_CONNS; i++)
		if (conns[i].state != FREE)
			finish(&conns[i], "destroyed at shutdown without DISCONNECTED");
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
	struct sigaction sa;
	unsigned long cq_events;
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
	printf("server: listening on %s port %u for %" PRIu32 " clients (pid %d)\n", addr,
	       ntohs(rdma_get_src_port(listener)), expected, (int)getpid());

	while (!stop_signal && finished < expected) {
		struct pollfd pfd[2] = {
			{ .fd = ch->fd, .events = POLLIN },
			{ .fd = dev.comp ? dev.comp->fd : -1, .events = POLLIN },
		};
		if (poll(pfd, 2, 1000) < 0 && errno != EINTR) {
			printf("server: poll: %s\n", msgr_errname(errno));
			status = 1;
			break;
		}
		if (drain_cm()) {
			status = 1;
			break;
		}
		handle_completions();
	}
	if (stop_signal || live())
		shutdown_all();

	if (listener && rdma_destroy_id(listener))
		printf("server: rdma_destroy_id(listener): %s\n", msgr_errname(errno));
	drain_cm(); /* nothing should be left; free whatever is */
	cq_events = dev.cq_events;
	msgr_dev_close(&dev);
	rdma_destroy_event_channel(ch);
	free(conns);

	rdmasafe_cm_get_counters(&cnt);
	printf("server: CM events %lu in %lu rdmasafe_get_events calls (largest batch %lu), CQ events %lu\n",
	       cm_events, cm_calls, cm_largest, cq_events);
	printf("server: done: %" PRIu32 " served, %" PRIu32 " failed, %" PRIu32 " refused, %s\n",
	       served, failed, refused, stop_signal ? "stopped by signal" : "all expected clients finished");
	printf("server: counters copied=%llu freed=%llu outstanding=%llu slots_allocated=%llu\n",
	       (unsigned long long)cnt.copied, (unsigned long long)cnt.freed,
	       (unsigned long long)cnt.outstanding, (unsigned long long)cnt.slots_allocated);
	if (cnt.outstanding || failed || (!stop_signal && served != expected))
		status = 1;
	printf("server: exit %d\n", status);
	return status;
}
