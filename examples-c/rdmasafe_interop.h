/*
 * Shared by rdmasafe_rdma_server.c and rdmasafe_rdma_client.c: the peer
 * side of rdma-core's stock rdma_client / rdma_server (rdmacm-utils), on an
 * rdmasafe event channel instead of synchronous rdma_create_ep ids.
 *
 * What the stock tools do (rdma-core librdmacm/examples, Debian 12: v44):
 *  - port 7471 by default (-p), address -s; RDMA_PS_TCP; no private data;
 *  - one RC QP each, 1 send + 1 receive WR, 1 SGE, max_inline_data 16,
 *    sq_sig_all; messages are exactly 16 bytes (the stock tools send 16
 *    zero bytes);
 *  - rdma_client: post recv, connect (synchronous: returns at
 *    ESTABLISHED), send, wait send completion, wait recv completion,
 *    rdma_disconnect (synchronous: waits for its DISCONNECTED, i.e. for
 *    the peer's DREP), destroy;
 *  - rdma_server: listen, rdma_get_request, post recv, accept (synchronous:
 *    returns at ESTABLISHED), wait recv completion, send, wait send
 *    completion, rdma_disconnect (waits for the peer's DREP), destroy.
 * So the rdmasafe side must answer a DISCONNECTED with rdma_disconnect, or
 * the stock tool waits for the CM's DREP timeout.
 */
#ifndef RDMASAFE_INTEROP_H
#define RDMASAFE_INTEROP_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "rdmasafe.h"

#define STOCK_MSG_LEN 16
#define STEP_MS 10000 /* longest wait for any one event or completion */

static const char *prog = "?";

static const char *errname(int e)
{
	const char *s = strerrorname_np(e);

	return s ? s : (e ? "E?" : "0");
}

static void on_alarm(int sig)
{
	(void)sig;
	if (write(STDOUT_FILENO, prog, strlen(prog)) < 0 ||
	    write(STDOUT_FILENO, ": watchdog fired (hang), giving up\n", 35) < 0)
		_exit(4);
	_exit(3);
}

/*
 * Waits for the next CM event and checks its type and id. Returns the copy
 * (free it with rdmasafe_event_free) or NULL after printing why not.
 */
static struct rdma_cm_event *expect_event(struct rdma_event_channel *ch, int type, struct rdma_cm_id *id)
{
	struct rdma_cm_event *ev;

	if (rdmasafe_get_event_timeout(ch, &ev, STEP_MS)) {
		printf("%s: waiting for %s: %s\n", prog, rdmasafe_event_str(type), errname(errno));
		return NULL;
	}
	printf("%s: %s (status %d, private_data_len %u)\n", prog, rdmasafe_event_str(ev->event), ev->status,
	       ev->param.conn.private_data_len);
	if ((int)ev->event != type || (id && ev->id != id)) {
		printf("%s: wanted %s\n", prog, rdmasafe_event_str(type));
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

static int expect_and_free(struct rdma_event_channel *ch, int type, struct rdma_cm_id *id)
{
	struct rdma_cm_event *ev = expect_event(ch, type, id);

	if (!ev)
		return -1;
	if (rdmasafe_event_free(ev)) {
		printf("%s: rdmasafe_event_free: %s\n", prog, errname(errno));
		return -1;
	}
	return 0;
}

/* Per-connection verbs resources, sized like the stock tools'. */
struct peer {
	struct ibv_pd *pd;
	struct ibv_comp_channel *comp;
	struct ibv_cq *cq;
	struct ibv_mr *recv_mr, *send_mr;
	int send_flags;
	uint8_t recv_buf[STOCK_MSG_LEN];
	uint8_t send_buf[STOCK_MSG_LEN];
	struct ibv_wc early; /* a completion that came before the one waited for */
	int has_early;
};

static int peer_setup(struct rdma_cm_id *id, struct peer *p)
{
	struct ibv_qp_init_attr attr;

	memset(p, 0, sizeof *p);
	if (!(p->pd = ibv_alloc_pd(id->verbs)) || !(p->comp = ibv_create_comp_channel(id->verbs)) ||
	    !(p->cq = ibv_create_cq(id->verbs, 2, p, p->comp, 0)) || ibv_req_notify_cq(p->cq, 0)) {
		printf("%s: PD / completion channel / CQ: %s\n", prog, errname(errno));
		return -1;
	}
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = p->cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 1;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.cap.max_inline_data = STOCK_MSG_LEN;
	attr.sq_sig_all = 1;
	if (rdma_create_qp(id, p->pd, &attr)) {
		printf("%s: rdma_create_qp: %s\n", prog, errname(errno));
		return -1;
	}
	if (attr.cap.max_inline_data >= STOCK_MSG_LEN)
		p->send_flags = IBV_SEND_INLINE;
	if (!(p->recv_mr = ibv_reg_mr(p->pd, p->recv_buf, sizeof p->recv_buf, IBV_ACCESS_LOCAL_WRITE)) ||
	    (!p->send_flags && !(p->send_mr = ibv_reg_mr(p->pd, p->send_buf, sizeof p->send_buf, 0)))) {
		printf("%s: ibv_reg_mr: %s\n", prog, errname(errno));
		return -1;
	}
	return 0;
}

static void peer_teardown(struct rdma_cm_id *id, struct peer *p)
{
	if (id && id->qp)
		rdma_destroy_qp(id);
	if (p->recv_mr)
		ibv_dereg_mr(p->recv_mr);
	if (p->send_mr)
		ibv_dereg_mr(p->send_mr);
	if (p->cq)
		ibv_destroy_cq(p->cq);
	if (p->comp)
		ibv_destroy_comp_channel(p->comp);
	if (p->pd)
		ibv_dealloc_pd(p->pd);
	memset(p, 0, sizeof *p);
}

static int post_recv(struct rdma_cm_id *id, struct peer *p)
{
	struct ibv_sge sge = { (uintptr_t)p->recv_buf, sizeof p->recv_buf, p->recv_mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
	int r = ibv_post_recv(id->qp, &wr, &bad);

	if (r)
		printf("%s: ibv_post_recv: %s\n", prog, errname(r));
	return r ? -1 : 0;
}

static int post_send(struct rdma_cm_id *id, struct peer *p, const char *msg)
{
	struct ibv_sge sge = { (uintptr_t)p->send_buf, sizeof p->send_buf, p->send_mr ? p->send_mr->lkey : 0 };
	struct ibv_send_wr wr = {
		.wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = p->send_flags,
	}, *bad;
	int r;

	memcpy(p->send_buf, msg, sizeof p->send_buf);
	r = ibv_post_send(id->qp, &wr, &bad);
	if (r)
		printf("%s: ibv_post_send: %s\n", prog, errname(r));
	return r ? -1 : 0;
}

/* Waits for one completion of the wanted opcode through the completion
 * channel. The send's completion and the reply's receive share one CQ and
 * may complete in either order (the peer's reply can overtake the ack that
 * completes the send), so a successful completion of the other opcode is
 * kept for the next call. */
static int wait_completion(struct peer *p, enum ibv_wc_opcode opcode, struct ibv_wc *wc)
{
	if (p->has_early && p->early.opcode == opcode) {
		*wc = p->early;
		p->has_early = 0;
		return 0;
	}
	for (;;) {
		struct pollfd pfd = { .fd = p->comp->fd, .events = POLLIN };
		struct ibv_cq *cq;
		void *ctx;
		int n = ibv_poll_cq(p->cq, 1, wc);

		if (n < 0) {
			printf("%s: ibv_poll_cq failed\n", prog);
			return -1;
		}
		if (n == 1) {
			if (wc->status == IBV_WC_SUCCESS && wc->opcode != opcode && !p->has_early) {
				p->early = *wc;
				p->has_early = 1;
				continue;
			}
			if (wc->status != IBV_WC_SUCCESS || wc->opcode != opcode) {
				printf("%s: completion opcode %d status %s\n", prog, wc->opcode,
				       ibv_wc_status_str(wc->status));
				return -1;
			}
			return 0;
		}
		/* empty: wait for the event, ack it, re-arm, poll again */
		if (poll(&pfd, 1, STEP_MS) != 1) {
			printf("%s: no completion within %d ms\n", prog, STEP_MS);
			return -1;
		}
		if (ibv_get_cq_event(p->comp, &cq, &ctx)) {
			printf("%s: ibv_get_cq_event: %s\n", prog, errname(errno));
			return -1;
		}
		ibv_ack_cq_events(cq, 1);
		if (ibv_req_notify_cq(p->cq, 0)) {
			printf("%s: ibv_req_notify_cq failed\n", prog);
			return -1;
		}
	}
}

static void print_bytes(const char *what, const uint8_t *b, unsigned len)
{
	printf("%s: %s %u bytes:", prog, what, len);
	for (unsigned i = 0; i < len; i++)
		printf(" %02x", b[i]);
	printf("\n");
}

static int print_counters(void)
{
	struct rdmasafe_cm_counters c = { .size = sizeof c };

	if (rdmasafe_cm_get_counters(&c))
		return -1;
	printf("%s: counters copied=%llu freed=%llu outstanding=%llu slots_allocated=%llu\n", prog,
	       (unsigned long long)c.copied, (unsigned long long)c.freed, (unsigned long long)c.outstanding,
	       (unsigned long long)c.slots_allocated);
	return c.outstanding ? -1 : 0;
}

#endif
