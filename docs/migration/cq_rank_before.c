/*
 * cq_rank_before.c: an MPI-style rank's completion handling on raw
 * libibverbs: arm, ibv_get_cq_event, ack, re-arm, drain, written by hand.
 * This is the "before" of docs/migrating-from-librdmacm.md;
 * cq_rank_after.c hands the same CQs to rdmasafe_cq_loop.
 * Build: cc cq_rank_before.c -lrdmacm -libverbs
 *
 *   cq_rank_before [-a ADDR] [-p PORT] [-n ROUNDS]  (ADDR: $RDMASAFE_TEST_ADDR)
 *
 * Two ranks live in this one process, connected by one RC connection that
 * rdma_cm sets up to ADDR (a loopback connection; no MPI needed). Each rank
 * has a send CQ and a receive CQ, and all four CQs share one completion
 * channel, as in a progress engine. Rank 0 sends ROUNDS small messages one
 * at a time; rank 1 answers each; every completion is handled by the
 * progress loop, which re-posts receives and sends the next message.
 *
 * Exits 0 when all ROUNDS round trips completed with the right sequence
 * numbers and no error completion. A watchdog turns a hang into exit 3.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define NRANKS 2
#define NCQ (2 * NRANKS)  /* rank r: cqs[2r] send, cqs[2r + 1] receive */
#define RECV_DEPTH 8
#define SEND_DEPTH 16
#define CQ_DEPTH 64
#define POLL_BATCH 16
#define ACK_BATCH 16      /* CQ events per ibv_ack_cq_events call */
#define SEND_SLOT 0xffff  /* wr_id slot of a send */
#define TIMEOUT_MS 2000
#define WATCHDOG_S 60

struct msg {              /* host byte order: both ranks are this process */
	uint32_t seq;
	char text[60];
};

struct rank {
	int num;
	struct rdma_cm_id *id;
	struct ibv_mr *mr;    /* covers this struct */
	uint32_t received;    /* messages received, in order */
	uint32_t sends_done;
	struct msg recv_buf[RECV_DEPTH];
	struct msg send_buf;
};

struct cq_info {          /* each CQ's cq_context */
	struct ibv_cq *cq;
	const char *name;
	unsigned long events; /* CQ events read */
	unsigned unacked;     /* CQ events read and not acked yet */
};

static struct rdma_event_channel *cm_ch;
static struct ibv_pd *pd;
static struct ibv_comp_channel *channel;
static struct cq_info cqs[NCQ];
static struct rank ranks[NRANKS];
static uint32_t rounds = 1000;
static unsigned long completions, error_completions, cq_events, ack_calls, arm_calls;
static int done, failed;

static void on_alarm(int sig)
{
	static const char msg[] = "watchdog: hang, exiting\n";

	(void)sig;
	if (write(STDOUT_FILENO, msg, sizeof msg - 1) < 0)
		_exit(4);
	_exit(3);
}

static void fail(const char *what)
{
	printf("cq_rank_before: %s: %s\n", what, strerror(errno));
	exit(1);
}

/* ---------------------------------------------------------- the messages */

static int post_recv(struct rank *r, unsigned slot)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)&r->recv_buf[slot],
		.length = sizeof r->recv_buf[slot],
		.lkey = r->mr->lkey,
	};
	struct ibv_recv_wr wr = {
		.wr_id = (uint64_t)r->num << 16 | slot,
		.sg_list = &sge,
		.num_sge = 1,
	}, *bad;

	return ibv_post_recv(r->id->qp, &wr, &bad);
}

static int post_send(struct rank *r, uint32_t seq)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)&r->send_buf,
		.length = sizeof r->send_buf,
		.lkey = r->mr->lkey,
	};
	struct ibv_send_wr wr = {
		.wr_id = (uint64_t)r->num << 16 | SEND_SLOT,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED,
	}, *bad;

	r->send_buf.seq = seq;
	snprintf(r->send_buf.text, sizeof r->send_buf.text, "%s %u from rank %d",
		 r->num ? "pong" : "ping", seq, r->num);
	return ibv_post_send(r->id->qp, &wr, &bad);
}

/* One work completion, whichever CQ it came from. */
static void handle_wc(const struct ibv_wc *wc)
{
	struct rank *r = &ranks[wc->wr_id >> 16];
	unsigned slot = wc->wr_id & 0xffff;
	char want[sizeof r->send_buf.text];

	completions++;
	if (wc->status != IBV_WC_SUCCESS) {
		printf("rank %d: %s completion: %s\n", r->num, slot == SEND_SLOT ? "send" : "receive",
		       ibv_wc_status_str(wc->status));
		error_completions++;
		failed = done = 1;
		return;
	}
	if (slot == SEND_SLOT) {
		r->sends_done++;
	} else {
		const struct msg *m = &r->recv_buf[slot];
		uint32_t seq = m->seq;

		snprintf(want, sizeof want, "%s %u from rank %d", r->num ? "ping" : "pong",
			 r->received, !r->num);
		if (seq != r->received || strcmp(m->text, want)) {
			printf("rank %d: got \"%.60s\" (seq %u), want \"%s\"\n", r->num, m->text,
			       seq, want);
			failed = done = 1;
			return;
		}
		r->received++;
		if (post_recv(r, slot) || /* rank 1 answers, rank 0 sends the next */
		    ((r->num == 1 || seq + 1 < rounds) && post_send(r, r->num ? seq : seq + 1))) {
			printf("rank %d: ibv_post_recv / ibv_post_send: %s\n", r->num, strerror(errno));
			failed = done = 1;
			return;
		}
	}
	if (ranks[0].received == rounds && ranks[1].received == rounds &&
	    ranks[0].sends_done == rounds && ranks[1].sends_done == rounds)
		done = 1;
}

/* ------------------------------------------------- connecting the ranks */

/* The next CM event, which must be `want` (TIMEWAIT_EXIT is skipped). */
static struct rdma_cm_id *cm_wait(enum rdma_cm_event_type want)
{
	for (;;) {
		struct rdma_cm_event *ev;
		enum rdma_cm_event_type got;
		struct rdma_cm_id *id;
		int status;

		if (rdma_get_cm_event(cm_ch, &ev)) {
			if (errno == EINTR)
				continue;
			fail("rdma_get_cm_event");
		}
		got = ev->event;
		id = ev->id;
		status = ev->status;
		rdma_ack_cm_event(ev);
		if (got == RDMA_CM_EVENT_TIMEWAIT_EXIT)
			continue;
		if (got != want) {
			printf("cq_rank_before: waiting for %s, got %s (status %d)\n",
			       rdma_event_str(want), rdma_event_str(got), status);
			exit(1);
		}
		return id;
	}
}

static void create_verbs(struct ibv_context *ctx)
{
	static const char *names[NCQ] = { "rank 0 send", "rank 0 recv", "rank 1 send", "rank 1 recv" };
	int i;

	if (!(pd = ibv_alloc_pd(ctx)) || !(channel = ibv_create_comp_channel(ctx)))
		fail("ibv_alloc_pd / ibv_create_comp_channel");
	for (i = 0; i < NCQ; i++) {
		cqs[i].name = names[i];
		if (!(cqs[i].cq = ibv_create_cq(ctx, CQ_DEPTH, &cqs[i], channel, 0)))
			fail("ibv_create_cq");
	}
	for (i = 0; i < NRANKS; i++) {
		ranks[i].num = i;
		if (!(ranks[i].mr = ibv_reg_mr(pd, &ranks[i], sizeof ranks[i], IBV_ACCESS_LOCAL_WRITE)))
			fail("ibv_reg_mr");
	}
}

static void create_qp(struct rank *r)
{
	struct ibv_qp_init_attr attr;
	unsigned slot;

	memset(&attr, 0, sizeof attr);
	attr.send_cq = cqs[2 * r->num].cq;
	attr.recv_cq = cqs[2 * r->num + 1].cq;
	attr.qp_type = IBV_QPT_RC;
	attr.cap.max_send_wr = SEND_DEPTH;
	attr.cap.max_recv_wr = RECV_DEPTH;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (rdma_create_qp(r->id, pd, &attr))
		fail("rdma_create_qp");
	for (slot = 0; slot < RECV_DEPTH; slot++)
		if (post_recv(r, slot))
			fail("ibv_post_recv");
}

static void connect_ranks(const struct addrinfo *ai, struct rdma_cm_id **listener)
{
	struct rdma_conn_param p;

	memset(&p, 0, sizeof p);
	p.responder_resources = p.initiator_depth = 1;
	p.retry_count = p.rnr_retry_count = 7;
	if (!(cm_ch = rdma_create_event_channel()) ||
	    rdma_create_id(cm_ch, listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(*listener, ai->ai_addr) || rdma_listen(*listener, 1) ||
	    rdma_create_id(cm_ch, &ranks[0].id, &ranks[0], RDMA_PS_TCP) ||
	    rdma_resolve_addr(ranks[0].id, NULL, ai->ai_addr, TIMEOUT_MS))
		fail("listener / rank 0 id");
	cm_wait(RDMA_CM_EVENT_ADDR_RESOLVED);
	create_verbs(ranks[0].id->verbs);
	if (rdma_resolve_route(ranks[0].id, TIMEOUT_MS))
		fail("rdma_resolve_route");
	cm_wait(RDMA_CM_EVENT_ROUTE_RESOLVED);
	create_qp(&ranks[0]);
	if (rdma_connect(ranks[0].id, &p))
		fail("rdma_connect");
	ranks[1].id = cm_wait(RDMA_CM_EVENT_CONNECT_REQUEST);
	if (ranks[1].id->verbs != ranks[0].id->verbs) {
		printf("cq_rank_before: the ranks are on two devices\n");
		exit(1);
	}
	ranks[1].id->context = &ranks[1];
	create_qp(&ranks[1]);
	if (rdma_accept(ranks[1].id, &p))
		fail("rdma_accept");
	cm_wait(RDMA_CM_EVENT_ESTABLISHED);
	cm_wait(RDMA_CM_EVENT_ESTABLISHED);
	printf("cq_rank_before: rank 0 (QP %u) and rank 1 (QP %u) connected on %s, "
	       "%d CQs on one completion channel\n",
	       ranks[0].id->qp->qp_num, ranks[1].id->qp->qp_num,
	       ibv_get_device_name(ranks[0].id->verbs->device), NCQ);
}

static void disconnect_ranks(void)
{
	int i;

	if (rdma_disconnect(ranks[0].id))
		fail("rdma_disconnect");
	for (i = 0; i < 2; i++)
		if (cm_wait(RDMA_CM_EVENT_DISCONNECTED) == ranks[1].id)
			rdma_disconnect(ranks[1].id); /* answers rank 0's DREQ */
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR"), *port = "7492";
	struct rdma_cm_id *listener = NULL;
	struct addrinfo hints, *ai;
	int op, rc, i;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((op = getopt(argc, argv, "a:p:n:")) != -1) {
		switch (op) {
		case 'a': addr = optarg; break;
		case 'p': port = optarg; break;
		case 'n': rounds = (uint32_t)strtoul(optarg, NULL, 0); break;
		default: addr = NULL; break;
		}
	}
	if (!addr || optind != argc || rounds < 1) {
		fprintf(stderr, "usage: %s [-a ADDR] [-p PORT] [-n ROUNDS] (or set RDMASAFE_TEST_ADDR)\n",
			argv[0]);
		return 2;
	}
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = AI_NUMERICSERV;
	hints.ai_socktype = SOCK_STREAM;
	if ((rc = getaddrinfo(addr, port, &hints, &ai))) {
		fprintf(stderr, "%s port %s: %s\n", addr, port, gai_strerror(rc));
		return 2;
	}
	signal(SIGALRM, on_alarm);
	alarm(WATCHDOG_S);
	connect_ranks(ai, &listener);

	/* guide:progress begin */
	for (i = 0; i < NCQ; i++) {     /* arm every CQ once */
		if (ibv_req_notify_cq(cqs[i].cq, 0))
			fail("ibv_req_notify_cq");
		arm_calls++;
	}
	if (post_send(&ranks[0], 0))    /* rank 0 starts */
		fail("ibv_post_send");
	while (!done) {
		struct ibv_wc wc[POLL_BATCH];
		struct ibv_cq *cq;
		struct cq_info *ci;
		void *ctx;
		int n;

		if (ibv_get_cq_event(channel, &cq, &ctx)) { /* sleeps */
			if (errno == EINTR)
				continue;
			fail("ibv_get_cq_event");
		}
		ci = ctx;
		ci->events++;
		cq_events++;
		if (++ci->unacked == ACK_BATCH) { /* on the CQ the event named */
			ibv_ack_cq_events(cq, ci->unacked);
			ci->unacked = 0;
			ack_calls++;
		}
		if (ibv_req_notify_cq(cq, 0))   /* re-arm before the drain */
			fail("ibv_req_notify_cq");
		arm_calls++;
		do {                            /* then poll until empty */
			n = ibv_poll_cq(cq, POLL_BATCH, wc);
			for (i = 0; i < n; i++)
				handle_wc(&wc[i]);
		} while (n > 0);
		if (n < 0)
			fail("ibv_poll_cq");
	}
	/* guide:progress end */

	printf("cq_rank_before: %u round trips, %lu completions (%lu errors)\n",
	       ranks[0].received, completions, error_completions);
	printf("cq_rank_before: %lu CQ events, %lu ack calls, %lu arm calls\n", cq_events,
	       ack_calls, arm_calls);
	for (i = 0; i < NCQ; i++)
		printf("cq_rank_before: %s CQ: %lu events\n", cqs[i].name, cqs[i].events);
	disconnect_ranks();

	/* guide:teardown begin */
	rdma_destroy_qp(ranks[0].id);
	rdma_destroy_qp(ranks[1].id);
	for (i = 0; i < NCQ; i++) {
		/* Ack what was read and not acked yet, on the CQ each event
		 * named: ibv_destroy_cq waits forever for a missing ack. */
		if (cqs[i].unacked)
			ibv_ack_cq_events(cqs[i].cq, cqs[i].unacked);
		cqs[i].unacked = 0;
		if (ibv_destroy_cq(cqs[i].cq))
			fail("ibv_destroy_cq");
	}
	ibv_destroy_comp_channel(channel);
	/* guide:teardown end */

	for (i = 0; i < NRANKS; i++) {
		ibv_dereg_mr(ranks[i].mr);
		rdma_destroy_id(ranks[i].id);
	}
	ibv_dealloc_pd(pd);
	rdma_destroy_id(listener);
	rdma_destroy_event_channel(cm_ch);
	freeaddrinfo(ai);
	rc = failed || ranks[0].received != rounds || completions != 4ul * rounds;
	printf("cq_rank_before: %s\n", rc ? "FAILED" : "OK");
	return rc;
}
