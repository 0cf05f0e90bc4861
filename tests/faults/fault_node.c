/*
 * fault_node: the two ends of the peer-fault cases, through the rdmasafe
 * C API.
 *
 *   fault_node peer -p PORT [-a ADDR] [-n CONNS] [-L FILE] [-t SECS]
 *   fault_node survivor -x hostkill|prockill|linkflap -p PORT [-a PEER]
 *              [-r RETRY] [-k] [-K] [-P PERIOD_MS] [-B BOUND_MS] [-F STAMP]
 *              [-U STAMP] [-W FILE] [-t SECS]
 *
 * peer: listens on ADDR:PORT ($RDMASAFE_TEST_ADDR), accepts CONNS
 * connections, keeps receives posted on each (reposted from the loop
 * callback). Drives its CQ loop from its own poll() with
 * rdmasafe_cq_loop_fd + rdmasafe_cq_loop_run_once. Creates FILE once it
 * listens. Ends cleanly once every connection was disconnected by the
 * other side. In the fault cases it is the one that dies (SIGKILL of the
 * process, or of its whole guest), or the far side of a link flap.
 *
 * survivor: connects to PEER:PORT ($RDMASAFE_PEER_ADDR, else
 * $RDMASAFE_TEST_ADDR) a "traffic" connection (retry_count RETRY, default
 * 6) that streams SENDs (one every 5 ms, at most 8 outstanding) and, with
 * -k, an "idle" connection (retry_count 7, which rxe treats as infinite)
 * that only has receives posted and a rdmasafe keepalive (period -P,
 * default 200 ms; bound -B, default 2000 ms); -K gives the traffic
 * connection the same keepalive. All CQs are in one CQ loop
 * run on a pthread; async events are read with rdmasafe_async_get on
 * another; CM events on the main thread. After "fault_node: traffic
 * flowing" the guest script injects the fault (writing the moment, a
 * /proc/uptime copy, to STAMP first); "fault_node: traffic error" says
 * the first error completion arrived (the link flap keeps the link down
 * until then, and stamps the moment it sets it up again in -U STAMP).
 * What must reach the app, whatever the timing:
 *
 *   hostkill  the peer's host dies: on the traffic connection
 *             IBV_WC_RETRY_EXC_ERR, then only IBV_WC_WR_FLUSH_ERR, until
 *             every posted WR completed; with -k the keepalive declares the
 *             idle connection's peer dead (callback with its QP), the QP is
 *             moved to error and its receives flush.
 *   prockill  the peer process is SIGKILLed: RDMA_CM_EVENT_DISCONNECTED on
 *             the traffic connection; the survivor calls rdma_disconnect
 *             and every posted WR completes (flush errors).
 *   linkflap  our own link goes down and up: IBV_EVENT_PORT_ERR, then an
 *             error completion on the traffic connection and flushes, then
 *             IBV_EVENT_PORT_ACTIVE. rxe reports the error through the QP
 *             only if a send is posted (or retransmitted) while the port is
 *             down and sometimes never (see docs/RELIABILITY.md): with -K the
 *             keepalive turns that silence into flushes within its bound.
 *             The first error is rxe's status, or a flush when the
 *             keepalive moved the QP to error (which of the two comes
 *             first is timing: both are accepted, the keepalive at most
 *             once).
 *
 *   In every mode: after the first error completion only flushes, never
 *   a success, and every work request completed exactly once.
 *
 * Then teardown: rdmasafe_cq_loop_drain_qp on every QP (markers never delivered),
 * loop stats (unacked_now 0), destroy everything (watchdog), cm counters
 * outstanding 0, no cm_id of this process left in the kernel.
 * Figures are printed as "measure NAME=VALUE" lines (see fault_common.h).
 */
#include "fault_common.h"

#include "fault_conn.h"

enum mode { HOSTKILL, PROCKILL, LINKFLAP };

/* Loop thread: the keepalive declared the idle connection's peer dead. */
static void on_dead(void *ctx, struct ibv_qp *qp, uint32_t qp_num)
{
	struct conn *c = ctx;

	c->dead_qp = qp;
	c->dead_qpn = qp_num;
	atomic_store(&c->t_dead_us, ms_to_us(now_ms()));
	atomic_fetch_add(&c->dead, 1);
}

/* ================================================================= peer */

static int run_peer(const char *addr, uint16_t port, int nconns, const char *marker, int secs)
{
	struct rdma_event_channel *ch = new_channel(1);
	struct rdma_cm_id *listener = NULL;
	struct sockaddr_storage ss;
	struct conn conns[MAX_CONNS];
	int n = 0, established = 0, disconnected = 0;
	double deadline = now_ms() + secs * 1e3;

	memset(conns, 0, sizeof conns);
	phase = "peer: listen";
	if (!CHECK(ch && parse_addr(addr, port, &ss) == 0, "peer: channel and address %s", addr ? addr : "?"))
		return summary();
	if (!CHECK(rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP) == 0, "peer: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, (struct sockaddr *)&ss) == 0, "peer: rdma_bind_addr %s:%u", addr, port) ||
	    !CHECK(rdma_listen(listener, 8) == 0, "peer: rdma_listen") ||
	    !CHECK(listener->verbs != NULL, "peer: listener bound to a device") ||
	    make_context(listener->verbs))
		return summary();
	if (marker)
		touch(marker);
	milestone("listening");

	phase = "peer: serving";
	while (now_ms() < deadline && !(established == nconns && disconnected == nconns)) {
		struct pollfd pfd[2] = { { ch->fd, POLLIN, 0 }, { rdmasafe_cq_loop_fd(loop), POLLIN, 0 } };
		struct rdma_cm_event *ev;

		poll(pfd, 2, 50);
		int r = rdmasafe_cq_loop_run_once(loop, 0);
		if (r < 0)
			CHECK(0, "peer: rdmasafe_cq_loop_run_once -> %s", rname(r));
		while (rdmasafe_get_event(ch, &ev) == 0) {
			struct conn *c = NULL;
			for (int i = 0; i < n; i++)
				if (conns[i].id == ev->id)
					c = &conns[i];
			if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
				struct rdma_conn_param p;
				if (n == MAX_CONNS || n == nconns) {
					info("peer: refusing an extra connection");
					rdma_reject(ev->id, NULL, 0);
					rdma_destroy_id(ev->id);
				} else {
					c = &conns[n++];
					c->name = "peer";
					c->id = ev->id;
					atomic_store(&c->first_err_status, -1);
					conn_param(&p, NULL, 0, 7);
					if (setup_qp(c, PEER_RECVS) == 0)
						CHECK(rdma_accept(c->id, &p) == 0, "peer: rdma_accept");
				}
			} else if (ev->event == RDMA_CM_EVENT_ESTABLISHED && c) {
				c->established = 1;
				established++;
				info("peer: connection %d established (qp %u)", (int)(c - conns), c->id->qp->qp_num);
			} else if (ev->event == RDMA_CM_EVENT_DISCONNECTED && c) {
				c->disconnected = 1;
				disconnected++;
				rdma_disconnect(c->id);
				info("peer: connection %d disconnected after %d messages",
				     (int)(c - conns), atomic_load(&c->msgs));
			} else {
				info("peer: %s (status %d)", rdmasafe_event_str(ev->event), ev->status);
			}
			free_event(ev);
		}
	}
	CHECK(established == nconns && disconnected == nconns,
	      "peer: %d of %d connections established and disconnected by the survivor",
	      disconnected, nconns);

	phase = "peer: teardown";
	alarm(60);
	for (int i = 0; i < n; i++) {
		measure("peer_messages", "%d", atomic_load(&conns[i].msgs));
		drain(&conns[i]);
	}
	/*
	 * The peer drives its loop with run_once, which batches acks: removing
	 * each CQ acks what is pending (a destroy would do it too).
	 */
	for (int i = 0; i < n; i++) {
		int r = rdmasafe_cq_loop_remove_cq(loop, conns[i].cq);
		CHECK(r == 0, "peer: rdmasafe_cq_loop_remove_cq -> %s", rname(r));
	}
	{
		struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
		print_loop_stats(loop, "peer", &s);
		CHECK(s.unacked_now == 0, "peer loop: unacked_now %" PRIu64 " after removing its CQs",
		      s.unacked_now);
	}
	drop_events(ch);
	{
		int r = rdmasafe_cq_loop_destroy(loop);
		CHECK(r == 0, "peer: rdmasafe_cq_loop_destroy -> %s", rname(r));
		loop = NULL;
	}
	for (int i = 0; i < n; i++)
		destroy_conn(&conns[i]);
	CHECK(rdma_destroy_id(listener) == 0, "peer: rdma_destroy_id(listener)");
	destroy_context();
	drop_events(ch);
	rdma_destroy_event_channel(ch);
	check_counters_zero("peer");
	check_no_cm_ids("peer");
	return summary();
}

/* ============================================================= survivor */

static int connect_one(struct rdma_event_channel *ch, struct conn *c,
		       struct sockaddr_storage *dst, int retry)
{
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	char what[64];

	atomic_store(&c->first_err_status, -1);
	if (!CHECK(rdma_create_id(ch, &c->id, c, RDMA_PS_TCP) == 0, "%s: rdma_create_id", c->name) ||
	    resolve(ch, c->id, dst, c->name))
		return -1;
	if (!pd && make_context(c->id->verbs))
		return -1;
	if (setup_qp(c, RECVS))
		return -1;
	conn_param(&p, NULL, 0, retry);
	if (!CHECK(rdma_connect(c->id, &p) == 0, "%s: rdma_connect (retry_count %d)", c->name, retry))
		return -1;
	snprintf(what, sizeof what, "%s: established", c->name);
	if (!(ev = expect(ch, RDMA_CM_EVENT_ESTABLISHED, c->id, STEP_MS, what)))
		return -1;
	free_event(ev);
	c->established = 1;
	return 0;
}

struct cm_rec {
	int event, status;
	const char *conn;
	double t;
};

static int run_survivor(enum mode mode, const char *addr, uint16_t port, int retry,
			int idle_ka, int traffic_ka, int period, int bound, const char *stamp,
			const char *upstamp, const char *killed, int secs)
{
	static const char *mode_name[] = { "hostkill", "prockill", "linkflap" };
	struct rdma_event_channel *ch = new_channel(1);
	struct sockaddr_storage dst;
	struct conn conns[2], *T = &conns[0], *K = &conns[1];
	struct async_reader ar;
	struct loop_thread lt;
	struct cm_rec cm[64];
	int ncm = 0, nconns = idle_ka ? 2 : 1, flowing = 0, error_seen = 0, done = 0, r;
	double t_flowing = 0, t_killed_seen = -1, next_send, deadline, t_poll_marker = 0;

	memset(conns, 0, sizeof conns);
	memset(&lt, 0, sizeof lt);
	T->name = "traffic";
	K->name = "idle";
	info("survivor: mode %s, peer %s:%u, traffic retry_count %d%s%s", mode_name[mode],
	     addr ? addr : "?", port, retry, traffic_ka ? " with keepalive" : "",
	     idle_ka ? ", idle connection with keepalive" : "");
	phase = "survivor: connect";
	if (!CHECK(ch && parse_addr(addr, port, &dst) == 0, "survivor: channel and peer address"))
		return summary();
	if (connect_one(ch, T, &dst, retry))
		return summary();
	if (traffic_ka) {
		r = rdmasafe_cq_loop_add_keepalive(loop, T->id->qp, period, bound, PROBE_WR_ID, on_dead, T);
		if (!CHECK(r == 0, "traffic: rdmasafe_cq_loop_add_keepalive(period %d ms, bound %d ms) -> %s",
			   period, bound, rname(r)))
			return summary();
	}
	if (idle_ka) {
		if (connect_one(ch, K, &dst, 7))
			return summary();
		r = rdmasafe_cq_loop_add_keepalive(loop, K->id->qp, period, bound, PROBE_WR_ID, on_dead, K);
		if (!CHECK(r == 0, "idle: rdmasafe_cq_loop_add_keepalive(period %d ms, bound %d ms) -> %s",
			   period, bound, rname(r)))
			return summary();
	}
	if (!CHECK(async_start(&ar, T->id->verbs) == 0, "survivor: async event thread") ||
	    !CHECK(loop_start(&lt, loop) == 0, "survivor: CQ loop thread"))
		return summary();
	milestone("connected");

	phase = "survivor: traffic and fault";
	next_send = now_ms();
	deadline = now_ms() + secs * 1e3;
	while (!done && now_ms() < deadline) {
		struct rdma_cm_event *ev;
		double t;

		if (rdmasafe_get_event_timeout(ch, &ev, PACE_MS) == 0) {
			struct conn *c = ev->id == T->id ? T : ev->id == K->id ? K : NULL;
			if (ncm < 64)
				cm[ncm++] = (struct cm_rec){ ev->event, ev->status, c ? c->name : "?", now_ms() };
			info("CM %s (status %d) on %s", rdmasafe_event_str(ev->event), ev->status,
			     c ? c->name : "?");
			if (ev->event == RDMA_CM_EVENT_DISCONNECTED && c && !c->disconnected) {
				c->disconnected = 1;
				c->t_disconnected = now_ms();
				/* as an app would: QP to error, outstanding work flushes */
				rdma_disconnect(c->id);
			}
			free_event(ev);
		}
		t = now_ms();
		if (!atomic_load(&T->errors) && !T->disconnected && t >= next_send &&
		    atomic_load(&T->sends_posted) - atomic_load(&T->sends_done) < WINDOW) {
			if (post_send(T))
				info("traffic: ibv_post_send failed: %s", ename(errno));
			next_send = t + PACE_MS;
		}
		if (!flowing && atomic_load(&T->sends_done) >= FLOWING_AFTER && !atomic_load(&T->errors)) {
			struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
			rdmasafe_cq_loop_get_stats(loop, &s);
			if (!idle_ka || s.keepalive_probes_ok >= 2) {
				flowing = 1;
				t_flowing = t;
				info("keepalive probes so far: %" PRIu64 " posted, %" PRIu64 " ok",
				     s.keepalive_probes, s.keepalive_probes_ok);
				milestone("traffic flowing");
			}
		}
		if (flowing && !error_seen && atomic_load(&T->errors)) {
			/* (the link flap keeps the link down until this line) */
			error_seen = 1;
			milestone("traffic error");
		}
		if (killed && t_killed_seen < 0 && t - t_poll_marker >= 50) {
			t_poll_marker = t;
			if (file_exists(killed))
				t_killed_seen = t;
		}
		int all_t = atomic_load(&T->errors) > 0 &&
			    atomic_load(&T->sends_done) == atomic_load(&T->sends_posted) &&
			    atomic_load(&T->recvs_done) == atomic_load(&T->recvs_posted);
		int all_k = !idle_ka || (atomic_load(&K->dead) &&
					 atomic_load(&K->recvs_done) == atomic_load(&K->recvs_posted));
		switch (mode) {
		case HOSTKILL:
			done = all_t && all_k;
			break;
		case PROCKILL:
			done = all_t && T->disconnected;
			break;
		case LINKFLAP: {
			int e = async_find(&ar, IBV_EVENT_PORT_ERR, 0);
			done = all_t && e >= 0 && async_find(&ar, IBV_EVENT_PORT_ACTIVE, e) >= 0;
			break;
		}
		}
	}
	CHECK(flowing, "traffic flowed before the fault (%d sends completed)", atomic_load(&T->sends_done));
	CHECK(done, "%s: everything expected arrived within %d s", mode_name[mode], secs);

	/* ------------------------------------------------------------ figures */
	double t_fault = read_stamp_ms(stamp);
	double t_last_ok = us_to_ms(atomic_load(&T->t_last_ok_us));
	double t_err = us_to_ms(atomic_load(&T->t_first_err_us));
	int first = atomic_load(&T->first_err_status);

	info("fault stamp %.0f ms, traffic flowing at %.0f, last successful completion %.0f, first error %.0f",
	     t_fault, t_flowing, t_last_ok, t_err);
	measure("sends_ok", "%d", atomic_load(&T->oks));
	measure("sends_posted", "%d", atomic_load(&T->sends_posted));
	measure("first_error", "%s", first >= 0 ? wc_str(first) : "none");
	if (t_fault > 0 && first >= 0)
		measure("first_error_after_fault_ms", "%.0f", t_err - t_fault);
	if (first >= 0 && t_last_ok > 0)
		measure("first_error_after_last_ok_ms", "%.0f", t_err - t_last_ok);
	if (t_killed_seen > 0 && first >= 0)
		measure("first_error_after_killed_seen_ms", "%.0f", t_err - t_killed_seen);
	if (t_fault > 0 && t_killed_seen > 0)
		measure("killed_seen_after_fault_ms", "%.0f", t_killed_seen - t_fault);
	{
		/*
		 * The error sequence on the traffic connection, as the loop
		 * delivered it (counted on arrival, so it does not matter how
		 * much traffic came before the fault): at least one error, and
		 * after the first only flushes, never a success (an RC QP in
		 * error stays there; every later request is flushed).
		 */
		int n_err = atomic_load(&T->errors), n_flush = atomic_load(&T->flush_after_first);
		int n_other = atomic_load(&T->other_err_after_first), n_ok = atomic_load(&T->ok_after_first);
		measure("error_completions", "%d", n_err);
		measure("flush_after_first", "%d", n_flush);
		measure("other_after_first", "%d", n_other);
		measure("ok_after_first", "%d", n_ok);
		CHECK(n_err >= 1 && first >= 0 && first != IBV_WC_SUCCESS && n_flush == n_err - 1 && n_other == 0 &&
		      n_ok == 0,
		      "traffic: %d error completions: first %s, then only IBV_WC_WR_FLUSH_ERR (%d; %d other errors, "
		      "%d successes after the first error)",
		      n_err, first >= 0 ? wc_str(first) : "none", n_flush, n_other, n_ok);
	}
	if (mode == HOSTKILL)
		CHECK(first == IBV_WC_RETRY_EXC_ERR, "hostkill: the first error is IBV_WC_RETRY_EXC_ERR (%s)",
		      first >= 0 ? wc_str(first) : "none");
	if (traffic_ka) {
		int fired = atomic_load(&T->dead);
		measure("traffic_keepalive_fired", "%d", fired);
		if (fired)
			CHECK(T->dead_qp == T->id->qp && fired == 1,
			      "traffic: keepalive callback called once with the traffic QP");
		/*
		 * rxe reports a dead link through the QP (an error status), or
		 * stays silent and the keepalive moves the QP to error: then the
		 * first error is a flush. Nothing else moves it to error here.
		 */
		if (first == IBV_WC_WR_FLUSH_ERR)
			CHECK(fired == 1, "traffic: the first error is a flush, so the keepalive moved the QP to error "
			      "(fired %d)", fired);
		if (fired && t_fault > 0)
			measure("traffic_dead_after_fault_ms", "%.0f", us_to_ms(atomic_load(&T->t_dead_us)) - t_fault);
	}
	if (idle_ka) {
		struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
		double t_dead = us_to_ms(atomic_load(&K->t_dead_us));
		rdmasafe_cq_loop_get_stats(loop, &s);
		CHECK(atomic_load(&K->dead) == 1 && K->dead_qp == K->id->qp && K->dead_qpn == K->id->qp->qp_num,
		      "idle: keepalive callback called once (%d) with the idle QP (qp_num %u)",
		      atomic_load(&K->dead), K->dead_qpn);
		CHECK(s.keepalive_dead == 1, "idle: loop stats keepalive_dead %" PRIu64, s.keepalive_dead);
		CHECK(atomic_load(&K->recvs_done) == RECVS && atomic_load(&K->errors) == RECVS &&
		      atomic_load(&K->first_err_status) == IBV_WC_WR_FLUSH_ERR,
		      "idle: its %d receives flushed after the keepalive (%d completions, %d errors, first %s)",
		      RECVS, atomic_load(&K->recvs_done), atomic_load(&K->errors),
		      atomic_load(&K->first_err_status) >= 0 ? wc_str(atomic_load(&K->first_err_status)) : "none");
		measure("keepalive_probes", "%" PRIu64, s.keepalive_probes);
		measure("keepalive_probes_ok", "%" PRIu64, s.keepalive_probes_ok);
		if (t_fault > 0 && atomic_load(&K->dead))
			measure("dead_after_fault_ms", "%.0f", t_dead - t_fault);
		if (t_killed_seen > 0 && atomic_load(&K->dead))
			measure("dead_after_killed_seen_ms", "%.0f", t_dead - t_killed_seen);
		if (first >= 0 && atomic_load(&K->dead))
			measure("dead_before_retry_exc_ms", "%.0f", t_err - t_dead);
		measure("keepalive_period_ms", "%d", period);
		measure("keepalive_bound_ms", "%d", bound);
	}
	{
		int d = 0;
		for (int i = 0; i < ncm; i++) {
			info("CM event %s (status %d) on %s at %+.0f ms from the fault",
			     rdmasafe_event_str(cm[i].event), cm[i].status, cm[i].conn,
			     t_fault > 0 ? cm[i].t - t_fault : 0);
			if (cm[i].event == RDMA_CM_EVENT_DISCONNECTED && !d++) {
				if (t_fault > 0)
					measure("disconnected_after_fault_ms", "%.0f", cm[i].t - t_fault);
				if (t_last_ok > 0)
					measure("disconnected_after_last_ok_ms", "%.0f", cm[i].t - t_last_ok);
			}
		}
		measure("cm_events_during_fault", "%d", ncm);
		if (mode == PROCKILL)
			CHECK(T->disconnected, "prockill: RDMA_CM_EVENT_DISCONNECTED on the traffic connection");
	}
	{
		int na = atomic_load(&ar.n);
		measure("async_events", "%d", na);
		for (int i = 0; i < na; i++) {
			info("async event %s (kind %d, port %u) at %+.0f ms from the fault",
			     rdmasafe_async_event_str(ar.rec[i].ev.event_type), ar.rec[i].ev.element_kind,
			     ar.rec[i].ev.port_num, t_fault > 0 ? ar.rec[i].t - t_fault : 0);
		}
		if (mode == LINKFLAP) {
			int e = async_find(&ar, IBV_EVENT_PORT_ERR, 0);
			int a = async_find(&ar, IBV_EVENT_PORT_ACTIVE, e);
			CHECK(e >= 0 && ar.rec[e].ev.element_kind == RDMASAFE_ASYNC_PORT && ar.rec[e].ev.port_num == 1,
			      "linkflap: IBV_EVENT_PORT_ERR on port 1 via rdmasafe_async_get");
			CHECK(a >= 0 && ar.rec[a].ev.element_kind == RDMASAFE_ASYNC_PORT && ar.rec[a].ev.port_num == 1,
			      "linkflap: then IBV_EVENT_PORT_ACTIVE on port 1");
			if (e >= 0 && t_fault > 0)
				measure("port_err_after_fault_ms", "%.0f", ar.rec[e].t - t_fault);
			if (e >= 0 && first >= 0) {
				double d = t_err - ar.rec[e].t;
				measure("first_error_after_port_err_ms", "%.0f", d);
				/* how the app learnt it (reported; which comes first,
				 * rxe's retransmission timer or the keepalive's bound, is
				 * timing): rxe failed a send (status of its own), or rxe
				 * stayed silent and the keepalive moved the QP to error
				 * (the first error is a flush) */
				measure("error_path", "%s", first == IBV_WC_WR_FLUSH_ERR ? "keepalive"
							    : d < 1000			 ? "next_send"
											 : "retransmission");
			}
			if (e >= 0 && a >= 0)
				measure("port_active_after_port_err_ms", "%.0f", ar.rec[a].t - ar.rec[e].t);
			/* causality, whatever the timing: the port went down after the
			 * link did and came back after it was set up again (the
			 * stamps are taken before the ip commands) */
			if (e >= 0 && t_fault > 0)
				CHECK(ar.rec[e].t >= t_fault, "linkflap: PORT_ERR after the link went down (%+.0f ms)",
				      ar.rec[e].t - t_fault);
			double t_up = read_stamp_ms(upstamp);
			if (a >= 0 && t_up > 0) {
				measure("port_active_after_link_up_ms", "%.0f", ar.rec[a].t - t_up);
				CHECK(ar.rec[a].t >= t_up, "linkflap: PORT_ACTIVE after the link was set up (%+.0f ms)",
				      ar.rec[a].t - t_up);
			}
			if (a >= 0 && first >= 0)
				CHECK(t_err < ar.rec[a].t, "linkflap: the error completion (%+.0f ms) before PORT_ACTIVE",
				      t_err - ar.rec[a].t);
		}
	}

	/* ----------------------------------------------------------- teardown */
	phase = "survivor: teardown";
	alarm(90);
	double t_td = now_ms();
	r = loop_join(&lt);
	CHECK(r == 0, "rdmasafe_cq_loop_run returned %s after rdmasafe_cq_loop_stop", rname(r));
	for (int i = 0; i < nconns; i++)
		drain(&conns[i]);
	if (idle_ka) {
		r = rdmasafe_cq_loop_remove_keepalive(loop, K->id->qp);
		CHECK(r == 0, "idle: rdmasafe_cq_loop_remove_keepalive -> %s", rname(r));
	}
	if (traffic_ka) {
		r = rdmasafe_cq_loop_remove_keepalive(loop, T->id->qp);
		CHECK(r == 0, "traffic: rdmasafe_cq_loop_remove_keepalive -> %s", rname(r));
	}
	{
		struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
		print_loop_stats(loop, "survivor", &s);
		CHECK(s.unacked_now == 0, "survivor loop: unacked_now %" PRIu64 " after stop", s.unacked_now);
	}
	r = rdmasafe_cq_loop_destroy(loop);
	CHECK(r == 0, "rdmasafe_cq_loop_destroy -> %s", rname(r));
	loop = NULL;
	async_stop(&ar);
	for (int i = 0; i < nconns; i++)
		if (!conns[i].disconnected)
			rdma_disconnect(conns[i].id);
	if (mode == LINKFLAP) {
		/* the peer is reachable again: it answers our disconnect */
		struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_DISCONNECTED, T->id, 30000,
						  "linkflap: DISCONNECTED after our rdma_disconnect");
		if (ev)
			free_event(ev);
	}
	drop_events(ch);
	for (int i = 0; i < nconns; i++)
		destroy_conn(&conns[i]);
	destroy_context();
	drop_events(ch);
	rdma_destroy_event_channel(ch);
	measure("teardown_ms", "%.0f", now_ms() - t_td);
	check_counters_zero("survivor");
	check_no_cm_ids("survivor");
	return summary();
}

static void usage(void)
{
	fprintf(stderr, "usage: fault_node peer -p PORT [-a ADDR] [-n CONNS] [-L FILE] [-t SECS]\n"
			"       fault_node survivor -x hostkill|prockill|linkflap -p PORT [-a PEER]\n"
			"                  [-r RETRY] [-k] [-K] [-P PERIOD_MS] [-B BOUND_MS] [-F STAMP] [-U STAMP] [-W FILE]\n"
			"                  [-t SECS]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *addr = NULL, *marker = NULL, *stamp = NULL, *upstamp = NULL, *killed = NULL, *x = NULL;
	int port = 0, nconns = 1, secs = 60, retry = 6, idle_ka = 0, traffic_ka = 0, period = 200, bound = 2000, opt;
	enum mode mode = HOSTKILL;

	if (argc < 2)
		usage();
	optind = 2;
	while ((opt = getopt(argc, argv, "a:p:n:L:t:x:r:kKP:B:F:U:W:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'p': port = atoi(optarg); break;
		case 'n': nconns = atoi(optarg); break;
		case 'L': marker = optarg; break;
		case 't': secs = atoi(optarg); break;
		case 'x': x = optarg; break;
		case 'r': retry = atoi(optarg); break;
		case 'k': idle_ka = 1; break;
		case 'K': traffic_ka = 1; break;
		case 'P': period = atoi(optarg); break;
		case 'B': bound = atoi(optarg); break;
		case 'F': stamp = optarg; break;
		case 'U': upstamp = optarg; break;
		case 'W': killed = optarg; break;
		default: usage();
		}
	}
	if (port <= 0 || port > 65535 || nconns < 1 || nconns > MAX_CONNS)
		usage();
	watchdog_init("fault_node", (unsigned)secs + 120);
	if (!strcmp(argv[1], "peer")) {
		if (!addr)
			addr = getenv("RDMASAFE_TEST_ADDR");
		return run_peer(addr, (uint16_t)port, nconns, marker, secs);
	}
	if (strcmp(argv[1], "survivor") || !x)
		usage();
	if (!strcmp(x, "hostkill"))
		mode = HOSTKILL;
	else if (!strcmp(x, "prockill"))
		mode = PROCKILL;
	else if (!strcmp(x, "linkflap"))
		mode = LINKFLAP;
	else
		usage();
	if (!addr)
		addr = getenv("RDMASAFE_PEER_ADDR");
	if (!addr)
		addr = getenv("RDMASAFE_TEST_ADDR");
	return run_survivor(mode, addr, (uint16_t)port, retry, idle_ka, traffic_ka, period, bound, stamp, upstamp,
			    killed, secs);
}
