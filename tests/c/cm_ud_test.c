/*
 * cm_ud_test: a udaddy-style UD exchange, written as a librdmacm program
 * that switched to rdmasafe by renaming its two calls: events are taken
 * with rdmasafe_get_event and given back with rdmasafe_event_free, and
 * nothing else of rdmasafe is used. Built with -DRAW the same source
 * calls rdma_get_cm_event / rdma_ack_cm_event instead: the control, run
 * with the same checks.
 *
 * On the device at $RDMASAFE_TEST_ADDR (rxe0 in the test guest), in one
 * process, one thread: a listener and a client, both RDMA_PS_UDP.
 *  - client: resolve address and route, UD QP (librdmacm gives it qkey
 *    0x01234567), rdma_connect with 180 bytes of private data (a SIDR REQ
 *    carries 216, 36 of them the CMA header);
 *  - server: CONNECT_REQUEST with param.ud: the listener as listen_id, a
 *    new UDP id carrying the listener's context, the 180 bytes; UD QP on
 *    the new id, rdma_accept with its qp_num and 136 bytes (a SIDR REP's
 *    private data);
 *  - client: ESTABLISHED with param.ud: every field checked against what
 *    it must be (qp_num = the server QP's number read from the QP itself,
 *    qkey 0x01234567, the 136 bytes, ah_attr naming the server's GID on
 *    this port); then ibv_create_ah from the copy's ah_attr and one UD
 *    SEND to the copy's qp_num / qkey;
 *  - server: receives it from the client's QP, answers through an AH
 *    built from the work completion (as udaddy does);
 *  - client: receives the answer; ibv_init_ah_from_wc of it must name the
 *    same GID, GID index and port as the ESTABLISHED copy's ah_attr.
 *
 * Prints one line per check ("ok   ..." or "FAIL ..."), "info" lines with
 * the raw field values, then "cm_ud_test: N passed, M failed"; exits 0 only
 * if M is 0. A SIGALRM watchdog turns a hang into a failure (exit 3).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

#ifdef RAW
/* the program as it was before the switch */
#define rdmasafe_get_event rdma_get_cm_event
#define rdmasafe_event_free rdma_ack_cm_event
#define BUILD "raw librdmacm"
#else
#include "rdmasafe.h"
#define BUILD "rdmasafe"
#endif

#define UDP_QKEY 0x01234567u /* librdmacm's qkey for RDMA_PS_UDP ids */
#define REQ_PDATA 180	     /* SIDR REQ private data after the CMA header */
#define REP_PDATA 136	     /* SIDR REP private data */
#define MSG_SIZE 64
#define GRH_SIZE 40 /* a UD receive starts with room for the GRH */
#define STEP_MS 30000 /* how long any one expected event may take (turns a hang into a failure) */

/* ---------------------------------------------------------------- output */

static const char *gid_str(const union ibv_gid *g, char *buf, size_t len)
{
	return inet_ntop(AF_INET6, g->raw, buf, len) ? buf : "?";
}

/* ---------------------------------------------------------------- helpers */

static uint8_t pat(unsigned seed, unsigned i)
{
	return (uint8_t)(seed * 31u + i * 5u + (i >> 3) + 1u);
}

static void fill(uint8_t *buf, unsigned seed, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		buf[i] = pat(seed, i);
}

/* index of the first byte that is not pattern `seed`, or n */
static unsigned mismatch(const void *data, unsigned seed, unsigned n)
{
	const uint8_t *p = data;
	unsigned i;

	for (i = 0; i < n; i++)
		if (p[i] != pat(seed, i))
			break;
	return i;
}

static struct sockaddr_storage test_addr;
static union ibv_gid test_gid; /* the GID rxe gives test_addr */

static int parse_addr(const char *s)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;
	int r = getaddrinfo(s, NULL, &hints, &res);

	if (r) {
		fprintf(stderr, "getaddrinfo(%s): %s\n", s, gai_strerror(r));
		return -1;
	}
	memcpy(&test_addr, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	memset(&test_gid, 0, sizeof test_gid);
	if (test_addr.ss_family == AF_INET) {
		/* RoCE: an IPv4 address is the IPv4-mapped IPv6 GID */
		test_gid.raw[10] = test_gid.raw[11] = 0xff;
		memcpy(&test_gid.raw[12], &((struct sockaddr_in *)&test_addr)->sin_addr, 4);
	} else {
		memcpy(test_gid.raw, &((struct sockaddr_in6 *)&test_addr)->sin6_addr, 16);
	}
	return 0;
}

static struct sockaddr *addr_port(struct sockaddr_storage *ss, uint16_t port)
{
	memcpy(ss, &test_addr, sizeof *ss);
	if (ss->ss_family == AF_INET)
		((struct sockaddr_in *)ss)->sin_port = htons(port);
	else
		((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
	return (struct sockaddr *)ss;
}

/*
 * The next event on ch, which must be `type` (on `id`, if given); waits
 * with poll() on the channel's fd so a missing event is a failure, not a
 * hang. Returns the event (caller frees it) or NULL after a failed check.
 */
static struct rdma_cm_event *next_event(struct rdma_event_channel *ch, int type,
					struct rdma_cm_id *id, const char *what)
{
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *ev = NULL;
	int r;

	r = poll(&pfd, 1, STEP_MS);
	if (!CHECK(r == 1, "%s: an event within %d ms (poll -> %d)", what, STEP_MS, r))
		return NULL;
	r = rdmasafe_get_event(ch, &ev);
	if (!CHECK(r == 0 && ev, "%s: rdmasafe_get_event -> %d (%s)", what, r, r ? ename(errno) : "0"))
		return NULL;
	if (!CHECK((int)ev->event == type && (!id || ev->id == id),
		   "%s: %s status %d (want %s%s)", what, rdma_event_str(ev->event),
		   ev->status, rdma_event_str(type), id && ev->id != id ? " on its id" : "")) {
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

static void free_event(struct rdma_cm_event *ev, const char *what)
{
	int r = rdmasafe_event_free(ev);

	CHECK(r == 0, "%s: event freed -> %d", what, r);
}

/* The qkey of a UD QP (ibv_query_qp), 0 if the query fails. */
static uint32_t qp_qkey(struct ibv_qp *qp)
{
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;

	memset(&qa, 0, sizeof qa);
	return ibv_query_qp(qp, &qa, IBV_QP_QKEY, &qia) ? 0 : qa.qkey;
}

/* ------------------------------------------------------------------ nodes */

struct node {
	const char *name;
	struct rdma_cm_id *id;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct ibv_ah *ah;
	uint8_t send_buf[MSG_SIZE];
	uint8_t recv_buf[GRH_SIZE + MSG_SIZE];
};

/* PD, CQ, UD QP (rdma_create_qp), one MR over both buffers' struct */
static int node_init(struct node *n)
{
	struct ibv_qp_init_attr attr;

	n->pd = ibv_alloc_pd(n->id->verbs);
	n->cq = n->pd ? ibv_create_cq(n->id->verbs, 8, n, NULL, 0) : NULL;
	if (!n->cq)
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_UD;
	attr.send_cq = attr.recv_cq = n->cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 2;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.sq_sig_all = 1;
	attr.qp_context = n;
	if (rdma_create_qp(n->id, n->pd, &attr))
		return -1;
	n->mr = ibv_reg_mr(n->pd, n, sizeof *n, IBV_ACCESS_LOCAL_WRITE);
	return n->mr ? 0 : -1;
}

static void node_free(struct node *n)
{
	if (n->ah)
		ibv_destroy_ah(n->ah);
	if (n->id && n->id->qp)
		rdma_destroy_qp(n->id);
	if (n->mr)
		ibv_dereg_mr(n->mr);
	if (n->cq)
		ibv_destroy_cq(n->cq);
	if (n->pd)
		ibv_dealloc_pd(n->pd);
	n->ah = NULL;
	n->mr = NULL;
	n->cq = NULL;
	n->pd = NULL;
}

static int post_recv(struct node *n)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)n->recv_buf,
		.length = sizeof n->recv_buf,
		.lkey = n->mr->lkey,
	};
	struct ibv_recv_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad;

	memset(n->recv_buf, 0, sizeof n->recv_buf);
	return ibv_post_recv(n->id->qp, &wr, &bad);
}

static int post_send(struct node *n, struct ibv_ah *ah, uint32_t qpn,
		     uint32_t qkey, unsigned seed)
{
	struct ibv_sge sge = {
		.addr = (uintptr_t)n->send_buf,
		.length = sizeof n->send_buf,
		.lkey = n->mr->lkey,
	};
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;

	fill(n->send_buf, seed, sizeof n->send_buf);
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.ud.ah = ah;
	wr.wr.ud.remote_qpn = qpn;
	wr.wr.ud.remote_qkey = qkey;
	return ibv_post_send(n->id->qp, &wr, &bad);
}

/* The next completion of n's CQ within STEP_MS; 0 if one came. */
static int wait_wc(struct node *n, struct ibv_wc *wc)
{
	double end = now_ms() + STEP_MS;

	do {
		int r = ibv_poll_cq(n->cq, 1, wc);
		if (r)
			return r == 1 ? 0 : -1;
		usleep(100);
	} while (now_ms() < end);
	return -1;
}

static void expect_send_done(struct node *n)
{
	struct ibv_wc wc;

	if (CHECK(wait_wc(n, &wc) == 0, "%s: send completion", n->name))
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.wr_id == 1,
		      "%s: send completed: %s, opcode %d", n->name,
		      ibv_wc_status_str(wc.status), wc.opcode);
}

/* A receive of MSG_SIZE pattern-`seed` bytes from QP `src_qp`. */
static int expect_recv(struct node *n, unsigned seed, uint32_t src_qp, struct ibv_wc *wc)
{
	unsigned bad;

	if (!CHECK(wait_wc(n, wc) == 0, "%s: receive completion", n->name))
		return -1;
	if (!CHECK(wc->status == IBV_WC_SUCCESS && wc->opcode == IBV_WC_RECV && wc->wr_id == 2,
		   "%s: receive: %s, opcode %d", n->name, ibv_wc_status_str(wc->status), wc->opcode))
		return -1;
	CHECK(wc->byte_len == GRH_SIZE + MSG_SIZE, "%s: received %u bytes (GRH + %d)",
	      n->name, wc->byte_len, MSG_SIZE);
	CHECK(wc->wc_flags & IBV_WC_GRH, "%s: the receive has a GRH", n->name);
	CHECK(wc->src_qp == src_qp, "%s: the message came from QP %u (want %u)",
	      n->name, wc->src_qp, src_qp);
	bad = mismatch(n->recv_buf + GRH_SIZE, seed, MSG_SIZE);
	CHECK(bad == MSG_SIZE, "%s: all %d payload bytes match (first mismatch %u)",
	      n->name, MSG_SIZE, bad);
	return 0;
}

static void print_ah(const char *what, const struct ibv_ah_attr *a)
{
	char g[INET6_ADDRSTRLEN];

	info("%s: ah_attr is_global %u dgid %s sgid_index %u hop_limit %u traffic_class %u flow_label %u dlid %u sl %u src_path_bits %u static_rate %u port_num %u",
	     what, a->is_global, gid_str(&a->grh.dgid, g, sizeof g), a->grh.sgid_index,
	     a->grh.hop_limit, a->grh.traffic_class, a->grh.flow_label, a->dlid, a->sl,
	     a->src_path_bits, a->static_rate, a->port_num);
}

/* ------------------------------------------------------------------- test */

static int server_ctx, client_ctx; /* the ids' context pointers */

static void run(void)
{
	struct rdma_event_channel *sch = NULL, *cch = NULL;
	struct rdma_cm_id *listener = NULL;
	struct node srv = { .name = "server" }, cli = { .name = "client" };
	struct rdma_cm_event *ev;
	struct rdma_conn_param p;
	struct sockaddr_storage ss;
	struct ibv_ah_attr est_ah;
	struct ibv_wc wc;
	uint8_t hello[REQ_PDATA], welcome[REP_PDATA];
	uint32_t remote_qpn = 0, remote_qkey = 0, qkey;
	char g[INET6_ADDRSTRLEN], g2[INET6_ADDRSTRLEN];
	uint16_t port;
	unsigned bad;

	phase = "set-up";
	sch = rdma_create_event_channel();
	cch = rdma_create_event_channel();
	if (!CHECK(sch && cch, "two event channels"))
		goto out;
	if (!CHECK(rdma_create_id(sch, &listener, &server_ctx, RDMA_PS_UDP) == 0, "listener: rdma_create_id(RDMA_PS_UDP)") ||
	    !CHECK(rdma_bind_addr(listener, addr_port(&ss, 0)) == 0, "listener: rdma_bind_addr") ||
	    !CHECK(rdma_listen(listener, 4) == 0, "listener: rdma_listen"))
		goto out;
	port = ntohs(rdma_get_src_port(listener));
	info("build %s: UD listener on port %u", BUILD, port);

	phase = "client: resolve";
	if (!CHECK(rdma_create_id(cch, &cli.id, &client_ctx, RDMA_PS_UDP) == 0, "client: rdma_create_id(RDMA_PS_UDP)"))
		goto out;
	if (!CHECK(rdma_resolve_addr(cli.id, NULL, addr_port(&ss, port), 2000) == 0, "client: rdma_resolve_addr"))
		goto out;
	if (!(ev = next_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED, cli.id, "client: address")))
		goto out;
	free_event(ev, "client: ADDR_RESOLVED");
	if (!CHECK(rdma_resolve_route(cli.id, 2000) == 0, "client: rdma_resolve_route"))
		goto out;
	if (!(ev = next_event(cch, RDMA_CM_EVENT_ROUTE_RESOLVED, cli.id, "client: route")))
		goto out;
	free_event(ev, "client: ROUTE_RESOLVED");
	if (!CHECK(node_init(&cli) == 0, "client: PD, CQ, UD QP (rdma_create_qp), MR"))
		goto out;
	qkey = qp_qkey(cli.id->qp);
	CHECK(qkey == UDP_QKEY, "client: librdmacm gave the UD QP qkey 0x%08x", qkey);
	CHECK(post_recv(&cli) == 0, "client: receive posted");

	phase = "client: connect";
	fill(hello, 1, sizeof hello);
	memset(&p, 0, sizeof p);
	p.private_data = hello;
	p.private_data_len = sizeof hello;
	if (!CHECK(rdma_connect(cli.id, &p) == 0, "client: rdma_connect with %d bytes of private data", REQ_PDATA))
		goto out;

	phase = "server: connect request";
	if (!(ev = next_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, "server: request")))
		goto out;
	srv.id = ev->id;
	info("server: CONNECT_REQUEST param.ud private_data_len %u qp_num %u qkey 0x%08x",
	     ev->param.ud.private_data_len, ev->param.ud.qp_num, ev->param.ud.qkey);
	print_ah("server: CONNECT_REQUEST", &ev->param.ud.ah_attr);
	CHECK(ev->status == 0, "server: CONNECT_REQUEST status %d", ev->status);
	CHECK(ev->listen_id == listener, "server: CONNECT_REQUEST listen_id is the listener");
	CHECK(srv.id && srv.id != listener && srv.id != cli.id, "server: CONNECT_REQUEST id is a new id");
	CHECK(srv.id && srv.id->ps == RDMA_PS_UDP && srv.id->qp_type == IBV_QPT_UD,
	      "server: the new id is RDMA_PS_UDP / IBV_QPT_UD");
	CHECK(srv.id && srv.id->context == &server_ctx, "server: the new id carries the listener's context");
	CHECK(srv.id && srv.id->verbs == listener->verbs, "server: the new id is on the listener's device");
	CHECK(ev->param.ud.private_data_len == REQ_PDATA,
	      "server: CONNECT_REQUEST param.ud.private_data_len is %u (want %d)",
	      ev->param.ud.private_data_len, REQ_PDATA);
	bad = ev->param.ud.private_data ? mismatch(ev->param.ud.private_data, 1, REQ_PDATA) : 0;
	CHECK(bad == REQ_PDATA, "server: CONNECT_REQUEST private data: all %d bytes match (first mismatch %u)",
	      REQ_PDATA, bad);
	/* a SIDR REQ carries neither: the kernel reports 0 for both */
	CHECK(ev->param.ud.qp_num == 0 && ev->param.ud.qkey == 0,
	      "server: CONNECT_REQUEST param.ud qp_num %u, qkey 0x%x (a SIDR REQ carries neither: 0, 0)",
	      ev->param.ud.qp_num, ev->param.ud.qkey);
	if (!CHECK(node_init(&srv) == 0, "server: PD, CQ, UD QP on the new id, MR")) {
		rdmasafe_event_free(ev);
		goto out;
	}
	CHECK(post_recv(&srv) == 0, "server: receive posted");
	fill(welcome, 2, sizeof welcome);
	memset(&p, 0, sizeof p);
	p.qp_num = srv.id->qp->qp_num;
	p.private_data = welcome;
	p.private_data_len = sizeof welcome;
	CHECK(rdma_accept(srv.id, &p) == 0, "server: rdma_accept with qp_num %u and %d bytes",
	      p.qp_num, REP_PDATA);
	free_event(ev, "server: CONNECT_REQUEST");

	phase = "client: established";
	if (!(ev = next_event(cch, RDMA_CM_EVENT_ESTABLISHED, cli.id, "client: established")))
		goto out;
	info("client: ESTABLISHED param.ud private_data_len %u qp_num %u qkey 0x%08x",
	     ev->param.ud.private_data_len, ev->param.ud.qp_num, ev->param.ud.qkey);
	print_ah("client: ESTABLISHED", &ev->param.ud.ah_attr);
	CHECK(ev->status == 0, "client: ESTABLISHED status %d", ev->status);
	CHECK(ev->listen_id == NULL, "client: ESTABLISHED listen_id is NULL");
	CHECK(ev->id->context == &client_ctx, "client: ESTABLISHED id carries the client's context");
	CHECK(ev->param.ud.qp_num == srv.id->qp->qp_num,
	      "client: ESTABLISHED param.ud.qp_num %u is the server QP's number %u",
	      ev->param.ud.qp_num, srv.id->qp->qp_num);
	CHECK(ev->param.ud.qkey == UDP_QKEY, "client: ESTABLISHED param.ud.qkey 0x%08x (want 0x%08x)",
	      ev->param.ud.qkey, UDP_QKEY);
	CHECK(ev->param.ud.private_data_len == REP_PDATA,
	      "client: ESTABLISHED param.ud.private_data_len is %u (want %d)",
	      ev->param.ud.private_data_len, REP_PDATA);
	bad = ev->param.ud.private_data ? mismatch(ev->param.ud.private_data, 2, REP_PDATA) : 0;
	CHECK(bad == REP_PDATA, "client: ESTABLISHED private data: all %d bytes match (first mismatch %u)",
	      REP_PDATA, bad);
	{
		const struct ibv_ah_attr *a = &ev->param.ud.ah_attr;
		union ibv_gid sgid;

		CHECK(a->is_global == 1, "client: ah_attr.is_global is 1 (RoCE)");
		CHECK(!memcmp(a->grh.dgid.raw, test_gid.raw, 16), "client: ah_attr.grh.dgid %s is the server's GID %s",
		      gid_str(&a->grh.dgid, g, sizeof g), gid_str(&test_gid, g2, sizeof g2));
		CHECK(ibv_query_gid(cli.id->verbs, cli.id->port_num, a->grh.sgid_index, &sgid) == 0 &&
			      !memcmp(sgid.raw, test_gid.raw, 16),
		      "client: ah_attr.grh.sgid_index %u is this port's GID for the address", a->grh.sgid_index);
		CHECK(a->port_num == cli.id->port_num, "client: ah_attr.port_num %u is the id's port %u",
		      a->port_num, cli.id->port_num);
		CHECK(a->dlid == 0 && a->src_path_bits == 0, "client: ah_attr dlid %u, src_path_bits %u (RoCE: 0, 0)",
		      a->dlid, a->src_path_bits);
		CHECK(a->grh.hop_limit > 0, "client: ah_attr.grh.hop_limit %u is not 0", a->grh.hop_limit);
	}
	est_ah = ev->param.ud.ah_attr;
	remote_qpn = ev->param.ud.qp_num;
	remote_qkey = ev->param.ud.qkey;
	cli.ah = ibv_create_ah(cli.pd, &ev->param.ud.ah_attr);
	CHECK(cli.ah != NULL, "client: ibv_create_ah from the ESTABLISHED event's ah_attr (%s)",
	      cli.ah ? "0" : ename(errno));
	free_event(ev, "client: ESTABLISHED");
	if (!cli.ah)
		goto out;

	phase = "client -> server";
	CHECK(post_send(&cli, cli.ah, remote_qpn, remote_qkey, 3) == 0,
	      "client: UD SEND through the AH to qp_num %u qkey 0x%08x", remote_qpn, remote_qkey);
	expect_send_done(&cli);
	if (expect_recv(&srv, 3, cli.id->qp->qp_num, &wc))
		goto out;

	phase = "server -> client";
	srv.ah = ibv_create_ah_from_wc(srv.pd, &wc, (struct ibv_grh *)srv.recv_buf, srv.id->port_num);
	if (!CHECK(srv.ah != NULL, "server: ibv_create_ah_from_wc of the client's message"))
		goto out;
	qkey = qp_qkey(srv.id->qp);
	CHECK(qkey == UDP_QKEY, "server: its UD QP's qkey 0x%08x", qkey);
	CHECK(post_send(&srv, srv.ah, wc.src_qp, qkey, 4) == 0, "server: UD SEND back to QP %u", wc.src_qp);
	expect_send_done(&srv);
	if (expect_recv(&cli, 4, srv.id->qp->qp_num, &wc) == 0) {
		struct ibv_ah_attr from_wc;

		if (CHECK(ibv_init_ah_from_wc(cli.id->verbs, cli.id->port_num, &wc,
					      (struct ibv_grh *)cli.recv_buf, &from_wc) == 0,
			  "client: ibv_init_ah_from_wc of the server's answer")) {
			print_ah("client: from the answer's work completion", &from_wc);
			CHECK(from_wc.is_global == est_ah.is_global &&
				      !memcmp(from_wc.grh.dgid.raw, est_ah.grh.dgid.raw, 16) &&
				      from_wc.grh.sgid_index == est_ah.grh.sgid_index &&
				      from_wc.port_num == est_ah.port_num && from_wc.dlid == est_ah.dlid,
			      "client: the answer's address (GID, GID index, port, dlid) is the ESTABLISHED ah_attr's");
		}
	}

out:
	phase = "teardown";
	alarm(60);
	node_free(&cli);
	node_free(&srv);
	if (cli.id)
		CHECK(rdma_destroy_id(cli.id) == 0, "client: rdma_destroy_id");
	if (srv.id)
		CHECK(rdma_destroy_id(srv.id) == 0, "server: rdma_destroy_id of the accepted id");
	if (listener)
		CHECK(rdma_destroy_id(listener) == 0, "listener: rdma_destroy_id");
	if (sch)
		rdma_destroy_event_channel(sch);
	if (cch)
		rdma_destroy_event_channel(cch);
}

int main(void)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(120); /* a watchdog: turns a hang into a failure */
	if (CHECK(addr && *addr && parse_addr(addr) == 0, "RDMASAFE_TEST_ADDR %s parsed",
		  addr ? addr : "(unset)"))
		run();
	printf("cm_ud_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
