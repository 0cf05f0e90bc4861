/* Wire encoding and shared verbs helpers of the messenger (messenger.h). */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "messenger.h"

/* ----------------------------------------------------------- wire format */

/*
 * Copies at most sizeof(*out) of the `len` received bytes, zero-fills the
 * rest, checks magic and version, and returns the sender's own length.
 */
static const char *header(const void *data, size_t len, void *out, size_t size,
			  size_t min_len, uint16_t *own_len)
{
	const struct { uint32_t magic; uint16_t version; uint16_t len; } *h = out;

	if (!data)
		return "no private data";
	if (len < min_len)
		return "shorter than the fixed header";
	memset(out, 0, size);
	memcpy(out, data, len < size ? len : size);
	if (le32toh(h->magic) != MSGR_MAGIC)
		return "bad magic";
	if (le16toh(h->version) != MSGR_VERSION)
		return "unsupported version";
	*own_len = le16toh(h->len);
	if (*own_len < min_len || *own_len > size)
		return "own length out of range";
	if (*own_len > len)
		return "own length beyond the received bytes";
	return NULL;
}

/* The string field of `size` bytes at offset `off` ends (NUL) within own_len. */
static const char *string_in(const void *s, size_t off, size_t size, size_t own_len)
{
	size_t avail;

	if (own_len <= off)
		return "no string";
	avail = own_len - off < size ? own_len - off : size;
	if (!memchr((const char *)s + off, 0, avail))
		return "string not terminated within the own length";
	return NULL;
}

void msgr_hello_encode(struct msgr_hello *h)
{
	h->len = htole16((uint16_t)MSGR_HELLO_LEN(h));
	h->magic = htole32(MSGR_MAGIC);
	h->version = htole16(MSGR_VERSION);
	h->client_id = htole32(h->client_id);
	h->conn_index = htole32(h->conn_index);
	h->nonce = htole64(h->nonce);
}

const char *msgr_hello_decode(const void *data, size_t len, struct msgr_hello *out)
{
	uint16_t own;
	const char *why = header(data, len, out, sizeof *out,
				 offsetof(struct msgr_hello, name), &own);

	if (why || (why = string_in(out, offsetof(struct msgr_hello, name), MSGR_NAME_LEN, own)))
		return why;
	memset((char *)out + own, 0, sizeof *out - own); /* ignore the padding */
	out->magic = MSGR_MAGIC;
	out->version = MSGR_VERSION;
	out->len = own;
	out->client_id = le32toh(out->client_id);
	out->conn_index = le32toh(out->conn_index);
	out->nonce = le64toh(out->nonce);
	return NULL;
}

void msgr_welcome_encode(struct msgr_welcome *w)
{
	w->len = htole16((uint16_t)MSGR_WELCOME_LEN(w));
	w->magic = htole32(MSGR_MAGIC);
	w->version = htole16(MSGR_VERSION);
	w->session_id = htole64(w->session_id);
	w->nonce = htole64(w->nonce);
	w->client_id = htole32(w->client_id);
	w->conn_index = htole32(w->conn_index);
	w->conn_number = htole32(w->conn_number);
	w->max_msg = htole32(w->max_msg);
}

const char *msgr_welcome_decode(const void *data, size_t len, struct msgr_welcome *out)
{
	uint16_t own;
	const char *why = header(data, len, out, sizeof *out,
				 offsetof(struct msgr_welcome, banner), &own);

	if (why || (why = string_in(out, offsetof(struct msgr_welcome, banner), MSGR_BANNER_LEN, own)))
		return why;
	memset((char *)out + own, 0, sizeof *out - own);
	out->magic = MSGR_MAGIC;
	out->version = MSGR_VERSION;
	out->len = own;
	out->session_id = le64toh(out->session_id);
	out->nonce = le64toh(out->nonce);
	out->client_id = le32toh(out->client_id);
	out->conn_index = le32toh(out->conn_index);
	out->conn_number = le32toh(out->conn_number);
	out->max_msg = le32toh(out->max_msg);
	return NULL;
}

void msgr_refusal_encode(struct msgr_refusal *r)
{
	r->len = htole16((uint16_t)(offsetof(struct msgr_refusal, reason) + strlen(r->reason) + 1));
	r->magic = htole32(MSGR_MAGIC);
	r->version = htole16(MSGR_VERSION);
}

const char *msgr_refusal_decode(const void *data, size_t len, struct msgr_refusal *out)
{
	uint16_t own;
	const char *why = header(data, len, out, sizeof *out,
				 offsetof(struct msgr_refusal, reason), &own);

	if (why || (why = string_in(out, offsetof(struct msgr_refusal, reason), sizeof out->reason, own)))
		return why;
	out->len = own;
	return NULL;
}

void msgr_msg_encode(struct msgr_msg *m)
{
	m->text_len = htole16((uint16_t)(strlen(m->text) + 1));
	m->magic = htole32(MSGR_MAGIC);
	m->type = htole16(m->type);
	m->session_id = htole64(m->session_id);
	m->client_id = htole32(m->client_id);
	m->conn_index = htole32(m->conn_index);
	m->seq = htole32(m->seq);
	m->reserved = 0;
}

const char *msgr_msg_decode(const void *data, size_t len, struct msgr_msg *out)
{
	size_t head = offsetof(struct msgr_msg, text);

	if (len < head)
		return "message shorter than its header";
	memset(out, 0, sizeof *out);
	memcpy(out, data, len < sizeof *out ? len : sizeof *out);
	if (le32toh(out->magic) != MSGR_MAGIC)
		return "bad magic";
	out->magic = MSGR_MAGIC;
	out->type = le16toh(out->type);
	out->text_len = le16toh(out->text_len);
	out->session_id = le64toh(out->session_id);
	out->client_id = le32toh(out->client_id);
	out->conn_index = le32toh(out->conn_index);
	out->seq = le32toh(out->seq);
	if (out->text_len < 1 || out->text_len > MSGR_TEXT_LEN || head + out->text_len != len)
		return "text length does not match the received length";
	if (out->text[out->text_len - 1] != 0 || strlen(out->text) + 1 != out->text_len)
		return "text not terminated where its length says";
	return NULL;
}

/* ------------------------------------------------------------------ verbs */

int msgr_dev_open(struct msgr_dev *d, struct ibv_context *verbs, int cqe)
{
	int fl;

	memset(d, 0, sizeof *d);
	d->verbs = verbs;
	if (!(d->pd = ibv_alloc_pd(verbs)) ||
	    !(d->comp = ibv_create_comp_channel(verbs)) ||
	    !(d->cq = ibv_create_cq(verbs, cqe, d, d->comp, 0))) {
		int e = errno;
		msgr_dev_close(d);
		errno = e;
		return -1;
	}
	fl = fcntl(d->comp->fd, F_GETFL);
	if (fl < 0 || fcntl(d->comp->fd, F_SETFL, fl | O_NONBLOCK) ||
	    ibv_req_notify_cq(d->cq, 0)) {
		int e = errno;
		msgr_dev_close(d);
		errno = e;
		return -1;
	}
	return 0;
}

int msgr_dev_open_channel(struct msgr_dev *d, struct ibv_context *verbs)
{
	memset(d, 0, sizeof *d);
	d->verbs = verbs;
	if (!(d->pd = ibv_alloc_pd(verbs)) || !(d->comp = ibv_create_comp_channel(verbs))) {
		int e = errno;
		msgr_dev_close(d);
		errno = e;
		return -1;
	}
	return 0;
}

int msgr_dev_close(struct msgr_dev *d)
{
	int e = 0, r;

	/* every CQ event of the shared CQ was acked in msgr_dev_poll */
	if (d->cq && (r = ibv_destroy_cq(d->cq)) && !e)
		e = r;
	if (d->comp && (r = ibv_destroy_comp_channel(d->comp)) && !e)
		e = r;
	if (d->pd && (r = ibv_dealloc_pd(d->pd)) && !e)
		e = r;
	memset(d, 0, sizeof *d);
	if (e)
		errno = e;
	return e ? -1 : 0;
}

int msgr_dev_poll(struct msgr_dev *d, struct ibv_wc *wc, int max)
{
	struct ibv_cq *cq;
	void *ctx;
	unsigned n = 0;

	if (!d->cq)
		return 0;
	/* get (non-blocking fd), ack as one count, re-arm, then poll */
	while (ibv_get_cq_event(d->comp, &cq, &ctx) == 0)
		n++;
	if (n) {
		ibv_ack_cq_events(d->cq, n);
		d->cq_events += n;
	}
	if (ibv_req_notify_cq(d->cq, 0))
		return -1;
	return ibv_poll_cq(d->cq, max, wc);
}

int msgr_create_qp(struct rdma_cm_id *id, struct msgr_dev *d, int depth)
{
	return msgr_create_qp_on(id, d->pd, d->cq, depth);
}

int msgr_create_qp_on(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq, int depth)
{
	struct ibv_qp_init_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = depth;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.sq_sig_all = 1;
	return rdma_create_qp(id, pd, &attr);
}

int msgr_post_recv(struct rdma_cm_id *id, struct ibv_mr *mr, void *buf, uint32_t len, uint64_t wr_id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	int r = ibv_post_recv(id->qp, &wr, &bad);

	if (r)
		errno = r;
	return r ? -1 : 0;
}

int msgr_post_send(struct rdma_cm_id *id, struct ibv_mr *mr, void *buf, uint32_t len, uint64_t wr_id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
	}, *bad;
	int r = ibv_post_send(id->qp, &wr, &bad);

	if (r)
		errno = r;
	return r ? -1 : 0;
}

/* ------------------------------------------------------------------- misc */

const char *msgr_errname(int e)
{
	const char *s = strerrorname_np(e);

	return s ? s : (e ? "E?" : "0");
}

static const char *watchdog_who = "?";

static void on_alarm(int sig)
{
	(void)sig;
	if (write(STDOUT_FILENO, watchdog_who, strlen(watchdog_who)) < 0 ||
	    write(STDOUT_FILENO, ": watchdog fired (hang), giving up\n", 35) < 0)
		_exit(4);
	_exit(3);
}

void msgr_watchdog(const char *who, unsigned seconds)
{
	watchdog_who = who;
	signal(SIGALRM, on_alarm);
	alarm(seconds);
}

double msgr_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
