/*
 * messenger_client: the client side of the messenger (see messenger.h).
 *
 *   messenger_client -a ADDR -p PORT -i ID [-n CONNS] [-H] [-t WATCHDOG_SECS]
 *
 * Opens CONNS connections (default 1) from this one process, all on one CM
 * event channel (O_NONBLOCK) and one event loop: poll() on the channel fd
 * and the completion channel fd, then rdmasafe_get_event_timeout(..., 0)
 * until EAGAIN, then the shared CQ.
 *
 * Each connection sends a hello (client id, connection index, name
 * "client-ID.INDEX", a nonce) in its connect private data, checks the
 * server's welcome on ESTABLISHED (magic, own length, the echoed id, index
 * and nonce), sends one PING over a SEND and checks the PONG, which the
 * server builds from the state it kept from the hello. Then it disconnects;
 * with -H it holds the connection instead until the server disconnects
 * (used to test the server's shutdown on a signal).
 *
 * Exit status 0 only if every connection got its welcome and correct PONG
 * and ended cleanly, and no rdmasafe event copy is outstanding.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "messenger.h"
#include "rdmasafe.h"

#define MAX_CONNS 64

struct conn {
	struct rdma_cm_id *id;
	uint32_t index;
	char name[MSGR_NAME_LEN];
	uint64_t nonce;
	uint64_t session;
	uint32_t number;
	int welcomed, ok, done, failed, we_disconnected;
	int teardown_pending; /* asked for while a CM event of its id was held */
	struct ibv_mr *rx_mr, *tx_mr;
	struct msgr_msg rx, tx;
	char expect[MSGR_TEXT_LEN];
};

static struct conn conns[MAX_CONNS];
static uint32_t nconns = 1, client_id, ndone;
static int hold;
/*
 * Set while a CM event is being handled. rdma_destroy_id waits until every
 * event of its id is freed (the ack barrier), so a teardown asked for inside
 * the handler is done by drain_cm once the event is freed.
 */
static int in_cm_event;
static struct rdma_event_channel *ch;
static struct msgr_dev dev;
static struct addrinfo *server;

static void fail(struct conn *c, const char *what)
{
	printf("client %" PRIu32 " conn %" PRIu32 ": FAILED: %s\n", client_id, c->index, what);
	c->failed = 1;
}

static void teardown(struct conn *c)
{
	if (in_cm_event && c->id) {
		c->teardown_pending = 1;
		return;
	}
	c->teardown_pending = 0;
	if (c->id) {
		if (c->id->qp)
			rdma_destroy_qp(c->id);
		if (rdma_destroy_id(c->id))
			printf("client %" PRIu32 " conn %" PRIu32 ": rdma_destroy_id: %s\n", client_id,
			       c->index, msgr_errname(errno));
	}
	if (c->rx_mr)
		ibv_dereg_mr(c->rx_mr);
	if (c->tx_mr)
		ibv_dereg_mr(c->tx_mr);
	c->rx_mr = c->tx_mr = NULL;
	c->id = NULL;
	if (!c->done) {
		c->done = 1;
		ndone++;
	}
}

/* Gives up on a connection that has not been established yet or broke. */
static void abort_conn(struct conn *c, const char *what)
{
	fail(c, what);
	if (c->id && c->welcomed && !c->we_disconnected) {
		c->we_disconnected = 1;
		rdma_disconnect(c->id); /* the DISCONNECTED that follows tears down */
		return;
	}
	teardown(c);
}

static void on_route_resolved(struct conn *c)
{
	struct msgr_hello h;
	struct rdma_conn_param p;

	if (!dev.verbs) {
		if (msgr_dev_open(&dev, c->id->verbs, 4 * MAX_CONNS)) {
			abort_conn(c, "verbs resources");
			return;
		}
	} else if (dev.verbs != c->id->verbs) {
		abort_conn(c, "route on a second device");
		return;
	}
	if (msgr_create_qp(c->id, &dev, 4) ||
	    !(c->rx_mr = ibv_reg_mr(dev.pd, &c->rx, sizeof c->rx, IBV_ACCESS_LOCAL_WRITE)) ||
	    !(c->tx_mr = ibv_reg_mr(dev.pd, &c->tx, sizeof c->tx, 0)) ||
	    msgr_post_recv(c->id, c->rx_mr, &c->rx, sizeof c->rx, (uint64_t)c->index << 1)) {
		abort_conn(c, "QP, memory registration or receive");
		return;
	}
	memset(&h, 0, sizeof h);
	h.client_id = client_id;
	h.conn_index = c->index;
	h.nonce = c->nonce;
	snprintf(h.name, sizeof h.name, "%s", c->name);
	msgr_hello_encode(&h);
	memset(&p, 0, sizeof p);
	p.private_data = &h;
	p.private_data_len = (uint8_t)le16toh(h.len);
	p.responder_resources = 1;
	p.initiator_depth = 1;
	p.retry_count = 7;
	p.rnr_retry_count = 7;
	printf("client %" PRIu32 " conn %" PRIu32 ": connecting as \"%s\" (hello %u bytes)\n", client_id,
	       c->index, c->name, p.private_data_len);
	if (rdma_connect(c->id, &p))
		abort_conn(c, "rdma_connect");
}

static void on_established(struct conn *c, struct rdma_cm_event *ev)
{
	struct msgr_welcome w;
	const char *why = msgr_welcome_decode(ev->param.conn.private_data, ev->param.conn.private_data_len, &w);
	char want_banner[MSGR_BANNER_LEN];

	c->welcomed = 1;
	if (!why && (w.client_id != client_id || w.conn_index != c->index || w.nonce != c->nonce))
		why = "client id, connection index or nonce not echoed";
	if (why) {
		abort_conn(c, why);
		return;
	}
	c->session = w.session_id;
	c->number = w.conn_number;
	printf("client %" PRIu32 " conn %" PRIu32 ": welcome session=%#" PRIx64 " number=%" PRIu32
	       " max_msg=%" PRIu32 " banner=\"%s\" (welcome len %u, private_data_len %u)\n",
	       client_id, c->index, w.session_id, w.conn_number, w.max_msg, w.banner, w.len,
	       ev->param.conn.private_data_len);
	/* the banner names us: the server kept our hello */
	snprintf(want_banner, sizeof want_banner, " welcomes %s", c->name);
	if (strlen(w.banner) < strlen(want_banner) ||
	    strcmp(w.banner + strlen(w.banner) - strlen(want_banner), want_banner)) {
		abort_conn(c, "banner does not name this connection");
		return;
	}

	memset(&c->tx, 0, sizeof c->tx);
	c->tx.type = MSGR_PING;
	c->tx.session_id = c->session;
	c->tx.client_id = client_id;
	c->tx.conn_index = c->index;
	c->tx.seq = 1;
	snprintf(c->tx.text, sizeof c->tx.text, "ping from %s", c->name);
	snprintf(c->expect, sizeof c->expect, "pong to %s (client %" PRIu32 " conn %" PRIu32 ", number %" PRIu32 "): %.120s",
		 c->name, client_id, c->index, c->number, c->tx.text);
	uint32_t len = MSGR_MSG_LEN(&c->tx);
	msgr_msg_encode(&c->tx);
	if (msgr_post_send(c->id, c->tx_mr, &c->tx, len, ((uint64_t)c->index << 1) | 1))
		abort_conn(c, "post send");
}

static void on_recv(struct conn *c, struct ibv_wc *wc)
{
	struct msgr_msg m;
	const char *why = msgr_msg_decode(&c->rx, wc->byte_len, &m);

	if (!why && m.type != MSGR_PONG)
		why = "not a PONG";
	if (!why && (m.session_id != c->session || m.client_id != client_id || m.conn_index != c->index || m.seq != 1))
		why = "session, client id, connection index or seq do not match";
	if (!why && strcmp(m.text, c->expect))
		why = "unexpected reply text";
	if (why) {
		printf("client %" PRIu32 " conn %" PRIu32 ": got \"%s\", want \"%s\"\n", client_id, c->index,
		       m.text, c->expect);
		abort_conn(c, why);
		return;
	}
	c->ok = 1;
	printf("client %" PRIu32 " conn %" PRIu32 ": reply OK (%u bytes): \"%s\"\n", client_id, c->index,
	       wc->byte_len, m.text);
	if (hold) {
		printf("client %" PRIu32 " conn %" PRIu32 ": holding the connection until the server disconnects\n",
		       client_id, c->index);
		return;
	}
	c->we_disconnected = 1;
	if (rdma_disconnect(c->id))
		abort_conn(c, "rdma_disconnect");
}

static void on_cm_event(struct rdma_cm_event *ev)
{
	struct conn *c = ev->id ? ev->id->context : NULL;

	if (!c) {
		printf("client %" PRIu32 ": %s for no connection\n", client_id, rdmasafe_event_str(ev->event));
		return;
	}
	switch (ev->event) {
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		if (rdma_resolve_route(c->id, 2000))
			abort_conn(c, "rdma_resolve_route");
		break;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		on_route_resolved(c);
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		on_established(c, ev);
		break;
	case RDMA_CM_EVENT_DISCONNECTED:
		if (!c->we_disconnected) {
			printf("client %" PRIu32 " conn %" PRIu32 ": disconnected by the server%s\n", client_id,
			       c->index, hold && c->ok ? " (while holding)" : "");
			rdma_disconnect(c->id); /* DREP for the server's DREQ */
			if (!(hold && c->ok))
				fail(c, "server disconnected first");
		}
		printf("client %" PRIu32 " conn %" PRIu32 ": disconnected%s\n", client_id, c->index,
		       c->ok && !c->failed ? ", done" : "");
		teardown(c);
		break;
	case RDMA_CM_EVENT_REJECTED: {
		struct msgr_refusal r;
		const char *why = msgr_refusal_decode(ev->param.conn.private_data, ev->param.conn.private_data_len, &r);
		char text[160];
		snprintf(text, sizeof text, "rejected (status %d): %s", ev->status,
			 why ? "no refusal from a messenger server" : r.reason);
		abort_conn(c, text);
		break;
	}
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
		abort_conn(c, rdmasafe_event_str(ev->event));
		break;
	case RDMA_CM_EVENT_TIMEWAIT_EXIT:
		break;
	default:
		printf("client %" PRIu32 " conn %" PRIu32 ": unexpected %s (status %d)\n", client_id, c->index,
		       rdmasafe_event_str(ev->event), ev->status);
		break;
	}
}

static int drain_cm(void)
{
	struct rdma_cm_event *ev;

	while (rdmasafe_get_event_timeout(ch, &ev, 0) == 0) {
		in_cm_event = 1;
		on_cm_event(ev);
		in_cm_event = 0;
		if (rdmasafe_event_free(ev))
			printf("client %" PRIu32 ": rdmasafe_event_free: %s\n", client_id, msgr_errname(errno));
		for (uint32_t i = 0; i < nconns; i++)
			if (conns[i].teardown_pending)
				teardown(&conns[i]);
	}
	if (errno != EAGAIN) {
		printf("client %" PRIu32 ": rdmasafe_get_event_timeout: %s\n", client_id, msgr_errname(errno));
		return -1;
	}
	return 0;
}

static void handle_completions(void)
{
	struct ibv_wc wc[16];
	int n;

	do {
		n = msgr_dev_poll(&dev, wc, 16);
		for (int i = 0; i < n; i++) {
			uint32_t idx = (uint32_t)(wc[i].wr_id >> 1);
			struct conn *c = idx < nconns ? &conns[idx] : NULL;
			if (!c || !c->id)
				continue; /* late completion of a connection already gone */
			if (wc[i].status != IBV_WC_SUCCESS) {
				if (wc[i].status != IBV_WC_WR_FLUSH_ERR || !c->ok)
					abort_conn(c, ibv_wc_status_str(wc[i].status));
				continue;
			}
			if (!(wc[i].wr_id & 1))
				on_recv(c, &wc[i]);
		}
	} while (n == 16);
}

static void usage(const char *argv0)
{
	fprintf(stderr, "usage: %s -a ADDR -p PORT -i ID [-n CONNS] [-H] [-t WATCHDOG_SECS]\n", argv0);
	exit(2);
}

int main(int argc, char **argv)
{
	const char *addr = NULL, *port = NULL;
	unsigned watchdog = 60;
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV };
	struct rdmasafe_cm_counters cnt = { .size = sizeof cnt };
	uint32_t ok = 0, i;
	int op, r, status = 0, have_id = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((op = getopt(argc, argv, "a:p:i:n:Ht:")) != -1) {
		switch (op) {
		case 'a': addr = optarg; break;
		case 'p': port = optarg; break;
		case 'i': client_id = (uint32_t)strtoul(optarg, NULL, 0); have_id = 1; break;
		case 'n': nconns = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 'H': hold = 1; break;
		case 't': watchdog = (unsigned)strtoul(optarg, NULL, 0); break;
		default: usage(argv[0]);
		}
	}
	if (!addr || !port || !have_id || nconns < 1 || nconns > MAX_CONNS)
		usage(argv[0]);
	msgr_watchdog("client", watchdog);
	/*
	 * Every copy is freed right after its handler, and no id is destroyed
	 * while a copy of its events is held. A generous ack deadline makes
	 * the acked_at_deadline counter printed at exit count only a teardown
	 * that waits on its own held event, never a slow machine.
	 */
	rdmasafe_cm_set_ack_deadline(30000);
	r = getaddrinfo(addr, port, &hints, &server);
	if (r) {
		fprintf(stderr, "client: %s:%s: %s\n", addr, port, gai_strerror(r));
		return 1;
	}
	ch = rdma_create_event_channel();
	if (!ch || fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK)) {
		perror("client: event channel");
		return 1;
	}
	for (i = 0; i < nconns; i++) {
		struct conn *c = &conns[i];
		c->index = i;
		c->nonce = ((uint64_t)getpid() << 32) ^ ((uint64_t)client_id << 8) ^ (i * 0x9e3779b9u);
		snprintf(c->name, sizeof c->name, "client-%" PRIu32 ".%" PRIu32, client_id, i);
		if (rdma_create_id(ch, &c->id, c, RDMA_PS_TCP) ||
		    rdma_resolve_addr(c->id, NULL, server->ai_addr, 2000))
			abort_conn(c, "rdma_create_id / rdma_resolve_addr");
	}

	while (ndone < nconns) {
		struct pollfd pfd[2] = {
			{ .fd = ch->fd, .events = POLLIN },
			{ .fd = dev.comp ? dev.comp->fd : -1, .events = POLLIN },
		};
		if (poll(pfd, 2, 1000) < 0 && errno != EINTR) {
			perror("client: poll");
			status = 1;
			break;
		}
		if (drain_cm()) {
			status = 1;
			break;
		}
		handle_completions();
	}
	for (i = 0; i < nconns; i++) {
		if (conns[i].ok && !conns[i].failed)
			ok++;
		teardown(&conns[i]);
	}
	msgr_dev_close(&dev);
	rdma_destroy_event_channel(ch);
	freeaddrinfo(server);

	rdmasafe_cm_get_counters(&cnt);
	printf("client %" PRIu32 ": %" PRIu32 " of %" PRIu32 " connections OK; counters copied=%llu freed=%llu outstanding=%llu slots_allocated=%llu acked_at_deadline=%llu\n",
	       client_id, ok, nconns, (unsigned long long)cnt.copied, (unsigned long long)cnt.freed,
	       (unsigned long long)cnt.outstanding, (unsigned long long)cnt.slots_allocated,
	       (unsigned long long)cnt.acked_at_deadline);
	if (ok != nconns || cnt.outstanding || cnt.acked_at_deadline)
		status = 1;
	printf("client %" PRIu32 ": exit %d\n", client_id, status);
	return status;
}
