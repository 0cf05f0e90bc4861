/*
 * One RC connection of the fault programs (included after fault_common.h):
 * its CQ on the program's one completion channel, in the program's one CQ
 * loop, with a callback that counts and logs every completion (and, on a
 * receiving side, posts each receive again).
 */
#ifndef FAULT_CONN_H
#define FAULT_CONN_H

#define MSG 64
#define WINDOW 8	    /* sends in flight on the traffic connection */
#define RECVS 8		    /* receives posted per survivor connection */
#define PEER_RECVS 16	    /* receives posted per peer connection */
#define PACE_MS 5	    /* one send every PACE_MS */
#define FLOWING_AFTER 50    /* successful sends before "traffic flowing" */
#define MAX_CONNS 8
#define SEND_IDS 65536	    /* send wr_ids 1..SEND_IDS-1 are tracked one by one */
#define RECV_SLOTS 64	    /* receive slots (wr_id RECV_FLAG | slot) tracked */
#define RECV_FLAG (1ULL << 40)
#define PROBE_WR_ID 0x4b41000000000000ULL /* "KA": the keepalive's probes */
#define DRAIN_SEND UINT64_MAX
#define DRAIN_RECV (UINT64_MAX - 1)

struct conn {
	const char *name;
	struct rdma_cm_id *id;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	char *buf;
	int nrecv_bufs;
	int established, disconnected;
	double t_disconnected;
	/* written by the loop thread, read by the main thread */
	atomic_int sends_posted, sends_done, recvs_posted, recvs_done, markers;
	atomic_int oks, errors, first_err_status, msgs;
	atomic_llong t_last_ok_us, t_first_err_us, t_dead_us;
	atomic_int dead;
	struct ibv_qp *dead_qp;
	uint32_t dead_qpn;
	/*
	 * What the loop delivered, counted as it arrives (nothing depends on
	 * how much traffic came before a fault): after the first error
	 * completion, how many were flushes, other errors, successes; and per
	 * work request, whether it completed exactly once (send wr_ids are
	 * 1, 2, ...; a receive slot is posted again only after it completed).
	 */
	atomic_int flush_after_first, other_err_after_first, ok_after_first;
	atomic_int dup_completions, unknown_completions;
	uint8_t *send_seen;			/* [SEND_IDS], loop thread */
	atomic_int recv_outstanding[RECV_SLOTS];	/* per slot: posted - completed */
};

static struct ibv_pd *pd;
static struct ibv_comp_channel *comp;
static struct rdmasafe_cq_loop *loop;

HELPER double us_to_ms(long long us) { return us / 1e3; }
HELPER long long ms_to_us(double ms) { return (long long)(ms * 1e3); }

/* ------------------------------------------------------------ callbacks */

/* Loop thread: every completion of one connection's CQ. */
HELPER void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct conn *c = ctx;
	double t = now_ms();

	for (int i = 0; i < n; i++) {
		const struct ibv_wc *w = &wc[i];
		if (w->wr_id == DRAIN_SEND || w->wr_id == DRAIN_RECV) {
			atomic_fetch_add(&c->markers, 1);
			continue;
		}
		if (w->wr_id == PROBE_WR_ID) /* rdmasafe must never pass these on */
			CHECK(0, "%s: a keepalive probe completion reached the callback", c->name);
		if (w->status == IBV_WC_SUCCESS) {
			atomic_fetch_add(&c->oks, 1);
			atomic_store(&c->t_last_ok_us, ms_to_us(t));
			if (atomic_load(&c->errors))
				atomic_fetch_add(&c->ok_after_first, 1);
		} else if (atomic_fetch_add(&c->errors, 1) == 0) {
			atomic_store(&c->first_err_status, w->status);
			atomic_store(&c->t_first_err_us, ms_to_us(t));
		} else if (w->status == IBV_WC_WR_FLUSH_ERR) {
			atomic_fetch_add(&c->flush_after_first, 1);
		} else {
			atomic_fetch_add(&c->other_err_after_first, 1);
		}
		/* exactly once per work request */
		if (w->wr_id & RECV_FLAG) {
			uint64_t slot = w->wr_id & ~RECV_FLAG;
			if (slot >= RECV_SLOTS)
				atomic_fetch_add(&c->unknown_completions, 1);
			else if (atomic_fetch_sub(&c->recv_outstanding[slot], 1) <= 0)
				atomic_fetch_add(&c->dup_completions, 1);
		} else if (!c->send_seen || w->wr_id == 0 || w->wr_id >= SEND_IDS) {
			atomic_fetch_add(&c->unknown_completions, 1);
		} else if (c->send_seen[w->wr_id]++) {
			atomic_fetch_add(&c->dup_completions, 1);
		}
		if (w->wr_id & RECV_FLAG) {
			atomic_fetch_add(&c->recvs_done, 1);
			if (w->status == IBV_WC_SUCCESS) {
				/* peer: count the message and post the receive again */
				struct ibv_sge sge = { (uintptr_t)c->buf + (w->wr_id & 0xffff) * MSG,
						       MSG, c->mr->lkey };
				struct ibv_recv_wr wr = { .wr_id = w->wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
				atomic_fetch_add(&c->msgs, 1);
				if (ibv_post_recv(c->id->qp, &wr, &bad) == 0) {
					atomic_fetch_add(&c->recvs_posted, 1);
					if ((w->wr_id & ~RECV_FLAG) < RECV_SLOTS)
						atomic_fetch_add(&c->recv_outstanding[w->wr_id & ~RECV_FLAG], 1);
				}
			}
		} else {
			atomic_fetch_add(&c->sends_done, 1);
		}
	}
}

/* --------------------------------------------------------------- verbs */

HELPER int post_recv(struct conn *c, int slot)
{
	struct ibv_sge sge = { (uintptr_t)c->buf + slot * MSG, MSG, c->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = RECV_FLAG | slot, .sg_list = &sge, .num_sge = 1 }, *bad;
	int r;

	if (slot >= RECV_SLOTS)
		return CHECK(0, "%s: receive slot %d beyond the %d tracked", c->name, slot, RECV_SLOTS), -1;
	/* counted before the post: the completion may come at once */
	atomic_fetch_add(&c->recv_outstanding[slot], 1);
	r = ibv_post_recv(c->id->qp, &wr, &bad);
	if (!r)
		atomic_fetch_add(&c->recvs_posted, 1);
	else
		atomic_fetch_sub(&c->recv_outstanding[slot], 1);
	return r;
}

HELPER int post_send(struct conn *c)
{
	int seq = atomic_load(&c->sends_posted) + 1;
	struct ibv_sge sge = { (uintptr_t)c->buf, MSG, c->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = (uint64_t)seq, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
	int r;

	snprintf(c->buf, MSG, "message %d", seq);
	r = ibv_post_send(c->id->qp, &wr, &bad);
	if (!r)
		atomic_fetch_add(&c->sends_posted, 1);
	return r;
}

/* CQ (on the loop's channel), QP, MR, receives; CQ added to the loop. */
HELPER int setup_qp(struct conn *c, int nrecv)
{
	struct ibv_qp_init_attr attr;
	int r;

	c->nrecv_bufs = nrecv;
	c->send_seen = calloc(SEND_IDS, 1);
	if (!CHECK(c->send_seen, "%s: completion accounting", c->name))
		return -1;
	c->cq = ibv_create_cq(c->id->verbs, 64, c, comp, 0);
	if (!CHECK(c->cq, "%s: ibv_create_cq on the loop's channel", c->name))
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = c->cq;
	attr.cap.max_send_wr = WINDOW + 4; /* + keepalive probe + drain marker */
	attr.cap.max_recv_wr = nrecv + 2;  /* + drain marker */
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (!CHECK(rdma_create_qp(c->id, pd, &attr) == 0, "%s: rdma_create_qp", c->name))
		return -1;
	c->buf = calloc((size_t)nrecv + 1, MSG);
	c->mr = c->buf ? ibv_reg_mr(pd, c->buf, ((size_t)nrecv + 1) * MSG, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!CHECK(c->mr, "%s: ibv_reg_mr", c->name))
		return -1;
	/* slot 0 is the send buffer; receives use slots 1..nrecv */
	for (int i = 1; i <= nrecv; i++)
		if (post_recv(c, i))
			return CHECK(0, "%s: ibv_post_recv", c->name), -1;
	r = rdmasafe_cq_loop_add_cq(loop, c->cq, on_wc, c);
	return CHECK(r == 0, "%s: rdmasafe_cq_loop_add_cq -> %s", c->name, rname(r)) ? 0 : -1;
}

/*
 * Every work request posted on the connection completed exactly once: each
 * send wr_id 1..sends_posted was delivered once, every receive slot's
 * completions match its posts, nothing unknown or twice.
 */
HELPER void check_exactly_once(struct conn *c)
{
	int sends = atomic_load(&c->sends_posted), never = 0, twice = 0, slots = 0;

	if (!c->send_seen)
		return;
	for (int k = 1; k <= sends && k < SEND_IDS; k++) {
		never += c->send_seen[k] == 0;
		twice += c->send_seen[k] > 1;
	}
	for (int i = 0; i < RECV_SLOTS; i++)
		slots += atomic_load(&c->recv_outstanding[i]) != 0;
	CHECK(sends < SEND_IDS && never == 0 && twice == 0 && slots == 0 &&
	      atomic_load(&c->dup_completions) == 0 && atomic_load(&c->unknown_completions) == 0,
	      "%s: every work request completed exactly once (%d sends: %d never, %d twice; %d receive slots "
	      "unsettled; %d duplicate, %d unknown completions)", c->name, sends, never, twice, slots,
	      atomic_load(&c->dup_completions), atomic_load(&c->unknown_completions));
}

/* Moves the QP to error and waits until every WR completed (the loop's two
 * marker requests come back to the loop, never to the callback). */
HELPER void drain(struct conn *c)
{
	int before = atomic_load(&c->markers), r;

	if (!c->id || !c->id->qp || !c->cq)
		return;
	r = rdmasafe_cq_loop_drain_qp(loop, c->id->qp, 0, 10000);
	CHECK(r == 0 && atomic_load(&c->markers) - before == 0,
	      "%s: rdmasafe_cq_loop_drain_qp -> %s, %d markers delivered (want 0)", c->name,
	      rname(r), atomic_load(&c->markers) - before);
	CHECK(atomic_load(&c->sends_done) == atomic_load(&c->sends_posted) &&
	      atomic_load(&c->recvs_done) == atomic_load(&c->recvs_posted),
	      "%s: every posted WR completed (sends %d/%d, receives %d/%d)", c->name,
	      atomic_load(&c->sends_done), atomic_load(&c->sends_posted),
	      atomic_load(&c->recvs_done), atomic_load(&c->recvs_posted));
	check_exactly_once(c);
}

/* Destroys QP, MR, CQ, id; each must return (the watchdog is armed). */
HELPER void destroy_conn(struct conn *c)
{
	int r;

	if (c->id && c->id->qp)
		rdma_destroy_qp(c->id);
	if (c->mr)
		CHECK(ibv_dereg_mr(c->mr) == 0, "%s: ibv_dereg_mr", c->name);
	if (c->cq) {
		r = ibv_destroy_cq(c->cq);
		CHECK(r == 0, "%s: ibv_destroy_cq -> %d (returned: every CQ event was acked)", c->name, r);
	}
	if (c->id)
		CHECK(rdma_destroy_id(c->id) == 0, "%s: rdma_destroy_id", c->name);
	free(c->buf);
	free(c->send_seen);
	c->send_seen = NULL;
	c->id = NULL;
	c->mr = NULL;
	c->cq = NULL;
	c->buf = NULL;
}

/* Context objects, after every connection is gone. */
HELPER void destroy_context(void)
{
	if (loop) {
		int r = rdmasafe_cq_loop_destroy(loop);
		CHECK(r == 0, "rdmasafe_cq_loop_destroy -> %s", rname(r));
		loop = NULL;
	}
	if (comp)
		CHECK(ibv_destroy_comp_channel(comp) == 0, "ibv_destroy_comp_channel");
	if (pd)
		CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	comp = NULL;
	pd = NULL;
}

HELPER int make_context(struct ibv_context *ctx)
{
	int r;

	pd = ibv_alloc_pd(ctx);
	comp = pd ? ibv_create_comp_channel(ctx) : NULL;
	if (!CHECK(pd && comp, "PD and completion channel on %s", ibv_get_device_name(ctx->device)))
		return -1;
	r = rdmasafe_cq_loop_create(comp, NULL, &loop);
	return CHECK(r == 0, "rdmasafe_cq_loop_create (event mode) -> %s", rname(r)) ? 0 : -1;
}

/* Frees every CM event still queued; returns how many. */
HELPER int drop_events(struct rdma_event_channel *ch)
{
	struct rdma_cm_event *ev;
	int n = 0;

	while (rdmasafe_get_event_timeout(ch, &ev, 0) == 0) {
		info("left-over CM event %s (status %d)", rdmasafe_event_str(ev->event), ev->status);
		free_event(ev);
		n++;
	}
	return n;
}

#endif /* FAULT_CONN_H */
