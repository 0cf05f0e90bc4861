/*
 * A small Ceph-style messenger over RDMA CM, on the rdmasafe C API.
 *
 * Handshake in CM private data:
 *   client -> server  struct msgr_hello    in the connect request (<= 56 bytes)
 *   server -> client  struct msgr_welcome  in the accept           (<= 196 bytes)
 *   server -> client  struct msgr_refusal  in a reject             (<= 148 bytes)
 * The received private_data_len is the transport's padded maximum, not what
 * the peer sent, so every struct carries its own length (`len`: bytes the
 * sender filled in) and the receiver ignores anything after it.
 *
 * Then one message each way over SENDs on the connection's RC QP:
 *   client -> server  struct msgr_msg, type MSGR_PING
 *   server -> client  struct msgr_msg, type MSGR_PONG
 *
 * Multi-byte fields are little-endian on the wire (as in Ceph's messenger).
 */
#ifndef MESSENGER_H
#define MESSENGER_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define MSGR_MAGIC 0x5247534du /* "MSGR" read as little-endian bytes */
#define MSGR_VERSION 1

#define MSGR_REQ_PDATA_MAX 56  /* connect request private data, RoCE/IB TCP port space */
#define MSGR_REP_PDATA_MAX 196 /* accept private data */
#define MSGR_REJ_PDATA_MAX 148 /* reject private data */

#define MSGR_NAME_LEN 32
#define MSGR_BANNER_LEN 128
#define MSGR_TEXT_LEN 224

struct msgr_hello {
	uint32_t magic;
	uint16_t version;
	uint16_t len;        /* bytes of this struct the client filled in */
	uint32_t client_id;
	uint32_t conn_index; /* which of the client process's connections */
	uint64_t nonce;      /* echoed in the welcome */
	char name[MSGR_NAME_LEN]; /* NUL-terminated; len ends after the NUL */
};

struct msgr_welcome {
	uint32_t magic;
	uint16_t version;
	uint16_t len;          /* bytes of this struct the server filled in */
	uint64_t session_id;   /* assigned by the server */
	uint64_t nonce;        /* the hello's */
	uint32_t client_id;    /* the hello's */
	uint32_t conn_index;   /* the hello's */
	uint32_t conn_number;  /* 1, 2, ... in the server's accept order */
	uint32_t max_msg;      /* largest message the server receives */
	char banner[MSGR_BANNER_LEN]; /* NUL-terminated */
};

struct msgr_refusal {
	uint32_t magic;
	uint16_t version;
	uint16_t len;
	char reason[96]; /* NUL-terminated */
};

enum { MSGR_PING = 1, MSGR_PONG = 2 };

struct msgr_msg {
	uint32_t magic;
	uint16_t type;
	uint16_t text_len;  /* bytes of text including its NUL */
	uint64_t session_id;
	uint32_t client_id;
	uint32_t conn_index;
	uint32_t seq;
	uint32_t reserved;
	char text[MSGR_TEXT_LEN];
};

_Static_assert(sizeof(struct msgr_hello) <= MSGR_REQ_PDATA_MAX, "hello fits a connect request");
_Static_assert(sizeof(struct msgr_welcome) <= MSGR_REP_PDATA_MAX, "welcome fits an accept");
_Static_assert(sizeof(struct msgr_refusal) <= MSGR_REJ_PDATA_MAX, "refusal fits a reject");

/* Length actually filled in (header + the string and its NUL). */
#define MSGR_HELLO_LEN(h) (offsetof(struct msgr_hello, name) + strlen((h)->name) + 1)
#define MSGR_WELCOME_LEN(w) (offsetof(struct msgr_welcome, banner) + strlen((w)->banner) + 1)
#define MSGR_MSG_LEN(m) (offsetof(struct msgr_msg, text) + strlen((m)->text) + 1)

/* Encoding (host -> wire, in place) and checked decoding (wire -> host). */
void msgr_hello_encode(struct msgr_hello *h);
/* Decodes `len` received bytes into *out; NULL on success, else why not. */
const char *msgr_hello_decode(const void *data, size_t len, struct msgr_hello *out);
void msgr_welcome_encode(struct msgr_welcome *w);
const char *msgr_welcome_decode(const void *data, size_t len, struct msgr_welcome *out);
void msgr_refusal_encode(struct msgr_refusal *r);
const char *msgr_refusal_decode(const void *data, size_t len, struct msgr_refusal *out);
void msgr_msg_encode(struct msgr_msg *m);
const char *msgr_msg_decode(const void *data, size_t len, struct msgr_msg *out);

/*
 * Verbs resources shared by all connections of a process on one device:
 * a PD and a completion channel, and with msgr_dev_open one CQ on it that
 * every connection uses (the client: its fd is non-blocking, polled with
 * msgr_dev_poll). msgr_dev_open_channel makes no CQ and leaves the fd as it
 * is (the server: a CQ per connection on the channel, handed to an
 * rdmasafe_cq_loop, which is the channel's only reader).
 */
struct msgr_dev {
	struct ibv_context *verbs;
	struct ibv_pd *pd;
	struct ibv_comp_channel *comp;
	struct ibv_cq *cq;       /* NULL after msgr_dev_open_channel */
	unsigned long cq_events; /* CQ events seen by msgr_dev_poll (all acked) */
};

int msgr_dev_open(struct msgr_dev *d, struct ibv_context *verbs, int cqe);
int msgr_dev_open_channel(struct msgr_dev *d, struct ibv_context *verbs);
/* Destroys what is there (CQ, channel, PD); 0, or -1 with errno of the
 * first call that failed (a channel with CQs left on it: EBUSY). */
int msgr_dev_close(struct msgr_dev *d);
/* Takes and acks pending CQ events, re-arms, then polls up to max
 * completions (call again while it returns max). -1 on error. */
int msgr_dev_poll(struct msgr_dev *d, struct ibv_wc *wc, int max);
/* An RC QP on id using the shared CQ. */
int msgr_create_qp(struct rdma_cm_id *id, struct msgr_dev *d, int depth);
/* An RC QP on id with cq as its send and receive CQ. */
int msgr_create_qp_on(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq, int depth);
int msgr_post_recv(struct rdma_cm_id *id, struct ibv_mr *mr, void *buf, uint32_t len, uint64_t wr_id);
int msgr_post_send(struct rdma_cm_id *id, struct ibv_mr *mr, void *buf, uint32_t len, uint64_t wr_id);

/* Printable errno name ("EINVAL"). */
const char *msgr_errname(int e);
/* "watchdog" for alarm(): prints `who: watchdog fired` and _exits 3. */
void msgr_watchdog(const char *who, unsigned seconds);
double msgr_now_ms(void);

#endif
