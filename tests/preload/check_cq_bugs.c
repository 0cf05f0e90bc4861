/*
 * check_cq_bugs: small libibverbs programs with (or without) a CQ event
 * handling bug, for librdmasafe-preload.so's check mode
 * (LD_PRELOAD=... RDMASAFE_CHECK=1 or =fix). Plain libibverbs.
 *
 *   check_cq_bugs -m MODE [-t WATCHDOG_S]
 *
 * Every mode opens the device in $RDMASAFE_TEST_DEVICE (or the first one),
 * makes two CQs, A and B, on one completion channel and an RC QP with A
 * as its send CQ and B as its receive CQ, moves the QP (through INIT) to
 * the error state,
 * arms A and posts a signaled send: it is flushed, so A gets a completion
 * and the channel one CQ event, for A (no peer, no network). It reads the
 * event (ibv_get_cq_event names A), polls the completion, and then:
 *   ok       acks it on A and tears down: correct, nothing is reported;
 *   unacked  destroys A without acking it: ibv_destroy_cq waits forever
 *            (with RDMASAFE_CHECK=fix the preload acks it, and it returns);
 *   wrongcq  acks it on B, then destroys A and B (both would wait forever);
 *   overack  acks A twice for its one event, then destroys A (waits
 *            forever: libibverbs waits until the acks equal the events).
 *
 * Prints each step, with the CQs' addresses as %p (as check mode's reports
 * name them), then "check_cq_bugs: done" and exits 0; 1 on a setup
 * failure; 3 from the SIGALRM watchdog.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static void on_alarm(int sig)
{
	static const char msg[] = "check_cq_bugs: watchdog expired\n";

	(void)sig;
	if (write(STDOUT_FILENO, msg, sizeof msg - 1) < 0)
		_exit(3);
	_exit(3);
}

static void die(const char *what, int err)
{
	printf("check_cq_bugs: %s: %s\n", what, strerror(err));
	exit(1);
}

static void destroy_cq(const char *name, struct ibv_cq *cq)
{
	int ret;

	printf("ibv_destroy_cq(%s %p)\n", name, (void *)cq);
	ret = ibv_destroy_cq(cq);
	if (ret)
		die("ibv_destroy_cq", ret);
	printf("ibv_destroy_cq(%s) returned 0\n", name);
}

int main(int argc, char **argv)
{
	const char *mode = NULL, *want = getenv("RDMASAFE_TEST_DEVICE");
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_pd *pd;
	struct ibv_comp_channel *chan;
	struct ibv_cq *a, *b, *evcq;
	struct ibv_qp *qp;
	struct ibv_qp_init_attr init = { 0 };
	struct ibv_qp_attr attr = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	struct ibv_send_wr wr = { .wr_id = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
	struct ibv_wc wc;
	void *evctx;
	int watchdog = 120, op, n, i;

	while ((op = getopt(argc, argv, "m:t:")) != -1) {
		switch (op) {
		case 'm':
			mode = optarg;
			break;
		case 't':
			watchdog = atoi(optarg);
			break;
		default:
			return 2;
		}
	}
	if (!mode || (strcmp(mode, "ok") && strcmp(mode, "unacked") && strcmp(mode, "wrongcq") &&
		      strcmp(mode, "overack"))) {
		printf("usage: check_cq_bugs -m ok|unacked|wrongcq|overack\n");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(watchdog);

	list = ibv_get_device_list(&n);
	if (!list || n < 1)
		die("ibv_get_device_list", errno ? errno : ENODEV);
	for (i = 0; i < n && !ctx; i++)
		if (!want || !*want || !strcmp(ibv_get_device_name(list[i]), want))
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx)
		die("ibv_open_device", errno ? errno : ENODEV);
	pd = ibv_alloc_pd(ctx);
	chan = ibv_create_comp_channel(ctx);
	if (!pd || !chan)
		die("ibv_alloc_pd / ibv_create_comp_channel", errno);
	a = ibv_create_cq(ctx, 4, NULL, chan, 0);
	b = ibv_create_cq(ctx, 4, NULL, chan, 0);
	if (!a || !b)
		die("ibv_create_cq", errno);
	printf("CQ A %p and CQ B %p on one completion channel\n", (void *)a, (void *)b);
	init.send_cq = a;
	init.recv_cq = b;
	init.qp_type = IBV_QPT_RC;
	init.cap.max_send_wr = 2;
	init.cap.max_recv_wr = 2;
	init.cap.max_send_sge = 1;
	init.cap.max_recv_sge = 1;
	qp = ibv_create_qp(pd, &init);
	if (!qp)
		die("ibv_create_qp", errno);
	/* RESET -> INIT -> ERR (rxe refuses RESET -> ERR) */
	if ((i = ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
		die("ibv_modify_qp(INIT)", i);
	attr.qp_state = IBV_QPS_ERR;
	if ((i = ibv_modify_qp(qp, &attr, IBV_QP_STATE)))
		die("ibv_modify_qp(ERR)", i);
	if ((i = ibv_req_notify_cq(a, 0)))
		die("ibv_req_notify_cq", i);
	if ((i = ibv_post_send(qp, &wr, &bad)))
		die("ibv_post_send", i);
	if (ibv_get_cq_event(chan, &evcq, &evctx))
		die("ibv_get_cq_event", errno);
	printf("CQ event for %s\n", evcq == a ? "A" : evcq == b ? "B" : "an unknown CQ");
	if (evcq != a)
		return 1;
	do
		n = ibv_poll_cq(a, 1, &wc);
	while (n == 0);
	if (n < 0)
		die("ibv_poll_cq", EIO);
	printf("completion wr_id %llu status %s\n", (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));

	if (!strcmp(mode, "ok")) {
		ibv_ack_cq_events(a, 1);
		printf("acked the event on A\n");
	} else if (!strcmp(mode, "unacked")) {
		printf("not acking the event\n");
	} else if (!strcmp(mode, "wrongcq")) {
		ibv_ack_cq_events(b, 1);
		printf("acked the event on B (the wrong CQ)\n");
	} else {
		ibv_ack_cq_events(a, 2);
		printf("acked A twice for its one event\n");
	}
	if ((i = ibv_destroy_qp(qp)))
		die("ibv_destroy_qp", i);
	destroy_cq("A", a);
	destroy_cq("B", b);
	if ((i = ibv_destroy_comp_channel(chan)))
		die("ibv_destroy_comp_channel", i);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("check_cq_bugs: done\n");
	return 0;
}
