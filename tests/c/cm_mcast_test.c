/*
 * cm_mcast_test: an mckey-style multicast exchange, written as a librdmacm
 * program that switched to rdmasafe by renaming its two calls
 * (rdmasafe_get_event, rdmasafe_event_free; nothing else of rdmasafe).
 * Built with -DRAW the same source calls rdma_get_cm_event /
 * rdma_ack_cm_event: the control, run with the same checks.
 *
 * On the device at $RDMASAFE_TEST_ADDR (rxe0 in the test guest), in one
 * process: two RDMA_PS_UDP ids on one channel, each with its own UD QP,
 * resolve the multicast group 239.77.0.9 from the device's address and
 * join it with rdma_join_multicast, each with its own context pointer:
 *  - the sender's context is its node struct (as mckey passes its node);
 *  - the receiver's context points at the last readable byte before a
 *    PROT_NONE guard page, so a copy that read "private data" through it
 *    would fault instead of passing.
 * Each MULTICAST_JOIN must carry in param.ud.private_data exactly the
 * pointer its join gave (compared as a pointer, never read), the group's
 * GID in ah_attr, qp_num 0xFFFFFF and qkey 0x01234567 (librdmacm's
 * RDMA_PS_UDP qkey, as rxe reports it), equal to the receiver QP's qkey. The sender builds an AH from
 * its event's ah_attr and sends 4 UD messages to the event's qp_num / qkey;
 * the receiver's QP, attached to the group by librdmacm at the join, must
 * receive them (at least one, each intact, none twice, all from the
 * sender's QP; UD may drop, loopback on rxe does not in practice). Then
 * both leave the group and everything is destroyed.
 *
 * Prints one line per check ("ok   ..." or "FAIL ..."), "info" lines with
 * the raw field values, then "cm_mcast_test: N passed, M failed"; exits 0
 * only if M is 0. A SIGALRM watchdog turns a hang into a failure (exit 3),
 * a fault is reported before the exit (exit 5).
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
#include <sys/mman.h>
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

#define GROUP "239.77.0.9"
#define MCAST_QPN 0xFFFFFFu /* the QPN a multicast send goes to */
#define UDP_QKEY 0x01234567u /* librdmacm's qkey for RDMA_PS_UDP ids */
#define NMSG 4
#define MSG_SIZE 64
#define GRH_SIZE 40
#define STEP_MS 30000 /* how long any one expected event may take (turns a hang into a failure) */

/* ---------------------------------------------------------------- output */

static void on_fault(int sig)
{
	(void)sig;
	say_and_exit("FAIL SIGSEGV/SIGBUS (was a context pointer read as private data?) in phase: ", 5);
}

static const char *gid_str(const union ibv_gid *g, char *buf, size_t len)
{
	return inet_ntop(AF_INET6, g->raw, buf, len) ? buf : "?";
}

static uint8_t pat(unsigned seed, unsigned i)
{
	return (uint8_t)(seed * 37u + i * 3u + (i >> 2) + 1u);
}

/* ---------------------------------------------------------------- helpers */

static struct sockaddr_storage src_addr, group_addr;
static union ibv_gid group_gid; /* the GID RoCE gives the group */

static int parse(const char *s, struct sockaddr_storage *out)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;
	int r = getaddrinfo(s, NULL, &hints, &res);

	if (r) {
		fprintf(stderr, "getaddrinfo(%s): %s\n", s, gai_strerror(r));
		return -1;
	}
	memcpy(out, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	return 0;
}

/* The next event on ch: `type` on `id`, within STEP_MS (poll on the fd). */
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
	if (!CHECK((int)ev->event == type && ev->id == id, "%s: %s status %d (want %s on its id)",
		   what, rdma_event_str(ev->event), ev->status, rdma_event_str(type))) {
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

struct node {
	const char *name;
	struct rdma_cm_id *id;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	struct ibv_ah *ah;
	int joined;
	uint8_t send_buf[NMSG][MSG_SIZE];
	uint8_t recv_buf[NMSG][GRH_SIZE + MSG_SIZE];
};

static int node_init(struct node *n)
{
	struct ibv_qp_init_attr attr;

	n->pd = ibv_alloc_pd(n->id->verbs);
	n->cq = n->pd ? ibv_create_cq(n->id->verbs, 2 * NMSG, n, NULL, 0) : NULL;
	if (!n->cq)
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_UD;
	attr.send_cq = attr.recv_cq = n->cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = NMSG;
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
}

/* Resolves the group from the device's address: ADDR_RESOLVED on n. */
static int resolve(struct rdma_event_channel *ch, struct node *n)
{
	struct rdma_cm_event *ev;
	char what[64];

	snprintf(what, sizeof what, "%s: address", n->name);
	if (!CHECK(rdma_resolve_addr(n->id, (struct sockaddr *)&src_addr,
				     (struct sockaddr *)&group_addr, 2000) == 0,
		   "%s: rdma_resolve_addr(%s -> %s)", n->name, "device address", GROUP))
		return -1;
	if (!(ev = next_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED, n->id, what)))
		return -1;
	free_event(ev, what);
	return 0;
}

/*
 * Joins with `ctx`; checks the MULTICAST_JOIN and keeps what a sender
 * needs (AH from the event's ah_attr, qp_num, qkey) in n / *qpn / *qkey.
 */
static int join(struct rdma_event_channel *ch, struct node *n, void *ctx,
		uint32_t *qpn, uint32_t *qkey, int make_ah)
{
	struct rdma_cm_event *ev;
	const struct ibv_ah_attr *a;
	union ibv_gid sgid;
	char what[64], g[INET6_ADDRSTRLEN];

	snprintf(what, sizeof what, "%s: join", n->name);
	if (!CHECK(rdma_join_multicast(n->id, (struct sockaddr *)&group_addr, ctx) == 0,
		   "%s: rdma_join_multicast(%s, context %p)", n->name, GROUP, ctx))
		return -1;
	n->joined = 1;
	if (!(ev = next_event(ch, RDMA_CM_EVENT_MULTICAST_JOIN, n->id, what)))
		return -1;
	a = &ev->param.ud.ah_attr;
	info("%s: MULTICAST_JOIN param.ud private_data %p private_data_len %u qp_num 0x%x qkey 0x%08x",
	     n->name, ev->param.ud.private_data, ev->param.ud.private_data_len,
	     ev->param.ud.qp_num, ev->param.ud.qkey);
	info("%s: MULTICAST_JOIN ah_attr is_global %u dgid %s sgid_index %u hop_limit %u traffic_class %u flow_label %u dlid 0x%x sl %u src_path_bits %u static_rate %u port_num %u",
	     n->name, a->is_global, gid_str(&a->grh.dgid, g, sizeof g), a->grh.sgid_index,
	     a->grh.hop_limit, a->grh.traffic_class, a->grh.flow_label, a->dlid, a->sl,
	     a->src_path_bits, a->static_rate, a->port_num);
	CHECK(ev->status == 0, "%s: MULTICAST_JOIN status %d", n->name, ev->status);
	CHECK(ev->listen_id == NULL, "%s: MULTICAST_JOIN listen_id is NULL", n->name);
	CHECK(ev->id->context == n, "%s: MULTICAST_JOIN id carries the id's context (its node)", n->name);
	CHECK(ev->param.ud.private_data == ctx,
	      "%s: MULTICAST_JOIN param.ud.private_data %p is the join's context pointer %p, as is",
	      n->name, ev->param.ud.private_data, ctx);
	CHECK(ev->param.ud.private_data_len == 0, "%s: MULTICAST_JOIN param.ud.private_data_len %u (no bytes: 0)",
	      n->name, ev->param.ud.private_data_len);
	CHECK(ev->param.ud.qp_num == MCAST_QPN, "%s: MULTICAST_JOIN param.ud.qp_num 0x%x (want 0x%x)",
	      n->name, ev->param.ud.qp_num, MCAST_QPN);
	CHECK(ev->param.ud.qkey == UDP_QKEY, "%s: MULTICAST_JOIN param.ud.qkey 0x%08x (want 0x%08x)",
	      n->name, ev->param.ud.qkey, UDP_QKEY);
	CHECK(a->is_global == 1 && !memcmp(a->grh.dgid.raw, group_gid.raw, 16),
	      "%s: ah_attr is global with grh.dgid %s, the group's GID", n->name,
	      gid_str(&a->grh.dgid, g, sizeof g));
	CHECK(ibv_query_gid(n->id->verbs, n->id->port_num, a->grh.sgid_index, &sgid) == 0 &&
		      !memcmp(sgid.raw + 10, "\xff\xff", 2) &&
		      !memcmp(sgid.raw + 12, &((struct sockaddr_in *)&src_addr)->sin_addr, 4),
	      "%s: ah_attr.grh.sgid_index %u is this port's GID for the device address", n->name,
	      a->grh.sgid_index);
	CHECK(a->port_num == n->id->port_num, "%s: ah_attr.port_num %u is the id's port %u", n->name,
	      a->port_num, n->id->port_num);
	*qpn = ev->param.ud.qp_num;
	*qkey = ev->param.ud.qkey;
	if (make_ah) {
		n->ah = ibv_create_ah(n->pd, &ev->param.ud.ah_attr);
		CHECK(n->ah != NULL, "%s: ibv_create_ah from the MULTICAST_JOIN ah_attr (%s)", n->name,
		      n->ah ? "0" : ename(errno));
	}
	free_event(ev, what);
	return make_ah && !n->ah ? -1 : 0;
}

/* ------------------------------------------------------------------- test */

static void run(void)
{
	struct rdma_event_channel *ch;
	struct node *snd = calloc(1, sizeof *snd), *rcv = calloc(1, sizeof *rcv);
	uint32_t qpn = 0, qkey = 0, rqpn = 0, rqkey = 0;
	long pg = sysconf(_SC_PAGESIZE);
	uint8_t *guard;
	void *rcv_ctx;
	int i, sent = 0, sends_done = 0, got = 0, bad = 0, seen[NMSG] = { 0 };
	double end;

	phase = "set-up";
	if (!snd || !rcv)
		return;
	snd->name = "sender";
	rcv->name = "receiver";
	/* one readable byte, then a guard page */
	guard = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (!CHECK(guard != MAP_FAILED && mprotect(guard + pg, pg, PROT_NONE) == 0,
		   "a page followed by a PROT_NONE guard page"))
		return;
	rcv_ctx = guard + pg - 1;
	*(uint8_t *)rcv_ctx = 0x5a;

	ch = rdma_create_event_channel();
	if (!CHECK(ch != NULL, "event channel"))
		return;
	if (!CHECK(rdma_create_id(ch, &snd->id, snd, RDMA_PS_UDP) == 0, "sender: rdma_create_id(RDMA_PS_UDP)") ||
	    !CHECK(rdma_create_id(ch, &rcv->id, rcv, RDMA_PS_UDP) == 0, "receiver: rdma_create_id(RDMA_PS_UDP)"))
		goto out;
	info("build %s: group %s", BUILD, GROUP);
	if (resolve(ch, snd) || resolve(ch, rcv))
		goto out;
	if (!CHECK(node_init(snd) == 0, "sender: PD, CQ, UD QP, MR") ||
	    !CHECK(node_init(rcv) == 0, "receiver: PD, CQ, UD QP, MR"))
		goto out;
	for (i = 0; i < NMSG; i++) {
		struct ibv_sge sge = {
			.addr = (uintptr_t)rcv->recv_buf[i],
			.length = sizeof rcv->recv_buf[i],
			.lkey = rcv->mr->lkey,
		};
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *badwr;
		if (ibv_post_recv(rcv->id->qp, &wr, &badwr))
			break;
	}
	CHECK(i == NMSG, "receiver: %d receives posted", i);

	phase = "join";
	if (join(ch, snd, snd, &qpn, &qkey, 1))
		goto out;
	if (join(ch, rcv, rcv_ctx, &rqpn, &rqkey, 0))
		goto out;
	CHECK(*(uint8_t *)rcv_ctx == 0x5a, "receiver: the byte its context points at is untouched");
	CHECK(rqpn == qpn && rqkey == qkey, "both joins report the same qp_num and qkey");
	rqkey = qp_qkey(rcv->id->qp);
	CHECK(rqkey == qkey, "receiver: its UD QP's qkey 0x%08x is the join's qkey", rqkey);

	phase = "send to the group";
	for (i = 0; i < NMSG; i++) {
		struct ibv_sge sge = {
			.addr = (uintptr_t)snd->send_buf[i],
			.length = MSG_SIZE,
			.lkey = snd->mr->lkey,
		};
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *badwr;
		for (unsigned k = 0; k < MSG_SIZE; k++)
			snd->send_buf[i][k] = pat(10 + i, k);
		wr.opcode = IBV_WR_SEND;
		wr.send_flags = IBV_SEND_SIGNALED;
		wr.wr.ud.ah = snd->ah;
		wr.wr.ud.remote_qpn = qpn;
		wr.wr.ud.remote_qkey = qkey;
		if (ibv_post_send(snd->id->qp, &wr, &badwr))
			break;
		sent++;
	}
	CHECK(sent == NMSG, "sender: %d UD SENDs posted to qp_num 0x%x qkey 0x%08x through the AH",
	      sent, qpn, qkey);
	end = now_ms() + STEP_MS;
	while ((sends_done < sent || got < sent) && now_ms() < end) {
		struct ibv_wc wc;
		if (sends_done < sent && ibv_poll_cq(snd->cq, 1, &wc) == 1) {
			if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_SEND)
				bad++;
			sends_done++;
			continue;
		}
		if (got < sent && ibv_poll_cq(rcv->cq, 1, &wc) == 1) {
			unsigned slot = (unsigned)(wc.wr_id - 100), m, k;
			got++;
			if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV || slot >= NMSG ||
			    wc.byte_len != GRH_SIZE + MSG_SIZE || wc.src_qp != snd->id->qp->qp_num) {
				info("receiver: completion %s opcode %d wr_id %llu byte_len %u src_qp %u",
				     ibv_wc_status_str(wc.status), wc.opcode,
				     (unsigned long long)wc.wr_id, wc.byte_len, wc.src_qp);
				bad++;
				continue;
			}
			/* which message is it? */
			for (m = 0; m < NMSG; m++) {
				for (k = 0; k < MSG_SIZE; k++)
					if (rcv->recv_buf[slot][GRH_SIZE + k] != pat(10 + m, k))
						break;
				if (k == MSG_SIZE)
					break;
			}
			if (m == NMSG || seen[m]++)
				bad++;
			continue;
		}
		usleep(100);
	}
	CHECK(sends_done == sent && !bad, "sender: %d of %d send completions, all successful", sends_done, sent);
	info("receiver: %d of %d multicast messages received", got, sent);
	CHECK(got >= 1, "receiver: the group's messages arrived on the other QP (%d of %d)", got, sent);
	CHECK(!bad, "receiver: every message intact, from the sender's QP %u, none twice",
	      snd->id->qp->qp_num);

	phase = "leave";
	CHECK(rdma_leave_multicast(snd->id, (struct sockaddr *)&group_addr) == 0, "sender: rdma_leave_multicast");
	snd->joined = 0;
	CHECK(rdma_leave_multicast(rcv->id, (struct sockaddr *)&group_addr) == 0, "receiver: rdma_leave_multicast");
	rcv->joined = 0;

out:
	phase = "teardown";
	alarm(60);
	if (snd->joined)
		rdma_leave_multicast(snd->id, (struct sockaddr *)&group_addr);
	if (rcv->joined)
		rdma_leave_multicast(rcv->id, (struct sockaddr *)&group_addr);
	node_free(snd);
	node_free(rcv);
	if (snd->id)
		CHECK(rdma_destroy_id(snd->id) == 0, "sender: rdma_destroy_id");
	if (rcv->id)
		CHECK(rdma_destroy_id(rcv->id) == 0, "receiver: rdma_destroy_id");
	rdma_destroy_event_channel(ch);
	free(snd);
	free(rcv);
	munmap(guard, 2 * pg);
}

int main(void)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	signal(SIGSEGV, on_fault);
	signal(SIGBUS, on_fault);
	alarm(120); /* a watchdog: turns a hang into a failure */
	if (CHECK(addr && *addr && parse(addr, &src_addr) == 0 && src_addr.ss_family == AF_INET &&
			  parse(GROUP, &group_addr) == 0,
		  "RDMASAFE_TEST_ADDR %s (IPv4) and group %s parsed", addr ? addr : "(unset)", GROUP)) {
		/* RoCE: the IPv4 group's GID is its IPv4-mapped IPv6 address */
		group_gid.raw[10] = group_gid.raw[11] = 0xff;
		memcpy(&group_gid.raw[12], &((struct sockaddr_in *)&group_addr)->sin_addr, 4);
		run();
	}
	printf("cm_mcast_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
