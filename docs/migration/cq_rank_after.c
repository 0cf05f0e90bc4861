/*
 * cq_rank_after.c: cq_rank_before.c with its CQs handed to rdmasafe's CQ
 * loop. This is the "after" of docs/migrating-from-librdmacm.md.
 * Build: cc cq_rank_after.c $(pkg-config --cflags --libs rdmasafe)
 *
 *   cq_rank_after [-a ADDR] [-p PORT] [-n ROUNDS]  (ADDR: $RDMASAFE_TEST_ADDR)
 *
 * The same two ranks, connection, CQs and messages. The hand-written
 * progress loop (arm, ibv_get_cq_event, ack on the right CQ, re-arm, poll
 * until empty, ack the rest before ibv_destroy_cq) is gone: the four CQs
 * are added to one rdmasafe_cq_loop with a callback, which gets each batch
 * of completions; it stops the loop when the last round trip is done. The
 * loop is destroyed before ibv_destroy_cq. The CM events of the set-up go
 * through rdmasafe_get_event / rdmasafe_event_free.
 *
 * Exits 0 when all ROUNDS round trips completed with the right sequence
 * numbers and no error completion, and the loop's figures agree (every CQ
 * event acked). A watchdog turns a hang into exit 3.
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
#include <rdmasafe.h>

#define NRANKS 2
#define NCQ (2 * NRANKS)  /* rank r: cqs[2r] send, cqs[2r + 1] receive */
#define RECV_DEPTH 8
#define SEND_DEPTH 16
#define CQ_DEPTH 64
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

struct cq_info {          /* each CQ's callback context */
	struct ibv_cq *cq;
	const char *name;
	unsigned long batches; /* callbacks */
};

static struct rdma_event_channel *cm_ch;
static struct ibv_pd *pd;
static struct ibv_comp_channel *channel;
static struct cq_info cqs[NCQ];
static struct rank ranks[NRANKS];
static uint32_t rounds = 1000;
static struct rdmasafe_cq_loop *loop;
static unsigned long completions, error_completions;
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
	printf("cq_rank_after: %s: %s\n", what, strerror(errno));
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

/* guide:callback begin */
/* A batch of one CQ's completions (wc[] is valid during the call only), on
 * the thread that runs the loop. It may post work requests, stop the loop,
 * and add or remove CQs (applied when it returns); it must not run or
 * destroy the loop (-EDEADLK), block on a thread that waits for the loop,
 * or longjmp / throw out. */
static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct cq_info *ci = ctx;
	int i;

	ci->batches++;
	for (i = 0; i < n; i++)
		handle_wc(&wc[i]);
	if (done)
		rdmasafe_cq_loop_stop(loop); /* run returns after this batch */
}
/* guide:callback end */

/* ------------------------------------------------- connecting the ranks */

/* The next CM event, which must be `want` (TIMEWAIT_EXIT is skipped). */
static struct rdma_cm_id *cm_wait(enum rdma_cm_event_type want)
{
	for (;;) {
		struct rdma_cm_event *ev;
		enum rdma_cm_event_type got;
		struct rdma_cm_id *id;
		int status;

		if (rdmasafe_get_event(cm_ch, &ev)) {
			if (errno == EINTR)
				continue;
			fail("rdmasafe_get_event");
		}
		got = ev->event;
		id = ev->id;
		status = ev->status;
		rdmasafe_event_free(ev);
		if (got == RDMA_CM_EVENT_TIMEWAIT_EXIT)
			continue;
		if (got != want) {
			printf("cq_rank_after: waiting for %s, got %s (status %d)\n",
			       rdmasafe_event_str(want), rdmasafe_event_str(got), status);
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
		if (!(cqs[i].cq = ibv_create_cq(ctx, CQ_DEPTH, NULL, channel, 0)))
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
		printf("cq_rank_after: the ranks are on two devices\n");
		exit(1);
	}
	ranks[1].id->context = &ranks[1];
	create_qp(&ranks[1]);
	if (rdma_accept(ranks[1].id, &p))
		fail("rdma_accept");
	cm_wait(RDMA_CM_EVENT_ESTABLISHED);
	cm_wait(RDMA_CM_EVENT_ESTABLISHED);
	printf("cq_rank_after: rank 0 (QP %u) and rank 1 (QP %u) connected on %s, "
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
	struct rdmasafe_cq_loop_options opts;
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
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

	/* guide:setup begin */
	memset(&opts, 0, sizeof opts);  /* 0 in a field: its default */
	opts.size = sizeof opts;        /* the struct as this header has it */
	opts.mode = RDMASAFE_MODE_EVENT; /* arm, sleep, re-arm, drain */
	rc = rdmasafe_cq_loop_create(channel, &opts, &loop);
	if (rc < 0) {                   /* a negative errno, not -1 */
		printf("cq_rank_after: rdmasafe_cq_loop_create: %s\n", strerror(-rc));
		return 1;
	}
	for (i = 0; i < NCQ; i++) {
		rc = rdmasafe_cq_loop_add_cq(loop, cqs[i].cq, on_wc, &cqs[i]);
		if (rc < 0) {
			printf("cq_rank_after: rdmasafe_cq_loop_add_cq: %s\n", strerror(-rc));
			return 1;
		}
	}
	/* guide:setup end */

	/* guide:run begin */
	if (post_send(&ranks[0], 0))    /* rank 0 starts */
		fail("ibv_post_send");
	rc = rdmasafe_cq_loop_run(loop); /* until on_wc stops it */
	if (rc < 0)
		printf("cq_rank_after: rdmasafe_cq_loop_run: %s\n", strerror(-rc));
	/* guide:run end */

	rdmasafe_cq_loop_get_stats(loop, &st);
	printf("cq_rank_after: %u round trips, %lu completions (%lu errors)\n",
	       ranks[0].received, completions, error_completions);
	printf("cq_rank_after: loop: %llu wakeups, %llu CQ events, %llu completions, "
	       "%llu ack calls acking %llu events, %llu unacked, %llu arm calls\n",
	       (unsigned long long)st.wakeups, (unsigned long long)st.cq_events,
	       (unsigned long long)st.completions, (unsigned long long)st.ack_calls,
	       (unsigned long long)st.acked_events, (unsigned long long)st.unacked_now,
	       (unsigned long long)st.arm_calls);
	for (i = 0; i < NCQ; i++)
		printf("cq_rank_after: %s CQ: %lu callbacks\n", cqs[i].name, cqs[i].batches);
	if (st.completions != completions || st.unacked_now != 0 || st.acked_events != st.cq_events) {
		printf("cq_rank_after: the loop's figures do not add up\n");
		failed = 1;
	}
	disconnect_ranks();

	/* guide:teardown begin */
	rdma_destroy_qp(ranks[0].id);
	rdma_destroy_qp(ranks[1].id);
	/* The loop acks every CQ event it read: destroy it (or remove the
	 * CQs from it) before ibv_destroy_cq. */
	rc = rdmasafe_cq_loop_destroy(loop);
	if (rc < 0)
		printf("cq_rank_after: rdmasafe_cq_loop_destroy: %s\n", strerror(-rc));
	for (i = 0; i < NCQ; i++)
		if (ibv_destroy_cq(cqs[i].cq))
			fail("ibv_destroy_cq");
	ibv_destroy_comp_channel(channel); /* the loop is gone: it may go */
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
	printf("cq_rank_after: %s\n", rc ? "FAILED" : "OK");
	return rc;
}
