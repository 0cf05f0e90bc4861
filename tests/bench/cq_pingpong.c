/*
 * CQ notification benchmark over one RC connection (send/recv): the same
 * completion handler driven either by rdmasafe's CQ loop or by a
 * hand-written libibverbs loop.
 *
 * One source, two programs (tests/bench/Makefile):
 *   cq_pingpong_rdmasafe  (-DUSE_RDMASAFE) rdmasafe_cq_loop_* in event,
 *                         busy-poll, adaptive (fixed spin) or learning
 *                         mode;
 *   cq_pingpong_raw       the hand-written loop: event mode is the classic
 *                         ibv_get_cq_event (blocking) -> ibv_ack_cq_events
 *                         (1) -> ibv_req_notify_cq -> ibv_poll_cq until
 *                         empty; busy mode spins on ibv_poll_cq.
 * Both connect with rdma_cm: the CM events go through rdmasafe in the
 * first (rdmasafe_get_event / rdmasafe_event_free), raw librdmacm in the
 * second. The set-up is outside the measured window, but not without
 * effect on it: rdmasafe's CM starts its ack-deadline thread at the first
 * held event, and from then on glibc takes its multi-threaded paths in
 * the whole process (cancellation wrappers around every read / write,
 * ~45 instructions per completion here). `-C raw` makes the rdmasafe
 * program connect through raw librdmacm too, so that the two programs
 * differ in the CQ loop alone.
 *
 * Workloads (-w):
 *   pp      ping-pong: the client sends, the server echoes; the client
 *           times each round trip (post_send -> pong's recv completion);
 *   idle    the same, but the client sends at most one ping per -i
 *           microseconds (default 1000): a mostly idle server;
 *   poisson like idle, but the gaps between the client's ping send times
 *           are exponentially distributed with mean -i microseconds
 *           (Poisson arrivals at the server), drawn from a seeded
 *           xorshift64* generator (-r SEED, default 1: the same gaps in
 *           every run); a pong that comes after the next send time makes
 *           the client send at once;
 *   stream  the client streams -n sends (at most -q outstanding, posted as
 *           chained lists), the server receives them: counts wakeups,
 *           completions per wakeup, ack calls. The client starts when
 *           the server's one "go" message, sent just before its loop
 *           runs, arrives.
 *
 *   cq_pingpong -S -a ADDR -p PORT -w W -m MODE -n N [...]   server
 *   cq_pingpong    -a ADDR -p PORT -w W -m MODE -n N [...]   client
 * Options: -m event|busy|adaptive|learn (adaptive and learn: rdmasafe
 *   only; learn is RDMASAFE_MODE_LEARNING), -n N measured iterations /
 *   messages, -W warm-up iterations (pp/idle/poisson, default 50), -s
 *   bytes (64), -i us, -r seed (poisson), -q window (stream, 64), -A
 *   adaptive spin us, -L learning mode's latency weight, -B ack batch, -P
 *   poll batch (rdmasafe loop options; 0 = the library's default), -C raw|rdmasafe the CM calls of the set-up
 *   (rdmasafe program only; default rdmasafe), -t SECS alarm (300).
 * The server prints "READY" once listening. Each side prints one RESULT
 * line: wall time and CPU of the measured window (after warm-up), loop
 * counters, and on the client latency percentiles and quantiles.
 */
#include "bench_common.h"

#include <getopt.h>
#include <math.h>
#include <rdma/rdma_cma.h>

#ifdef USE_RDMASAFE
#include "rdmasafe.h"
#define GET_EVENT(ch, ev) rdmasafe_get_event((ch), (ev))
#define RELEASE_EVENT(ev) rdmasafe_event_free(ev)
#else
#define GET_EVENT(ch, ev) rdma_get_cm_event((ch), (ev))
#define RELEASE_EVENT(ev) rdma_ack_cm_event(ev)
#endif

enum { W_PP, W_IDLE, W_STREAM, W_POISSON };

/* -C raw: the rdmasafe program's set-up through raw librdmacm */
static int raw_cm;
enum { M_EVENT, M_BUSY, M_ADAPTIVE, M_LEARN };

struct app {
	int server, workload, mode;
	uint64_t n, warm, size, interval_us, window, spin_us, ack_batch, poll_batch, latency_weight;
	uint64_t seed; /* poisson: the gap generator's state (xorshift64*) */
	uint64_t gaps, gap_sum_ns; /* poisson: gaps drawn, their sum */
	/* resources */
	struct rdma_event_channel *cm_ch;
	struct rdma_cm_id *listen_id, *id;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char *buf;
	uint32_t rq_depth, sq_depth;
	/* progress */
	uint64_t recvs, sends_posted, sends_done, target;
	uint64_t t_send;
	uint64_t *lat;
	uint64_t nlat;
	int got_pong, done, failed;
	/* measured window */
	uint64_t t0, t1;
	double u0, s0, u1, s1;
	uint64_t a0, a1;
	int window_open;
#ifdef USE_RDMASAFE
	struct rdmasafe_cq_loop *loop;
#else
	uint64_t events, ack_calls, arm_calls, wakeups, empty_wakeups, completions;
#endif
};

static void start_window(struct app *a)
{
	a->window_open = 1;
	a->a0 = allocs();
	window_begin();
	cpu_secs(&a->u0, &a->s0);
	a->t0 = now_ns();
}

static void end_window(struct app *a)
{
	if (!a->window_open)
		return;
	a->t1 = now_ns();
	cpu_secs(&a->u1, &a->s1);
	window_end();
	a->a1 = allocs();
	a->window_open = 0;
}

static void finish(struct app *a)
{
	end_window(a);
	a->done = 1;
#ifdef USE_RDMASAFE
	rdmasafe_cq_loop_stop(a->loop);
#endif
}

/* ---- posting ---- */

static char *recv_slot(struct app *a, uint64_t i)
{
	return a->buf + i * a->size;
}

static char *send_slot(struct app *a, uint64_t i)
{
	return a->buf + (a->rq_depth + i % a->sq_depth) * a->size;
}

static void post_recv(struct app *a, uint64_t slot)
{
	struct ibv_sge sge = { (uintptr_t)recv_slot(a, slot), (uint32_t)a->size, a->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = slot, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(a->qp, &wr, &bad))
		DIE("ibv_post_recv");
}

/* posts `count` sends as one chained list (one doorbell) */
static void post_sends(struct app *a, uint64_t count)
{
	struct ibv_sge sge[64];
	struct ibv_send_wr wr[64], *bad;
	while (count) {
		uint64_t c = count < 64 ? count : 64;
		for (uint64_t i = 0; i < c; i++) {
			uint64_t seq = a->sends_posted + i;
			sge[i] = (struct ibv_sge){ (uintptr_t)send_slot(a, seq), (uint32_t)a->size, a->mr->lkey };
			wr[i] = (struct ibv_send_wr){ .wr_id = seq,
						      .next = i + 1 < c ? &wr[i + 1] : NULL,
						      .sg_list = &sge[i],
						      .num_sge = 1,
						      .opcode = IBV_WR_SEND,
						      .send_flags = IBV_SEND_SIGNALED };
		}
		if (ibv_post_send(a->qp, wr, &bad))
			DIE("ibv_post_send");
		a->sends_posted += c;
		count -= c;
	}
}

static void send_ping(struct app *a)
{
	a->got_pong = 0;
	a->t_send = now_ns();
	post_sends(a, 1);
}

/* ---- the completion handler, shared by both loops ---- */

static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct app *a = ctx;
	for (int i = 0; i < n; i++) {
		if (wc[i].status != IBV_WC_SUCCESS) {
			fprintf(stderr, "%s: completion error %s (wr_id %llu)\n", a->server ? "server" : "client",
				ibv_wc_status_str(wc[i].status), (unsigned long long)wc[i].wr_id);
			a->failed = 1;
			finish(a);
			return;
		}
		if (wc[i].opcode & IBV_WC_RECV) {
			/* only the pinging client reads the clock */
			uint64_t now = a->server || a->workload == W_STREAM ? 0 : now_ns();
			a->recvs++;
			post_recv(a, wc[i].wr_id);
			if (a->server) {
				if (a->workload != W_STREAM)
					post_sends(a, 1); /* the pong */
				else if (a->recvs == 1)
					start_window(a);
				if (a->workload != W_STREAM && a->recvs == a->warm)
					start_window(a);
			} else {
				if (a->recvs > a->warm && a->nlat < a->n)
					a->lat[a->nlat++] = now - a->t_send;
				if (a->recvs == a->warm)
					start_window(a);
				a->got_pong = 1;
				if (a->workload == W_PP && a->recvs < a->target)
					send_ping(a);
			}
		} else {
			a->sends_done++;
		}
	}
	if (!a->server && a->workload == W_STREAM && a->sends_posted < a->target) {
		uint64_t room = a->window - (a->sends_posted - a->sends_done);
		uint64_t left = a->target - a->sends_posted;
		uint64_t more_sends = room < left ? room : left;
		if (more_sends)
			post_sends(a, more_sends);
	}
	if (a->done)
		return;
	if (a->server) {
		if (a->recvs >= a->target && a->sends_done >= a->sends_posted)
			finish(a);
	} else if (a->workload == W_STREAM) {
		if (a->sends_done >= a->target)
			finish(a);
	} else if (a->recvs >= a->target && a->sends_done >= a->sends_posted) {
		finish(a);
	}
}

/* ---- the two loops ---- */

#ifdef USE_RDMASAFE
static void loop_setup(struct app *a)
{
	struct rdmasafe_cq_loop_options o = { .size = sizeof o };
	o.mode = a->mode == M_EVENT      ? RDMASAFE_MODE_EVENT
		 : a->mode == M_BUSY     ? RDMASAFE_MODE_BUSY_POLL
		 : a->mode == M_ADAPTIVE ? RDMASAFE_MODE_ADAPTIVE
		                         : RDMASAFE_MODE_LEARNING;
	o.adaptive_spin_us = (int)a->spin_us;
	o.learn_latency_weight = (int)a->latency_weight;
	o.ack_batch = (int)a->ack_batch;
	o.poll_batch = (int)a->poll_batch;
	int r = rdmasafe_cq_loop_create(a->cc, &o, &a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_create: %d", r);
	r = rdmasafe_cq_loop_add_cq(a->loop, a->cq, on_wc, a);
	if (r)
		DIE("rdmasafe_cq_loop_add_cq: %d", r);
}

/* until the handler finished the workload */
static void loop_run(struct app *a)
{
	int r = rdmasafe_cq_loop_run(a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_run: %d", r);
}

/* until a pong arrived (idle / poisson client) */
static void loop_until_pong(struct app *a)
{
	while (!a->got_pong && !a->done) {
		int r = rdmasafe_cq_loop_run_once(a->loop, -1);
		if (r < 0)
			DIE("rdmasafe_cq_loop_run_once: %d", r);
	}
}

static void loop_report(struct app *a, struct jline *j)
{
	struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
	rdmasafe_cq_loop_get_stats(a->loop, &s);
	j_u64(j, "cq_events", s.cq_events);
	j_u64(j, "ack_calls", s.ack_calls);
	j_u64(j, "acked_events", s.acked_events);
	j_u64(j, "arm_calls", s.arm_calls);
	j_u64(j, "wakeups", s.wakeups);
	j_u64(j, "empty_wakeups", s.empty_wakeups);
	j_u64(j, "completions", s.completions);
	j_raw(j, ",\"completions_per_wakeup_hist\":[");
	for (int i = 0; i < 16; i++)
		j_raw(j, "%s%llu", i ? "," : "", (unsigned long long)s.completions_per_wakeup[i]);
	j_raw(j, "]");
	j_u64(j, "longest_handler_ns", s.longest_handler_ns);
	/* 0 from a library older than these fields (it fills less of s) */
	j_u64(j, "sleeps", s.sleeps);
	j_u64(j, "channel_reads", s.channel_reads);
	j_u64(j, "channel_reads_empty", s.channel_reads_empty);
	/* learning mode: what it learned (0 in the other modes) */
	j_u64(j, "learn_timer_wakes", s.learn_timer_wakes);
	j_u64(j, "learn_calibrations", s.learn_calibrations);
	j_u64(j, "learn_spin_ns", s.learn_spin_ns);
	j_u64(j, "learn_window_from_ns", s.learn_window_from_ns);
	j_u64(j, "learn_window_to_ns", s.learn_window_to_ns);
	j_u64(j, "learn_wake_cost_ns", s.learn_wake_cost_ns);
	j_u64(j, "learn_wake_batch_milli", s.learn_wake_batch_milli);
	j_u64(j, "learn_idle_samples", s.learn_idle_samples);
}

static void loop_teardown(struct app *a)
{
	int r = rdmasafe_cq_loop_destroy(a->loop);
	if (r)
		DIE("rdmasafe_cq_loop_destroy: %d", r);
}
#else
static struct ibv_wc wcs[16];

/* polls until empty; returns the number of completions */
static uint64_t drain(struct app *a)
{
	uint64_t total = 0;
	for (;;) {
		int n = ibv_poll_cq(a->cq, 16, wcs);
		if (n < 0)
			DIE("ibv_poll_cq");
		if (n == 0)
			break;
		on_wc(a, wcs, n);
		total += (uint64_t)n;
		if (n < 16)
			break;
	}
	a->completions += total;
	return total;
}

static int armed;

static void loop_setup(struct app *a)
{
	(void)a;
	armed = 0;
}

static void loop_until(struct app *a, const int *flag)
{
	if (a->mode == M_BUSY) {
		while (!*flag && !a->done) {
			int n = ibv_poll_cq(a->cq, 16, wcs);
			if (n < 0)
				DIE("ibv_poll_cq");
			if (n > 0) {
				a->wakeups++;
				a->completions += (uint64_t)n;
				on_wc(a, wcs, n);
			}
		}
		return;
	}
	/* event mode: arm, drain (completions before the arm raise no event) */
	if (!armed) {
		a->arm_calls++;
		if (ibv_req_notify_cq(a->cq, 0))
			DIE("ibv_req_notify_cq");
		armed = 1;
		if (drain(a))
			a->wakeups++;
	}
	while (!*flag && !a->done) {
		struct ibv_cq *cq;
		void *cq_ctx;
		if (ibv_get_cq_event(a->cc, &cq, &cq_ctx))
			DIE("ibv_get_cq_event");
		a->events++;
		ibv_ack_cq_events(cq, 1);
		a->ack_calls++;
		a->arm_calls++;
		if (ibv_req_notify_cq(cq, 0))
			DIE("ibv_req_notify_cq");
		a->wakeups++;
		if (!drain(a))
			a->empty_wakeups++;
	}
}

static void loop_run(struct app *a)
{
	loop_until(a, &a->done);
}

static void loop_until_pong(struct app *a)
{
	loop_until(a, &a->got_pong);
}

static void loop_report(struct app *a, struct jline *j)
{
	j_u64(j, "cq_events", a->events);
	j_u64(j, "ack_calls", a->ack_calls);
	j_u64(j, "acked_events", a->events);
	j_u64(j, "arm_calls", a->arm_calls);
	j_u64(j, "wakeups", a->wakeups);
	j_u64(j, "empty_wakeups", a->empty_wakeups);
	j_u64(j, "completions", a->completions);
}

static void loop_teardown(struct app *a)
{
	(void)a;
}
#endif

/* ---- poisson arrivals ---- */

/* xorshift64* (Vigna): a small deterministic generator, enough for gaps */
static uint64_t next_rand(struct app *a)
{
	uint64_t x = a->seed;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	a->seed = x;
	return x * 0x2545F4914F6CDD1Dull;
}

/* the next gap between ping send times, ns: exponential, mean -i us */
static uint64_t next_gap_ns(struct app *a)
{
	/* u in (0, 1]: the top 53 bits, + 1 so that log(u) is finite */
	double u = (double)((next_rand(a) >> 11) + 1) / 9007199254740992.0;
	double g = -log(u) * (double)a->interval_us * 1000.0;
	a->gaps++;
	a->gap_sum_ns += (uint64_t)g;
	return (uint64_t)g;
}

/* ---- connection set-up (rdma_cm) ---- */

static struct rdma_cm_id *expect(struct app *a, enum rdma_cm_event_type type)
{
	struct rdma_cm_event *e;
	if (raw_cm ? rdma_get_cm_event(a->cm_ch, &e) : GET_EVENT(a->cm_ch, &e))
		DIE("get CM event");
	enum rdma_cm_event_type got = e->event;
	int status = e->status;
	struct rdma_cm_id *id = e->id;
	if (raw_cm)
		rdma_ack_cm_event(e);
	else
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
	a->pd = ibv_alloc_pd(ctx);
	a->cc = ibv_create_comp_channel(ctx);
	if (!a->pd || !a->cc)
		DIE("pd / comp channel");
	a->cq = ibv_create_cq(ctx, (int)(a->rq_depth + a->sq_depth + 16), NULL, a->cc, 0);
	if (!a->cq)
		DIE("ibv_create_cq");
	struct ibv_qp_init_attr qa;
	memset(&qa, 0, sizeof(qa));
	qa.qp_type = IBV_QPT_RC;
	qa.send_cq = qa.recv_cq = a->cq;
	qa.cap.max_send_wr = a->sq_depth;
	qa.cap.max_recv_wr = a->rq_depth;
	qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
	if (rdma_create_qp(a->id, a->pd, &qa))
		DIE("rdma_create_qp");
	a->qp = a->id->qp;
	size_t len = (size_t)(a->rq_depth + a->sq_depth) * a->size;
	a->buf = calloc(1, len);
	a->mr = a->buf ? ibv_reg_mr(a->pd, a->buf, len, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!a->mr)
		DIE("buffer / ibv_reg_mr");
	for (uint32_t i = 0; i < a->rq_depth; i++)
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

/* stream client: polls (outside the loop, which is not running yet) for the
   receiver's "go" message */
static void wait_go(struct app *a)
{
	for (;;) {
		struct ibv_wc wc;
		int n = ibv_poll_cq(a->cq, 1, &wc);
		if (n < 0)
			DIE("ibv_poll_cq");
		if (n == 0)
			continue;
		if (wc.status != IBV_WC_SUCCESS)
			DIE("go: completion error %s", ibv_wc_status_str(wc.status));
		if (wc.opcode & IBV_WC_RECV) {
			post_recv(a, wc.wr_id);
			return;
		}
	}
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
	ibv_destroy_cq(a->cq);
	ibv_destroy_comp_channel(a->cc);
	ibv_dealloc_pd(a->pd);
	rdma_destroy_id(a->id);
	if (a->listen_id)
		rdma_destroy_id(a->listen_id);
	rdma_destroy_event_channel(a->cm_ch);
}

static const char *mode_name[] = { "event", "busy", "adaptive", "learn" };
static const char *workload_name[] = { "pp", "idle", "stream", "poisson" };

int main(int argc, char **argv)
{
	static struct app app;
	struct app *a = &app;
	const char *addr = NULL, *port = "7620";
	int secs = 300, op;
	a->n = 1000;
	a->warm = 50;
	a->size = 64;
	a->interval_us = 1000;
	a->window = 64;
	a->seed = 1;
	while ((op = getopt(argc, argv, "Sa:p:w:m:n:W:s:i:r:q:A:L:B:P:C:t:")) != -1) {
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
		case 'w':
			a->workload = !strcmp(optarg, "pp")      ? W_PP
				      : !strcmp(optarg, "idle")    ? W_IDLE
				      : !strcmp(optarg, "stream")  ? W_STREAM
				      : !strcmp(optarg, "poisson") ? W_POISSON
				                                   : -1;
			break;
		case 'm':
			a->mode = !strcmp(optarg, "event")      ? M_EVENT
				  : !strcmp(optarg, "busy")     ? M_BUSY
				  : !strcmp(optarg, "adaptive") ? M_ADAPTIVE
				  : !strcmp(optarg, "learn")    ? M_LEARN
				                                : -1;
			break;
		case 'n':
			a->n = strtoull(optarg, NULL, 0);
			break;
		case 'W':
			a->warm = strtoull(optarg, NULL, 0);
			break;
		case 's':
			a->size = strtoull(optarg, NULL, 0);
			break;
		case 'i':
			a->interval_us = strtoull(optarg, NULL, 0);
			break;
		case 'r':
			a->seed = strtoull(optarg, NULL, 0);
			break;
		case 'q':
			a->window = strtoull(optarg, NULL, 0);
			break;
		case 'A':
			a->spin_us = strtoull(optarg, NULL, 0);
			break;
		case 'L':
			a->latency_weight = strtoull(optarg, NULL, 0);
			break;
		case 'B':
			a->ack_batch = strtoull(optarg, NULL, 0);
			break;
		case 'P':
			a->poll_batch = strtoull(optarg, NULL, 0);
			break;
		case 'C':
			raw_cm = !strcmp(optarg, "raw") ? 1 : !strcmp(optarg, "rdmasafe") ? 0 : -1;
			break;
		case 't':
			secs = atoi(optarg);
			break;
		default:
			fprintf(stderr, "usage: see the comment at the top of cq_pingpong.c\n");
			return 2;
		}
	}
	if (!addr || a->workload < 0 || a->mode < 0 || a->n < 1 || a->size < 1 || a->window < 1 || a->window > 1024 ||
	    a->seed == 0 || raw_cm < 0 || a->latency_weight > 1000)
		DIE("bad arguments");
#ifndef USE_RDMASAFE
	raw_cm = 1; /* the only CM there is */
	if (a->mode == M_ADAPTIVE || a->mode == M_LEARN)
		DIE("the hand-written loop has no adaptive or learning mode");
#endif
	alarm((unsigned)secs);
	if (a->workload == W_STREAM) {
		a->warm = 0;
		a->rq_depth = 4096;
		a->sq_depth = (uint32_t)a->window;
		a->target = a->n;
	} else {
		a->rq_depth = 64;
		a->sq_depth = 16;
		a->target = a->n + a->warm;
		a->lat = calloc(a->n, sizeof(*a->lat));
		if (!a->lat)
			DIE("calloc");
	}
	connect_both(a, addr, port);
	loop_setup(a);
	if (a->workload == W_STREAM) {
		/* the stream starts once the receiver runs its loop: measured
		   under load, not found queued in one go by a late receiver */
		if (a->server)
			post_sends(a, 1); /* "go", just before its loop runs */
		else
			wait_go(a);
	}

	uint64_t t_run = now_ns();
	if (a->warm == 0 && !(a->server && a->workload == W_STREAM))
		start_window(a);
	if (a->server || a->workload == W_PP) {
		if (!a->server)
			send_ping(a);
		loop_run(a);
	} else if (a->workload == W_STREAM) {
		post_sends(a, a->window < a->target ? a->window : a->target);
		loop_run(a);
	} else { /* idle / poisson client */
		while (!a->done) {
			send_ping(a);
			uint64_t gap = a->workload == W_POISSON ? next_gap_ns(a) : a->interval_us * 1000;
			loop_until_pong(a);
			if (a->done)
				break;
			/* relative sleep: the clock may be fastclock.so's; a
			   pong later than the next send time: send at once */
			uint64_t t = a->t_send + gap, now = now_ns();
			if (now < t) {
				struct timespec d = { (time_t)((t - now) / 1000000000ull),
						      (long)((t - now) % 1000000000ull) };
				nanosleep(&d, NULL);
			}
		}
	}
	uint64_t t_loop = now_ns() - t_run;

	struct jline j;
	j_begin(&j);
	j_str(&j, "role", a->server ? "server" : "client");
	j_str(&j, "workload", workload_name[a->workload]);
	j_str(&j, "mode", mode_name[a->mode]);
	j_u64(&j, "n", a->n);
	j_u64(&j, "size", a->size);
	if (a->workload == W_IDLE || a->workload == W_POISSON)
		j_u64(&j, "interval_us", a->interval_us);
	if (a->workload == W_STREAM)
		j_u64(&j, "window", a->window);
	j_u64(&j, "spin_us", a->spin_us);
	j_u64(&j, "latency_weight", a->latency_weight);
	if (a->gaps) { /* poisson client: the gaps drawn (warm-up included) */
		j_u64(&j, "gaps", a->gaps);
		j_dbl(&j, "gap_mean_us", a->gap_sum_ns / 1e3 / (double)a->gaps);
	}
	j_u64(&j, "failed", a->failed);
	j_u64(&j, "recvs", a->recvs);
	j_u64(&j, "sends", a->sends_done);
	double wall = (a->t1 - a->t0) / 1e9;
	j_dbl(&j, "window_s", wall);
	j_dbl(&j, "loop_s", t_loop / 1e9);
	j_dbl(&j, "cpu_user_s", a->u1 - a->u0);
	j_dbl(&j, "cpu_sys_s", a->s1 - a->s0);
	j_u64(&j, "allocs_window", a->a1 - a->a0);
	loop_report(a, &j);
	if (!a->server && a->workload != W_STREAM && a->nlat) {
		qsort(a->lat, a->nlat, sizeof(*a->lat), cmp_u64);
		j_u64(&j, "samples", a->nlat);
		j_u64(&j, "p50_ns", pct(a->lat, a->nlat, 50));
		j_u64(&j, "p99_ns", pct(a->lat, a->nlat, 99));
		j_u64(&j, "min_ns", a->lat[0]);
		j_u64(&j, "max_ns", a->lat[a->nlat - 1]);
		/* 200 quantiles for the latency plot */
		j_raw(&j, ",\"quantiles_ns\":[");
		for (int q = 0; q < 200; q++)
			j_raw(&j, "%s%llu", q ? "," : "",
			      (unsigned long long)pct(a->lat, a->nlat, (q + 0.5) * 100.0 / 200));
		j_raw(&j, "]");
	}
	j_end(&j);
	teardown(a);
	return a->failed ? 1 : 0;
}
