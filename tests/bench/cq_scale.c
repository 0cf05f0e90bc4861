/*
 * CQ loop scale benchmark: what a completion costs when the loop holds N
 * CQs on ONE completion channel and only one of them is active.
 *
 * One RC connection (rdma_cm) between a client and a server; the client's
 * QP uses one CQ for its sends and receives (the active CQ), and the
 * client adds N - 1 idle CQs, created on the same channel, to the same
 * loop (rdmasafe) or arms them (the hand-written loop). The client
 * ping-pongs with the server (the server echoes each ping; it is not
 * measured). The client's sends are unsignaled except every -g th (64)
 * of a phase, so a round trip is one receive completion and, every 64
 * round trips, one send completion: a window of a multiple of 64 round
 * trips holds a number of completions that does not depend on timing, and
 * in event mode each completion is one wakeup (but a send completion that
 * arrives together with the next receive: the RESULT lines count them).
 *
 * One process measures every N of the list (-N, ascending): it grows the
 * loop to N CQs (creates and adds the idle ones), then runs phases. A
 * phase posts a ping, runs the loop until -W warm-up round trips are done
 * (the first cycle arms and drains the CQs just added: outside the
 * window), then counts a window of L round trips: valgrind's callgrind
 * collects user-space instructions only inside the window (the programs
 * run under `valgrind --tool=callgrind --collect-atstart=no`), and each
 * phase ends with CALLGRIND_DUMP_STATS_AT("n=N len=L run=R"), one dump
 * file per window. Phases alternate L = M and L = 2M (-M, -R runs each),
 * so that instructions per completion are taken as the difference
 *   (I(2M) - I(M)) / (completions(2M) - completions(M))
 * which cancels whatever a window pays once (its start and end).
 *
 * One source, two programs (tests/bench/Makefile):
 *   cq_scale_rdmasafe  rdmasafe_cq_loop_* in event or busy-poll mode;
 *   cq_scale_raw       the hand-written libibverbs loop: event mode is
 *                      ibv_get_cq_event (blocking) -> ibv_ack_cq_events(1)
 *                      -> ibv_req_notify_cq -> ibv_poll_cq until empty on
 *                      the CQ the event names; busy mode polls every CQ
 *                      in turn.
 *
 *   cq_scale -S -a ADDR -p PORT                                  server
 *   cq_scale    -a ADDR -p PORT -m event|busy -N 1,64,1024,4096
 *               [-M 500] [-R 1] [-W 20] [-g 64] [-t SECS]         client
 *
 * The server prints "READY" once listening. The client prints one RESULT
 * line per window ("kind":"scale": N, L, run, completions, wakeups, CQ
 * events, ibv_poll_cq calls counted by a wrapper around the device's
 * poll_cq, ...), and both print a final RESULT line. Exit status 0 only if
 * every completion was a success and no idle CQ ever delivered one.
 */
#include "bench_common.h"

#include <getopt.h>
#include <rdma/rdma_cma.h>

#ifndef CALLGRIND_DUMP_STATS_AT
#define CALLGRIND_DUMP_STATS_AT(label) ((void)(label))
#endif

#ifdef USE_RDMASAFE
#include "rdmasafe.h"
#define GET_EVENT(ch, ev) rdmasafe_get_event((ch), (ev))
#define RELEASE_EVENT(ev) rdmasafe_event_free(ev)
#else
#define GET_EVENT(ch, ev) rdma_get_cm_event((ch), (ev))
#define RELEASE_EVENT(ev) rdma_ack_cm_event(ev)
#endif

enum { M_EVENT, M_BUSY };
enum { MAX_N = 16384, RQ_DEPTH = 16, SQ_DEPTH = 128, MSG = 64 };
#define QUIT_WRID UINT64_MAX

struct counts {
	uint64_t completions, recvs, sends, wakeups, cq_events, arm_calls, ack_calls, polls;
	/* rdmasafe's loop only: its epoll_wait sleeps, channel reads, and
	 * reads that found no event (EAGAIN) */
	uint64_t sleeps, reads, reads_empty;
};

struct app {
	int server, mode;
	uint64_t signal_every;
	/* resources */
	struct rdma_event_channel *cm_ch;
	struct rdma_cm_id *listen_id, *id;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq; /* the active CQ: cqs[0] */
	struct ibv_cq **cqs;
	int ncq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char *buf;
	/* progress */
	uint64_t sends_posted, sends_done, recvs_total, phase_sends;
	uint64_t phase_recvs, warm, len;
	int phase_done, quit_sent, quit_done, done, failed, idle_hits;
	/* window */
	int window_open;
	struct counts w0, w1;
	uint64_t win_completions, win_recvs, win_sends;
#ifdef USE_RDMASAFE
	struct rdmasafe_cq_loop *loop;
#else
	struct counts raw; /* the hand-written loop's own counters */
	int active_armed;
#endif
};

static struct app app;
static uint64_t t_start;

/* progress on stderr, with the time since start */
#define SAY(...)                                                                                           \
	do {                                                                                               \
		fprintf(stderr, "[cq_scale %s +%.3f s] ", app.server ? "server" : "client",                \
			(now_ns() - t_start) / 1e9);                                                       \
		fprintf(stderr, __VA_ARGS__);                                                              \
		fputc('\n', stderr);                                                                       \
	} while (0)

/* ---- ibv_poll_cq calls, counted by a wrapper around the device's poll_cq
 * (ibv_poll_cq is an inline call through cq->context->ops, for libibverbs
 * users and rdmasafe alike) ---- */
static int (*real_poll_cq)(struct ibv_cq *, int, struct ibv_wc *);
static uint64_t poll_calls;

static int counting_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
	poll_calls++;
	return real_poll_cq(cq, n, wc);
}

static void count_polls(struct ibv_context *ctx)
{
	if (ctx->ops.poll_cq != counting_poll_cq) {
		real_poll_cq = ctx->ops.poll_cq;
		ctx->ops.poll_cq = counting_poll_cq;
	}
}

static void snapshot(struct app *a, struct counts *c);

static void open_window(struct app *a)
{
	snapshot(a, &a->w0);
	a->win_completions = a->win_recvs = a->win_sends = 0;
	a->window_open = 1;
	window_begin();
}

static void close_window(struct app *a)
{
	window_end();
	a->window_open = 0;
	snapshot(a, &a->w1);
}

static void stop_loop(struct app *a);

/* ---- posting ---- */

static char *recv_slot(struct app *a, uint64_t i)
{
	return a->buf + i * MSG;
}

static char *send_slot(struct app *a, uint64_t i)
{
	return a->buf + (RQ_DEPTH + i % SQ_DEPTH) * MSG;
}

static void post_recv(struct app *a, uint64_t slot)
{
	struct ibv_sge sge = { (uintptr_t)recv_slot(a, slot), MSG, a->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = slot, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(a->qp, &wr, &bad))
		DIE("ibv_post_recv");
}

/* one send; signaled every `signal_every` th of a phase (so that windows
 * of a multiple of it hold the same number of send completions) and the
 * quit message */
static void post_send(struct app *a, char tag)
{
	uint64_t seq = a->sends_posted++, k = a->phase_sends++;
	char *p = send_slot(a, seq);
	p[0] = tag;
	int quit = tag == 'Q';
	struct ibv_sge sge = { (uintptr_t)p, MSG, a->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = quit ? QUIT_WRID : seq,
				  .sg_list = &sge,
				  .num_sge = 1,
				  .opcode = IBV_WR_SEND,
				  .send_flags = quit || k % a->signal_every == a->signal_every - 1 ? IBV_SEND_SIGNALED
													: 0 },
			  *bad;
	if (ibv_post_send(a->qp, &wr, &bad))
		DIE("ibv_post_send");
}

/* ---- the completion handler, shared by both loops ---- */

static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct app *a = ctx;
	for (int i = 0; i < n; i++) {
		if (a->window_open)
			a->win_completions++;
		if (wc[i].status != IBV_WC_SUCCESS) {
			fprintf(stderr, "%s: completion error %s (wr_id %llu)\n", a->server ? "server" : "client",
				ibv_wc_status_str(wc[i].status), (unsigned long long)wc[i].wr_id);
			a->failed = 1;
			a->done = a->phase_done = 1;
			stop_loop(a);
			return;
		}
		if (!(wc[i].opcode & IBV_WC_RECV)) {
			a->sends_done++;
			if (a->window_open)
				a->win_sends++;
			if (wc[i].wr_id == QUIT_WRID) {
				a->quit_done = 1;
				stop_loop(a);
			}
			continue;
		}
		a->recvs_total++;
		char tag = recv_slot(a, wc[i].wr_id)[0];
		post_recv(a, wc[i].wr_id);
		if (a->server) {
			if (tag == 'Q') {
				a->done = 1;
				stop_loop(a);
			} else {
				post_send(a, 'P'); /* the pong */
			}
			continue;
		}
		if (a->window_open)
			a->win_recvs++;
		a->phase_recvs++;
		if (a->phase_recvs == a->warm)
			open_window(a);
		if (a->phase_recvs == a->warm + a->len) {
			close_window(a);
			a->phase_done = 1;
			stop_loop(a);
		} else {
			post_send(a, 'P');
		}
	}
}

/* an idle CQ never has a completion: if it does, the run is wrong */
static void on_idle_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct app *a = ctx;
	(void)wc;
	a->idle_hits += n;
}

/* ---- the two loops ---- */

#ifdef USE_RDMASAFE
static void stop_loop(struct app *a)
{
	rdmasafe_cq_loop_stop(a->loop);
}

static void snapshot(struct app *a, struct counts *c)
{
	struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
	if (rdmasafe_cq_loop_get_stats(a->loop, &s))
		DIE("rdmasafe_cq_loop_get_stats");
	c->completions = s.completions;
	c->wakeups = s.wakeups;
	c->cq_events = s.cq_events;
	c->arm_calls = s.arm_calls;
	c->ack_calls = s.ack_calls;
	c->polls = poll_calls;
	c->sleeps = s.sleeps;
	c->reads = s.channel_reads;
	c->reads_empty = s.channel_reads_empty;
}

static void loop_setup(struct app *a)
{
	struct rdmasafe_cq_loop_options o = { .size = sizeof o };
	o.mode = a->mode == M_EVENT ? RDMASAFE_MODE_EVENT : RDMASAFE_MODE_BUSY_POLL;
	int r = rdmasafe_cq_loop_create(a->cc, &o, &a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_create: %d", r);
	r = rdmasafe_cq_loop_add_cq(a->loop, a->cq, on_wc, a);
	if (r)
		DIE("rdmasafe_cq_loop_add_cq: %d", r);
}

static void add_idle(struct app *a, struct ibv_cq *cq)
{
	int r = rdmasafe_cq_loop_add_cq(a->loop, cq, on_idle_wc, a);
	if (r)
		DIE("rdmasafe_cq_loop_add_cq (idle CQ %d): %d", a->ncq, r);
}

/* until the handler stops the loop */
static void loop_run(struct app *a)
{
	int r = rdmasafe_cq_loop_run(a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_run: %d", r);
}

static void loop_teardown(struct app *a)
{
	int r = rdmasafe_cq_loop_destroy(a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_destroy: %d", r);
}
#else
static int stop_flag;

static void stop_loop(struct app *a)
{
	(void)a;
	stop_flag = 1;
}

static void snapshot(struct app *a, struct counts *c)
{
	*c = a->raw;
	c->polls = poll_calls;
}

static struct ibv_wc wcs[16];

/* polls `cq` until empty; returns the number of completions */
static uint64_t drain(struct app *a, struct ibv_cq *cq)
{
	uint64_t total = 0;
	for (;;) {
		int n = ibv_poll_cq(cq, 16, wcs);
		if (n < 0)
			DIE("ibv_poll_cq");
		if (n == 0)
			break;
		/* counted before the handler sees them, as rdmasafe's loop does */
		a->raw.completions += (uint64_t)n;
		if (cq == a->cq)
			on_wc(a, wcs, n);
		else
			on_idle_wc(a, wcs, n);
		total += (uint64_t)n;
		if (n < 16)
			break;
	}
	return total;
}

static void loop_setup(struct app *a)
{
	(void)a;
}

static void add_idle(struct app *a, struct ibv_cq *cq)
{
	if (a->mode == M_EVENT) {
		a->raw.arm_calls++;
		if (ibv_req_notify_cq(cq, 0))
			DIE("ibv_req_notify_cq (idle CQ)");
	}
}

static void loop_run(struct app *a)
{
	stop_flag = 0;
	if (a->mode == M_BUSY) {
		while (!stop_flag) {
			for (int i = 0; i < a->ncq && !stop_flag; i++) {
				int n = ibv_poll_cq(a->cqs[i], 16, wcs);
				if (n < 0)
					DIE("ibv_poll_cq");
				if (n > 0) {
					a->raw.wakeups++;
					a->raw.completions += (uint64_t)n;
					if (i == 0)
						on_wc(a, wcs, n);
					else
						on_idle_wc(a, wcs, n);
				}
			}
		}
		return;
	}
	/* event mode: arm, drain (completions before the arm raise no event) */
	if (!a->active_armed) {
		a->raw.arm_calls++;
		if (ibv_req_notify_cq(a->cq, 0))
			DIE("ibv_req_notify_cq");
		a->active_armed = 1;
		if (drain(a, a->cq))
			a->raw.wakeups++;
	}
	while (!stop_flag) {
		struct ibv_cq *cq;
		void *cq_ctx;
		if (ibv_get_cq_event(a->cc, &cq, &cq_ctx))
			DIE("ibv_get_cq_event");
		a->raw.cq_events++;
		ibv_ack_cq_events(cq, 1);
		a->raw.ack_calls++;
		a->raw.arm_calls++;
		if (ibv_req_notify_cq(cq, 0))
			DIE("ibv_req_notify_cq");
		a->raw.wakeups++;
		drain(a, cq);
	}
}

static void loop_teardown(struct app *a)
{
	(void)a;
}
#endif

/* grows the loop to n CQs on the channel (the active one first) */
static void grow(struct app *a, int n)
{
	struct ibv_context *ctx = a->id->verbs;
	while (a->ncq < n) {
		struct ibv_cq *cq = ibv_create_cq(ctx, 1, NULL, a->cc, 0);
		if (!cq)
			DIE("ibv_create_cq (idle CQ %d)", a->ncq);
		a->cqs[a->ncq] = cq;
		add_idle(a, cq);
		a->ncq++;
	}
}

/* ---- connection set-up (rdma_cm) ---- */

static struct rdma_cm_id *expect(struct app *a, enum rdma_cm_event_type type)
{
	struct rdma_cm_event *e;
	if (GET_EVENT(a->cm_ch, &e))
		DIE("get CM event");
	enum rdma_cm_event_type got = e->event;
	int status = e->status;
	struct rdma_cm_id *id = e->id;
	RELEASE_EVENT(e);
	if (got != type) {
		fprintf(stderr, "expected %s, got %s (status %d)\n", rdma_event_str(type), rdma_event_str(got), status);
		exit(2);
	}
	return id;
}

static void setup_qp(struct app *a)
{
	struct ibv_context *ctx = a->id->verbs;
	count_polls(ctx);
	a->pd = ibv_alloc_pd(ctx);
	a->cc = ibv_create_comp_channel(ctx);
	if (!a->pd || !a->cc)
		DIE("pd / comp channel");
	a->cq = ibv_create_cq(ctx, RQ_DEPTH + SQ_DEPTH + 16, NULL, a->cc, 0);
	if (!a->cq)
		DIE("ibv_create_cq");
	a->cqs[0] = a->cq;
	a->ncq = 1;
	struct ibv_qp_init_attr qa;
	memset(&qa, 0, sizeof(qa));
	qa.qp_type = IBV_QPT_RC;
	qa.send_cq = qa.recv_cq = a->cq;
	qa.sq_sig_all = 0;
	qa.cap.max_send_wr = SQ_DEPTH;
	qa.cap.max_recv_wr = RQ_DEPTH;
	qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
	if (rdma_create_qp(a->id, a->pd, &qa))
		DIE("rdma_create_qp");
	a->qp = a->id->qp;
	size_t len = (size_t)(RQ_DEPTH + SQ_DEPTH) * MSG;
	a->buf = calloc(1, len);
	a->mr = a->buf ? ibv_reg_mr(a->pd, a->buf, len, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!a->mr)
		DIE("buffer / ibv_reg_mr");
	for (uint32_t i = 0; i < RQ_DEPTH; i++)
		post_recv(a, i);
}

static void connect_both(struct app *a, const char *addr, const char *port)
{
	struct rdma_addrinfo hints = { .ai_port_space = RDMA_PS_TCP }, *ai;
	if (a->server)
		hints.ai_flags = RAI_PASSIVE;
	if (rdma_getaddrinfo(addr, port, &hints, &ai))
		DIE("rdma_getaddrinfo");
	a->cm_ch = rdma_create_event_channel();
	if (!a->cm_ch)
		DIE("rdma_create_event_channel");
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1, .retry_count = 7, .rnr_retry_count = 7 };
	if (a->server) {
		if (rdma_create_id(a->cm_ch, &a->listen_id, NULL, RDMA_PS_TCP) || rdma_bind_addr(a->listen_id, ai->ai_src_addr) ||
		    rdma_listen(a->listen_id, 4))
			DIE("listen");
		printf("READY\n");
		fflush(stdout);
		a->id = expect(a, RDMA_CM_EVENT_CONNECT_REQUEST);
		setup_qp(a);
		if (rdma_accept(a->id, &cp))
			DIE("rdma_accept");
		expect(a, RDMA_CM_EVENT_ESTABLISHED);
	} else {
		if (rdma_create_id(a->cm_ch, &a->id, NULL, RDMA_PS_TCP) ||
		    rdma_resolve_addr(a->id, NULL, ai->ai_dst_addr, 5000))
			DIE("resolve addr");
		expect(a, RDMA_CM_EVENT_ADDR_RESOLVED);
		if (rdma_resolve_route(a->id, 5000))
			DIE("resolve route");
		expect(a, RDMA_CM_EVENT_ROUTE_RESOLVED);
		setup_qp(a);
		if (rdma_connect(a->id, &cp))
			DIE("rdma_connect");
		expect(a, RDMA_CM_EVENT_ESTABLISHED);
	}
	rdma_freeaddrinfo(ai);
}

static void teardown(struct app *a)
{
	/* both sides disconnect; each waits for its DISCONNECTED */
	rdma_disconnect(a->id);
	expect(a, RDMA_CM_EVENT_DISCONNECTED);
	loop_teardown(a);
	rdma_destroy_qp(a->id);
	ibv_dereg_mr(a->mr);
	free(a->buf);
	for (int i = a->ncq - 1; i >= 0; i--)
		if (ibv_destroy_cq(a->cqs[i]))
			DIE("ibv_destroy_cq %d", i);
	ibv_destroy_comp_channel(a->cc);
	ibv_dealloc_pd(a->pd);
	rdma_destroy_id(a->id);
	if (a->listen_id)
		rdma_destroy_id(a->listen_id);
	rdma_destroy_event_channel(a->cm_ch);
}

static const char *mode_name[] = { "event", "busy" };

/* one phase: warm-up, then a window of `len` round trips */
static void phase(struct app *a, uint64_t len, int run)
{
	a->phase_recvs = a->phase_sends = 0;
	a->warm = a->warm ? a->warm : 1;
	a->len = len;
	a->phase_done = 0;
	post_send(a, 'P');
	while (!a->phase_done)
		loop_run(a);
	if (a->failed)
		return;
	char label[128];
	snprintf(label, sizeof label, "n=%d len=%llu run=%d", a->ncq, (unsigned long long)len, run);
	CALLGRIND_DUMP_STATS_AT(label);
	SAY("window %s: %llu completions", label, (unsigned long long)a->win_completions);
	struct jline j;
	j_begin(&j);
	j_str(&j, "kind", "scale");
	j_str(&j, "role", "client");
	j_str(&j, "mode", mode_name[a->mode]);
	j_str(&j, "dump", label);
	j_u64(&j, "ncq", (uint64_t)a->ncq);
	j_u64(&j, "len", len);
	j_u64(&j, "run", (uint64_t)run);
	j_u64(&j, "completions", a->win_completions);
	j_u64(&j, "recvs", a->win_recvs);
	j_u64(&j, "sends", a->win_sends);
	j_u64(&j, "loop_completions", a->w1.completions - a->w0.completions);
	j_u64(&j, "wakeups", a->w1.wakeups - a->w0.wakeups);
	j_u64(&j, "cq_events", a->w1.cq_events - a->w0.cq_events);
	j_u64(&j, "arm_calls", a->w1.arm_calls - a->w0.arm_calls);
	j_u64(&j, "ack_calls", a->w1.ack_calls - a->w0.ack_calls);
	j_u64(&j, "poll_calls", a->w1.polls - a->w0.polls);
#ifdef USE_RDMASAFE
	j_u64(&j, "sleeps", a->w1.sleeps - a->w0.sleeps);
	j_u64(&j, "channel_reads", a->w1.reads - a->w0.reads);
	j_u64(&j, "channel_reads_empty", a->w1.reads_empty - a->w0.reads_empty);
#endif
	j_u64(&j, "idle_hits", (uint64_t)a->idle_hits);
	j_end(&j);
}

int main(int argc, char **argv)
{
	struct app *a = &app;
	const char *addr = NULL, *port = "7630", *list = "1";
	int secs = 300, runs = 1, op;
	uint64_t m = 500, warm = 20;
	a->signal_every = 64;
	while ((op = getopt(argc, argv, "Sa:p:m:N:M:R:W:g:t:")) != -1) {
		switch (op) {
		case 'S':
			a->server = 1;
			break;
		case 'a':
			addr = optarg;
			break;
		case 'p':
			port = optarg;
			break;
		case 'm':
			a->mode = !strcmp(optarg, "event") ? M_EVENT : !strcmp(optarg, "busy") ? M_BUSY : -1;
			break;
		case 'N':
			list = optarg;
			break;
		case 'M':
			m = strtoull(optarg, NULL, 0);
			break;
		case 'R':
			runs = atoi(optarg);
			break;
		case 'W':
			warm = strtoull(optarg, NULL, 0);
			break;
		case 'g':
			a->signal_every = strtoull(optarg, NULL, 0);
			break;
		case 't':
			secs = atoi(optarg);
			break;
		default:
			fprintf(stderr, "usage: see the comment at the top of cq_scale.c\n");
			return 2;
		}
	}
	if (!addr || a->mode < 0 || m < 1 || runs < 1 || a->signal_every < 1 || a->signal_every > SQ_DEPTH / 2)
		DIE("bad arguments");
	int ns[64], nn = 0;
	for (const char *p = list; *p && nn < 64;) {
		char *end;
		long v = strtol(p, &end, 10);
		if (end == p || v < 1 || v > MAX_N || (nn && v < ns[nn - 1]))
			DIE("-N: ascending CQ counts 1..%d, comma-separated", MAX_N);
		ns[nn++] = (int)v;
		p = *end == ',' ? end + 1 : end;
	}
	alarm((unsigned)secs);
	t_start = now_ns();
	a->cqs = calloc(MAX_N, sizeof(*a->cqs));
	if (!a->cqs)
		DIE("calloc");
	if (a->server)
		a->mode = M_EVENT;
	connect_both(a, addr, port);
	loop_setup(a);
	SAY("connected");

	if (a->server) {
		while (!a->done)
			loop_run(a);
	} else {
		a->warm = warm;
		for (int k = 0; k < nn && !a->failed; k++) {
			grow(a, ns[k]);
			SAY("%d CQs on the channel", a->ncq);
			for (int r = 1; r <= runs && !a->failed; r++) {
				phase(a, m, r);
				if (!a->failed)
					phase(a, 2 * m, r);
			}
		}
		/* tell the server to stop; wait until the message is through */
		post_send(a, 'Q');
		while (!a->quit_done && !a->failed)
			loop_run(a);
	}
	struct jline j;
	j_begin(&j);
	j_str(&j, "role", a->server ? "server" : "client");
	j_str(&j, "mode", mode_name[a->mode]);
	j_u64(&j, "ncq", (uint64_t)a->ncq);
	j_u64(&j, "failed", (uint64_t)a->failed);
	j_u64(&j, "recvs", a->recvs_total);
	j_u64(&j, "sends", a->sends_done);
	j_u64(&j, "idle_hits", (uint64_t)a->idle_hits);
	j_end(&j);
	teardown(a);
	SAY("done");
	return a->failed || a->idle_hits ? 1 : 0;
}
