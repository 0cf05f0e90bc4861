/*
 * fault_devremove: `rdma link delete` of the device under live connections
 * and a running CQ loop, through the rdmasafe C API.
 *
 *   fault_devremove [-a ADDR] [-n CONNS] [-F STAMP] [-t SECS]
 *
 * One process, one device ($RDMASAFE_TEST_ADDR): a listener, CONNS
 * (default 2) connections to itself, so 2*CONNS+1 ids (listener, client and
 * accepted ids) on two CM channels; every CQ in one CQ loop running on a
 * pthread; SENDs flowing client -> server; async events read with
 * rdmasafe_async_get on another thread. After "fault_devremove: traffic
 * flowing" the guest script writes the moment (a /proc/uptime copy) to
 * STAMP and runs `rdma link delete rxe0` in the background.
 *
 * Expected: RDMA_CM_EVENT_DEVICE_REMOVAL exactly once on every id, listener
 * included. Then the app tears down: stop the loop, drain every QP, destroy
 * the loop, QPs, CQs, ids, channels, PD; every call must return (watchdog),
 * loop unacked_now 0, cm counters outstanding 0, no cm_id of this process
 * left. The delete itself finishes only once the process has exited
 * (librdmacm keeps the device open); the script measures that.
 */
#include "fault_common.h"
#include "fault_conn.h"

struct idrec {
	struct rdma_cm_id *id;
	const char *what;
	int removals;
	double t_removal;
};

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR"), *stamp = NULL;
	int nconn = 2, secs = 60, opt, r;
	struct rdma_event_channel *chs, *chc;
	struct rdma_cm_id *listener = NULL;
	struct sockaddr_storage ss;
	struct conn cli[MAX_CONNS], srv[MAX_CONNS];
	struct idrec ids[2 * MAX_CONNS + 1];
	int nids = 0, flowing = 0, removals = 0, other_events = 0;
	struct async_reader ar;
	struct loop_thread lt;
	double deadline, next_send = 0, t_first = -1, t_last = -1;
	uint16_t port;

	while ((opt = getopt(argc, argv, "a:n:F:t:")) != -1) {
		switch (opt) {
		case 'a': addr = optarg; break;
		case 'n': nconn = atoi(optarg); break;
		case 'F': stamp = optarg; break;
		case 't': secs = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: fault_devremove [-a ADDR] [-n CONNS] [-F STAMP] [-t SECS]\n");
			return 2;
		}
	}
	if (nconn < 1 || nconn > MAX_CONNS)
		return 2;
	watchdog_init("fault_devremove", (unsigned)secs + 120);
	memset(cli, 0, sizeof cli);
	memset(srv, 0, sizeof srv);
	memset(&lt, 0, sizeof lt);

	phase = "setup";
	chs = new_channel(1);
	chc = new_channel(1);
	if (!CHECK(chs && chc && parse_addr(addr, 0, &ss) == 0, "channels and address %s", addr ? addr : "?"))
		return summary();
	if (!CHECK(rdma_create_id(chs, &listener, NULL, RDMA_PS_TCP) == 0, "listener: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, (struct sockaddr *)&ss) == 0, "listener: rdma_bind_addr") ||
	    !CHECK(rdma_listen(listener, 8) == 0, "listener: rdma_listen") ||
	    make_context(listener->verbs))
		return summary();
	port = ntohs(rdma_get_src_port(listener));
	parse_addr(addr, port, &ss);
	ids[nids++] = (struct idrec){ listener, "listener", 0, 0 };

	for (int i = 0; i < nconn; i++) {
		struct rdma_conn_param p;
		struct rdma_cm_event *ev;

		cli[i].name = "client";
		srv[i].name = "server";
		atomic_store(&cli[i].first_err_status, -1);
		atomic_store(&srv[i].first_err_status, -1);
		if (!CHECK(rdma_create_id(chc, &cli[i].id, NULL, RDMA_PS_TCP) == 0, "client %d: rdma_create_id", i) ||
		    resolve(chc, cli[i].id, &ss, "client") || setup_qp(&cli[i], RECVS))
			return summary();
		conn_param(&p, NULL, 0, 6);
		if (!CHECK(rdma_connect(cli[i].id, &p) == 0, "client %d: rdma_connect", i))
			return summary();
		if (!(ev = expect(chs, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, STEP_MS, "server: connect request")))
			return summary();
		srv[i].id = ev->id;
		free_event(ev);
		if (setup_qp(&srv[i], PEER_RECVS) ||
		    !CHECK(rdma_accept(srv[i].id, &p) == 0, "server %d: rdma_accept", i))
			return summary();
		if (!(ev = expect(chc, RDMA_CM_EVENT_ESTABLISHED, cli[i].id, STEP_MS, "client: established")))
			return summary();
		free_event(ev);
		if (!(ev = expect(chs, RDMA_CM_EVENT_ESTABLISHED, srv[i].id, STEP_MS, "server: established")))
			return summary();
		free_event(ev);
		ids[nids++] = (struct idrec){ cli[i].id, "client", 0, 0 };
		ids[nids++] = (struct idrec){ srv[i].id, "accepted", 0, 0 };
	}
	if (!CHECK(async_start(&ar, listener->verbs) == 0, "async event thread") ||
	    !CHECK(loop_start(&lt, loop) == 0, "CQ loop thread"))
		return summary();
	info("%d ids: listener on port %u, %d connections; CQ loop running", nids, port, nconn);

	phase = "traffic, then device removal";
	deadline = now_ms() + secs * 1e3;
	while (removals < nids && now_ms() < deadline) {
		struct pollfd pfd[2] = { { chs->fd, POLLIN, 0 }, { chc->fd, POLLIN, 0 } };
		struct rdma_cm_event *ev;
		double t;

		poll(pfd, 2, PACE_MS);
		for (int k = 0; k < 2; k++) {
			while (rdmasafe_get_event(k ? chc : chs, &ev) == 0) {
				struct idrec *rec = NULL;
				t = now_ms();
				for (int j = 0; j < nids; j++)
					if (ids[j].id == ev->id)
						rec = &ids[j];
				info("CM %s (status %d) on %s id", rdmasafe_event_str(ev->event), ev->status,
				     rec ? rec->what : "an unknown");
				if (ev->event == RDMA_CM_EVENT_DEVICE_REMOVAL && rec) {
					if (!rec->removals++) {
						rec->t_removal = t;
						removals++;
					}
					if (t_first < 0)
						t_first = t;
					t_last = t;
				} else {
					other_events++;
				}
				free_event(ev);
			}
		}
		t = now_ms();
		if (removals == 0 && t >= next_send) {
			/* one send per connection per PACE_MS, at most WINDOW outstanding */
			for (int i = 0; i < nconn; i++)
				if (atomic_load(&cli[i].sends_posted) - atomic_load(&cli[i].sends_done) < WINDOW &&
				    !atomic_load(&cli[i].errors))
					post_send(&cli[i]);
			next_send = t + PACE_MS;
		}
		if (!flowing) {
			int ok = 1;
			for (int i = 0; i < nconn; i++)
				ok &= atomic_load(&srv[i].msgs) >= FLOWING_AFTER;
			if (ok) {
				flowing = 1;
				milestone("traffic flowing");
			}
		}
	}
	CHECK(flowing, "traffic flowed before the removal");
	{
		int once = 1;
		for (int j = 0; j < nids; j++)
			once &= ids[j].removals == 1;
		CHECK(removals == nids && once,
		      "RDMA_CM_EVENT_DEVICE_REMOVAL exactly once on each of the %d ids (listener, %d client, %d accepted): %d",
		      nids, nconn, nconn, removals);
	}
	double t_stamp = read_stamp_ms(stamp);
	measure("ids", "%d", nids);
	measure("removal_events", "%d", removals);
	measure("other_cm_events", "%d", other_events);
	if (t_stamp > 0 && t_first > 0) {
		measure("first_removal_after_delete_ms", "%.0f", t_first - t_stamp);
		measure("last_removal_after_delete_ms", "%.0f", t_last - t_stamp);
	}
	{
		int na = atomic_load(&ar.n);
		measure("async_events", "%d", na);
		for (int i = 0; i < na; i++)
			info("async event %s (kind %d) at %+.0f ms from the delete",
			     rdmasafe_async_event_str(ar.rec[i].ev.event_type), ar.rec[i].ev.element_kind,
			     t_stamp > 0 ? ar.rec[i].t - t_stamp : 0);
	}
	{
		int errs = 0, sent = 0, got = 0;
		for (int i = 0; i < nconn; i++) {
			errs += atomic_load(&cli[i].errors) + atomic_load(&srv[i].errors);
			sent += atomic_load(&cli[i].oks);
			got += atomic_load(&srv[i].msgs);
		}
		measure("sends_ok", "%d", sent);
		measure("messages_received", "%d", got);
		measure("error_completions_before_teardown", "%d", errs);
	}

	phase = "teardown after device removal";
	alarm(90);
	double t_td = now_ms();
	r = loop_join(&lt);
	CHECK(r == 0, "rdmasafe_cq_loop_run returned %s after rdmasafe_cq_loop_stop", rname(r));
	for (int i = 0; i < nconn; i++) {
		drain(&cli[i]);
		drain(&srv[i]);
	}
	{
		struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
		print_loop_stats(loop, "devremove", &s);
		CHECK(s.unacked_now == 0, "loop: unacked_now %" PRIu64 " after stop", s.unacked_now);
	}
	r = rdmasafe_cq_loop_destroy(loop);
	CHECK(r == 0, "rdmasafe_cq_loop_destroy -> %s", rname(r));
	loop = NULL;
	async_stop(&ar);
	drop_events(chs);
	drop_events(chc);
	for (int i = 0; i < nconn; i++) {
		destroy_conn(&cli[i]);
		destroy_conn(&srv[i]);
	}
	CHECK(rdma_destroy_id(listener) == 0, "listener: rdma_destroy_id");
	destroy_context();
	CHECK(drop_events(chs) + drop_events(chc) == 0, "no CM event after the ids were destroyed");
	rdma_destroy_event_channel(chs);
	rdma_destroy_event_channel(chc);
	measure("teardown_ms", "%.0f", now_ms() - t_td);
	check_counters_zero("devremove");
	check_no_cm_ids("devremove");
	return summary();
}
