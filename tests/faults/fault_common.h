/*
 * Helpers shared by the fault programs of tests/faults/ (each program is
 * one translation unit and includes this file once).
 *
 * Output conventions (parsed by rdmasafe-capi/tests/faults.rs):
 *   "ok   TEXT" / "FAIL TEXT"   one line per check
 *   "info TEXT"                 context, not parsed
 *   "measure NAME=VALUE"        one figure (times in ms, as a decimal)
 *   "PROG: N passed, M failed"  last line; exit 0 only if M is 0
 * A SIGALRM watchdog turns a hang into "FAIL watchdog fired (hang) in
 * phase: ..." and exit 3.
 *
 * Everything runs through the rdmasafe C API: CM events only with
 * rdmasafe_get_event*, completions only through a rdmasafe CQ loop, async
 * events only with rdmasafe_async_get.
 */
#ifndef FAULT_COMMON_H
#define FAULT_COMMON_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "rdmasafe.h"

/* Not every program uses every helper. */
#define HELPER static __attribute__((unused))

#define STEP_MS 10000 /* how long one expected CM step may take (TCG) */

static const char *prog_name = "fault";
static atomic_int passed, failed;
static const char *volatile phase = "start";

/* ---------------------------------------------------------------- output */

static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

HELPER int check_at(int line, int ok, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
HELPER int check_at(int line, int ok, const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&out_lock);
	printf("%s ", ok ? "ok  " : "FAIL");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	if (!ok)
		printf("  [%s:%d]", prog_name, line);
	printf("\n");
	fflush(stdout);
	pthread_mutex_unlock(&out_lock);
	if (ok)
		atomic_fetch_add(&passed, 1);
	else
		atomic_fetch_add(&failed, 1);
	return ok;
}
#define CHECK(ok, ...) check_at(__LINE__, !!(ok), __VA_ARGS__)

HELPER void info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
HELPER void info(const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&out_lock);
	printf("info ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	pthread_mutex_unlock(&out_lock);
}

/* "measure NAME=VALUE": one figure for the report. */
HELPER void measure(const char *name, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
HELPER void measure(const char *name, const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&out_lock);
	printf("measure %s=", name);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	pthread_mutex_unlock(&out_lock);
}

/* A line the guest scripts wait for ("PROG: NAME"). */
HELPER void milestone(const char *name)
{
	pthread_mutex_lock(&out_lock);
	printf("%s: %s\n", prog_name, name);
	fflush(stdout);
	pthread_mutex_unlock(&out_lock);
}

HELPER int summary(void)
{
	int f = atomic_load(&failed);

	printf("%s: %d passed, %d failed\n", prog_name, atomic_load(&passed), f);
	fflush(stdout);
	return f ? 1 : 0;
}

/* "EINVAL" for EINVAL; "0" for no error. */
HELPER const char *ename(int e)
{
	const char *s = strerrorname_np(e);

	return s ? s : (e ? "E?" : "0");
}

/* "0", "-EINVAL", "5": a return value of the negative-errno convention. */
HELPER const char *rname(int r)
{
	static __thread char buf[4][32];
	static __thread int k;
	char *b = buf[k++ & 3];

	if (r < 0)
		snprintf(b, sizeof buf[0], "-%s", ename(-r));
	else
		snprintf(b, sizeof buf[0], "%d", r);
	return b;
}

/* --------------------------------------------------------------- watchdog */

HELPER void on_alarm(int sig)
{
	static const char a[] = "FAIL watchdog fired (hang) in phase: ";
	const char *p = phase;
	(void)sig;
	if (write(STDOUT_FILENO, a, sizeof a - 1) < 0 ||
	    write(STDOUT_FILENO, p, strlen(p)) < 0 ||
	    write(STDOUT_FILENO, "\n", 1) < 0)
		_exit(4);
	_exit(3);
}

HELPER void watchdog_init(const char *name, unsigned secs)
{
	prog_name = name;
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	signal(SIGPIPE, SIG_IGN);
	alarm(secs);
}

/* ------------------------------------------------------------------ time */

/*
 * Milliseconds since boot (CLOCK_BOOTTIME, the clock of /proc/uptime), so
 * a shell script can stamp a moment that a program compares with.
 */
HELPER double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_BOOTTIME, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

HELPER void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

HELPER int file_exists(const char *path)
{
	struct stat st;

	return path && stat(path, &st) == 0;
}

/* Reads a "SECONDS[.FRACTION]" stamp (e.g. a copy of /proc/uptime) as ms. */
HELPER double read_stamp_ms(const char *path)
{
	FILE *f = path ? fopen(path, "r") : NULL;
	double s = -1;

	if (f) {
		if (fscanf(f, "%lf", &s) != 1)
			s = -1;
		fclose(f);
	}
	return s < 0 ? -1 : s * 1e3;
}

HELPER void touch(const char *path)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);

	if (fd >= 0)
		close(fd);
}

/* --------------------------------------------------------------- address */

HELPER int parse_addr(const char *s, uint16_t port, struct sockaddr_storage *ss)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res;
	int r;

	if (!s) {
		fprintf(stderr, "%s: no address given\n", prog_name);
		return -1;
	}
	r = getaddrinfo(s, NULL, &hints, &res);
	if (r) {
		fprintf(stderr, "getaddrinfo(%s): %s\n", s, gai_strerror(r));
		return -1;
	}
	memset(ss, 0, sizeof *ss);
	memcpy(ss, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	if (ss->ss_family == AF_INET)
		((struct sockaddr_in *)ss)->sin_port = htons(port);
	else
		((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
	return 0;
}

/* ----------------------------------------------------------- CM and ids */

HELPER struct rdma_event_channel *new_channel(int nonblocking)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();

	if (!ch) {
		perror("rdma_create_event_channel");
		return NULL;
	}
	if (nonblocking) {
		int fl = fcntl(ch->fd, F_GETFL);
		if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK)) {
			perror("fcntl");
			rdma_destroy_event_channel(ch);
			return NULL;
		}
	}
	return ch;
}

/* Gets the next event (copy) and checks its type and id. NULL on failure. */
HELPER struct rdma_cm_event *expect(struct rdma_event_channel *ch, int type,
				    struct rdma_cm_id *id, int timeout_ms,
				    const char *what)
{
	struct rdma_cm_event *ev = NULL;

	if (rdmasafe_get_event_timeout(ch, &ev, timeout_ms)) {
		int e = errno;
		CHECK(0, "%s: no %s within %d ms (%s)", what,
		      rdmasafe_event_str(type), timeout_ms, ename(e));
		return NULL;
	}
	if (!CHECK((int)ev->event == type && (!id || ev->id == id),
		   "%s: %s (status %d)", what, rdmasafe_event_str(ev->event),
		   ev->status)) {
		info("%s: wanted %s", what, rdmasafe_event_str(type));
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

HELPER void free_event(struct rdma_cm_event *ev)
{
	int r = rdmasafe_event_free(ev);

	if (r)
		CHECK(0, "rdmasafe_event_free -> %d/%s", r, ename(errno));
}

/* Resolves address and route of `id` (on `ch`) to `dst`. */
HELPER int resolve(struct rdma_event_channel *ch, struct rdma_cm_id *id,
		   struct sockaddr_storage *dst, const char *who)
{
	struct rdma_cm_event *ev;
	char what[96];

	if (!CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)dst, 5000) == 0,
		   "%s: rdma_resolve_addr", who))
		return -1;
	snprintf(what, sizeof what, "%s: address resolved", who);
	if (!(ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id, STEP_MS, what)))
		return -1;
	free_event(ev);
	if (!CHECK(rdma_resolve_route(id, 5000) == 0, "%s: rdma_resolve_route", who))
		return -1;
	snprintf(what, sizeof what, "%s: route resolved", who);
	if (!(ev = expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, id, STEP_MS, what)))
		return -1;
	free_event(ev);
	return 0;
}

HELPER void conn_param(struct rdma_conn_param *p, const void *data,
		       unsigned len, int retry)
{
	memset(p, 0, sizeof *p);
	p->private_data = data;
	p->private_data_len = (uint8_t)len;
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = (uint8_t)retry;
	p->rnr_retry_count = 7;
}

/*
 * Number of cm_ids the kernel lists for this process (`rdma res show
 * cm_id`), or -1 if the tool failed. 0 after teardown: no id leaked.
 */
HELPER int my_cm_ids(void)
{
	char cmd[64], line[512], needle[32];
	FILE *p;
	int n = 0;

	snprintf(cmd, sizeof cmd, "rdma res show cm_id 2>/dev/null");
	snprintf(needle, sizeof needle, " pid %d ", (int)getpid());
	p = popen(cmd, "r");
	if (!p)
		return -1;
	while (fgets(line, sizeof line, p)) {
		size_t l = strlen(line);
		if (l && line[l - 1] == '\n')
			line[l - 1] = ' ';
		if (strstr(line, needle))
			n++;
	}
	if (pclose(p) != 0)
		return -1;
	return n;
}

HELPER void check_counters_zero(const char *when)
{
	struct rdmasafe_cm_counters c = { .size = sizeof c };

	CHECK(rdmasafe_cm_get_counters(&c) == 0, "rdmasafe_cm_get_counters");
	measure("cm_copied", "%" PRIu64, c.copied);
	measure("cm_outstanding", "%" PRIu64, c.outstanding);
	CHECK(c.outstanding == 0 && c.copied == c.freed,
	      "%s: rdmasafe cm counters outstanding %" PRIu64 " (copied %" PRIu64
	      " == freed %" PRIu64 ")", when, c.outstanding, c.copied, c.freed);
}

HELPER void check_no_cm_ids(const char *when)
{
	int n = my_cm_ids();

	measure("cm_ids_left", "%d", n);
	CHECK(n == 0, "%s: the kernel lists %d cm_id(s) of this process (rdma res show cm_id)",
	      when, n);
}

/* ----------------------------------------------------------- async events */

#define MAX_ASYNC 256

struct async_rec {
	struct rdmasafe_async_event ev;
	double t;
};

struct async_reader {
	struct ibv_context *ctx;
	pthread_t thread;
	atomic_int stop;
	atomic_int n;
	int last_err;
	struct async_rec rec[MAX_ASYNC];
};

HELPER void *async_main(void *arg)
{
	struct async_reader *a = arg;

	while (!atomic_load(&a->stop)) {
		struct rdmasafe_async_event ev = { .size = sizeof ev };
		int r = rdmasafe_async_get(a->ctx, &ev, 100);

		if (r == -ETIMEDOUT || r == -EINTR)
			continue;
		if (r) {
			a->last_err = r;
			info("rdmasafe_async_get -> %s; async reader stops", rname(r));
			break;
		}
		int i = atomic_load(&a->n);
		if (i < MAX_ASYNC) {
			a->rec[i].ev = ev;
			a->rec[i].t = now_ms();
			atomic_store(&a->n, i + 1);
		}
		info("async %s (kind %d, element %p, qp_num %u, port %u)",
		     rdmasafe_async_event_str(ev.event_type), ev.element_kind,
		     ev.element, ev.qp_num, ev.port_num);
	}
	return NULL;
}

HELPER int async_start(struct async_reader *a, struct ibv_context *ctx)
{
	memset(a, 0, sizeof *a);
	a->ctx = ctx;
	return pthread_create(&a->thread, NULL, async_main, a);
}

HELPER void async_stop(struct async_reader *a)
{
	atomic_store(&a->stop, 1);
	pthread_join(a->thread, NULL);
}

/* First async event of `type` at or after index `from`, or -1. */
HELPER int async_find(struct async_reader *a, uint32_t type, int from)
{
	int n = atomic_load(&a->n);

	for (int i = from < 0 ? 0 : from; i < n; i++)
		if (a->rec[i].ev.event_type == type)
			return i;
	return -1;
}

HELPER int async_count(struct async_reader *a, uint32_t type)
{
	int n = atomic_load(&a->n), c = 0;

	for (int i = 0; i < n; i++)
		c += a->rec[i].ev.event_type == type;
	return c;
}

/* ------------------------------------------------------------ loop thread */

struct loop_thread {
	struct rdmasafe_cq_loop *loop;
	pthread_t thread;
	int rc;
	int running;
};

HELPER void *loop_main(void *arg)
{
	struct loop_thread *lt = arg;

	lt->rc = rdmasafe_cq_loop_run(lt->loop);
	return NULL;
}

HELPER int loop_start(struct loop_thread *lt, struct rdmasafe_cq_loop *loop)
{
	lt->loop = loop;
	lt->rc = 0;
	lt->running = pthread_create(&lt->thread, NULL, loop_main, lt) == 0;
	return lt->running ? 0 : -1;
}

/* Stops the loop thread; returns what rdmasafe_cq_loop_run returned. */
HELPER int loop_join(struct loop_thread *lt)
{
	if (!lt->running)
		return lt->rc;
	rdmasafe_cq_loop_stop(lt->loop);
	pthread_join(lt->thread, NULL);
	lt->running = 0;
	return lt->rc;
}

HELPER void print_loop_stats(struct rdmasafe_cq_loop *loop, const char *prefix,
			     struct rdmasafe_cq_loop_stats *out)
{
	struct rdmasafe_cq_loop_stats s = { .size = sizeof s };
	char name[64];

	CHECK(rdmasafe_cq_loop_get_stats(loop, &s) == 0, "%s: rdmasafe_cq_loop_stats", prefix);
	info("%s loop: wakeups %" PRIu64 " completions %" PRIu64 " errors %" PRIu64
	     " cq_events %" PRIu64 " acked %" PRIu64 " in %" PRIu64 " calls, unacked_now %" PRIu64
	     ", keepalive probes %" PRIu64 " ok %" PRIu64 " dead %" PRIu64,
	     prefix, s.wakeups, s.completions, s.error_completions, s.cq_events,
	     s.acked_events, s.ack_calls, s.unacked_now, s.keepalive_probes,
	     s.keepalive_probes_ok, s.keepalive_dead);
	snprintf(name, sizeof name, "%s_unacked_now", prefix);
	measure(name, "%" PRIu64, s.unacked_now);
	snprintf(name, sizeof name, "%s_completions", prefix);
	measure(name, "%" PRIu64, s.completions);
	snprintf(name, sizeof name, "%s_error_completions", prefix);
	measure(name, "%" PRIu64, s.error_completions);
	if (out)
		*out = s;
}

/* "IBV_WC_RETRY_EXC_ERR": the enum name of a work completion status. */
HELPER const char *wc_str(int status)
{
#define WC(x) [IBV_WC_##x] = "IBV_WC_" #x
	static const char *const names[] = {
		WC(SUCCESS), WC(LOC_LEN_ERR), WC(LOC_QP_OP_ERR), WC(LOC_EEC_OP_ERR),
		WC(LOC_PROT_ERR), WC(WR_FLUSH_ERR), WC(MW_BIND_ERR), WC(BAD_RESP_ERR),
		WC(LOC_ACCESS_ERR), WC(REM_INV_REQ_ERR), WC(REM_ACCESS_ERR), WC(REM_OP_ERR),
		WC(RETRY_EXC_ERR), WC(RNR_RETRY_EXC_ERR), WC(LOC_RDD_VIOL_ERR),
		WC(REM_INV_RD_REQ_ERR), WC(REM_ABORT_ERR), WC(INV_EECN_ERR),
		WC(INV_EEC_STATE_ERR), WC(FATAL_ERR), WC(RESP_TIMEOUT_ERR), WC(GENERAL_ERR),
	};
#undef WC
	if (status >= 0 && (size_t)status < sizeof names / sizeof names[0] && names[status])
		return names[status];
	return "IBV_WC_UNKNOWN";
}

#endif /* FAULT_COMMON_H */
