/*
 * cm_barrier_test: an rping-shaped program that relies on librdmacm's
 * destroy barrier, switched to rdmasafe by renaming its two calls
 * (rdmasafe_get_event, rdmasafe_event_free; nothing else of rdmasafe).
 * Built with -DRAW the same source calls rdma_get_cm_event /
 * rdma_ack_cm_event: the control. Meant to be built with
 * -fsanitize=address.
 *
 *   cm_barrier_test [-H] [-d MAX_MS]
 *
 * One run forks: the parent is the server, the child the client (a real
 * RC connection on $RDMASAFE_TEST_ADDR, rxe0 in the test guest; the server
 * binds port 0 and passes the port through a pipe once it listens). Each
 * side is shaped like rdma-core's rping (v44): a per-connection struct
 * (`struct conn`, rping's `struct rping_cb`) that is the ids' context, a
 * CM event thread looping get -> handler -> free, and a main thread that
 * waits on the struct's semaphore for each state the handler posts
 * (route resolved / connect request, established, disconnected), moves one
 * message each way, and at DISCONNECTED tears down: QP, CQ, MR, PD,
 * rdma_destroy_id, rdma_destroy_event_channel, free(conn), then joins the
 * CM thread.
 *
 * The DISCONNECTED handler sets conn->state, posts the semaphore and then
 * touches conn again: after a random 0..MAX_MS (default 100) ms it
 * increments conn->late. That is correct with librdmacm: rdma_destroy_id
 * waits until the id's events are acked, and the CM thread acks only after
 * the handler returned, so main cannot free conn while the handler still
 * uses it. The CM thread stops after DISCONNECTED, and it reads neither
 * conn nor the channel after the ack (it was given the channel at start),
 * so the program itself has no race on librdmacm. If a drop-in acks the
 * original before the handler runs, rdma_destroy_id returns at once and
 * the handler writes freed memory: ASan reports a heap-use-after-free.
 * Each side also checks the barrier itself (the handler was done before
 * rdma_destroy_id returned), which fails even when the late write happens
 * to land between the destroy and the free.
 * (Why up to 100 ms: on the TCG guest main needs ~5-50 ms from the post to
 * free(conn); with a handler that goes on for only 0-2 ms the barrier is
 * never needed and the test cannot tell a drop-in without it.)
 *
 * -H (hold): the client's CM thread keeps its DISCONNECTED event, frees it
 * 5 s after the handler, and its handler does not touch conn after the
 * post; the server side runs as without -H but without the late touch.
 * The client's main thread measures how long rdma_destroy_id of the
 * connection blocked and prints `measure destroy_ms=<ms>` (with librdmacm
 * ~5000: the destroy waits for the ack). There is no timed assertion:
 * only that the destroy returned (the watchdog turns a hang into a
 * failure).
 *
 * Prints "ok   ..." / "FAIL ..." lines prefixed by the side, "info" lines,
 * then "cm_barrier_test: N passed, M failed" (both sides); exits 0 only if
 * M is 0 and the client process exited 0. A SIGALRM watchdog (120 s) in
 * each process turns a hang into a failure (exit 3).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
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

#define MSG_SIZE 64
#define STEP_MS 30000	     /* how long a completion may take (turns a hang into a failure) */
#define HOLD_MS 5000	     /* -H: how long the client keeps its DISCONNECTED */
#define MAX_TOUCH_DELAY_MS 100 /* default of -d */
#define WATCHDOG_S 120

#ifdef __SANITIZE_ADDRESS__
/*
 * Sized for the ~1 GiB test guest (two processes per run); overridable
 * with ASAN_OPTIONS. Leak checking stays on: a correct run leaks nothing.
 */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
	return "quarantine_size_mb=32:malloc_context_size=16:detect_leaks=1";
}
#endif

static int hold;
static unsigned max_delay_ms = MAX_TOUCH_DELAY_MS;
/* CLOCK_MONOTONIC ms, for the info lines: when main woke at DISCONNECTED,
 * when its rdma_destroy_id of the connection returned, when it freed the
 * struct, when the handler was done with it */
static double t_posted, t_woke, t_destroyed, t_freed, t_handler_done;

/* ---------------------------------------------------------------- output */

static void sleep_us(unsigned us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (long)(us % 1000000) * 1000 };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

/* 0 .. max, different in every process and run */
static unsigned random_upto(unsigned max)
{
	struct timespec ts;
	uint64_t x;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	x = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
	/* splitmix64 */
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	x ^= x >> 31;
	return (unsigned)(x % ((uint64_t)max + 1));
}

/* ------------------------------------------------------- the connection */

enum state {
	IDLE,
	ADDR_RESOLVED,
	ROUTE_RESOLVED,
	CONNECT_REQUEST,
	CONNECTED,
	DISCONNECTED,
	ERROR,
};

static const char *state_str(enum state s)
{
	static const char *const names[] = { "IDLE", "ADDR_RESOLVED", "ROUTE_RESOLVED",
					     "CONNECT_REQUEST", "CONNECTED", "DISCONNECTED",
					     "ERROR" };

	return s <= ERROR ? names[s] : "?";
}

/* Per connection, like rping's struct rping_cb: the ids' context. */
struct conn {
	int server;
	enum state state; /* written by the CM thread before each sem_post */
	sem_t sem;
	struct rdma_event_channel *channel;
	struct rdma_cm_id *cm_id;	/* client: the connection; server: the listener */
	struct rdma_cm_id *child_cm_id; /* server: the accepted connection */
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	unsigned touch_delay_us; /* how long the DISCONNECTED handler goes on */
	unsigned late;		 /* touches after the DISCONNECTED post */
	unsigned done;		 /* wr_ids whose completion came (bit mask) */
	uint8_t send_buf[MSG_SIZE];
	uint8_t recv_buf[MSG_SIZE];
};

/* What the CM thread does after the handler. */
enum next { GO_ON, STOP, KEEP };

/*
 * The CM event handler, as rping's: finds the connection through the id's
 * context, records the new state, wakes main.
 */
static enum next cma_event_handler(struct rdma_cm_id *id, struct rdma_cm_event *ev)
{
	struct conn *cb = id->context;
	int keep = hold && !cb->server;

	switch (ev->event) {
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		cb->state = ADDR_RESOLVED;
		if (rdma_resolve_route(id, 2000)) {
			perror("rdma_resolve_route");
			cb->state = ERROR;
			sem_post(&cb->sem);
		}
		return GO_ON;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		cb->state = ROUTE_RESOLVED;
		sem_post(&cb->sem);
		return GO_ON;
	case RDMA_CM_EVENT_CONNECT_REQUEST:
		cb->child_cm_id = id;
		cb->state = CONNECT_REQUEST;
		sem_post(&cb->sem);
		return GO_ON;
	case RDMA_CM_EVENT_ESTABLISHED:
		cb->state = CONNECTED;
		sem_post(&cb->sem);
		return GO_ON;
	case RDMA_CM_EVENT_DISCONNECTED:
		cb->state = DISCONNECTED;
		t_posted = now_ms();
		sem_post(&cb->sem);
		if (keep)
			return KEEP; /* -H, client: cb is main's from here on */
		if (hold)
			return STOP; /* -H, server: no late touch */
		/*
		 * Still in the handler: with librdmacm, main's rdma_destroy_id
		 * waits for this event's ack, so cb is still there.
		 */
		sleep_us(cb->touch_delay_us);
		cb->late++;
		t_handler_done = now_ms();
		return STOP;
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		printf("FAIL %s: CM event %s, status %d\n", side, rdma_event_str(ev->event), ev->status);
		fflush(stdout);
		cb->state = ERROR;
		sem_post(&cb->sem);
		return STOP;
	default:
		printf("info %s: CM event %s ignored\n", side, rdma_event_str(ev->event));
		fflush(stdout);
		return GO_ON;
	}
}

/*
 * The CM event thread. It is given the channel at start and reads neither
 * the channel nor the connection after the last event was acked.
 */
static void *cm_thread(void *arg)
{
	struct rdma_event_channel *ch = arg;
	struct rdma_cm_event *ev, *kept = NULL;
	enum next next = GO_ON;
	double t_kept;

	while (next == GO_ON) {
		if (rdmasafe_get_event(ch, &ev)) {
			int e = errno;
			printf("FAIL %s: CM thread: rdmasafe_get_event: %s (%s)\n", side, strerror(e), ename(e));
			fflush(stdout);
			_exit(6);
		}
		next = cma_event_handler(ev->id, ev);
		if (next == KEEP)
			kept = ev;
		else
			rdmasafe_event_free(ev);
	}
	if (kept) {
		t_kept = now_ms();
		while (now_ms() < t_kept + HOLD_MS)
			usleep(10 * 1000);
		rdmasafe_event_free(kept);
		printf("info %s: CM thread freed the kept DISCONNECTED event %.0f ms after its handler\n",
		       side, now_ms() - t_kept);
		fflush(stdout);
	}
	return NULL;
}

/* Waits (watchdog-bounded) for the handler's next post; checks the state. */
static int wait_state(struct conn *cb, enum state want)
{
	int r;

	do
		r = sem_wait(&cb->sem);
	while (r && errno == EINTR);
	return CHECK(cb->state == want, "state %s (want %s)", state_str(cb->state), state_str(want));
}

static int setup_qp(struct conn *cb, struct rdma_cm_id *id)
{
	struct ibv_qp_init_attr attr;

	cb->pd = ibv_alloc_pd(id->verbs);
	cb->cq = cb->pd ? ibv_create_cq(id->verbs, 4, cb, NULL, 0) : NULL;
	if (!cb->cq)
		return -1;
	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = attr.recv_cq = cb->cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 2;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.sq_sig_all = 1;
	if (rdma_create_qp(id, cb->pd, &attr))
		return -1;
	cb->mr = ibv_reg_mr(cb->pd, cb->send_buf, sizeof cb->send_buf + sizeof cb->recv_buf,
			    IBV_ACCESS_LOCAL_WRITE);
	return cb->mr ? 0 : -1;
}

static void free_qp(struct conn *cb, struct rdma_cm_id *id)
{
	if (id && id->qp)
		rdma_destroy_qp(id);
	if (cb->mr)
		ibv_dereg_mr(cb->mr);
	if (cb->cq)
		ibv_destroy_cq(cb->cq);
	if (cb->pd)
		ibv_dealloc_pd(cb->pd);
	cb->mr = NULL;
	cb->cq = NULL;
	cb->pd = NULL;
}

static int post_recv(struct conn *cb, struct rdma_cm_id *id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)cb->recv_buf, .length = MSG_SIZE, .lkey = cb->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad;

	return ibv_post_recv(id->qp, &wr, &bad);
}

static int post_send(struct conn *cb, struct rdma_cm_id *id, const char *text)
{
	struct ibv_sge sge = { .addr = (uintptr_t)cb->send_buf, .length = MSG_SIZE, .lkey = cb->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;

	snprintf((char *)cb->send_buf, MSG_SIZE, "%s", text);
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED;
	return ibv_post_send(id->qp, &wr, &bad);
}

/*
 * Until the completion of wr_id `want` (1 send, 2 receive) has come,
 * within STEP_MS; completions may come in either order (the peer's answer
 * can overtake the ack of our send), each is remembered in cb->done.
 */
static int wait_wc(struct conn *cb, uint64_t want, const char *what)
{
	double end = now_ms() + STEP_MS;
	struct ibv_wc wc;
	int ok = 1;

	while (!(cb->done & (1u << want)) && now_ms() < end) {
		if (ibv_poll_cq(cb->cq, 1, &wc) != 1) {
			usleep(100);
			continue;
		}
		if (wc.status != IBV_WC_SUCCESS || wc.wr_id > 2) {
			CHECK(0, "%s: completion of wr_id %llu: %s", what, (unsigned long long)wc.wr_id,
			      ibv_wc_status_str(wc.status));
			ok = 0;
			continue;
		}
		cb->done |= 1u << wc.wr_id;
	}
	return CHECK(ok && (cb->done & (1u << want)), "%s", what);
}

static struct sockaddr_storage test_addr;

static int parse_addr(const char *s, uint16_t port)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;

	if (getaddrinfo(s, NULL, &hints, &res))
		return -1;
	memcpy(&test_addr, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	if (test_addr.ss_family == AF_INET)
		((struct sockaddr_in *)&test_addr)->sin_port = htons(port);
	else
		((struct sockaddr_in6 *)&test_addr)->sin6_port = htons(port);
	return 0;
}

static struct conn *new_conn(int server)
{
	struct conn *cb = calloc(1, sizeof *cb);

	if (!cb)
		return NULL;
	cb->server = server;
	cb->touch_delay_us = random_upto(max_delay_ms * 1000);
	sem_init(&cb->sem, 0, 0);
	return cb;
}

/* Main's teardown at DISCONNECTED, as rping's: the struct is freed last. */
static void teardown(struct conn *cb, struct rdma_cm_id *conn_id)
{
	double t0, ms;
	int r;

	phase = "teardown";
	free_qp(cb, conn_id);
	t0 = now_ms();
	r = rdma_destroy_id(conn_id);
	t_destroyed = now_ms();
	ms = t_destroyed - t0;
	CHECK(r == 0, "rdma_destroy_id of the connection returned 0 (%.1f ms)", ms);
	if (hold && !cb->server)
		printf("measure destroy_ms=%.1f\n", ms);
	if (cb->server)
		CHECK(rdma_destroy_id(cb->cm_id) == 0, "rdma_destroy_id of the listener");
	rdma_destroy_event_channel(cb->channel);
	sem_destroy(&cb->sem);
	t_freed = now_ms();
	free(cb);
}

/* ------------------------------------------------------------------ sides */

static void run_server(const char *addr, int *port_fd)
{
	struct conn *cb = new_conn(1);
	struct rdma_conn_param p;
	struct rdma_cm_id *child;
	pthread_t tid;
	uint16_t port;
	unsigned delay;
	int ok;

	phase = "listen";
	if (!CHECK(cb && parse_addr(addr, 0) == 0, "address %s", addr))
		return;
	delay = cb->touch_delay_us;
	cb->channel = rdma_create_event_channel();
	ok = cb->channel && rdma_create_id(cb->channel, &cb->cm_id, cb, RDMA_PS_TCP) == 0 &&
	     rdma_bind_addr(cb->cm_id, (struct sockaddr *)&test_addr) == 0 && rdma_listen(cb->cm_id, 1) == 0;
	if (!CHECK(ok, "listening (%s)", ok ? "0" : ename(errno)))
		return;
	port = ntohs(rdma_get_src_port(cb->cm_id));
	info("build %s%s: listening on port %u", BUILD, hold ? ", -H" : "", port);
	if (!CHECK(pthread_create(&tid, NULL, cm_thread, cb->channel) == 0, "CM thread started"))
		return;
	if (write(*port_fd, &port, sizeof port) != sizeof port)
		perror("write port");
	close(*port_fd);
	*port_fd = -1;

	phase = "connect request";
	if (!wait_state(cb, CONNECT_REQUEST))
		goto out; /* (the CM thread ended: nothing more to join on) */
	child = cb->child_cm_id;
	if (!CHECK(setup_qp(cb, child) == 0, "PD, CQ, RC QP, MR on the new id") ||
	    !CHECK(post_recv(cb, child) == 0, "receive posted"))
		goto out;
	memset(&p, 0, sizeof p);
	p.responder_resources = p.initiator_depth = 1;
	p.retry_count = p.rnr_retry_count = 7;
	if (!CHECK(rdma_accept(child, &p) == 0, "rdma_accept"))
		goto out;
	phase = "established";
	if (!wait_state(cb, CONNECTED))
		goto out;
	phase = "ping/pong";
	if (wait_wc(cb, 2, "ping received"))
		CHECK(!strcmp((char *)cb->recv_buf, "ping"), "ping is \"%.8s\"", (char *)cb->recv_buf);
	/*
	 * Not waited for: the client disconnects once it has the pong, and
	 * its QP may go to the error state before it acked it; the send then
	 * completes (flushed) only at this side's rdma_disconnect.
	 */
	CHECK(post_send(cb, child, "pong") == 0, "pong posted");

	phase = "disconnected";
	if (!wait_state(cb, DISCONNECTED))
		goto out;
	t_woke = now_ms();
	CHECK(rdma_disconnect(child) == 0, "rdma_disconnect after DISCONNECTED");
	info("DISCONNECTED handler touches the connection again after %u us", delay);
	teardown(cb, child);
	cb = NULL;
	pthread_join(tid, NULL);
	CHECK(1, "torn down; CM thread joined");
	if (!hold)
		CHECK(t_handler_done > 0 && t_handler_done <= t_destroyed,
		      "the DISCONNECTED handler was done with the connection before rdma_destroy_id returned (librdmacm's barrier; %s)",
		      t_handler_done > t_destroyed ? "it was not" : "it was");
	if (t_handler_done > 0)
		info("after the DISCONNECTED post: main woke at +%.2f ms, destroy returned at +%.2f ms, struct freed at +%.2f ms, handler done at +%.2f ms",
		     t_woke - t_posted, t_destroyed - t_posted, t_freed - t_posted, t_handler_done - t_posted);
	return;
out:
	info("giving up in phase %s", phase);
	printf("cm_barrier_test: %d passed, %d failed (server gave up)\n", passed, failed);
	_exit(1);
}

static void run_client(const char *addr, int port_fd)
{
	struct conn *cb = new_conn(0);
	struct rdma_conn_param p;
	pthread_t tid;
	uint16_t port = 0;
	unsigned delay;

	phase = "wait for the listener";
	if (read(port_fd, &port, sizeof port) != sizeof port || !port) {
		CHECK(0, "the server's port (server gone?)");
		return;
	}
	close(port_fd);
	if (!CHECK(cb && parse_addr(addr, port) == 0, "address %s port %u", addr, port))
		return;
	delay = cb->touch_delay_us;
	cb->channel = rdma_create_event_channel();
	if (!CHECK(cb->channel && rdma_create_id(cb->channel, &cb->cm_id, cb, RDMA_PS_TCP) == 0,
		   "channel and id"))
		return;
	if (!CHECK(pthread_create(&tid, NULL, cm_thread, cb->channel) == 0, "CM thread started"))
		return;

	phase = "resolve";
	if (!CHECK(rdma_resolve_addr(cb->cm_id, NULL, (struct sockaddr *)&test_addr, 2000) == 0,
		   "rdma_resolve_addr") ||
	    !wait_state(cb, ROUTE_RESOLVED))
		goto out;
	if (!CHECK(setup_qp(cb, cb->cm_id) == 0, "PD, CQ, RC QP, MR") ||
	    !CHECK(post_recv(cb, cb->cm_id) == 0, "receive posted"))
		goto out;
	memset(&p, 0, sizeof p);
	p.responder_resources = p.initiator_depth = 1;
	p.retry_count = p.rnr_retry_count = 7;
	phase = "connect";
	if (!CHECK(rdma_connect(cb->cm_id, &p) == 0, "rdma_connect") || !wait_state(cb, CONNECTED))
		goto out;
	phase = "ping/pong";
	if (CHECK(post_send(cb, cb->cm_id, "ping") == 0, "ping posted"))
		wait_wc(cb, 1, "ping sent");
	if (wait_wc(cb, 2, "pong received"))
		CHECK(!strcmp((char *)cb->recv_buf, "pong"), "pong is \"%.8s\"", (char *)cb->recv_buf);

	phase = "disconnect";
	CHECK(rdma_disconnect(cb->cm_id) == 0, "rdma_disconnect");
	if (!wait_state(cb, DISCONNECTED))
		goto out;
	t_woke = now_ms();
	if (!hold)
		info("DISCONNECTED handler touches the connection again after %u us", delay);
	teardown(cb, cb->cm_id);
	cb = NULL;
	pthread_join(tid, NULL);
	CHECK(1, "torn down; CM thread joined");
	if (!hold)
		CHECK(t_handler_done > 0 && t_handler_done <= t_destroyed,
		      "the DISCONNECTED handler was done with the connection before rdma_destroy_id returned (librdmacm's barrier; %s)",
		      t_handler_done > t_destroyed ? "it was not" : "it was");
	if (t_handler_done > 0)
		info("after the DISCONNECTED post: main woke at +%.2f ms, destroy returned at +%.2f ms, struct freed at +%.2f ms, handler done at +%.2f ms",
		     t_woke - t_posted, t_destroyed - t_posted, t_freed - t_posted, t_handler_done - t_posted);
	return;
out:
	info("giving up in phase %s", phase);
	_exit(1);
}

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");
	int port_pipe[2], result_pipe[2], opt, status = 0, counts[2] = { 0, 0 };
	pid_t server_pid = getpid(), child;

	side = "server"; /* the client process says "client" */
	while ((opt = getopt(argc, argv, "Hd:")) != -1) {
		if (opt == 'H') {
			hold = 1;
		} else if (opt == 'd') {
			max_delay_ms = (unsigned)strtoul(optarg, NULL, 0);
		} else {
			fprintf(stderr, "usage: %s [-H] [-d MAX_MS]\n", argv[0]);
			return 2;
		}
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	if (!addr || !*addr) {
		printf("FAIL RDMASAFE_TEST_ADDR is not set\n");
		return 1;
	}
	if (pipe(port_pipe) || pipe(result_pipe)) {
		perror("pipe");
		return 1;
	}
	/* fork before anything of librdmacm exists in this process */
	child = fork();
	if (child < 0) {
		perror("fork");
		return 1;
	}
	if (child == 0) {
		side = "client";
		prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed server */
		if (getppid() != server_pid)
			_exit(1);
		alarm(WATCHDOG_S);
		close(port_pipe[1]);
		close(result_pipe[0]);
		run_client(addr, port_pipe[0]);
		counts[0] = passed;
		counts[1] = failed;
		if (write(result_pipe[1], counts, sizeof counts) != sizeof counts)
			perror("write counts");
		return failed ? 1 : 0;
	}
	alarm(WATCHDOG_S);
	close(port_pipe[0]);
	close(result_pipe[1]);
	run_server(addr, &port_pipe[1]);
	if (port_pipe[1] >= 0)
		close(port_pipe[1]); /* the server gave up before listening */
	if (read(result_pipe[0], counts, sizeof counts) != sizeof counts)
		counts[0] = counts[1] = 0;
	while (waitpid(child, &status, 0) < 0 && errno == EINTR)
		;
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && counts[1] == 0,
	      "client process exited 0 (status 0x%x, %d passed, %d failed)", status, counts[0], counts[1]);
	passed += counts[0];
	failed += counts[1];
	printf("cm_barrier_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
