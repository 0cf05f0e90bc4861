/*
 * fault_overrun: a CQ overrun on rxe, through the rdmasafe C API.
 *
 *   fault_overrun [-a ADDR] [-n SENDS] [-T ACK_TIMEOUT] [-t SECS]
 *
 * One process, one connection to itself on $RDMASAFE_TEST_ADDR. The
 * server's receive CQ is asked for 4 entries (rxe rounds up) while SENDS
 * (default 64) receives are posted and the client sends SENDS messages at
 * once. Nobody polls the server CQ meanwhile: it is in a CQ loop of its own
 * (on its own completion channel) that is not run yet. The client's CQ is
 * in another loop that runs on a pthread.
 *
 * Expected, through rdmasafe:
 *  - IBV_EVENT_CQ_ERR via rdmasafe_async_get, element_kind RDMASAFE_ASYNC_CQ
 *    and element == the server CQ (rxe raises one per completion it could
 *    not store);
 *  - the client's sends: some succeed, then IBV_WC_RETRY_EXC_ERR (the
 *    overrun responder stops acknowledging), then only IBV_WC_WR_FLUSH_ERR,
 *    every send completed (the client's ack timeout is lowered with
 *    RDMA_OPTION_ID_ACK_TIMEOUT to -T, default 14 = 67 ms, so this takes
 *    well under a second instead of ~15 s);
 *  - the server loop, run afterwards, delivers what the CQ holds (at most
 *    its size), and rdmasafe_cq_loop_drain_qp on the server QP still
 *    completes (its flush marker arrives);
 *  - teardown: unacked_now 0 on both loops, everything destroyed, cm
 *    counters outstanding 0, no cm_id left.
 */
#include "fault_common.h"

#define CLIENT_CQE 256
#define SEND_LEN 8

struct side {
	const char *name;
	struct rdma_cm_id *id;
	struct ibv_comp_channel *comp;
	struct ibv_cq *cq;
	struct rdmasafe_cq_loop *loop;
	struct ibv_mr *mr;
	char buf[4096];
	atomic_int done, ok, errors, first_err, markers, after_first_bad;
	atomic_llong t_first_err_us;
};

static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct side *s = ctx;

	for (int i = 0; i < n; i++) {
		if (wc[i].wr_id >= UINT64_MAX - 1) {
			atomic_fetch_add(&s->markers, 1);
			continue;
		}
		atomic_fetch_add(&s->done, 1);
		if (wc[i].status == IBV_WC_SUCCESS) {
			atomic_fetch_add(&s->ok, 1);
			if (atomic_load(&s->errors))
				atomic_fetch_add(&s->after_first_bad, 1); /* success after an error */
		} else if (atomic_fetch_add(&s->errors, 1) == 0) {
			atomic_store(&s->first_err, wc[i].status);
			atomic_store(&s->t_first_err_us, (long long)(now_ms() * 1e3));
		} else if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
			atomic_fetch_add(&s->after_first_bad, 1);
		}
	}
}

static int make_side(struct side *s, struct ibv_pd *pd, int cqe, int send_wr, int recv_wr)
{
	struct ibv_qp_init_attr attr;
	int r;

	atomic_store(&s->first_err, -1);
	s->comp = ibv_create_comp_channel(s->id->verbs);
	s->cq = s->comp ? ibv_create_cq(s->id->verbs, cqe, s, s->comp, 0) : NULL;
	if (!CHECK(s->cq, "%s: completion channel and CQ (asked for %d entries, got %d)", s->name, cqe,
		   s->cq ? s->cq->cqe : -1))
		return -1;
	r = rdmasafe_cq_loop_create(s->comp, NULL, &s->loop);
	if (!CHECK(r == 0, "%s: rdmasafe_cq_loop_create -> %s", s->name, rname(r)))
		return -1;
	r = rdmasafe_cq_loop_add_cq(s->loop, s->cq, on_wc, s);
	if (!CHECK(r == 0, "%s: rdmasafe_cq_loop_add_cq -> %s", s->name, rname(r)))
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = s->cq;
	attr.cap.max_send_wr = send_wr;
	attr.cap.max_recv_wr = recv_wr;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (!CHECK(rdma_create_qp(s->id, pd, &attr) == 0, "%s: rdma_create_qp", s->name))
		return -1;
	s->mr = ibv_reg_mr(pd, s->buf, sizeof s->buf, IBV_ACCESS_LOCAL_WRITE);
	return CHECK(s->mr, "%s: ibv_reg_mr", s->name) ? 0 : -1;
}

static void destroy_side(struct side *s)
{
	int r;

	if (s->loop) {
		r = rdmasafe_cq_loop_destroy(s->loop);
		CHECK(r == 0, "%s: rdmasafe_cq_loop_destroy -> %s", s->name, rname(r));
	}
	if (s->id && s->id->qp)
		rdma_destroy_qp(s->id);
	if (s->mr)
		CHECK(ibv_dereg_mr(s->mr) == 0, "%s: ibv_dereg_mr", s->name);
	if (s->cq)
		CHECK(ibv_destroy_cq(s->cq) == 0, "%s: ibv_destroy_cq returned 0 (every CQ event acked)", s->name);
	if (s->comp)
		CHECK(ibv_destroy_comp_channel(s->comp) == 0, "%s: ibv_destroy_comp_channel", s->name);
	if (s->id)
		CHECK(rdma_destroy_id(s->id) == 0, "%s: rdma_destroy_id", s->name);
}

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");
	int sends = 64, secs = 60, ack_timeout = 14, opt, r;
	struct rdma_event_channel *chs, *chc;
	struct rdma_cm_id *listener = NULL;
	struct sockaddr_storage ss;
	static struct side cli = { .name = "client" }, srv = { .name = "server" };
	struct ibv_pd *pd;
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	struct async_reader ar;
	struct loop_thread lt;
	double t0, deadline;
	int lost_before_drain = 0;

	while ((opt = getopt(argc, argv, "a:n:T:t:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'n': sends = atoi(optarg); break;
		case 'T': ack_timeout = atoi(optarg); break;
		case 't': secs = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: fault_overrun [-a ADDR] [-n SENDS] [-T ACK_TIMEOUT] [-t SECS]\n");
			return 2;
		}
	}
	if (sends < 8 || sends > 200)
		return 2;
	watchdog_init("fault_overrun", (unsigned)secs + 120);
	memset(&lt, 0, sizeof lt);

	phase = "setup";
	chs = new_channel(1);
	chc = new_channel(1);
	if (!CHECK(chs && chc && parse_addr(addr, 0, &ss) == 0, "channels and address %s", addr ? addr : "?"))
		return summary();
	if (!CHECK(rdma_create_id(chs, &listener, NULL, RDMA_PS_TCP) == 0, "listener: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, (struct sockaddr *)&ss) == 0, "listener: rdma_bind_addr") ||
	    !CHECK(rdma_listen(listener, 4) == 0, "listener: rdma_listen"))
		return summary();
	parse_addr(addr, ntohs(rdma_get_src_port(listener)), &ss);
	pd = ibv_alloc_pd(listener->verbs);
	if (!CHECK(pd, "ibv_alloc_pd"))
		return summary();

	if (!CHECK(rdma_create_id(chc, &cli.id, NULL, RDMA_PS_TCP) == 0, "client: rdma_create_id") ||
	    resolve(chc, cli.id, &ss, "client"))
		return summary();
	{
		uint8_t t = (uint8_t)ack_timeout;
		r = rdma_set_option(cli.id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof t);
		CHECK(r == 0, "client: RDMA_OPTION_ID_ACK_TIMEOUT %d (4.096 us * 2^%d = %.0f ms)", ack_timeout,
		      ack_timeout, 4.096e-3 * (1 << ack_timeout));
	}
	if (make_side(&cli, pd, CLIENT_CQE, sends + 2, 4))
		return summary();
	conn_param(&p, NULL, 0, 6);
	if (!CHECK(rdma_connect(cli.id, &p) == 0, "client: rdma_connect (retry_count 6)"))
		return summary();
	if (!(ev = expect(chs, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, STEP_MS, "server: connect request")))
		return summary();
	srv.id = ev->id;
	free_event(ev);
	/* the server's CQ: 4 entries asked, far fewer than the receives */
	if (make_side(&srv, pd, 4, 4, sends + 2))
		return summary();
	measure("cq_asked", "4");
	measure("cq_got", "%d", srv.cq->cqe);
	CHECK(srv.cq->cqe < sends, "server CQ (%d entries) smaller than the %d receives", srv.cq->cqe, sends);
	for (int i = 0; i < sends; i++) {
		struct ibv_sge sge = { (uintptr_t)srv.buf + (size_t)i * 32, 32, srv.mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = (uint64_t)i, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(srv.id->qp, &wr, &bad))
			return CHECK(0, "server: ibv_post_recv %d", i), summary();
	}
	if (!CHECK(rdma_accept(srv.id, &p) == 0, "server: rdma_accept"))
		return summary();
	if (!(ev = expect(chc, RDMA_CM_EVENT_ESTABLISHED, cli.id, STEP_MS, "client: established")))
		return summary();
	free_event(ev);
	if (!(ev = expect(chs, RDMA_CM_EVENT_ESTABLISHED, srv.id, STEP_MS, "server: established")))
		return summary();
	free_event(ev);
	if (!CHECK(async_start(&ar, listener->verbs) == 0, "async event thread") ||
	    !CHECK(loop_start(&lt, cli.loop) == 0, "client loop thread"))
		return summary();

	phase = "overrun";
	t0 = now_ms();
	for (int i = 0; i < sends; i++) {
		struct ibv_sge sge = { (uintptr_t)cli.buf, SEND_LEN, cli.mr->lkey };
		struct ibv_send_wr wr = { .wr_id = (uint64_t)i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
		if (ibv_post_send(cli.id->qp, &wr, &bad))
			return CHECK(0, "client: ibv_post_send %d", i), summary();
	}
	deadline = t0 + secs * 1e3;
	while (atomic_load(&cli.done) < sends && now_ms() < deadline)
		sleep_ms(5);
	double t_sends = now_ms();
	/* then up to 2 s more for the async events to settle */
	{
		int last = -1;
		double quiet = now_ms();
		while (now_ms() - quiet < 1000 && now_ms() < deadline + 2000) {
			int n = atomic_load(&ar.n);
			if (n != last) {
				last = n;
				quiet = now_ms();
			}
			sleep_ms(20);
		}
	}
	int first = atomic_load(&cli.first_err);
	CHECK(atomic_load(&cli.done) == sends, "client: all %d sends completed (%d ok, %d errors) in %.0f ms",
	      sends, atomic_load(&cli.ok), atomic_load(&cli.errors), t_sends - t0);
	CHECK(first == IBV_WC_RETRY_EXC_ERR && atomic_load(&cli.after_first_bad) == 0,
	      "client: first error %s, then only IBV_WC_WR_FLUSH_ERR (%d other)",
	      first >= 0 ? wc_str(first) : "none", atomic_load(&cli.after_first_bad));
	measure("client_sends_ok", "%d", atomic_load(&cli.ok));
	measure("client_first_error", "%s", first >= 0 ? wc_str(first) : "none");
	if (first >= 0)
		measure("client_first_error_ms", "%.0f", atomic_load(&cli.t_first_err_us) / 1e3 - t0);
	{
		int na = atomic_load(&ar.n), cq_err = 0, naming = 0, i_first = async_find(&ar, IBV_EVENT_CQ_ERR, 0);
		for (int i = 0; i < na; i++) {
			struct rdmasafe_async_event *e = &ar.rec[i].ev;
			if (e->event_type == IBV_EVENT_CQ_ERR) {
				cq_err++;
				naming += e->element_kind == RDMASAFE_ASYNC_CQ && e->element == (void *)srv.cq;
			} else {
				info("async %s (kind %d, qp_num %u) at %.0f ms", rdmasafe_async_event_str(e->event_type),
				     e->element_kind, e->qp_num, ar.rec[i].t - t0);
			}
		}
		CHECK(cq_err >= 1 && naming == cq_err,
		      "IBV_EVENT_CQ_ERR via rdmasafe_async_get: %d event(s), %d naming the server CQ %p", cq_err,
		      naming, (void *)srv.cq);
		measure("cq_err_events", "%d", cq_err);
		measure("async_events", "%d", na);
		if (i_first >= 0)
			measure("first_cq_err_ms", "%.0f", ar.rec[i_first].t - t0);
	}

	phase = "server loop after the overrun";
	{
		int n = 0, k;
		for (int i = 0; i < 4; i++)
			if ((k = rdmasafe_cq_loop_run_once(srv.loop, 0)) > 0)
				n += k;
		int held_ok = atomic_load(&srv.ok);
		CHECK(held_ok > 0 && held_ok <= srv.cq->cqe + 1,
		      "server loop delivered what the overrun CQ held: %d completions, %d successful (CQ size %d)",
		      n, held_ok, srv.cq->cqe);
		measure("server_delivered_ok", "%d", held_ok);
		/* what the loop will ever see of the receives: the rest was lost */
		lost_before_drain = sends - atomic_load(&srv.done);
		r = rdmasafe_cq_loop_drain_qp(srv.loop, srv.id->qp, 0, 10000);
		CHECK(r == 0 && atomic_load(&srv.markers) == 0,
		      "server: rdmasafe_cq_loop_drain_qp after the overrun -> %s (%d markers delivered, want 0)", rname(r),
		      atomic_load(&srv.markers));
		measure("server_flushed", "%d", atomic_load(&srv.errors));
		/* receives that never produced a completion the app could see */
		int lost = sends - atomic_load(&srv.done);
		measure("completions_lost", "%d", lost);
		/* the async reader may lag behind the kernel (a loaded machine):
		 * wait (bounded) until it has read as many CQ_ERR as were lost,
		 * then a second of quiet for any beyond */
		{
			double until = now_ms() + 30000, quiet = now_ms();
			int last = -1;
			while (now_ms() < until &&
			       (async_count(&ar, IBV_EVENT_CQ_ERR) < lost || now_ms() - quiet < 1000)) {
				int n = atomic_load(&ar.n);
				if (n != last) {
					last = n;
					quiet = now_ms();
				}
				sleep_ms(20);
			}
		}
		info("server: %d completions lost before the drain, %d in all; %d CQ_ERR events", lost_before_drain,
		     lost, async_count(&ar, IBV_EVENT_CQ_ERR));
		CHECK(lost > 0 && async_count(&ar, IBV_EVENT_CQ_ERR) == lost,
		      "one IBV_EVENT_CQ_ERR per lost completion (%d lost, %d events)", lost,
		      async_count(&ar, IBV_EVENT_CQ_ERR));
		info("server: %d receive completions delivered in all (%d ok, %d errors) of %d posted",
		     atomic_load(&srv.done), held_ok, atomic_load(&srv.errors), sends);
	}

	phase = "teardown";
	alarm(60);
	r = loop_join(&lt);
	CHECK(r == 0, "client: rdmasafe_cq_loop_run returned %s after stop", rname(r));
	r = rdmasafe_cq_loop_drain_qp(cli.loop, cli.id->qp, 0, 10000);
	CHECK(r == 0 && atomic_load(&cli.markers) == 0, "client: rdmasafe_cq_loop_drain_qp -> %s (%d markers delivered, want 0)",
	      rname(r), atomic_load(&cli.markers));
	{
		struct rdmasafe_cq_loop_stats a = { .size = sizeof a }, b = { .size = sizeof b };
		print_loop_stats(cli.loop, "client", &a);
		print_loop_stats(srv.loop, "server", &b);
		CHECK(a.unacked_now == 0 && b.unacked_now == 0, "unacked_now %" PRIu64 " / %" PRIu64 " after stop",
		      a.unacked_now, b.unacked_now);
	}
	async_stop(&ar);
	rdma_disconnect(cli.id);
	while (rdmasafe_get_event_timeout(chc, &ev, 0) == 0 || rdmasafe_get_event_timeout(chs, &ev, 0) == 0) {
		info("CM %s (status %d)", rdmasafe_event_str(ev->event), ev->status);
		free_event(ev);
	}
	destroy_side(&cli);
	destroy_side(&srv);
	CHECK(rdma_destroy_id(listener) == 0, "listener: rdma_destroy_id");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	rdma_destroy_event_channel(chs);
	rdma_destroy_event_channel(chc);
	check_counters_zero("overrun");
	check_no_cm_ids("overrun");
	return summary();
}
