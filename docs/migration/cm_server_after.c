/*
 * cm_server_after.c: cm_server_before.c moved to rdmasafe. This is the
 * "after" of docs/migrating-from-librdmacm.md.
 * Build: cc cm_server_after.c $(pkg-config --cflags --libs rdmasafe) -pthread
 *
 *   cm_server_after [-a ADDR] [-p PORT]     (ADDR: $RDMASAFE_TEST_ADDR)
 *
 * The same server and client: rdma_get_cm_event became rdmasafe_get_event
 * and rdma_ack_cm_event became rdmasafe_event_free. What the copies allow
 * on top of the rename:
 *  - the server keeps each CONNECT_REQUEST copy for the whole connection
 *    and reads the hello in place (no copying it out before an ack);
 *  - a refused request's id is destroyed while its copy is still held;
 *  - a finished connection is torn down on the event thread and its copies
 *    are queued to a worker thread, which reads them after rdma_destroy_id
 *    and frees them there.
 * Never pass a copy to rdma_ack_cm_event. The ids stay the application's.
 *
 * Exits 0 when the server served NCONN - 1 connections and refused one,
 * the client saw every welcome and the refusal, and no copy is left in
 * either process. SIGINT / SIGTERM stop the server (exit 1); a watchdog
 * turns a hang into exit 3.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include <rdma/rdma_cma.h>
#include <rdmasafe.h>

#define NCONN 4         /* client connections: the last one gets refused */
#define CLIENT_ID 7
#define HELLO_VERSION 1
#define TIMEOUT_MS 2000 /* address and route resolution */
#define WATCHDOG_S 30

/*
 * Wire formats (multi-byte fields big-endian). The received
 * private_data_len is the transport's maximum (56 on a connect request,
 * 196 on ESTABLISHED, 148 on REJECTED), so each message carries its length.
 */
struct hello {                  /* client -> server: rdma_connect private data */
	uint8_t len;            /* bytes filled in, up to the name's NUL */
	uint8_t version;
	uint16_t conn_index;
	uint32_t client_id;
	char name[48];
} __attribute__((packed));
_Static_assert(sizeof(struct hello) == 56, "a hello fits a connect request");

struct welcome {                /* server -> client: rdma_accept private data */
	uint8_t len;
	uint8_t version;
	uint16_t conn_index;    /* the hello's */
	uint32_t session;       /* assigned by the server */
	char banner[96];
} __attribute__((packed));

struct refusal {                /* server -> client: rdma_reject private data */
	uint8_t len;
	char reason[80];
} __attribute__((packed));

/* Checks a received hello in place: NULL if it is good, else why not. */
static const char *hello_check(const void *data, unsigned data_len)
{
	const struct hello *h = data;
	const size_t head = offsetof(struct hello, name);

	if (!data || data_len < head + 1 || h->len < head + 1 || h->len > data_len ||
	    h->len > sizeof *h || !memchr(h->name, '\0', h->len - head))
		return "malformed hello";
	if (h->version != HELLO_VERSION)
		return "unsupported hello version";
	return NULL;
}

/* An RC QP on librdmacm's default PD, with CQs librdmacm creates. */
static int create_qp(struct rdma_cm_id *id)
{
	struct ibv_qp_init_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 1;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	return rdma_create_qp(id, NULL, &attr);
}

static void on_alarm(int sig)
{
	static const char msg[] = "watchdog: hang, exiting\n";

	(void)sig;
	if (write(STDOUT_FILENO, msg, sizeof msg - 1) < 0)
		_exit(4);
	_exit(3);
}

/* Prints the copy counters; 0 if no copy is left. */
static int counters(const char *who)
{
	struct rdmasafe_cm_counters k = { .size = sizeof k };
	int rc = rdmasafe_cm_get_counters(&k); /* 0 or a negative errno */

	if (rc < 0) {
		printf("%s: rdmasafe_cm_counters: %s\n", who, strerror(-rc));
		return 1;
	}
	printf("%s: counters copied=%llu freed=%llu outstanding=%llu\n", who,
	       (unsigned long long)k.copied, (unsigned long long)k.freed,
	       (unsigned long long)k.outstanding);
	return k.outstanding != 0;
}

/* ------------------------------------------------------------ the server */

struct conn {                   /* per-connection state: id->context */
	struct conn *next;      /* live list, then the worker queue */
	struct rdma_cm_id *id;
	struct rdma_cm_event *req;  /* the CONNECT_REQUEST copy, kept */
	const struct hello *hello;  /* points into req */
	struct rdma_cm_event *fin;  /* the copy that ended the connection */
	uint32_t session;
	int established;
};

static struct rdma_event_channel *ch;
static struct conn *conns;      /* live connections */
static unsigned served, refused, failed, sessions;
static volatile sig_atomic_t stop;

static void on_stop(int sig)
{
	stop = sig;
}

/* The worker's queue of finished connections. */
static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_cond = PTHREAD_COND_INITIALIZER;
static struct conn *q_head, **q_tail = &q_head;
static int q_closed;

static void queue_push(struct conn *c)
{
	pthread_mutex_lock(&q_lock);
	c->next = NULL;
	*q_tail = c;
	q_tail = &c->next;
	pthread_cond_signal(&q_cond);
	pthread_mutex_unlock(&q_lock);
}

/* The next finished connection, or NULL once the queue is closed and empty. */
static struct conn *queue_pop(void)
{
	struct conn *c;

	pthread_mutex_lock(&q_lock);
	while (!q_head && !q_closed)
		pthread_cond_wait(&q_cond, &q_lock);
	if ((c = q_head) && !(q_head = c->next))
		q_tail = &q_head;
	pthread_mutex_unlock(&q_lock);
	return c;
}

static void queue_close(void)
{
	pthread_mutex_lock(&q_lock);
	q_closed = 1;
	pthread_cond_broadcast(&q_cond);
	pthread_mutex_unlock(&q_lock);
}

static void refuse(struct rdma_cm_id *id, const char *reason)
{
	struct refusal r;

	memset(&r, 0, sizeof r);
	snprintf(r.reason, sizeof r.reason, "%s", reason);
	r.len = offsetof(struct refusal, reason) + strlen(r.reason) + 1;
	if (rdma_reject(id, &r, r.len))
		perror("server: rdma_reject");
	refused++;
}

static int accept_with_welcome(struct conn *c)
{
	struct welcome w;
	struct rdma_conn_param p;

	memset(&w, 0, sizeof w);
	w.version = HELLO_VERSION;
	w.conn_index = c->hello->conn_index;
	w.session = htobe32(c->session);
	snprintf(w.banner, sizeof w.banner, "session %u for %s, welcome", c->session, c->hello->name);
	w.len = offsetof(struct welcome, banner) + strlen(w.banner) + 1;
	memset(&p, 0, sizeof p);
	p.private_data = &w;
	p.private_data_len = w.len;
	p.responder_resources = p.initiator_depth = 1;
	p.rnr_retry_count = 7;
	return rdma_accept(c->id, &p);
}

static void unlink_conn(struct conn *c)
{
	struct conn **p;

	for (p = &conns; *p; p = &(*p)->next) {
		if (*p == c) {
			*p = c->next;
			break;
		}
	}
}

/* guide:connect-request begin */
/* Returns 1 if it kept the copy, 0 if the caller frees it. */
static int on_connect_request(struct rdma_cm_event *ev)
{
	const struct hello *h = ev->param.conn.private_data;
	const char *why = hello_check(h, ev->param.conn.private_data_len);
	struct conn *c;

	if (why || !(c = calloc(1, sizeof *c))) {
		printf("server: refusing a connection: %s\n", why ? why : "out of memory");
		refuse(ev->id, why ? why : "out of memory");
		rdma_destroy_id(ev->id); /* at once: the copy holds no ack */
		return 0;
	}
	c->req = ev;            /* keep the copy as long as the connection */
	c->hello = h;           /* valid until rdmasafe_event_free(c->req) */
	c->id = ev->id;
	c->session = ++sessions;
	ev->id->context = c;
	c->next = conns;
	conns = c;
	printf("server: hello from client %u conn %u name \"%s\" (hello len %u, "
	       "private_data_len %u) -> session %u\n",
	       be32toh(h->client_id), be16toh(h->conn_index), h->name, h->len,
	       ev->param.conn.private_data_len, c->session);
	if (create_qp(ev->id) || accept_with_welcome(c)) {
		perror("server: rdma_create_qp / rdma_accept");
		unlink_conn(c);
		if (ev->id->qp)
			rdma_destroy_qp(ev->id);
		rdma_destroy_id(ev->id);
		free(c);
		failed++;
		return 0;
	}
	return 1;
}
/* guide:connect-request end */

/* guide:teardown begin */
/* The connection is over: tear it down now, on the event thread, and hand
 * its two copies (CONNECT_REQUEST and this one) to the worker. */
static int finish(struct conn *c, struct rdma_cm_event *ev)
{
	if (ev->event == RDMA_CM_EVENT_DISCONNECTED)
		rdma_disconnect(c->id); /* answers the client's DREQ */
	rdma_destroy_qp(c->id);
	if (rdma_destroy_id(c->id))   /* never waits for a held copy */
		perror("server: rdma_destroy_id");
	c->id = NULL;           /* ev->id and c->req->id dangle from here on */
	if (ev->event == RDMA_CM_EVENT_DISCONNECTED && c->established)
		served++;
	else
		failed++;
	unlink_conn(c);
	c->fin = ev;
	queue_push(c);
	return 1;               /* the worker frees both copies */
}
/* guide:teardown end */

/* guide:worker begin */
static void *worker(void *arg)
{
	struct conn *c;

	(void)arg;
	while ((c = queue_pop())) {
		/* The id is destroyed; the copies are still valid, and ours. */
		printf("worker: session %u ended by %s (status %d): client %u conn %u "
		       "\"%s\" (hello len %u, still readable after rdma_destroy_id)\n",
		       c->session, rdmasafe_event_str(c->fin->event), c->fin->status,
		       be32toh(c->hello->client_id), be16toh(c->hello->conn_index),
		       c->hello->name, c->hello->len);
		rdmasafe_event_free(c->fin);
		rdmasafe_event_free(c->req); /* c->hello dangles now */
		free(c);
	}
	return NULL;
}
/* guide:worker end */

/* Returns 1 if it kept the copy, 0 if the caller frees it. */
static int on_event(struct rdma_cm_event *ev)
{
	struct conn *c = NULL;

	/* guide:route begin */
	/* The id's context as it was when the event was copied: no need to
	 * dereference ev->id (which a worker must never do after the destroy). */
	rdmasafe_event_get_contexts(ev, (void **)&c, NULL);
	/* guide:route end */

	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST:
		return on_connect_request(ev);
	case RDMA_CM_EVENT_ESTABLISHED:
		c->established = 1;
		printf("server: session %u established\n", c->session);
		return 0;
	case RDMA_CM_EVENT_DISCONNECTED:
		printf("server: session %u (client %u conn %u \"%s\") disconnected, %s\n", c->session,
		       be32toh(c->hello->client_id), be16toh(c->hello->conn_index), c->hello->name,
		       c->established ? "served" : "failed");
		return finish(c, ev);
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
		printf("server: session %u: %s (status %d)\n", c->session,
		       rdmasafe_event_str(ev->event), ev->status);
		return finish(c, ev);
	case RDMA_CM_EVENT_TIMEWAIT_EXIT:
		return 0;
	default:
		printf("server: unexpected %s (status %d)\n", rdmasafe_event_str(ev->event),
		       ev->status);
		return 0;
	}
}

static int server(const struct addrinfo *ai, int ready_fd)
{
	struct rdma_cm_id *listener = NULL;
	pthread_t tid;
	int rc;

	/* guide:deadline begin */
	/* This server keeps copies past rdma_destroy_id on purpose (the worker
	 * frees them): it gives up librdmacm's destroy barrier, so that no held
	 * copy ever delays a destroy. Copies are then acked when they are got. */
	rdmasafe_cm_set_ack_deadline(0);
	/* guide:deadline end */
	if ((rc = pthread_create(&tid, NULL, worker, NULL))) {
		printf("server: pthread_create: %s\n", strerror(rc));
		return 1;
	}
	if (!(ch = rdma_create_event_channel()) ||
	    rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(listener, ai->ai_addr) || rdma_listen(listener, 8)) {
		perror("server: channel / listener");
		return 1;
	}
	printf("server: listening\n");
	if (write(ready_fd, "r", 1) != 1)
		perror("server: ready pipe");
	close(ready_fd);

	/* guide:loop begin */
	while (!stop && served + refused + failed < NCONN) {
		struct rdma_cm_event *ev;

		if (rdmasafe_get_event(ch, &ev)) {
			if (errno == EINTR)
				continue; /* a signal: look at `stop`, wait again */
			perror("server: rdmasafe_get_event");
			break;
		}
		if (!on_event(ev))      /* 1: on_event kept the copy */
			rdmasafe_event_free(ev); /* never rdma_ack_cm_event */
	}
	/* guide:loop end */

	if (stop)
		printf("server: stopped by signal %d\n", (int)stop);
	while (conns) {         /* (after a stop) */
		struct conn *c = conns;

		conns = c->next;
		if (c->id->qp)
			rdma_destroy_qp(c->id);
		rdma_destroy_id(c->id);
		rdmasafe_event_free(c->req);
		free(c);
	}
	rdma_destroy_id(listener);
	rdma_destroy_event_channel(ch);
	queue_close();
	pthread_join(tid, NULL);
	printf("server: %u served, %u refused, %u failed\n", served, refused, failed);
	rc = counters("server");
	return !rc && !stop && served == NCONN - 1 && refused == 1 && failed == 0 ? 0 : 1;
}

/* ------------------------------------------------------------ the client */

struct cconn {
	struct rdma_cm_id *id;
	unsigned index;
	int refuse_me;          /* sends a hello the server must refuse */
};

static int send_hello(struct cconn *k)
{
	struct hello h;
	struct rdma_conn_param p;

	memset(&h, 0, sizeof h);
	h.version = k->refuse_me ? HELLO_VERSION + 8 : HELLO_VERSION;
	h.conn_index = htobe16(k->index);
	h.client_id = htobe32(CLIENT_ID);
	snprintf(h.name, sizeof h.name, "client-%u.%u", CLIENT_ID, k->index);
	h.len = offsetof(struct hello, name) + strlen(h.name) + 1;
	memset(&p, 0, sizeof p);
	p.private_data = &h;
	p.private_data_len = h.len; /* what we send; the server sees 56 */
	p.responder_resources = p.initiator_depth = 1;
	p.retry_count = p.rnr_retry_count = 7;
	return rdma_connect(k->id, &p);
}

static int check_welcome(struct cconn *k, struct rdma_cm_event *ev)
{
	const struct welcome *w = ev->param.conn.private_data;
	const size_t head = offsetof(struct welcome, banner);
	unsigned n = ev->param.conn.private_data_len;

	if (!w || n < head + 1 || w->len < head + 1 || w->len > n || w->len > sizeof *w ||
	    !memchr(w->banner, '\0', w->len - head) || be16toh(w->conn_index) != k->index) {
		printf("client: conn %u: no valid welcome (private_data_len %u)\n", k->index, n);
		return 0;
	}
	printf("client: conn %u: welcome session %u \"%s\" (welcome len %u, private_data_len %u)\n",
	       k->index, be32toh(w->session), w->banner, w->len, n);
	return !k->refuse_me;
}

static int check_refusal(struct cconn *k, struct rdma_cm_event *ev)
{
	const struct refusal *r = ev->param.conn.private_data;
	const size_t head = offsetof(struct refusal, reason);
	unsigned n = ev->param.conn.private_data_len;

	if (!r || n < head + 1 || r->len < head + 1 || r->len > n || r->len > sizeof *r ||
	    !memchr(r->reason, '\0', r->len - head)) {
		printf("client: conn %u: rejected (status %d), no refusal\n", k->index, ev->status);
		return 0;
	}
	printf("client: conn %u: refused (status %d): \"%s\" (refusal len %u, private_data_len %u)\n",
	       k->index, ev->status, r->reason, r->len, n);
	return k->refuse_me;
}

static int client(const struct addrinfo *ai, int ready_fd)
{
	struct rdma_event_channel *cch;
	struct cconn cc[NCONN];
	unsigned done = 0, ok = 0, i;
	char byte;

	if (read(ready_fd, &byte, 1) != 1) {
		printf("client: the server did not start\n");
		return 1;
	}
	if (!(cch = rdma_create_event_channel())) {
		perror("client: rdma_create_event_channel");
		return 1;
	}
	for (i = 0; i < NCONN; i++) {
		cc[i].index = i;
		cc[i].refuse_me = i == NCONN - 1;
		if (rdma_create_id(cch, &cc[i].id, &cc[i], RDMA_PS_TCP) ||
		    rdma_resolve_addr(cc[i].id, NULL, ai->ai_addr, TIMEOUT_MS)) {
			perror("client: rdma_create_id / rdma_resolve_addr");
			return 1;
		}
	}
	while (done < NCONN) {
		struct rdma_cm_event *ev;
		struct cconn *k;
		int end = 0;

		if (rdmasafe_get_event(cch, &ev)) {
			if (errno == EINTR)
				continue;
			perror("client: rdmasafe_get_event");
			return 1;
		}
		k = ev->id->context;
		switch (ev->event) {
		case RDMA_CM_EVENT_ADDR_RESOLVED:
			end = rdma_resolve_route(ev->id, TIMEOUT_MS) != 0;
			break;
		case RDMA_CM_EVENT_ROUTE_RESOLVED:
			end = create_qp(ev->id) || send_hello(k);
			break;
		case RDMA_CM_EVENT_ESTABLISHED:
			ok += check_welcome(k, ev);
			rdma_disconnect(ev->id);
			break;
		case RDMA_CM_EVENT_DISCONNECTED:
			end = 1;
			break;
		case RDMA_CM_EVENT_REJECTED:
			ok += check_refusal(k, ev);
			end = 1;
			break;
		default:
			printf("client: conn %u: unexpected %s (status %d)\n", k->index,
			       rdmasafe_event_str(ev->event), ev->status);
			end = 1;
			break;
		}
		rdmasafe_event_free(ev);
		if (end) {
			if (k->id->qp)
				rdma_destroy_qp(k->id);
			rdma_destroy_id(k->id);
			done++;
		}
	}
	rdma_destroy_event_channel(cch);
	printf("client: %u of %u connections as expected\n", ok, NCONN);
	return counters("client") || ok != NCONN ? 1 : 0;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR"), *port = "7490";
	struct addrinfo hints, *ai;
	struct sigaction sa;
	int ready[2], op, rc, status = -1;
	pid_t pid;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((op = getopt(argc, argv, "a:p:")) != -1) {
		switch (op) {
		case 'a': addr = optarg; break;
		case 'p': port = optarg; break;
		default: addr = NULL; break;
		}
	}
	if (!addr || optind != argc) {
		fprintf(stderr, "usage: %s [-a ADDR] [-p PORT] (or set RDMASAFE_TEST_ADDR)\n", argv[0]);
		return 2;
	}
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = AI_NUMERICSERV;
	hints.ai_socktype = SOCK_STREAM;
	if ((rc = getaddrinfo(addr, port, &hints, &ai))) {
		fprintf(stderr, "%s port %s: %s\n", addr, port, gai_strerror(rc));
		return 2;
	}
	signal(SIGALRM, on_alarm);
	if (pipe(ready) || (pid = fork()) < 0) {
		perror("pipe / fork");
		return 1;
	}
	if (pid == 0) {         /* before any librdmacm call in this process */
		close(ready[1]);
		alarm(WATCHDOG_S);
		exit(client(ai, ready[0]));
	}
	close(ready[0]);
	alarm(WATCHDOG_S);
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop; /* no SA_RESTART: waits end with EINTR */
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	rc = server(ai, ready[1]);
	if (rc)
		kill(pid, SIGTERM);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status))
		rc = 1;
	freeaddrinfo(ai);
	printf("cm_server_after: client exit status %d: %s\n",
	       WIFEXITED(status) ? WEXITSTATUS(status) : -1, rc ? "FAILED" : "OK");
	return rc;
}
