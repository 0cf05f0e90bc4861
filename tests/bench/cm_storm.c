/*
 * CM connection storm, cmtime-style: N connections are created, resolved
 * (address, route), given a QP, connected, disconnected and destroyed, each
 * step for all N ids at once; the client times every step.
 *
 * One source, two programs (tests/bench/Makefile):
 *   cm_storm_rdmasafe  (-DUSE_RDMASAFE) gets events with rdmasafe_get_event
 *                      and frees them with rdmasafe_event_free;
 *   cm_storm_raw       the same program with rdma_get_cm_event /
 *                      rdma_ack_cm_event.
 * Both sides handle an event the same way: read what they need, release
 * the event (ack / free), then act on it (accept, destroy, ...).
 *
 *   cm_storm -S -a ADDR -p PORT -c N      server: prints "READY" once
 *                                          listening, exits after N
 *                                          connections were torn down
 *   cm_storm -a ADDR -p PORT -c N         client
 * Options: -t SECS (alarm, default 300), -b BACKLOG (default 4096),
 * -T (one more, idle thread for the whole run: see bench_common.h; the raw
 * program with -T on both sides is the comparison at rdmasafe's threading
 * state, whose ack-deadline thread runs from the first held event).
 * Each side prints one RESULT line (see bench_common.h).
 */
#include "bench_common.h"

#include <getopt.h>
#include <netdb.h>
#include <sys/resource.h>
#include <rdma/rdma_cma.h>
#include <signal.h>

#ifdef USE_RDMASAFE
#include "rdmasafe.h"
#define GET_EVENT(ch, ev) rdmasafe_get_event((ch), (ev))
#define RELEASE_EVENT(ev) rdmasafe_event_free(ev)
#else
#define GET_EVENT(ch, ev) rdma_get_cm_event((ch), (ev))
#define RELEASE_EVENT(ev) rdma_ack_cm_event(ev)
#endif

static const char *addr = NULL;
static const char *port = "7600";
static int conns = 200;
static int backlog = 4096;
static uint64_t events_total;

/* one event, copied out before it is released */
struct ev {
	enum rdma_cm_event_type type;
	int status;
	struct rdma_cm_id *id;
};

static struct ev next_event(struct rdma_event_channel *ch)
{
	struct rdma_cm_event *e;
	if (GET_EVENT(ch, &e))
		DIE("get event");
	struct ev r = { e->event, e->status, e->id };
	if (RELEASE_EVENT(e))
		DIE("release event");
	events_total++;
	return r;
}

static void init_qp_attr(struct ibv_qp_init_attr *a)
{
	memset(a, 0, sizeof(*a));
	a->qp_type = IBV_QPT_RC;
	a->cap.max_send_wr = 1;
	a->cap.max_recv_wr = 1;
	a->cap.max_send_sge = 1;
	a->cap.max_recv_sge = 1;
}

static void print_cpu(struct jline *j)
{
	double u, s;
	cpu_secs(&u, &s);
	j_dbl(j, "cpu_user_s", u);
	j_dbl(j, "cpu_sys_s", s);
}

#ifdef USE_RDMASAFE
static void print_counters(struct jline *j)
{
	struct rdmasafe_cm_counters c = { .size = sizeof c };
	rdmasafe_cm_get_counters(&c);
	j_u64(j, "rs_copied", c.copied);
	j_u64(j, "rs_outstanding", c.outstanding);
	j_u64(j, "rs_slots_allocated", c.slots_allocated);
}
#else
static void print_counters(struct jline *j)
{
	(void)j;
}
#endif

static int server(struct rdma_addrinfo *ai)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *listen_id;
	if (!ch || rdma_create_id(ch, &listen_id, NULL, RDMA_PS_TCP))
		DIE("server: channel / id");
	if (rdma_bind_addr(listen_id, ai->ai_src_addr ? ai->ai_src_addr : ai->ai_dst_addr))
		DIE("server: bind");
	if (rdma_listen(listen_id, backlog))
		DIE("server: listen");
	printf("READY\n");
	fflush(stdout);

	int requests = 0, established = 0, done = 0, other = 0;
	uint64_t t_first = 0;
	while (done < conns) {
		struct ev e = next_event(ch);
		if (!t_first)
			t_first = now_ns();
		switch (e.type) {
		case RDMA_CM_EVENT_CONNECT_REQUEST: {
			struct ibv_qp_init_attr qa;
			init_qp_attr(&qa);
			struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
			requests++;
			if (rdma_create_qp(e.id, NULL, &qa) || rdma_accept(e.id, &cp)) {
				fprintf(stderr, "server: accept failed: %s\n", strerror(errno));
				rdma_reject(e.id, NULL, 0);
				rdma_destroy_qp(e.id);
				rdma_destroy_id(e.id);
				done++;
			}
			break;
		}
		case RDMA_CM_EVENT_ESTABLISHED:
			established++;
			break;
		case RDMA_CM_EVENT_DISCONNECTED:
			rdma_destroy_qp(e.id);
			rdma_destroy_id(e.id);
			done++;
			break;
		default:
			other++;
			fprintf(stderr, "server: %s status %d\n", rdma_event_str(e.type), e.status);
			break;
		}
	}
	uint64_t t_end = now_ns();
	struct jline j;
	j_begin(&j);
	j_str(&j, "role", "server");
	j_u64(&j, "conns", conns);
	j_u64(&j, "requests", requests);
	j_u64(&j, "established", established);
	j_u64(&j, "other_events", other);
	j_u64(&j, "events", events_total);
	j_dbl(&j, "busy_ms", (t_end - t_first) / 1e6);
	print_cpu(&j);
	print_counters(&j);
	j_end(&j);
	rdma_destroy_id(listen_id);
	rdma_destroy_event_channel(ch);
	return 0;
}

/* waits until `want` events of `type` arrived; other events are counted */
static int wait_for(struct rdma_event_channel *ch, enum rdma_cm_event_type type, int want, int *bad)
{
	int got = 0;
	while (got < want) {
		struct ev e = next_event(ch);
		if (e.type == type) {
			got++;
		} else if (e.type == RDMA_CM_EVENT_TIMEWAIT_EXIT) {
			/* harmless: counted as an event, not as a step result */
		} else {
			(*bad)++;
			fprintf(stderr, "client: waiting for %s, got %s status %d\n", rdma_event_str(type),
				rdma_event_str(e.type), e.status);
			if (*bad > 10)
				DIE("client: too many unexpected events");
			got++; /* the id is done for this step either way */
		}
	}
	return got;
}

enum { S_CREATE, S_ADDR, S_ROUTE, S_QP, S_CONNECT, S_DISCONNECT, S_DESTROY, S_N };
static const char *step_name[S_N] = { "create_id",  "resolve_addr", "resolve_route", "create_qp",
				      "connect",    "disconnect",   "destroy" };

static int client(struct rdma_addrinfo *ai)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	if (!ch)
		DIE("client: channel");
	struct rdma_cm_id **ids = calloc((size_t)conns, sizeof(*ids));
	if (!ids)
		DIE("calloc");
	double step_ms[S_N];
	uint64_t step_events[S_N];
	int bad = 0;
	uint64_t a0 = allocs();
	window_begin();
	uint64_t t_all = now_ns();
	for (int s = 0; s < S_N; s++) {
		uint64_t t0 = now_ns(), e0 = events_total;
		switch (s) {
		case S_CREATE:
			for (int i = 0; i < conns; i++)
				if (rdma_create_id(ch, &ids[i], (void *)(intptr_t)i, RDMA_PS_TCP))
					DIE("rdma_create_id %d", i);
			break;
		case S_ADDR:
			for (int i = 0; i < conns; i++)
				if (rdma_resolve_addr(ids[i], ai->ai_src_addr, ai->ai_dst_addr, 5000))
					DIE("rdma_resolve_addr %d", i);
			wait_for(ch, RDMA_CM_EVENT_ADDR_RESOLVED, conns, &bad);
			break;
		case S_ROUTE:
			for (int i = 0; i < conns; i++)
				if (rdma_resolve_route(ids[i], 5000))
					DIE("rdma_resolve_route %d", i);
			wait_for(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, conns, &bad);
			break;
		case S_QP:
			for (int i = 0; i < conns; i++) {
				struct ibv_qp_init_attr qa;
				init_qp_attr(&qa);
				if (rdma_create_qp(ids[i], NULL, &qa))
					DIE("rdma_create_qp %d", i);
			}
			break;
		case S_CONNECT:
			for (int i = 0; i < conns; i++) {
				struct rdma_conn_param cp = { .responder_resources = 1,
							      .initiator_depth = 1,
							      .retry_count = 5,
							      .rnr_retry_count = 5 };
				if (rdma_connect(ids[i], &cp))
					DIE("rdma_connect %d", i);
			}
			wait_for(ch, RDMA_CM_EVENT_ESTABLISHED, conns, &bad);
			break;
		case S_DISCONNECT:
			for (int i = 0; i < conns; i++)
				if (rdma_disconnect(ids[i]))
					DIE("rdma_disconnect %d", i);
			wait_for(ch, RDMA_CM_EVENT_DISCONNECTED, conns, &bad);
			break;
		case S_DESTROY:
			for (int i = 0; i < conns; i++) {
				rdma_destroy_qp(ids[i]);
				if (rdma_destroy_id(ids[i]))
					DIE("rdma_destroy_id %d", i);
			}
			break;
		}
		step_ms[s] = (now_ns() - t0) / 1e6;
		step_events[s] = events_total - e0;
	}
	double total_ms = (now_ns() - t_all) / 1e6;
	window_end();
	uint64_t a1 = allocs();

	struct jline j;
	j_begin(&j);
	j_str(&j, "role", "client");
	j_u64(&j, "conns", conns);
	j_u64(&j, "unexpected_events", bad);
	j_u64(&j, "events", events_total);
	j_dbl(&j, "total_ms", total_ms);
	for (int s = 0; s < S_N; s++) {
		char k[64];
		snprintf(k, sizeof(k), "ms_%s", step_name[s]);
		j_dbl(&j, k, step_ms[s]);
		snprintf(k, sizeof(k), "ev_%s", step_name[s]);
		j_u64(&j, k, step_events[s]);
	}
	j_u64(&j, "allocs_window", a1 - a0);
	print_cpu(&j);
	print_counters(&j);
	j_end(&j);
	free(ids);
	rdma_destroy_event_channel(ch);
	return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	int is_server = 0, secs = 300, thread = 0, op;
	while ((op = getopt(argc, argv, "Sa:p:c:t:b:T")) != -1) {
		switch (op) {
		case 'S':
			is_server = 1;
			break;
		case 'a':
			addr = optarg;
			break;
		case 'p':
			port = optarg;
			break;
		case 'c':
			conns = atoi(optarg);
			break;
		case 't':
			secs = atoi(optarg);
			break;
		case 'b':
			backlog = atoi(optarg);
			break;
		case 'T':
			thread = 1;
			break;
		default:
			fprintf(stderr, "usage: %s [-S] -a ADDR [-p PORT] [-c N] [-t SECS] [-b BACKLOG] [-T]\n", argv[0]);
			return 2;
		}
	}
	if (!addr || conns < 1)
		DIE("need -a ADDR and -c N >= 1");
	alarm((unsigned)secs);
	/* librdmacm gives every QP made without CQs its own completion
	 * channel: 1000 connections need more than the default 1024 fds */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 65536) {
		rl.rlim_cur = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	struct rdma_addrinfo hints = { .ai_port_space = RDMA_PS_TCP }, *ai;
	if (is_server)
		hints.ai_flags = RAI_PASSIVE;
	if (rdma_getaddrinfo(addr, port, &hints, &ai))
		DIE("rdma_getaddrinfo %s:%s", addr, port);
	struct idle_thread idle;
	if (thread)
		idle_thread_start(&idle);
	int rc = is_server ? server(ai) : client(ai);
	rdma_freeaddrinfo(ai);
	if (thread)
		idle_thread_stop(&idle);
	return rc;
}
