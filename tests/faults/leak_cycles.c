/*
 * leak_cycles: connect/disconnect cycles and ping-pong completions through
 * the rdmasafe C API, meant to run under valgrind memcheck (see guest.sh
 * "leaks" and rdma-core.supp).
 *
 *   leak_cycles [-a ADDR] [-c CYCLES] [-m ROUND_TRIPS] [-t SECS]
 *
 * One process, both ends of each connection ($RDMASAFE_TEST_ADDR). Per
 * cycle (default 100): a client id resolves and connects with private data
 * to a listener that lives for the whole run; the server side checks the
 * data and accepts with its own; per cycle a new completion channel, CQ
 * loop, two CQs, two QPs and MRs. Then ROUND_TRIPS (default 25) ping-pongs
 * driven entirely from the loop's callbacks (4 completions each: send and
 * receive on both sides): on 9 cycles of 10 with rdmasafe_cq_loop_run_once
 * from this thread, on every 10th with rdmasafe_cq_loop_run on a pthread
 * stopped from inside the last callback. Every 4th cycle the client QP has
 * a keepalive (added and removed). Then rdmasafe_cq_loop_drain_qp on both
 * QPs, disconnect both ways, destroy everything. CM events are taken with
 * rdmasafe_get_event_timeout and rdmasafe_get_events (batch), async events
 * polled with rdmasafe_async_get.
 *
 * Then one rejected request held past the ack deadline (see
 * rejected_request_held): the CONNECT_REQUEST's new id is rejected and
 * destroyed while the copy is held, which librdmacm allows (it charges the
 * request to the listen id), and the copy is freed only after the
 * deadline's ack: the ack thread must not read the destroyed id (valgrind
 * reported an invalid read in rdmasafe_core::sys::current_event there).
 *
 * Prints "measure cycles=N", "measure completions=N",
 * "measure rejected_request_acked_at_deadline=N" and the usual check
 * lines; exit 0 only if every check passed (under valgrind,
 * --error-exitcode makes memory errors and leaks fail the run).
 */
#include "fault_common.h"

#define MSG 32
#define RECV_DEPTH 2
#define PDATA_LEN 24
#define KA_WR_ID 0x4b41000000000001ULL

struct end {
	const char *name;
	struct rdma_cm_id *id;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	char buf[(RECV_DEPTH + 1) * MSG];
};

struct cycle {
	struct end cli, srv;
	struct rdmasafe_cq_loop *loop;
	int round_trips, target, errors, stop_when_done;
	long completions;
};

static long total_completions;

static int post_recv(struct end *e, int slot)
{
	struct ibv_sge sge = { (uintptr_t)e->buf + (size_t)(slot + 1) * MSG, MSG, e->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 100 + (uint64_t)slot, .sg_list = &sge, .num_sge = 1 }, *bad;

	return ibv_post_recv(e->id->qp, &wr, &bad);
}

static int post_send(struct end *e, int seq)
{
	struct ibv_sge sge = { (uintptr_t)e->buf, MSG, e->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = (uint64_t)seq, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;

	snprintf(e->buf, MSG, "%s %d", e->name, seq);
	return ibv_post_send(e->id->qp, &wr, &bad);
}

/* Both CQs' callback: the ping-pong runs entirely from here. */
static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct cycle *c = ctx;

	for (int i = 0; i < n; i++) {
		const struct ibv_wc *w = &wc[i];
		c->completions++;
		if (w->wr_id >= UINT64_MAX - 1)
			continue; /* drain markers */
		if (w->status != IBV_WC_SUCCESS) {
			c->errors++;
			continue;
		}
		if (w->opcode != IBV_WC_RECV)
			continue;
		int slot = (int)(w->wr_id - 100);
		if (w->qp_num == c->srv.id->qp->qp_num) {
			/* ping received: post the receive again, answer */
			if (post_recv(&c->srv, slot) || post_send(&c->srv, c->round_trips))
				c->errors++;
		} else {
			/* pong received: one round trip done */
			c->round_trips++;
			if (post_recv(&c->cli, slot))
				c->errors++;
			if (c->round_trips < c->target) {
				if (post_send(&c->cli, c->round_trips))
					c->errors++;
			} else if (c->stop_when_done) {
				rdmasafe_cq_loop_stop(c->loop);
			}
		}
	}
}

static void on_dead(void *ctx, struct ibv_qp *qp, uint32_t qp_num)
{
	(void)ctx;
	(void)qp;
	CHECK(0, "keepalive declared the peer of QP %u dead in a healthy connection", qp_num);
}

static int make_end(struct end *e, struct ibv_pd *pd, struct ibv_comp_channel *comp)
{
	struct ibv_qp_init_attr attr;

	e->cq = ibv_create_cq(e->id->verbs, 16, NULL, comp, 0);
	if (!e->cq)
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = e->cq;
	attr.cap.max_send_wr = 4;
	attr.cap.max_recv_wr = RECV_DEPTH + 1;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (rdma_create_qp(e->id, pd, &attr))
		return -1;
	e->mr = ibv_reg_mr(pd, e->buf, sizeof e->buf, IBV_ACCESS_LOCAL_WRITE);
	if (!e->mr)
		return -1;
	for (int i = 0; i < RECV_DEPTH; i++)
		if (post_recv(e, i))
			return -1;
	return 0;
}

static void free_end(struct end *e)
{
	if (e->id && e->id->qp)
		rdma_destroy_qp(e->id);
	if (e->mr && ibv_dereg_mr(e->mr))
		CHECK(0, "%s: ibv_dereg_mr", e->name);
	if (e->cq && ibv_destroy_cq(e->cq))
		CHECK(0, "%s: ibv_destroy_cq", e->name);
	if (e->id && rdma_destroy_id(e->id))
		CHECK(0, "%s: rdma_destroy_id", e->name);
	e->id = NULL;
	e->mr = NULL;
	e->cq = NULL;
}

static struct rdma_cm_event *get(struct rdma_event_channel *ch, int type, const char *what, int batch)
{
	struct rdma_cm_event *ev = NULL;
	int r = batch ? rdmasafe_get_events(ch, &ev, 1, STEP_MS) : rdmasafe_get_event_timeout(ch, &ev, STEP_MS);

	if (r < 0 || !ev) {
		CHECK(0, "%s: no %s (%s)", what, rdmasafe_event_str(type), ename(errno));
		return NULL;
	}
	if ((int)ev->event != type) {
		CHECK(0, "%s: %s (status %d), wanted %s", what, rdmasafe_event_str(ev->event), ev->status,
		      rdmasafe_event_str(type));
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

static void *loop_thread(void *arg)
{
	struct cycle *c = arg;
	long r = rdmasafe_cq_loop_run(c->loop);

	return (void *)r;
}

/* One connect / ping-pong / disconnect cycle. 0 if every step worked. */
static int one_cycle(int k, int round_trips, struct rdma_event_channel *chs, struct rdma_event_channel *chc,
		     struct sockaddr_storage *dst, struct ibv_pd *pd)
{
	struct cycle c;
	struct ibv_comp_channel *comp = NULL;
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	char hello[PDATA_LEN] = { 0 }, welcome[PDATA_LEN] = { 0 };
	int ok = 0, r, keepalive = k % 4 == 0, threaded = k % 10 == 9;

	memset(&c, 0, sizeof c);
	c.cli.name = "client";
	c.srv.name = "server";
	c.target = round_trips;
	snprintf(hello, sizeof hello, "hello %d", k);
	snprintf(welcome, sizeof welcome, "welcome %d", k);

	if (rdma_create_id(chc, &c.cli.id, NULL, RDMA_PS_TCP) || resolve(chc, c.cli.id, dst, "client"))
		goto out;
	comp = ibv_create_comp_channel(c.cli.id->verbs);
	if (!comp || rdmasafe_cq_loop_create(comp, NULL, &c.loop) || make_end(&c.cli, pd, comp))
		goto out;
	conn_param(&p, hello, sizeof hello, 6);
	if (rdma_connect(c.cli.id, &p) || !(ev = get(chs, RDMA_CM_EVENT_CONNECT_REQUEST, "server", k & 1)))
		goto out;
	c.srv.id = ev->id;
	if (memcmp(ev->param.conn.private_data, hello, sizeof hello))
		CHECK(0, "cycle %d: request private data", k);
	rdmasafe_event_free(ev);
	if (make_end(&c.srv, pd, comp))
		goto out;
	conn_param(&p, welcome, sizeof welcome, 6);
	if (rdma_accept(c.srv.id, &p) || !(ev = get(chc, RDMA_CM_EVENT_ESTABLISHED, "client", k & 2)))
		goto out;
	if (memcmp(ev->param.conn.private_data, welcome, sizeof welcome))
		CHECK(0, "cycle %d: accept private data", k);
	rdmasafe_event_free(ev);
	if (!(ev = get(chs, RDMA_CM_EVENT_ESTABLISHED, "server", 0)))
		goto out;
	rdmasafe_event_free(ev);

	if (rdmasafe_cq_loop_add_cq(c.loop, c.cli.cq, on_wc, &c) ||
	    rdmasafe_cq_loop_add_cq(c.loop, c.srv.cq, on_wc, &c))
		goto out;
	if (keepalive &&
	    (r = rdmasafe_cq_loop_add_keepalive(c.loop, c.cli.id->qp, 5, 60000, KA_WR_ID, on_dead, &c))) {
		CHECK(0, "cycle %d: rdmasafe_cq_loop_add_keepalive -> %s", k, rname(r));
		goto out;
	}
	if (post_send(&c.cli, 0))
		goto out;
	if (threaded) {
		pthread_t t;
		void *res;
		c.stop_when_done = 1;
		if (pthread_create(&t, NULL, loop_thread, &c))
			goto out;
		pthread_join(t, &res);
		if ((long)res)
			CHECK(0, "cycle %d: rdmasafe_cq_loop_run -> %s", k, rname((int)(long)res));
	} else {
		double until = now_ms() + 60000;
		while (c.round_trips < round_trips && !c.errors && now_ms() < until)
			if ((r = rdmasafe_cq_loop_run_once(c.loop, 1000)) < 0) {
				CHECK(0, "cycle %d: rdmasafe_cq_loop_run_once -> %s", k, rname(r));
				break;
			}
	}
	if (c.round_trips != round_trips || c.errors) {
		CHECK(0, "cycle %d: %d of %d round trips (%d error completions)", k, c.round_trips, round_trips,
		      c.errors);
		goto out;
	}
	/* run_once may leave the last sends' completions in the CQs: drain */
	if ((r = rdmasafe_cq_loop_drain_qp(c.loop, c.cli.id->qp, 0, 10000)) ||
	    (r = rdmasafe_cq_loop_drain_qp(c.loop, c.srv.id->qp, 0, 10000))) {
		CHECK(0, "cycle %d: rdmasafe_cq_loop_drain_qp -> %s", k, rname(r));
		goto out;
	}
	if (keepalive && (r = rdmasafe_cq_loop_remove_keepalive(c.loop, c.cli.id->qp))) {
		CHECK(0, "cycle %d: rdmasafe_cq_loop_remove_keepalive -> %s", k, rname(r));
		goto out;
	}
	if (rdma_disconnect(c.cli.id) || !(ev = get(chs, RDMA_CM_EVENT_DISCONNECTED, "server", 0)))
		goto out;
	rdmasafe_event_free(ev);
	if (rdma_disconnect(c.srv.id) || !(ev = get(chc, RDMA_CM_EVENT_DISCONNECTED, "client", 0)))
		goto out;
	rdmasafe_event_free(ev);
	ok = 1;
out:
	if (!ok)
		CHECK(0, "cycle %d failed", k);
	if (c.loop) {
		struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
		/* removing the CQs acks what run_once left pending */
		if (c.cli.cq)
			rdmasafe_cq_loop_remove_cq(c.loop, c.cli.cq);
		if (c.srv.cq)
			rdmasafe_cq_loop_remove_cq(c.loop, c.srv.cq);
		if (!rdmasafe_cq_loop_get_stats(c.loop, &s) && s.unacked_now)
			CHECK(0, "cycle %d: unacked_now %" PRIu64 " after removing the CQs", k, s.unacked_now);
		if ((r = rdmasafe_cq_loop_destroy(c.loop)))
			CHECK(0, "cycle %d: rdmasafe_cq_loop_destroy -> %s", k, rname(r));
	}
	free_end(&c.cli);
	free_end(&c.srv);
	if (comp && ibv_destroy_comp_channel(comp))
		CHECK(0, "cycle %d: ibv_destroy_comp_channel", k);
	total_completions += c.completions;
	return ok ? 0 : -1;
}

/*
 * A connect request whose new id is rejected and destroyed while its copy
 * is held, past a 100 ms ack deadline: librdmacm's rdma_destroy_id of the
 * new id does not wait for the request (it is charged to the listen id),
 * so the id's memory is freed while the original is still un-acked; then
 * the ack thread acks the original at the deadline, and the copy is freed.
 * Under valgrind any read of the destroyed id is an error. Measures how
 * many originals the deadline acked meanwhile (1).
 */
static void rejected_request_held(struct rdma_event_channel *chs, struct rdma_event_channel *chc,
				  struct sockaddr_storage *dst)
{
	struct rdmasafe_cm_counters before = { .size = sizeof before }, now = { .size = sizeof now };
	struct rdma_cm_id *cli = NULL;
	struct rdma_cm_event *req, *ev;
	struct rdma_conn_param p;
	char hello[PDATA_LEN] = "held request";
	int old = rdmasafe_cm_set_ack_deadline(100);

	CHECK(old >= 0, "rdmasafe_cm_set_ack_deadline(100) -> %d", old);
	if (!CHECK(rdma_create_id(chc, &cli, NULL, RDMA_PS_TCP) == 0, "held request: rdma_create_id") ||
	    resolve(chc, cli, dst, "held request client"))
		goto out;
	conn_param(&p, hello, sizeof hello, 6);
	if (!CHECK(rdma_connect(cli, &p) == 0, "held request: rdma_connect") ||
	    !(req = get(chs, RDMA_CM_EVENT_CONNECT_REQUEST, "held request server", 0)))
		goto out;
	CHECK(rdmasafe_cm_get_counters(&before) == 0, "rdmasafe_cm_get_counters");
	/* legal with librdmacm while the request is held: it is the listen id's */
	CHECK(rdma_reject(req->id, NULL, 0) == 0, "held request: rdma_reject");
	CHECK(rdma_destroy_id(req->id) == 0, "held request: rdma_destroy_id of the new id");
	if ((ev = get(chc, RDMA_CM_EVENT_REJECTED, "held request client", 0)))
		rdmasafe_event_free(ev);
	/* the ack thread acks the held original at the deadline */
	double until = now_ms() + STEP_MS;
	do {
		usleep(20000);
		CHECK(rdmasafe_cm_get_counters(&now) == 0, "rdmasafe_cm_get_counters");
	} while (now.acked_at_deadline == before.acked_at_deadline && now_ms() < until);
	measure("rejected_request_acked_at_deadline", "%" PRIu64, now.acked_at_deadline - before.acked_at_deadline);
	CHECK(now.acked_at_deadline > before.acked_at_deadline,
	      "held request: its original acked at the deadline within %d ms", STEP_MS);
	CHECK(req->event == RDMA_CM_EVENT_CONNECT_REQUEST && !memcmp(req->param.conn.private_data, hello, sizeof hello),
	      "held request: the copy still reads as the request after the deadline");
	free_event(req);
out:
	if (cli)
		CHECK(rdma_destroy_id(cli) == 0, "held request: rdma_destroy_id of the client id");
	if (old >= 0)
		rdmasafe_cm_set_ack_deadline(old);
}

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");
	int cycles = 100, round_trips = 25, secs = 600, opt, good = 0;
	struct rdma_event_channel *chs, *chc;
	struct rdma_cm_id *listener = NULL;
	struct sockaddr_storage ss;
	struct ibv_pd *pd;
	double t0;

	while ((opt = getopt(argc, argv, "a:c:m:t:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'c': cycles = atoi(optarg); break;
		case 'm': round_trips = atoi(optarg); break;
		case 't': secs = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: leak_cycles [-a ADDR] [-c CYCLES] [-m ROUND_TRIPS] [-t SECS]\n");
			return 2;
		}
	}
	if (cycles < 1 || round_trips < 1)
		return 2;
	watchdog_init("leak_cycles", (unsigned)secs);

	phase = "setup";
	chs = new_channel(1);
	chc = new_channel(1);
	if (!CHECK(chs && chc && parse_addr(addr, 0, &ss) == 0, "channels and address %s", addr ? addr : "?"))
		return summary();
	if (!CHECK(rdma_create_id(chs, &listener, NULL, RDMA_PS_TCP) == 0, "listener: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, (struct sockaddr *)&ss) == 0, "listener: rdma_bind_addr") ||
	    !CHECK(rdma_listen(listener, 8) == 0, "listener: rdma_listen"))
		return summary();
	parse_addr(addr, ntohs(rdma_get_src_port(listener)), &ss);
	pd = ibv_alloc_pd(listener->verbs);
	if (!CHECK(pd, "ibv_alloc_pd"))
		return summary();
	CHECK(rdmasafe_cm_reserve(8) >= 8, "rdmasafe_cm_reserve(8)");

	phase = "cycles";
	t0 = now_ms();
	for (int k = 0; k < cycles; k++) {
		struct rdmasafe_async_event ae = { .size = sizeof ae };
		if (one_cycle(k, round_trips, chs, chc, &ss, pd) == 0)
			good++;
		else
			break;
		if (k % 10 == 0) {
			int r = rdmasafe_async_get(listener->verbs, &ae, 0);
			if (r != -EAGAIN)
				CHECK(0, "rdmasafe_async_get(0) -> %s, want -EAGAIN (no async event)", rname(r));
		}
	}
	double dt = now_ms() - t0;
	CHECK(good == cycles, "%d of %d connect / %d round trips / disconnect cycles in %.0f ms", good, cycles,
	      round_trips, dt);
	measure("cycles", "%d", good);
	measure("completions", "%ld", total_completions);
	measure("cycles_ms", "%.0f", dt);

	phase = "rejected request held past the ack deadline";
	rejected_request_held(chs, chc, &ss);

	phase = "teardown";
	CHECK(rdma_destroy_id(listener) == 0, "listener: rdma_destroy_id");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	rdma_destroy_event_channel(chs);
	rdma_destroy_event_channel(chc);
	check_counters_zero("leak_cycles");
	check_no_cm_ids("leak_cycles");
	return summary();
}
