/*
 * cq_loop_test: checks the rdmasafe CQ loop C API (include/rdmasafe.h) from C.
 *
 *   cq_loop_test [-n MESSAGES] [-l LOCKSTEP_MESSAGES] [-a ADDR]
 *
 * Part 1, handles and arguments (needs only the device's context): NULL,
 * foreign and destroyed loop pointers, options out of range, CQs on another
 * channel / without a channel / of another device context, the same CQ in
 * two loops, removal of a CQ not in the loop, run_once timeouts, async
 * event arguments and names.
 *
 * Part 2, on the device at $RDMASAFE_TEST_ADDR (rxe0 in the test guest):
 * one RC connection set up with rdmasafe_get_event; the send and receive
 * CQs of both of its QPs (4 CQs) on ONE completion channel in ONE loop.
 * Then, for each mode (event, busy-poll, adaptive; a new loop per mode,
 * the QPs reused) MESSAGES (default 2000) SENDs each way, the next sends
 * and receives posted from the callbacks. Every completion must come
 * exactly once and in wr_id order per QP and queue. The loop runs on a
 * pthread; the main thread checks what is refused while it runs (-EBUSY),
 * stops it from outside while traffic flows (the sends stop at half the
 * stream until then, so a slow main thread cannot find the stream over),
 * checks that every CQ event was acked, and runs it again on the main
 * thread to the end (the last callback stops it). The first callback checks what is refused from
 * inside a callback (-EDEADLK). Then LOCKSTEP_MESSAGES (default 200) each
 * way per mode with one message in flight per QP (latency-bound figures),
 * and a short stream driven by the app's own poll() on
 * rdmasafe_cq_loop_fd plus rdmasafe_cq_loop_run_once(0).
 * At the end: disconnect, rdmasafe_cq_loop_drain_qp on both QPs (flush
 * errors for the posted receives, both markers), rdmasafe_cq_loop_destroy,
 * and ibv_destroy_cq of every CQ must return (SIGALRM watchdog).
 *
 * Per mode and window one parseable line (messages: both ways together):
 *   figures mode=M window=W messages=N completions=C wakeups=W
 *     per_wakeup=X empty_wakeups=E cq_events=V ack_calls=A
 *     acks_per_cq_event=R arm_calls=P watchdog_polls=D
 *     longest_handler_us=H ms=T
 * Some behaviour is reported as "info" lines rather than checked (what a
 * stop requested while the loop is idle or driven by run_once does).
 * Times are checked only where load cannot break them: a wait lasts at
 * least its timeout; "at once" means well before a long timeout, and
 * generous limits (the SIGALRM watchdog per phase) turn a hang into a
 * failure. The machine running this is often busy.
 *
 * Prints one line per check ("ok   ..." or "FAIL ..."), then
 * "cq_loop_test: N passed, M failed"; exits 0 only if M is 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
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
#include <sys/wait.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "check.h"

#include "rdmasafe.h"

#define MSG_SIZE 64
#define SEND_WINDOW 32 /* sends in flight per QP */
#define RECV_DEPTH 64  /* receives kept posted per QP */
#define CQE 256
#define MSG_MAGIC 0x51434c54u /* "TLCQ" */
#define STEP_MS 30000 /* one CM step may take (only turns a hang into a failure) */
#define RUN_ONCE_MESSAGES 200

#define DRAIN_SEND_WR_ID UINT64_MAX
#define DRAIN_RECV_WR_ID (UINT64_MAX - 1)

/* ---------------------------------------------------------------- output */

/* "0", "-EINVAL", "5": a return value of the negative-errno convention. */
static const char *rname(int r)
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

/* A call of the negative-errno convention returned exactly `want`. */
#define CHECK_RC(call, want, what)                                             \
	do {                                                                   \
		int r_ = (call);                                               \
		CHECK(r_ == (want), "%s -> %s", what, rname(r_));              \
	} while (0)

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

static struct rdmasafe_cq_loop_stats stats_of(struct rdmasafe_cq_loop *l)
{
	struct rdmasafe_cq_loop_stats s = { .size = sizeof s };

	if (rdmasafe_cq_loop_get_stats(l, &s))
		CHECK(0, "rdmasafe_cq_loop_get_stats failed");
	return s;
}

static void noop_cb(void *ctx, const struct ibv_wc *wc, int n)
{
	(void)ctx;
	(void)wc;
	(void)n;
}

/* ---------------------------------------------------------- the address */

static struct sockaddr_storage test_addr;

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

/* ================================================ part 1: handles, options */

static struct {
	struct rdmasafe_cq_loop *loop;
	atomic_int rc; /* 1 while running */
} runner;

static void *run_thread(void *arg)
{
	(void)arg;
	atomic_store(&runner.rc, rdmasafe_cq_loop_run(runner.loop));
	return NULL;
}

static void test_bad_handles(const char *what, struct rdmasafe_cq_loop *bad,
			     struct ibv_cq *cq, struct ibv_qp *qp)
{
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	char w[160];

#define BAD(call, name)                                                        \
	do {                                                                   \
		snprintf(w, sizeof w, "%s loop: %s", what, name);              \
		CHECK_RC(call, -EINVAL, w);                                    \
	} while (0)
	BAD(rdmasafe_cq_loop_add_cq(bad, cq, noop_cb, NULL), "rdmasafe_cq_loop_add_cq");
	BAD(rdmasafe_cq_loop_remove_cq(bad, cq), "rdmasafe_cq_loop_remove_cq");
	BAD(rdmasafe_cq_loop_run(bad), "rdmasafe_cq_loop_run");
	BAD(rdmasafe_cq_loop_run_once(bad, 0), "rdmasafe_cq_loop_run_once(0)");
	BAD(rdmasafe_cq_loop_fd(bad), "rdmasafe_cq_loop_fd");
	BAD(rdmasafe_cq_loop_stop(bad), "rdmasafe_cq_loop_stop");
	BAD(rdmasafe_cq_loop_set_outstanding(bad, 1), "rdmasafe_cq_loop_set_outstanding");
	BAD(rdmasafe_cq_loop_get_stats(bad, &st), "rdmasafe_cq_loop_get_stats");
	if (qp)
		BAD(rdmasafe_cq_loop_drain_qp(bad, qp, 0, 100), "rdmasafe_cq_loop_drain_qp");
	BAD(rdmasafe_cq_loop_destroy(bad), "rdmasafe_cq_loop_destroy");
#undef BAD
}

/* Sized output structs (header "Struct sizes"): an older caller's shorter
 * struct gets nothing written past its size; a newer caller's longer one
 * learns how much was filled; an unset size is -EINVAL. */
static void test_stats_sizes(struct rdmasafe_cq_loop *l)
{
	union {
		struct rdmasafe_cq_loop_stats s;
		unsigned char b[sizeof(struct rdmasafe_cq_loop_stats) + 32];
	} u;
	size_t old = offsetof(struct rdmasafe_cq_loop_stats, completions);
	size_t i;
	int clean = 1;

	memset(&u, 0xAA, sizeof u);
	u.s.size = old;
	CHECK_RC(rdmasafe_cq_loop_get_stats(l, &u.s), 0, "get_stats into an older, shorter struct");
	CHECK(u.s.size == old, "older struct: size stays %zu (got %u)", old, u.s.size);
	for (i = old; i < sizeof u; i++)
		clean &= u.b[i] == 0xAA;
	CHECK(clean, "older struct: no byte written past its size");
	memset(&u, 0xAA, sizeof u);
	u.s.size = sizeof u;
	CHECK_RC(rdmasafe_cq_loop_get_stats(l, &u.s), 0, "get_stats into a newer, longer struct");
	CHECK(u.s.size == sizeof(struct rdmasafe_cq_loop_stats), "newer struct: size says %zu bytes filled (got %u)",
	      sizeof(struct rdmasafe_cq_loop_stats), u.s.size);
	clean = 1;
	for (i = sizeof(struct rdmasafe_cq_loop_stats); i < sizeof u; i++)
		clean &= u.b[i] == 0xAA;
	CHECK(clean, "newer struct: nothing written past the library's struct");
	memset(&u, 0, sizeof u);
	CHECK_RC(rdmasafe_cq_loop_get_stats(l, &u.s), -EINVAL, "get_stats with size 0 (never set)");
}

static int make_loop(struct ibv_comp_channel *ch, int mode, struct rdmasafe_cq_loop **out)
{
	struct rdmasafe_cq_loop_options o = { .size = sizeof o };

	o.mode = mode;
	*out = NULL;
	return rdmasafe_cq_loop_create(ch, &o, out);
}

static void test_options(struct ibv_comp_channel *ch)
{
#define OPT(...) { .size = sizeof(struct rdmasafe_cq_loop_options), __VA_ARGS__ }
	static const struct {
		const char *what;
		struct rdmasafe_cq_loop_options o;
	} bad[] = {
		{ "mode 4 (after RDMASAFE_MODE_LEARNING)", OPT(.mode = 4) },
		{ "mode -1", OPT(.mode = -1) },
		{ "poll_batch -1", OPT(.poll_batch = -1) },
		{ "poll_batch 4097", OPT(.poll_batch = 4097) },
		{ "ack_batch -1", OPT(.ack_batch = -1) },
		{ "ack_batch 65537", OPT(.ack_batch = 65537) },
		{ "adaptive_spin_us -1", OPT(.mode = RDMASAFE_MODE_ADAPTIVE, .adaptive_spin_us = -1) },
		{ "watchdog_ms -1", OPT(.watchdog_ms = -1) },
		{ "learn_latency_weight -1", OPT(.mode = RDMASAFE_MODE_LEARNING, .learn_latency_weight = -1) },
		{ "learn_latency_weight 1001", OPT(.mode = RDMASAFE_MODE_LEARNING, .learn_latency_weight = 1001) },
		{ "poll_batch INT_MIN", OPT(.poll_batch = INT_MIN) },
		{ "size 0 (never set)", { .size = 0, .mode = 0 } },
		{ "size 5000", { .size = 5000 } },
	};
	static const struct {
		const char *what;
		struct rdmasafe_cq_loop_options o;
	} good[] = {
		{ "all zero (defaults)", OPT(.mode = 0) },
		{ "poll_batch 4096, ack_batch 65536", OPT(.poll_batch = 4096, .ack_batch = 65536) },
		{ "poll_batch 1, ack_batch 1", OPT(.poll_batch = 1, .ack_batch = 1) },
		{ "busy poll", OPT(.mode = RDMASAFE_MODE_BUSY_POLL) },
		{ "adaptive, spin 1 us, watchdog 5 ms", OPT(.mode = RDMASAFE_MODE_ADAPTIVE, .adaptive_spin_us = 1, .watchdog_ms = 5) },
		{ "solicited only", OPT(.solicited_only = 1) },
		{ "learning (adaptive_spin_us ignored)", OPT(.mode = RDMASAFE_MODE_LEARNING, .adaptive_spin_us = 123) },
		{ "learning, latency weight 1000", OPT(.mode = RDMASAFE_MODE_LEARNING, .learn_latency_weight = 1000) },
		/* an older caller: the struct ends before poll_batch (defaults from there on) */
		{ "truncated (older header)", { .size = offsetof(struct rdmasafe_cq_loop_options, poll_batch), .mode = RDMASAFE_MODE_BUSY_POLL } },
	};
#undef OPT
	struct rdmasafe_cq_loop *l, *sentinel = (struct rdmasafe_cq_loop *)&l;
	size_t i;

	phase = "options";
	for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		l = sentinel;
		int r = rdmasafe_cq_loop_create(ch, &bad[i].o, &l);
		CHECK(r == -EINVAL && l == sentinel,
		      "rdmasafe_cq_loop_create(%s) -> %s, *out untouched", bad[i].what, rname(r));
	}
	CHECK(!(fcntl(ch->fd, F_GETFL) & O_NONBLOCK), "refused creates left the channel fd blocking");
	for (i = 0; i < sizeof good / sizeof good[0]; i++) {
		l = NULL;
		int r = rdmasafe_cq_loop_create(ch, &good[i].o, &l);
		CHECK(r == 0 && l, "rdmasafe_cq_loop_create(%s) -> %s", good[i].what, rname(r));
		if (r == 0)
			CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "rdmasafe_cq_loop_destroy of it");
	}
	{
		/* A newer caller: its struct is longer than ours. Zero bytes past
		 * ours are fine; a field we do not know that is set is -E2BIG. */
		union {
			struct rdmasafe_cq_loop_options o;
			unsigned char b[sizeof(struct rdmasafe_cq_loop_options) + 16];
		} newer;
		memset(&newer, 0, sizeof newer);
		newer.o.size = sizeof newer;
		l = NULL;
		int r = rdmasafe_cq_loop_create(ch, &newer.o, &l);
		CHECK(r == 0 && l, "rdmasafe_cq_loop_create(newer struct, unknown tail zero) -> %s", rname(r));
		if (r == 0)
			CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "rdmasafe_cq_loop_destroy of it");
		newer.b[sizeof(struct rdmasafe_cq_loop_options) + 3] = 1;
		l = sentinel;
		CHECK_RC(rdmasafe_cq_loop_create(ch, &newer.o, &l), -E2BIG,
			 "rdmasafe_cq_loop_create(newer struct, an unknown field set)");
		CHECK(l == sentinel, "E2BIG leaves *out untouched");
	}
	l = sentinel;
	CHECK_RC(rdmasafe_cq_loop_create(NULL, NULL, &l), -EINVAL, "rdmasafe_cq_loop_create(NULL channel)");
	CHECK(l == sentinel, "rdmasafe_cq_loop_create(NULL channel) leaves *out untouched");
	CHECK_RC(rdmasafe_cq_loop_create(ch, NULL, NULL), -EINVAL, "rdmasafe_cq_loop_create(NULL out)");
}

/* ----------------------------------- handles, signals and fork (part 1) */

/* A destroyed loop's handle never reaches a newer loop, whatever memory the
 * newer one gets: destroy, create until the old handle's table cell is
 * reused, then the stale handle is -EINVAL and the new loop intact. */
static void test_stale_handles(struct ibv_comp_channel *ch)
{
	struct rdmasafe_cq_loop *old = NULL, *cur = NULL;
	int i, same = 0;

	phase = "stale handles";
	if (!CHECK(make_loop(ch, RDMASAFE_MODE_EVENT, &old) == 0, "stale: a loop"))
		return;
	CHECK_RC(rdmasafe_cq_loop_destroy(old), 0, "stale: destroyed");
	for (i = 0; i < 64; i++) {
		if (make_loop(ch, RDMASAFE_MODE_EVENT, &cur) != 0)
			break;
		same |= cur == old;
		if (i < 63)
			CHECK_RC(rdmasafe_cq_loop_destroy(cur), 0, "stale: a newer loop destroyed");
	}
	CHECK(!same, "stale: no newer loop got the destroyed loop's handle value (64 creates)");
	CHECK_RC(rdmasafe_cq_loop_destroy(old), -EINVAL, "stale: rdmasafe_cq_loop_destroy of the destroyed handle");
	CHECK_RC(rdmasafe_cq_loop_stop(old), -EINVAL, "stale: rdmasafe_cq_loop_stop of it");
	CHECK_RC(rdmasafe_cq_loop_run_once(old, 0), -EINVAL, "stale: rdmasafe_cq_loop_run_once of it");
	CHECK_RC(rdmasafe_cq_loop_run_once(cur, 0), 0, "stale: the newest loop is intact");
	CHECK_RC(rdmasafe_cq_loop_destroy(cur), 0, "stale: the newest loop destroyed");
	CHECK_RC(rdmasafe_cq_loop_destroy(cur), -EINVAL, "stale: destroyed twice -> -EINVAL");
}

static struct rdmasafe_cq_loop *sig_loop;
static atomic_int sig_handled, sig_errno_changed;

static void on_usr2(int sig)
{
	(void)sig;
	errno = 4711;
	rdmasafe_cq_loop_stop(sig_loop); /* async-signal-safe, keeps errno */
	if (errno != 4711)
		atomic_fetch_add(&sig_errno_changed, 1);
	atomic_fetch_add(&sig_handled, 1);
}

static atomic_int busy_stop;

static void *busy_calls(void *arg)
{
	struct rdmasafe_cq_loop_stats s;
	(void)arg;
	while (!atomic_load(&busy_stop)) {
		memset(&s, 0, sizeof s);
		s.size = sizeof s;
		rdmasafe_cq_loop_get_stats(sig_loop, &s);
		rdmasafe_cq_loop_set_outstanding(sig_loop, 0);
		rdmasafe_cq_loop_fd(sig_loop);
	}
	return NULL;
}

static atomic_int run_once_done;

static void *run_once_forever(void *arg)
{
	intptr_t r;

	(void)arg;
	r = rdmasafe_cq_loop_run_once(sig_loop, -1);
	atomic_store(&run_once_done, 1);
	return (void *)r;
}

/* A handler that does nothing: a signal only interrupts a wait. */
static void on_sig_nop(int sig)
{
	(void)sig;
}

static void *run_loop(void *arg)
{
	(void)arg;
	return (void *)(intptr_t)rdmasafe_cq_loop_run(sig_loop);
}

/* rdmasafe_cq_loop_stop from a signal handler that interrupts other loop
 * calls on the same thread, 2000 times: no deadlock (it takes no lock),
 * errno kept. A signal ends run_once(-1) with -EINTR, not run. */
static void test_signals(struct ibv_comp_channel *ch)
{
	struct sigaction sa, old;
	pthread_t t;
	void *ret;
	int i;

	phase = "signals";
	if (!CHECK(make_loop(ch, RDMASAFE_MODE_EVENT, &sig_loop) == 0, "signals: a loop"))
		return;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr2; /* no SA_RESTART */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR2, &sa, &old);
	atomic_store(&busy_stop, 0);
	pthread_create(&t, NULL, busy_calls, NULL);
	for (i = 0; i < 2000; i++) {
		pthread_kill(t, SIGUSR2);
		if (i % 64 == 0)
			sleep_ms(1);
	}
	atomic_store(&busy_stop, 1);
	pthread_join(t, NULL);
	CHECK(atomic_load(&sig_handled) > 0 && atomic_load(&sig_errno_changed) == 0,
	      "signals: rdmasafe_cq_loop_stop from a handler interrupting other loop calls: %d handled, no deadlock, errno kept",
	      atomic_load(&sig_handled));
	/* the pending stop from above: consumed by a run_once */
	CHECK_RC(rdmasafe_cq_loop_run_once(sig_loop, 0), 0, "signals: the pending stop consumed");

	atomic_store(&sig_handled, 0);
	/* run_once(-1) interrupted: -EINTR. A handler that does nothing, sent
	 * until the call returns: a signal before the thread waits is simply
	 * handled (a stopping handler there would make it return 0, a stop,
	 * not the interrupted wait this checks). */
	sigaction(SIGUSR2, &(struct sigaction){ .sa_handler = on_sig_nop }, NULL);
	atomic_store(&run_once_done, 0);
	pthread_create(&t, NULL, run_once_forever, NULL);
	while (!atomic_load(&run_once_done)) {
		pthread_kill(t, SIGUSR2);
		sleep_ms(20);
	}
	pthread_join(t, &ret);
	CHECK((intptr_t)ret == -EINTR,
	      "signals: rdmasafe_cq_loop_run_once(-1) ended by a signal -> %s", rname((int)(intptr_t)ret));
	/* run: signals from a handler that does not stop end nothing; then
	 * the stopping handler ends it */
	sigaction(SIGUSR2, &(struct sigaction){ .sa_handler = SIG_IGN }, NULL);
	pthread_create(&t, NULL, run_loop, NULL);
	for (i = 0; i < 5; i++) {
		sleep_ms(20);
		pthread_kill(t, SIGUSR2);
	}
	sigaction(SIGUSR2, &(struct sigaction){ .sa_handler = on_usr2 }, NULL);
	sleep_ms(50);
	pthread_kill(t, SIGUSR2);
	pthread_join(t, &ret);
	CHECK((intptr_t)ret == 0, "signals: rdmasafe_cq_loop_run kept running through signals and a handler's stop ended it -> %s",
	      rname((int)(intptr_t)ret));
	sigaction(SIGUSR2, &old, NULL);
	CHECK_RC(rdmasafe_cq_loop_destroy(sig_loop), 0, "signals: loop destroyed");
	sig_loop = NULL;
}

/* fork() while other threads are inside the library, 40 times: the child
 * only calls async-signal-safe functions and _exit (the documented rule);
 * every child exits 0, none hangs. */
static void test_fork(struct ibv_comp_channel *ch)
{
	pthread_t t;
	int i, ok = 0;

	phase = "fork";
	if (!CHECK(make_loop(ch, RDMASAFE_MODE_EVENT, &sig_loop) == 0, "fork: a loop"))
		return;
	atomic_store(&busy_stop, 0);
	pthread_create(&t, NULL, busy_calls, NULL);
	for (i = 0; i < 40; i++) {
		pid_t pid = fork();
		int st = 0;
		if (pid == 0) {
			static const char m[] = "child\n";
			if (write(2, m, 0) < 0)
				_exit(2);
			_exit(0);
		}
		if (pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0)
			ok++;
	}
	atomic_store(&busy_stop, 1);
	pthread_join(t, NULL);
	CHECK(ok == 40, "fork: 40 children forked while another thread was inside rdmasafe calls exited 0 (%d)", ok);
	CHECK_RC(rdmasafe_cq_loop_destroy(sig_loop), 0, "fork: loop destroyed");
	sig_loop = NULL;
}

static struct {
	atomic_int calls;
	int result;
	void *object;
} removed;

static void on_removed(void *ctx, void *object, int result)
{
	(void)ctx;
	removed.result = result;
	removed.object = object;
	atomic_fetch_add(&removed.calls, 1);
}

/* add_cq_ex and its sized options, remove_cq_async, destroy_cq (part 1:
 * CQs on the channel, no QP). */
static void test_cq_options_and_async_removal(struct ibv_context *ctx, struct ibv_comp_channel *ch)
{
	struct rdmasafe_cq_loop *l = NULL;
	struct ibv_cq *a = ibv_create_cq(ctx, 16, NULL, ch, 0), *b = ibv_create_cq(ctx, 16, NULL, ch, 0);
	struct rdmasafe_cq_options o = { .size = sizeof o };
	union {
		struct rdmasafe_cq_options o;
		unsigned char bytes[sizeof(struct rdmasafe_cq_options) + 8];
	} newer;
	struct rdmasafe_cq_loop_stats st;

	phase = "CQ options, async removal, destroy_cq";
	if (!CHECK(a && b && make_loop(ch, RDMASAFE_MODE_EVENT, &l) == 0, "options: two CQs and a loop"))
		return;
	o.size = 0;
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, a, &o, noop_cb, NULL), -EINVAL, "add_cq_ex with size 0 (never set)");
	o.size = sizeof o;
	o.notify = 7;
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, a, &o, noop_cb, NULL), -EINVAL, "add_cq_ex with notify 7");
	o.notify = RDMASAFE_NOTIFY_ALL;
	o.budget = -1;
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, a, &o, noop_cb, NULL), -EINVAL, "add_cq_ex with budget -1");
	memset(&newer, 0, sizeof newer);
	newer.o.size = sizeof newer;
	newer.bytes[sizeof(struct rdmasafe_cq_options) + 1] = 1;
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, a, &newer.o, noop_cb, NULL), -E2BIG, "add_cq_ex with a newer struct, unknown field set");
	o.budget = 8;
	o.notify = RDMASAFE_NOTIFY_SOLICITED;
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, a, &o, noop_cb, NULL), 0, "add_cq_ex (solicited only, budget 8)");
	CHECK_RC(rdmasafe_cq_loop_add_cq_ex(l, b, NULL, noop_cb, NULL), 0, "add_cq_ex with NULL options (the loop's defaults)");
	CHECK_RC(rdmasafe_cq_loop_run_once(l, 0), 0, "options: run_once arms both");

	CHECK_RC(rdmasafe_cq_loop_remove_cq_async(l, a, NULL, NULL), -EINVAL, "remove_cq_async(NULL done)");
	atomic_store(&removed.calls, 0);
	CHECK_RC(rdmasafe_cq_loop_remove_cq_async(l, a, on_removed, NULL), 0, "remove_cq_async of an idle loop's CQ");
	CHECK(atomic_load(&removed.calls) == 1 && removed.result == 0 && removed.object == a,
	      "remove_cq_async: done called once (the loop is idle: within the call), result %s, its CQ", rname(removed.result));
	CHECK_RC(rdmasafe_cq_loop_remove_cq_async(l, a, on_removed, NULL), -ENOENT, "remove_cq_async of a CQ not in the loop");
	CHECK(atomic_load(&removed.calls) == 1, "remove_cq_async: done not called for -ENOENT");
	CHECK(ibv_destroy_cq(a) == 0, "ibv_destroy_cq right after the async removal's done -> 0");
	CHECK_RC(rdmasafe_cq_loop_destroy_cq(l, a), -ENOENT, "destroy_cq of a CQ not in the loop");
	CHECK_RC(rdmasafe_cq_loop_destroy_cq(l, b), 0, "rdmasafe_cq_loop_destroy_cq: removed, then ibv_destroy_cq");
	st = stats_of(l);
	CHECK(st.cqs == 0 && st.cqs_added == 2 && st.cqs_removed == 2,
	      "options: stats cqs %" PRIu64 ", added %" PRIu64 ", removed %" PRIu64, st.cqs, st.cqs_added, st.cqs_removed);
	CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "options: loop destroyed");
}

static void test_handles(struct ibv_context *ctx)
{
	struct ibv_comp_channel *ch1 = NULL, *ch2 = NULL, *och = NULL;
	struct ibv_cq *cq1 = NULL, *cq1b = NULL, *cq2 = NULL, *nocq = NULL, *ocq = NULL;
	struct ibv_context *octx = NULL;
	struct rdmasafe_cq_loop *a = NULL, *b = NULL, *d = NULL;
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	uint64_t stack_fake[32] = { 0 };
	void *heap_fake;
	int fl, r;

	phase = "handles and arguments";
	ch1 = ibv_create_comp_channel(ctx);
	ch2 = ibv_create_comp_channel(ctx);
	if (!CHECK(ch1 && ch2, "two completion channels"))
		goto out;
	cq1 = ibv_create_cq(ctx, 16, NULL, ch1, 0);
	cq1b = ibv_create_cq(ctx, 16, NULL, ch1, 0);
	cq2 = ibv_create_cq(ctx, 16, NULL, ch2, 0);
	nocq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!CHECK(cq1 && cq1b && cq2 && nocq, "CQs: two on channel 1, one on channel 2, one without a channel"))
		goto out;

	/* NULL and foreign loop pointers */
	test_bad_handles("NULL", NULL, cq1, NULL);
	test_bad_handles("stack (foreign)", (struct rdmasafe_cq_loop *)stack_fake, cq1, NULL);
	heap_fake = calloc(1, 4096);
	test_bad_handles("heap (foreign)", heap_fake, cq1, NULL);
	free(heap_fake);
	test_bad_handles("CQ pointer as", (struct rdmasafe_cq_loop *)cq1, cq1, NULL);
	CHECK_RC(rdmasafe_cq_loop_run_once(NULL, -2), -EINVAL, "rdmasafe_cq_loop_run_once(NULL, -2)");

	fl = fcntl(ch1->fd, F_GETFL);
	CHECK(fl >= 0 && !(fl & O_NONBLOCK), "channel 1 fd is blocking before a loop exists");
	test_options(ch1);

	phase = "handles: one loop";
	if (!CHECK(make_loop(ch1, RDMASAFE_MODE_EVENT, &a) == 0 && a, "rdmasafe_cq_loop_create on channel 1"))
		goto out;
	test_stats_sizes(a);
	fl = fcntl(ch1->fd, F_GETFL);
	CHECK(fl >= 0 && (fl & O_NONBLOCK), "rdmasafe_cq_loop_create set O_NONBLOCK on the channel fd");
	r = rdmasafe_cq_loop_fd(a);
	CHECK(r >= 0 && r != ch1->fd, "rdmasafe_cq_loop_fd -> %d (the loop's own epoll fd, not the channel's %d)", r, ch1->fd);
	{
		int t = 12345;
		CHECK_RC(rdmasafe_cq_loop_next_timeout_ms(a, &t), 0, "rdmasafe_cq_loop_next_timeout_ms of an idle loop");
		CHECK(t == -1, "an idle loop with no deadline: next timeout -1 (got %d)", t);
		CHECK_RC(rdmasafe_cq_loop_next_timeout_ms(a, NULL), -EINVAL, "rdmasafe_cq_loop_next_timeout_ms(NULL)");
	}
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, NULL, noop_cb, NULL), -EINVAL, "add_cq(NULL cq)");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq1, NULL, NULL), -EINVAL, "add_cq(NULL callback)");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq2, noop_cb, NULL), -EINVAL, "add_cq of a CQ created on ANOTHER comp channel");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, nocq, noop_cb, NULL), -EINVAL, "add_cq of a CQ created without a channel");
	octx = NULL;
	{
		/* a second context of the same device: its CQ is of another context */
		struct ibv_context *oc = ibv_open_device(ctx->device);
		if (oc && (och = ibv_create_comp_channel(oc)) &&
		    (ocq = ibv_create_cq(oc, 16, NULL, och, 0)))
			CHECK_RC(rdmasafe_cq_loop_add_cq(a, ocq, noop_cb, NULL), -EINVAL,
				 "add_cq of a CQ of another device context (second ibv_open_device)");
		else
			info("second device context not available: %s", strerror(errno));
		octx = oc;
	}
	CHECK_RC(rdmasafe_cq_loop_remove_cq(a, cq1), -ENOENT, "remove_cq of a CQ not in the loop");
	CHECK_RC(rdmasafe_cq_loop_remove_cq(a, NULL), -EINVAL, "remove_cq(NULL cq)");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq1, noop_cb, NULL), 0, "add_cq of a CQ on the loop's channel");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq1, noop_cb, NULL), -EBUSY, "add_cq of the same CQ again (same loop)");
	CHECK_RC(rdmasafe_cq_loop_get_stats(a, NULL), -EINVAL, "rdmasafe_cq_loop_get_stats(NULL out)");
	CHECK_RC(rdmasafe_cq_loop_run_once(a, -2), -EINVAL, "rdmasafe_cq_loop_run_once(timeout -2)");
	CHECK_RC(rdmasafe_cq_loop_run_once(a, INT_MIN), -EINVAL, "rdmasafe_cq_loop_run_once(timeout INT_MIN)");
	CHECK_RC(rdmasafe_cq_loop_run_once(a, 0), 0, "rdmasafe_cq_loop_run_once(0) with nothing to do");
	{
		double t0 = now_ms();
		r = rdmasafe_cq_loop_run_once(a, 50);
		double dt = now_ms() - t0;
		/* at least its timeout; at most: it returned (the watchdog bounds a hang) */
		CHECK(r == 0 && dt >= 49.0 && dt < 20000.0, "rdmasafe_cq_loop_run_once(50) with nothing to do -> %s after %.1f ms", rname(r), dt);
	}
	CHECK_RC(rdmasafe_cq_loop_drain_qp(a, NULL, 0, 100), -EINVAL, "rdmasafe_cq_loop_drain_qp(NULL qp)");
	CHECK_RC(rdmasafe_cq_loop_set_outstanding(a, 3), 0, "rdmasafe_cq_loop_set_outstanding(3)");
	CHECK_RC(rdmasafe_cq_loop_set_outstanding(a, 0), 0, "rdmasafe_cq_loop_set_outstanding(0)");
	st = stats_of(a);
	CHECK(st.completions == 0 && st.unacked_now == 0 && st.cq_events == 0,
	      "stats of an idle loop: completions %" PRIu64 ", cq_events %" PRIu64 ", unacked_now %" PRIu64,
	      st.completions, st.cq_events, st.unacked_now);

	/*
	 * A channel has one reader: a second loop on channel 1 is refused (it
	 * would read, and ack, the first loop's CQ events). So the same CQ can
	 * never be in two loops.
	 */
	phase = "handles: two loops";
	b = NULL;
	CHECK_RC(make_loop(ch1, RDMASAFE_MODE_EVENT, &b), -EBUSY, "a second loop on channel 1");
	CHECK(b == NULL, "the refused create leaves *out untouched");
	CHECK_RC(rdmasafe_cq_loop_remove_cq(a, cq1), 0, "remove_cq from the loop");
	CHECK_RC(rdmasafe_cq_loop_remove_cq(a, cq1), -ENOENT, "remove_cq of the same CQ again");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq1b, noop_cb, NULL), 0, "add_cq of the other CQ of channel 1");
	CHECK_RC(rdmasafe_cq_loop_add_cq(a, cq1, noop_cb, NULL), 0, "after its removal the CQ can join again");
	/* an armed CQ gets no event here (no QP), so destroy must not block */
	CHECK_RC(rdmasafe_cq_loop_run_once(a, 0), 0, "run_once(0) arms the CQs (nothing delivered)");

	/*
	 * stop on an idle loop: is the request remembered? (reported, and
	 * what run_once does meanwhile). run goes on a pthread, so a stop that
	 * is not remembered cannot hang the test.
	 */
	{
		double t0, t1, t2, t3;
		int r1, r2, r3, remembered;
		pthread_t th;

		CHECK_RC(rdmasafe_cq_loop_stop(a), 0, "rdmasafe_cq_loop_stop of an idle loop");
		/* "at once": long before its 20 s timeout, however slow this runs */
		t0 = now_ms();
		r1 = rdmasafe_cq_loop_run_once(a, 20000);
		t1 = now_ms();
		r2 = rdmasafe_cq_loop_run_once(a, 100);
		t2 = now_ms();
		CHECK(r1 == 0 && t1 - t0 < 10000.0,
		      "a stop ends the next run_once at once (-> %s after %.1f ms, timeout 20000)", rname(r1), t1 - t0);
		CHECK(r2 == 0 && t2 - t1 >= 99.0,
		      "and is consumed: the following run_once(100) waits (-> %s after %.1f ms)", rname(r2), t2 - t1);
		runner.loop = a;
		atomic_store(&runner.rc, 1);
		remembered = 0;
		if (CHECK(pthread_create(&th, NULL, run_thread, NULL) == 0, "pthread running the idle loop")) {
			for (int i = 0; i < 500 && atomic_load(&runner.rc) == 1; i++)
				sleep_ms(1);
			remembered = atomic_load(&runner.rc) != 1;
			t3 = now_ms();
			if (!remembered)
				rdmasafe_cq_loop_stop(a);
			pthread_join(th, NULL);
			info("stop requested on an idle loop: %s (run returned %s after %.1f ms)",
			     remembered ? "remembered, the next rdmasafe_cq_loop_run returned at once"
					: "not remembered, rdmasafe_cq_loop_run waited for a new stop",
			     rname(atomic_load(&runner.rc)), t3 - t2);
			CHECK(atomic_load(&runner.rc) == 0, "rdmasafe_cq_loop_run of the idle loop returned 0");
		}
		t0 = now_ms();
		r3 = rdmasafe_cq_loop_run_once(a, 30);
		t1 = now_ms();
		CHECK(r3 == 0 && t1 - t0 >= 29.0,
		      "no stale wakeup after a stop: run_once(30) waits (%s after %.1f ms)", rname(r3), t1 - t0);
		t0 = now_ms();
		r3 = rdmasafe_cq_loop_run_once(a, 30);
		t1 = now_ms();
		CHECK(r3 == 0 && t1 - t0 >= 29.0,
		      "then no stop is pending any more: run_once(30) waits (%s after %.1f ms)", rname(r3), t1 - t0);
	}

	phase = "handles: destroyed loop";
	CHECK_RC(rdmasafe_cq_loop_destroy(a), 0, "rdmasafe_cq_loop_destroy (2 armed CQs in it)");
	test_bad_handles("destroyed", a, cq1, NULL);
	CHECK_RC(rdmasafe_cq_loop_destroy(a), -EINVAL, "rdmasafe_cq_loop_destroy twice");
	a = NULL;

	/* a loop on channel 2 takes its CQ; destroying it with the CQ in it */
	if (CHECK(make_loop(ch2, RDMASAFE_MODE_BUSY_POLL, &d) == 0, "a busy-poll loop on channel 2")) {
		CHECK_RC(rdmasafe_cq_loop_add_cq(d, cq2, noop_cb, NULL), 0, "add_cq of channel 2's CQ");
		CHECK_RC(rdmasafe_cq_loop_run_once(d, 0), 0, "busy-poll run_once(0) with nothing to do");
		CHECK_RC(rdmasafe_cq_loop_destroy(d), 0, "rdmasafe_cq_loop_destroy of the busy-poll loop");
	}

out:
	phase = "handles: teardown";
	alarm(60);
	{
		int bad = 0;
		if (cq1 && ibv_destroy_cq(cq1))
			bad++;
		if (cq1b && ibv_destroy_cq(cq1b))
			bad++;
		if (cq2 && ibv_destroy_cq(cq2))
			bad++;
		if (nocq && ibv_destroy_cq(nocq))
			bad++;
		if (ocq && ibv_destroy_cq(ocq))
			bad++;
		CHECK(!bad, "ibv_destroy_cq of the part-1 CQs after their loops were destroyed -> 0 each");
	}
	if (och)
		ibv_destroy_comp_channel(och);
	if (octx)
		ibv_close_device(octx);
	CHECK((!ch1 || ibv_destroy_comp_channel(ch1) == 0) && (!ch2 || ibv_destroy_comp_channel(ch2) == 0),
	      "ibv_destroy_comp_channel of the part-1 channels");
	alarm(120);
}

static struct ibv_context *async_ctx;
static atomic_int async_done;

static void on_usr1_nop(int sig)
{
	(void)sig;
}

static void *async_get_forever(void *arg)
{
	struct rdmasafe_async_event ev = { .size = sizeof ev };
	int r;
	(void)arg;
	r = rdmasafe_async_get(async_ctx, &ev, -1);
	atomic_store(&async_done, 1);
	return (void *)(intptr_t)r;
}

/* A signal ends rdmasafe_async_get(-1) with -EINTR, as it does
 * ibv_get_async_event (a removed rxe device raises no event: a signal is
 * the only way to stop a reader). Signals until it returns: one that comes
 * before the wait starts is lost. The alarm is the watchdog. */
static void test_async_eintr(struct ibv_context *ctx)
{
	struct sigaction sa, old;
	pthread_t t;
	void *ret;

	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_usr1_nop; /* no SA_RESTART */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, &old);
	async_ctx = ctx;
	atomic_store(&async_done, 0);
	pthread_create(&t, NULL, async_get_forever, NULL);
	while (!atomic_load(&async_done)) {
		pthread_kill(t, SIGUSR1);
		sleep_ms(20);
	}
	pthread_join(t, &ret);
	sigaction(SIGUSR1, &old, NULL);
	CHECK((intptr_t)ret == -EINTR, "rdmasafe_async_get(-1) ended by a signal -> %s (want -EINTR)",
	      rname((int)(intptr_t)ret));
}

static void test_async(struct ibv_context *ctx)
{
	struct rdmasafe_async_event ev = { .size = sizeof ev };
	int r, n = 0, names_ok = 1;
	double t0, dt;

	phase = "async events";
	CHECK_RC(rdmasafe_async_get(NULL, &ev, 0), -EINVAL, "rdmasafe_async_get(NULL context)");
	CHECK_RC(rdmasafe_async_get(ctx, NULL, 0), -EINVAL, "rdmasafe_async_get(NULL out)");
	CHECK_RC(rdmasafe_async_get(ctx, &ev, -2), -EINVAL, "rdmasafe_async_get(timeout -2)");
	while ((r = rdmasafe_async_get(ctx, &ev, 0)) == 0 && n < 32) {
		info("async event pending at start: %s (kind %d, port %u)",
		     rdmasafe_async_event_str(ev.event_type), ev.element_kind, ev.port_num);
		n++;
	}
	CHECK(r == -EAGAIN, "rdmasafe_async_get(0) on a quiet device -> %s (want -EAGAIN)", rname(r));
	t0 = now_ms();
	r = rdmasafe_async_get(ctx, &ev, 30);
	dt = now_ms() - t0;
	CHECK(r == -ETIMEDOUT && dt >= 29.0, "rdmasafe_async_get(30) on a quiet device -> %s after %.1f ms", rname(r), dt);
	test_async_eintr(ctx);
	for (uint32_t t = IBV_EVENT_CQ_ERR; t <= IBV_EVENT_WQ_FATAL; t++) {
		const char *a = rdmasafe_async_event_str(t);
		const char *want[] = {
			"IBV_EVENT_CQ_ERR", "IBV_EVENT_QP_FATAL", "IBV_EVENT_QP_REQ_ERR",
			"IBV_EVENT_QP_ACCESS_ERR", "IBV_EVENT_COMM_EST", "IBV_EVENT_SQ_DRAINED",
			"IBV_EVENT_PATH_MIG", "IBV_EVENT_PATH_MIG_ERR", "IBV_EVENT_DEVICE_FATAL",
			"IBV_EVENT_PORT_ACTIVE", "IBV_EVENT_PORT_ERR", "IBV_EVENT_LID_CHANGE",
			"IBV_EVENT_PKEY_CHANGE", "IBV_EVENT_SM_CHANGE", "IBV_EVENT_SRQ_ERR",
			"IBV_EVENT_SRQ_LIMIT_REACHED", "IBV_EVENT_QP_LAST_WQE_REACHED",
			"IBV_EVENT_CLIENT_REREGISTER", "IBV_EVENT_GID_CHANGE", "IBV_EVENT_WQ_FATAL",
		};
		if (!a || strcmp(a, want[t])) {
			CHECK(0, "rdmasafe_async_event_str(%u) = %s, want %s", t, a ? a : "(null)", want[t]);
			names_ok = 0;
		}
	}
	if (names_ok)
		CHECK(1, "rdmasafe_async_event_str(0..%d) name every enum ibv_event_type value", IBV_EVENT_WQ_FATAL);
	{
		const char *s = rdmasafe_async_event_str(1000);
		CHECK(s && !strcmp(s, "IBV_EVENT_UNKNOWN"), "rdmasafe_async_event_str(1000) = %s", s ? s : "(null)");
	}
}

/* ========================================================= part 2: traffic */

struct msg {
	uint32_t magic;
	uint32_t side; /* sender's index */
	uint64_t seq;  /* the sender's send number = the receiver's recv number */
	uint32_t mode;
	uint8_t pad[MSG_SIZE - 20];
};
_Static_assert(sizeof(struct msg) == MSG_SIZE, "message size");

struct side {
	const char *name;
	uint32_t idx;
	struct rdma_cm_id *id;
	struct ibv_qp *qp;
	struct ibv_cq *scq, *rcq;
	uint8_t *sbuf, *rbuf;
	struct side *peer;
	/* cumulative over every stream (the QPs are reused) */
	uint64_t send_posted, send_done, recv_posted, recv_done, send_target;
	uint64_t hold_at; /* no send numbered hold_at or beyond until it is raised */
	uint64_t errors;
	char err[256];
	/* drain */
	uint64_t flush_recv, flush_send, send_marker, recv_marker, after_marker;
};

struct cbctx {
	struct side *s;
	int send;
};

enum { STREAM, DRAIN };

static struct side sides[2];
static struct cbctx cbctx[4];
static struct ibv_pd *pd;
static struct ibv_mr *mr;
static uint8_t *membuf;
static struct ibv_comp_channel *comp;
static struct ibv_cq *spare_cq; /* on `comp`, never in a loop (probes) */
/* on `comp` too: added and removed by the main thread while another runs
 * the loop (not spare_cq, which the in-callback probes may still hold:
 * their add and remove are applied when that callback returns) */
static struct ibv_cq *spare_cq2;
static struct rdmasafe_cq_loop *cur_loop;
static int cb_phase = STREAM, cur_mode, stop_when_done;
static uint64_t window = SEND_WINDOW; /* sends in flight per QP now */
static atomic_int stop_sent;
static atomic_int probe_pending;
/* gate: the first callback of a run waits until the main thread is done
 * with the calls that must find the loop running */
static atomic_int gate_pending, gate_entered, gate_open;

/* results of the calls made from inside a callback */
static struct {
	int done;
	int destroy, run, run_once, add, remove, drain, stats, fd, outstanding, stop_other;
	int remove_again, remove_async; /* spare_cq's removal asked twice more */
	atomic_int async_calls;
	int async_result;
	struct rdmasafe_cq_loop_stats st;
} probe;

static void on_probe_removed(void *ctx, void *object, int result)
{
	(void)ctx;
	(void)object;
	probe.async_result = result;
	atomic_fetch_add(&probe.async_calls, 1);
}

static void note(struct side *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct side *s, const char *fmt, ...)
{
	va_list ap;

	if (s->errors++ == 0) {
		va_start(ap, fmt);
		vsnprintf(s->err, sizeof s->err, fmt, ap);
		va_end(ap);
	}
	/* first failed expectation ends the stream: the driver reports it */
	if (cur_loop)
		rdmasafe_cq_loop_stop(cur_loop);
}

static int post_recv(struct side *s)
{
	uint64_t k = s->recv_posted;
	struct ibv_sge sge = {
		.addr = (uintptr_t)(s->rbuf + (k % RECV_DEPTH) * MSG_SIZE),
		.length = MSG_SIZE,
		.lkey = mr->lkey,
	};
	struct ibv_recv_wr wr = { .wr_id = k, .sg_list = &sge, .num_sge = 1 }, *bad;
	int r = ibv_post_recv(s->qp, &wr, &bad);

	if (r) {
		note(s, "%s: ibv_post_recv #%" PRIu64 ": %s", s->name, k, ename(r));
		return -1;
	}
	s->recv_posted++;
	return 0;
}

/* Posts the sends the window and the peer's posted receives allow. */
static void pump(struct side *s)
{
	while (s->send_posted < s->send_target && s->send_posted < s->hold_at &&
	       s->send_posted - s->send_done < window &&
	       s->send_posted < s->peer->recv_posted) {
		uint64_t k = s->send_posted;
		struct msg *m = (struct msg *)(s->sbuf + (k % SEND_WINDOW) * MSG_SIZE);
		struct ibv_sge sge = { .addr = (uintptr_t)m, .length = MSG_SIZE, .lkey = mr->lkey };
		struct ibv_send_wr wr = {
			.wr_id = k, .sg_list = &sge, .num_sge = 1,
			.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
		}, *bad;
		int r;

		memset(m, 0, sizeof *m);
		m->magic = MSG_MAGIC;
		m->side = s->idx;
		m->seq = k;
		m->mode = (uint32_t)cur_mode;
		r = ibv_post_send(s->qp, &wr, &bad);
		if (r) {
			note(s, "%s: ibv_post_send #%" PRIu64 ": %s", s->name, k, ename(r));
			return;
		}
		s->send_posted++;
	}
}

static int stream_done(void)
{
	for (int i = 0; i < 2; i++) {
		struct side *s = &sides[i];
		if (s->send_done != s->send_target || s->peer->recv_done != s->send_target)
			return 0;
	}
	return 1;
}

static void maybe_stop(void)
{
	if (stop_when_done && stream_done() && !atomic_exchange(&stop_sent, 1))
		rdmasafe_cq_loop_stop(cur_loop);
}

/* What the API must refuse from inside a callback (once per run). */
static void run_probes(struct cbctx *c)
{
	struct rdmasafe_cq_loop *l = cur_loop;

	probe.destroy = rdmasafe_cq_loop_destroy(l);
	probe.run = rdmasafe_cq_loop_run(l);
	probe.run_once = rdmasafe_cq_loop_run_once(l, 0);
	(void)c;
	probe.add = rdmasafe_cq_loop_add_cq(l, spare_cq, noop_cb, NULL);
	probe.remove = rdmasafe_cq_loop_remove_cq(l, spare_cq); /* applied after the add */
	/* spare_cq stays in the loop until the removal is applied: both are
	 * accepted, then find it gone (the first logged, the second's done) */
	probe.remove_again = rdmasafe_cq_loop_remove_cq(l, spare_cq);
	probe.remove_async = rdmasafe_cq_loop_remove_cq_async(l, spare_cq, on_probe_removed, NULL);
	probe.drain = rdmasafe_cq_loop_drain_qp(l, NULL, 0, 100);
	probe.st.size = sizeof probe.st;
	probe.stats = rdmasafe_cq_loop_get_stats(l, &probe.st);
	probe.fd = rdmasafe_cq_loop_fd(l);
	probe.outstanding = rdmasafe_cq_loop_set_outstanding(l, 0);
	probe.done = 1;
}

static void drain_wc(struct side *s, const struct ibv_wc *wc, int send)
{
	if (wc->wr_id == (send ? DRAIN_SEND_WR_ID : DRAIN_RECV_WR_ID)) {
		if (wc->status != IBV_WC_WR_FLUSH_ERR)
			note(s, "%s: %s marker with status %s", s->name, send ? "send" : "recv",
			     ibv_wc_status_str(wc->status));
		if (wc->qp_num != s->qp->qp_num)
			note(s, "%s: marker with qp_num %u, want %u", s->name, wc->qp_num, s->qp->qp_num);
		if (send)
			s->send_marker++;
		else
			s->recv_marker++;
		return;
	}
	if (send ? s->send_marker : s->recv_marker)
		s->after_marker++;
	/* a flushed request: in order, status FLUSH_ERR (rxe: opcode 0) */
	if (send) {
		if (wc->wr_id != s->send_done)
			note(s, "%s: flushed send wr_id %" PRIu64 ", want %" PRIu64, s->name, wc->wr_id, s->send_done);
		s->send_done = wc->wr_id + 1;
		s->flush_send++;
	} else {
		if (wc->wr_id != s->recv_done)
			note(s, "%s: flushed recv wr_id %" PRIu64 ", want %" PRIu64, s->name, wc->wr_id, s->recv_done);
		s->recv_done = wc->wr_id + 1;
		s->flush_recv++;
	}
	if (wc->status != IBV_WC_WR_FLUSH_ERR && wc->status != IBV_WC_SUCCESS)
		note(s, "%s: drain completion wr_id %" PRIu64 " status %s", s->name, wc->wr_id,
		     ibv_wc_status_str(wc->status));
}

static void on_send(struct side *s, const struct ibv_wc *wc)
{
	if (wc->wr_id != s->send_done)
		note(s, "%s: send completion wr_id %" PRIu64 ", want %" PRIu64 " (order / exactly once)",
		     s->name, wc->wr_id, s->send_done);
	else if (wc->status != IBV_WC_SUCCESS)
		note(s, "%s: send #%" PRIu64 " status %s", s->name, wc->wr_id, ibv_wc_status_str(wc->status));
	else if (wc->opcode != IBV_WC_SEND)
		note(s, "%s: send #%" PRIu64 " opcode %d", s->name, wc->wr_id, wc->opcode);
	else if (wc->qp_num != s->qp->qp_num)
		note(s, "%s: send #%" PRIu64 " qp_num %u", s->name, wc->wr_id, wc->qp_num);
	if (wc->wr_id >= s->send_done && wc->wr_id < s->send_posted)
		s->send_done = wc->wr_id + 1;
}

static void on_recv(struct side *s, const struct ibv_wc *wc)
{
	const struct msg *m = (const struct msg *)(s->rbuf + (wc->wr_id % RECV_DEPTH) * MSG_SIZE);

	if (wc->wr_id != s->recv_done) {
		note(s, "%s: recv completion wr_id %" PRIu64 ", want %" PRIu64 " (order / exactly once)",
		     s->name, wc->wr_id, s->recv_done);
	} else if (wc->status != IBV_WC_SUCCESS) {
		note(s, "%s: recv #%" PRIu64 " status %s", s->name, wc->wr_id, ibv_wc_status_str(wc->status));
	} else if (wc->opcode != IBV_WC_RECV || wc->byte_len != MSG_SIZE || wc->qp_num != s->qp->qp_num) {
		note(s, "%s: recv #%" PRIu64 " opcode %d byte_len %u qp_num %u", s->name, wc->wr_id,
		     wc->opcode, wc->byte_len, wc->qp_num);
	} else if (m->magic != MSG_MAGIC || m->side != s->peer->idx || m->seq != wc->wr_id ||
		   m->mode != (uint32_t)cur_mode) {
		note(s, "%s: recv #%" PRIu64 " carries magic %#x side %u seq %" PRIu64 " mode %u",
		     s->name, wc->wr_id, m->magic, m->side, m->seq, m->mode);
	}
	if (wc->wr_id >= s->recv_done && wc->wr_id < s->recv_posted)
		s->recv_done = wc->wr_id + 1;
	post_recv(s); /* keep RECV_DEPTH posted */
}

static void on_wc(void *ctx, const struct ibv_wc *wc, int n)
{
	struct cbctx *c = ctx;
	struct side *s = c->s;

	if (atomic_exchange(&probe_pending, 0))
		run_probes(c);
	if (atomic_exchange(&gate_pending, 0)) {
		atomic_store(&gate_entered, 1);
		while (!atomic_load(&gate_open))
			sleep_ms(1);
	}
	for (int i = 0; i < n; i++) {
		if (cb_phase == DRAIN)
			drain_wc(s, &wc[i], c->send);
		else if (c->send)
			on_send(s, &wc[i]);
		else
			on_recv(s, &wc[i]);
	}
	if (cb_phase == DRAIN)
		return;
	/* more sends: ours (window) or the peer's (our new receives) */
	pump(c->send ? s : s->peer);
	maybe_stop();
}

/* ------------------------------------------------------ connection setup */

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, int type,
				    struct rdma_cm_id *id, const char *what)
{
	struct rdma_cm_event *ev = NULL;

	if (rdmasafe_get_event_timeout(ch, &ev, STEP_MS)) {
		CHECK(0, "%s: no %s within %d ms (%s)", what, rdmasafe_event_str(type), STEP_MS, ename(errno));
		return NULL;
	}
	if (!CHECK((int)ev->event == type && (!id || ev->id == id) && ev->status == 0,
		   "%s: %s (status %d)", what, rdmasafe_event_str(ev->event), ev->status)) {
		rdmasafe_event_free(ev);
		return NULL;
	}
	return ev;
}

static int expect_free(struct rdma_event_channel *ch, int type, struct rdma_cm_id *id, const char *what)
{
	struct rdma_cm_event *ev = expect(ch, type, id, what);

	if (!ev)
		return -1;
	if (rdmasafe_event_free(ev))
		CHECK(0, "%s: rdmasafe_event_free -> -1/%s", what, ename(errno));
	return 0;
}

static int make_qp(struct side *s)
{
	struct ibv_qp_init_attr attr;

	memset(&attr, 0, sizeof attr);
	attr.qp_type = IBV_QPT_RC;
	attr.send_cq = s->scq;
	attr.recv_cq = s->rcq;
	attr.cap.max_send_wr = SEND_WINDOW + 1;  /* + the drain marker */
	attr.cap.max_recv_wr = RECV_DEPTH + 1;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	if (rdma_create_qp(s->id, pd, &attr))
		return -1;
	s->qp = s->id->qp;
	for (int i = 0; i < RECV_DEPTH; i++)
		if (post_recv(s))
			return -1;
	return 0;
}

static void conn_param(struct rdma_conn_param *p)
{
	memset(p, 0, sizeof *p);
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

static struct rdma_event_channel *sch, *cch;
static struct rdma_cm_id *listener;

/* One RC connection: sides[0] the client, sides[1] the accepted id. */
static int connect_pair(struct ibv_context *ctx, uint16_t port)
{
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	struct sockaddr_storage ss;
	struct side *c = &sides[0], *s = &sides[1];

	phase = "connect";
	c->name = "client";
	s->name = "server";
	c->idx = 0;
	s->idx = 1;
	c->peer = s;
	s->peer = c;
	membuf = aligned_alloc(4096, 2 * (SEND_WINDOW + RECV_DEPTH) * MSG_SIZE);
	if (!CHECK(membuf && (pd = ibv_alloc_pd(ctx)), "PD and buffers"))
		return -1;
	memset(membuf, 0, 2 * (SEND_WINDOW + RECV_DEPTH) * MSG_SIZE);
	mr = ibv_reg_mr(pd, membuf, 2 * (SEND_WINDOW + RECV_DEPTH) * MSG_SIZE, IBV_ACCESS_LOCAL_WRITE);
	if (!CHECK(mr, "ibv_reg_mr"))
		return -1;
	for (int i = 0; i < 2; i++) {
		sides[i].sbuf = membuf + i * (SEND_WINDOW + RECV_DEPTH) * MSG_SIZE;
		sides[i].rbuf = sides[i].sbuf + SEND_WINDOW * MSG_SIZE;
	}
	comp = ibv_create_comp_channel(ctx);
	if (!CHECK(comp, "one completion channel for both sides"))
		return -1;
	c->scq = ibv_create_cq(ctx, CQE, &cbctx[0], comp, 0);
	c->rcq = ibv_create_cq(ctx, CQE, &cbctx[1], comp, 0);
	s->scq = ibv_create_cq(ctx, CQE, &cbctx[2], comp, 0);
	s->rcq = ibv_create_cq(ctx, CQE, &cbctx[3], comp, 0);
	spare_cq = ibv_create_cq(ctx, 16, NULL, comp, 0);
	spare_cq2 = ibv_create_cq(ctx, 16, NULL, comp, 0);
	if (!CHECK(c->scq && c->rcq && s->scq && s->rcq && spare_cq && spare_cq2,
		   "4 CQs (send and receive of both sides) and two spare ones, all on that channel"))
		return -1;
	cbctx[0] = (struct cbctx){ c, 1 };
	cbctx[1] = (struct cbctx){ c, 0 };
	cbctx[2] = (struct cbctx){ s, 1 };
	cbctx[3] = (struct cbctx){ s, 0 };

	if (!CHECK(rdma_create_id(cch, &c->id, NULL, RDMA_PS_TCP) == 0, "client: rdma_create_id"))
		return -1;
	if (!CHECK(rdma_resolve_addr(c->id, NULL, addr_port(&ss, port), 2000) == 0, "client: rdma_resolve_addr") ||
	    expect_free(cch, RDMA_CM_EVENT_ADDR_RESOLVED, c->id, "client: address resolved") ||
	    !CHECK(rdma_resolve_route(c->id, 2000) == 0, "client: rdma_resolve_route") ||
	    expect_free(cch, RDMA_CM_EVENT_ROUTE_RESOLVED, c->id, "client: route resolved"))
		return -1;
	if (!CHECK(c->id->verbs == ctx, "client id on the listener's device context") ||
	    !CHECK(make_qp(c) == 0, "client: RC QP on its 2 CQs, %d receives posted", RECV_DEPTH))
		return -1;
	conn_param(&p);
	if (!CHECK(rdma_connect(c->id, &p) == 0, "client: rdma_connect"))
		return -1;
	if (!(ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL, "server: connect request")))
		return -1;
	s->id = ev->id;
	rdmasafe_event_free(ev);
	if (!CHECK(s->id->verbs == ctx, "server id on the same device context") ||
	    !CHECK(make_qp(s) == 0, "server: RC QP on its 2 CQs, %d receives posted", RECV_DEPTH))
		return -1;
	conn_param(&p);
	if (!CHECK(rdma_accept(s->id, &p) == 0, "server: rdma_accept"))
		return -1;
	if (expect_free(cch, RDMA_CM_EVENT_ESTABLISHED, c->id, "client: established") ||
	    expect_free(sch, RDMA_CM_EVENT_ESTABLISHED, s->id, "server: established"))
		return -1;
	return 0;
}

/* ---------------------------------------------------------------- streams */

static const char *mode_name(int mode)
{
	return mode == RDMASAFE_MODE_EVENT ? "event" : mode == RDMASAFE_MODE_BUSY_POLL ? "busy_poll"
	       : mode == RDMASAFE_MODE_LEARNING ? "learning" : "adaptive";
}

static int add_cqs(struct rdmasafe_cq_loop *l)
{
	int ok = 1;

	for (int i = 0; i < 4; i++) {
		struct ibv_cq *cq = cbctx[i].send ? cbctx[i].s->scq : cbctx[i].s->rcq;
		if (rdmasafe_cq_loop_add_cq(l, cq, on_wc, &cbctx[i]))
			ok = 0;
	}
	return ok;
}

static uint64_t side_errors(void)
{
	uint64_t e = sides[0].errors + sides[1].errors;

	for (int i = 0; i < 2; i++)
		if (sides[i].errors)
			info("%s: %" PRIu64 " failed expectations, the first: %s", sides[i].name, sides[i].errors, sides[i].err);
	return e;
}

static void print_figures(const char *mode, uint64_t messages, const struct rdmasafe_cq_loop_stats *st, double ms)
{
	printf("figures mode=%s window=%" PRIu64 " messages=%" PRIu64 " completions=%" PRIu64 " wakeups=%" PRIu64
	       " per_wakeup=%.2f empty_wakeups=%" PRIu64 " cq_events=%" PRIu64 " ack_calls=%" PRIu64
	       " acks_per_cq_event=%.4f arm_calls=%" PRIu64 " watchdog_polls=%" PRIu64
	       " longest_handler_us=%.1f ms=%.1f\n",
	       mode, window, messages, st->completions, st->wakeups,
	       st->wakeups ? (double)st->completions / st->wakeups : 0.0, st->empty_wakeups,
	       st->cq_events, st->ack_calls, st->cq_events ? (double)st->ack_calls / st->cq_events : 0.0,
	       st->arm_calls, st->watchdog_polls, st->longest_handler_ns / 1e3, ms);
	fflush(stdout);
}

/*
 * n messages each way in `mode`, at most `win` in flight per QP. With
 * `threaded`: run on a pthread, checks while it runs, stopped from the main
 * thread at about a quarter, then run again on the main thread to the end.
 * Otherwise run on the main thread only.
 */
static void stream_mode(int mode, uint64_t n, uint64_t win, int threaded, int first)
{
	struct rdmasafe_cq_loop *l = NULL;
	struct rdmasafe_cq_loop_options o = { .size = sizeof o };
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	char m[48];
	uint64_t want = 4 * n; /* a send and a receive completion per message, both ways */
	pthread_t th;
	double t0, t1;
	int r;

	snprintf(m, sizeof m, "%s/w%" PRIu64, mode_name(mode), win);
	phase = mode_name(mode);
	window = win;
	o.mode = mode;
	o.adaptive_spin_us = 100;
	if (!CHECK(rdmasafe_cq_loop_create(comp, &o, &l) == 0, "%s: rdmasafe_cq_loop_create (mode %d)", m, mode))
		return;
	if (!CHECK(add_cqs(l), "%s: the 4 CQs added to one loop", m))
		goto out;
	cur_loop = l;
	cur_mode = mode;
	cb_phase = STREAM;
	stop_when_done = 1;
	atomic_store(&stop_sent, 0);
	atomic_store(&probe_pending, first);
	atomic_store(&gate_pending, first);
	atomic_store(&gate_entered, 0);
	atomic_store(&gate_open, 0);
	alarm(300); /* this stream's watchdog */
	for (int i = 0; i < 2; i++) {
		sides[i].send_target += n;
		/* threaded: half the stream until the stop from outside is done */
		sides[i].hold_at = threaded ? sides[i].send_target - n + n / 2 : UINT64_MAX;
	}
	pump(&sides[0]); /* the first window of each side; the rest from callbacks */
	pump(&sides[1]);

	t0 = now_ms();
	if (!threaded)
		goto main_run;
	runner.loop = l;
	atomic_store(&runner.rc, 1);
	if (!CHECK(pthread_create(&th, NULL, run_thread, NULL) == 0, "%s: pthread running the loop", m))
		goto out;
	if (first) {
		/*
		 * Only once a callback runs is the loop surely running (a call
		 * that needs it idle, made while the other thread is still
		 * entering run, would make that run fail with -EBUSY); the
		 * callback waits until these calls are done.
		 */
		while (!atomic_load(&gate_entered))
			sleep_ms(1);
		CHECK_RC(rdmasafe_cq_loop_run(l), -EBUSY, "rdmasafe_cq_loop_run while another thread runs the loop");
		CHECK_RC(rdmasafe_cq_loop_run_once(l, 0), -EBUSY, "rdmasafe_cq_loop_run_once while another thread runs the loop");
		CHECK_RC(rdmasafe_cq_loop_destroy(l), -EBUSY, "rdmasafe_cq_loop_destroy while another thread runs the loop");
		CHECK(rdmasafe_cq_loop_fd(l) >= 0, "rdmasafe_cq_loop_fd while it runs");
		/* the callback waits for the gate: a remove now would wait for
		 * it (the rule: a callback must not wait for a remover) */
		atomic_store(&gate_open, 1);
		CHECK_RC(rdmasafe_cq_loop_add_cq(l, spare_cq2, noop_cb, NULL), 0, "add_cq while another thread runs the loop");
		CHECK_RC(rdmasafe_cq_loop_remove_cq(l, spare_cq2), 0, "remove_cq while another thread runs the loop (returns when it is out)");
		CHECK_RC(rdmasafe_cq_loop_remove_cq(l, spare_cq2), -ENOENT, "remove_cq of it again");
	}
	/* stop from this thread while traffic flows */
	do {
		st = stats_of(l);
		if (st.completions >= want / 4)
			break;
		sleep_ms(1);
	} while (atomic_load(&runner.rc) == 1);
	CHECK_RC(rdmasafe_cq_loop_stop(l), 0, "rdmasafe_cq_loop_stop from another thread");
	pthread_join(th, NULL);
	st = stats_of(l);
	r = atomic_load(&runner.rc);
	CHECK(r == 0, "%s: rdmasafe_cq_loop_run on the pthread returned %s after the stop", m, rname(r));
	CHECK(st.completions < want && !stream_done(),
	      "%s: stopped mid-stream (%" PRIu64 " of %" PRIu64 " completions delivered)", m, st.completions, want);
	CHECK(st.unacked_now == 0 && st.acked_events == st.cq_events,
	      "%s: after the stop unacked_now %" PRIu64 " (cq_events %" PRIu64 ", acked %" PRIu64 " in %" PRIu64 " ack calls)",
	      m, st.unacked_now, st.cq_events, st.acked_events, st.ack_calls);
	if (first) {
		CHECK(probe.done, "the first callback ran the in-callback calls");
		CHECK(probe.destroy == -EDEADLK, "rdmasafe_cq_loop_destroy from inside its own callback -> %s", rname(probe.destroy));
		CHECK(probe.run == -EDEADLK, "rdmasafe_cq_loop_run from inside a callback -> %s", rname(probe.run));
		CHECK(probe.run_once == -EDEADLK, "rdmasafe_cq_loop_run_once from inside a callback -> %s", rname(probe.run_once));
		CHECK(probe.add == RDMASAFE_PENDING, "rdmasafe_cq_loop_add_cq from inside a callback -> %s (RDMASAFE_PENDING)", rname(probe.add));
		CHECK(probe.remove == RDMASAFE_PENDING, "rdmasafe_cq_loop_remove_cq from inside a callback -> %s (RDMASAFE_PENDING)", rname(probe.remove));
		CHECK(probe.remove_again == RDMASAFE_PENDING,
		      "rdmasafe_cq_loop_remove_cq of the same CQ again in that callback -> %s (RDMASAFE_PENDING: still in the loop)",
		      rname(probe.remove_again));
		CHECK(probe.remove_async == 0 && atomic_load(&probe.async_calls) == 1 && probe.async_result == -ENOENT,
		      "rdmasafe_cq_loop_remove_cq_async of it a third time in that callback -> %s, done called %d time(s) with %s "
		      "(0, once, -ENOENT: the first removal took it)",
		      rname(probe.remove_async), atomic_load(&probe.async_calls), rname(probe.async_result));
		CHECK(probe.drain == -EINVAL, "rdmasafe_cq_loop_drain_qp(NULL qp) from inside a callback -> %s", rname(probe.drain));
		CHECK(probe.stats == 0 && probe.fd == rdmasafe_cq_loop_fd(l) && probe.outstanding == 0,
		      "stats, fd and set_outstanding from inside a callback -> %s, %s, %s",
		      rname(probe.stats), rname(probe.fd), rname(probe.outstanding));
	}

	/* the sends held back: posted from here (no callback runs now) */
	for (int i = 0; i < 2; i++)
		sides[i].hold_at = UINT64_MAX;
	pump(&sides[0]);
	pump(&sides[1]);

	/* run again, on this thread, to the end (the last callback stops it) */
main_run:
	r = rdmasafe_cq_loop_run(l);
	t1 = now_ms();
	st = stats_of(l);
	CHECK(r == 0, "%s: rdmasafe_cq_loop_run %son the main thread -> %s", m, threaded ? "again " : "", rname(r));
	CHECK(side_errors() == 0, "%s: every completion as expected (status, opcode, length, payload)", m);
	CHECK(stream_done() && atomic_load(&stop_sent),
	      "%s: %" PRIu64 " messages each way, all sends and receives completed (client %" PRIu64 "/%" PRIu64
	      " sent, %" PRIu64 " received; server %" PRIu64 "/%" PRIu64 " sent, %" PRIu64 " received)",
	      m, n, sides[0].send_done, sides[0].send_target, sides[0].recv_done,
	      sides[1].send_done, sides[1].send_target, sides[1].recv_done);
	CHECK(st.completions == want && st.error_completions == 0,
	      "%s: every completion delivered exactly once, in wr_id order per QP and queue (%" PRIu64 " of %" PRIu64 ")",
	      m, st.completions, want);
	CHECK(st.unacked_now == 0 && st.acked_events == st.cq_events,
	      "%s: after the run unacked_now %" PRIu64 " (cq_events %" PRIu64 " all acked in %" PRIu64 " ack calls)",
	      m, st.unacked_now, st.cq_events, st.ack_calls);
	if (mode == RDMASAFE_MODE_BUSY_POLL)
		CHECK(st.cq_events == 0 && st.arm_calls == 0, "%s: no CQ armed, no CQ event (%" PRIu64 " arms, %" PRIu64 " events)",
		      m, st.arm_calls, st.cq_events);
	else if (mode == RDMASAFE_MODE_EVENT)
		CHECK(st.cq_events > 0 && st.arm_calls > 0, "%s: CQs armed (%" PRIu64 ") and CQ events read (%" PRIu64 ")",
		      m, st.arm_calls, st.cq_events);
	else
		CHECK(st.arm_calls > 0, "%s: CQs armed before sleeping (%" PRIu64 " arms, %" PRIu64 " CQ events)",
		      m, st.arm_calls, st.cq_events);
	print_figures(mode_name(mode), 2 * n, &st, t1 - t0);

out:
	cur_loop = NULL;
	CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "rdmasafe_cq_loop_destroy of the loop");
	alarm(120);
}

/*
 * The app's own poll() on rdmasafe_cq_loop_fd, then run_once(0) when it is
 * readable (event mode): n messages each way, no stop.
 */
static void stream_run_once(uint64_t n)
{
	struct rdmasafe_cq_loop *l = NULL;
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	uint64_t want = 4 * n, delivered = 0;
	int r, calls = 0, stalls = 0, bad = 0, fd;
	double t0;

	phase = "run_once stream";
	alarm(300);
	window = SEND_WINDOW;
	if (!CHECK(make_loop(comp, RDMASAFE_MODE_EVENT, &l) == 0 && add_cqs(l), "run_once: event-mode loop with the 4 CQs"))
		return;
	cur_loop = l;
	cur_mode = 100;
	cb_phase = STREAM;
	stop_when_done = 0;
	for (int i = 0; i < 2; i++) {
		sides[i].send_target += n;
		sides[i].hold_at = UINT64_MAX;
	}
	pump(&sides[0]);
	pump(&sides[1]);
	fd = rdmasafe_cq_loop_fd(l);
	t0 = now_ms();
	/* no priming call: the CQs just added make the fd readable */
	while (!stream_done() && !sides[0].errors && !sides[1].errors && now_ms() - t0 < 240000) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		/* a lost wakeup leaves the fd quiet for good with work
		 * outstanding; 30 s tells that from a slow machine */
		if (poll(&p, 1, 30000) == 0) {
			stalls++;
			info("run_once: fd quiet for 30 s with the stream unfinished (client sent %" PRIu64 ", server sent %" PRIu64 ")",
			     sides[0].send_done, sides[1].send_done);
			break;
		}
		r = rdmasafe_cq_loop_run_once(l, 0);
		calls++;
		if (r < 0)
			bad++;
		else
			delivered += r;
	}
	st = stats_of(l);
	CHECK(side_errors() == 0 && stream_done() && !bad,
	      "run_once: %" PRIu64 " messages each way driven by poll() on the fd + run_once(0), in order (%d calls)", n, calls);
	CHECK(delivered == want && st.completions == want,
	      "run_once: the calls returned %" PRIu64 " completions in all, stats say %" PRIu64 " (want %" PRIu64 ")",
	      delivered, st.completions, want);
	CHECK(stalls == 0, "run_once: the fd never stayed quiet while work was outstanding (%d stalls)", stalls);
	info("run_once: after the stream unacked_now %" PRIu64 " (run_once leaves acks to the ack batch, stop or destroy)",
	     st.unacked_now);
	print_figures("run_once_event", 2 * n, &st, now_ms() - t0);

	/*
	 * A stop requested while the app drives the loop with run_once (as a
	 * callback may do): what do later run_once calls deliver? Reported;
	 * then the request is consumed by a run (on a pthread, stopped again
	 * if it does not return) and run_once must finish the message.
	 */
	{
		uint64_t got = 0, before = stats_of(l).completions;
		double t1, t2;
		pthread_t th;

		for (int i = 0; i < 2; i++)
			sides[i].send_target += 1;
		CHECK_RC(rdmasafe_cq_loop_stop(l), 0, "run_once: rdmasafe_cq_loop_stop while the app drives the loop with run_once");
		pump(&sides[0]);
		pump(&sides[1]);
		sleep_ms(20);
		t1 = now_ms();
		for (int i = 0; i < 5; i++) {
			r = rdmasafe_cq_loop_run_once(l, 100);
			if (r > 0)
				got += (uint64_t)r;
		}
		t2 = now_ms();
		info("run_once after a stop request: 5 calls of run_once(100) delivered %" PRIu64 " of 4 completions in %.1f ms%s",
		     got, t2 - t1, got == 0 ? " (the request stays pending: run_once neither waits nor delivers until a run consumes it)" : "");
		runner.loop = l;
		atomic_store(&runner.rc, 1);
		if (CHECK(pthread_create(&th, NULL, run_thread, NULL) == 0, "run_once: pthread running the loop once")) {
			for (int i = 0; i < 500 && atomic_load(&runner.rc) == 1; i++)
				sleep_ms(1);
			if (atomic_load(&runner.rc) == 1)
				rdmasafe_cq_loop_stop(l);
			pthread_join(th, NULL);
		}
		t1 = now_ms();
		while (!stream_done() && !sides[0].errors && !sides[1].errors && now_ms() - t1 < 60000)
			rdmasafe_cq_loop_run_once(l, 100);
		st = stats_of(l);
		CHECK(stream_done() && side_errors() == 0 && st.completions - before == 4,
		      "run_once: after a run consumed the stop, the message each way completed (%" PRIu64 " completions)",
		      st.completions - before);
	}
	cur_loop = NULL;
	CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "rdmasafe_cq_loop_destroy of the run_once loop (acks what is pending)");
	alarm(120);
}

/* ------------------------------------------------------------- teardown */

static void disconnect_pair(void)
{
	phase = "disconnect";
	CHECK(rdma_disconnect(sides[0].id) == 0, "client: rdma_disconnect");
	if (expect_free(sch, RDMA_CM_EVENT_DISCONNECTED, sides[1].id, "server: disconnected") == 0)
		CHECK(rdma_disconnect(sides[1].id) == 0, "server: rdma_disconnect after DISCONNECTED");
	expect_free(cch, RDMA_CM_EVENT_DISCONNECTED, sides[0].id, "client: disconnected");
}

static struct {
	atomic_int done;
	int result;
	void *object;
} drained;

static void on_drained(void *ctx, void *object, int result)
{
	(void)ctx;
	drained.result = result;
	drained.object = object;
	atomic_store(&drained.done, 1);
}

static void drain_pair(void)
{
	struct rdmasafe_cq_loop *l = NULL;
	struct rdmasafe_cq_loop_stats st = { .size = sizeof st };
	uint64_t pending[2];
	int r;

	phase = "drain";
	if (!CHECK(make_loop(comp, RDMASAFE_MODE_EVENT, &l) == 0, "drain: a new event-mode loop on the channel"))
		return;
	CHECK_RC(rdmasafe_cq_loop_drain_qp(l, sides[0].qp, 0, 1000), -EINVAL, "rdmasafe_cq_loop_drain_qp of a QP whose CQs are not in the loop");
	CHECK_RC(rdmasafe_cq_loop_drain_qp(l, sides[0].qp, 0, 0), -EINVAL, "rdmasafe_cq_loop_drain_qp(timeout 0)");
	CHECK(add_cqs(l), "drain: the 4 CQs added");
	cur_loop = l;
	cb_phase = DRAIN;
	/* both QPs are in the error state since the disconnect: a drain polls
	 * every CQ of the loop, so the first delivers the other's flushes too */
	for (int i = 0; i < 2; i++)
		pending[i] = sides[i].recv_posted - sides[i].recv_done;
	/* the loop runs on a pthread; side 0 is drained from here, blocking
	 * while the other thread runs the loop; side 1 asynchronously */
	runner.loop = l;
	atomic_store(&runner.rc, 1);
	pthread_t th;
	if (!CHECK(pthread_create(&th, NULL, run_thread, NULL) == 0, "drain: pthread running the loop"))
		return;
	sleep_ms(50); /* the pthread enters run (if not yet, the drain runs the loop itself) */
	alarm(120);
	r = rdmasafe_cq_loop_drain_qp(l, sides[0].qp, 0, 60000);
	CHECK(r == 0, "%s: rdmasafe_cq_loop_drain_qp from another thread while the loop runs -> %s", sides[0].name, rname(r));
	CHECK_RC(rdmasafe_cq_loop_drain_qp_async(l, sides[1].qp, 0, 60000, NULL, NULL), -EINVAL,
		 "rdmasafe_cq_loop_drain_qp_async(NULL done)");
	atomic_store(&drained.done, 0);
	CHECK_RC(rdmasafe_cq_loop_drain_qp_async(l, sides[1].qp, 0, 60000, on_drained, &drained), 0,
		 "rdmasafe_cq_loop_drain_qp_async while the loop runs");
	while (!atomic_load(&drained.done))
		sleep_ms(1);
	CHECK(drained.result == 0 && drained.object == sides[1].qp,
	      "%s: the async drain's callback: result %s, its QP", sides[1].name, rname(drained.result));
	CHECK_RC(rdmasafe_cq_loop_stop(l), 0, "drain: stop");
	pthread_join(th, NULL);
	alarm(120);
	for (int i = 0; i < 2; i++) {
		struct side *s = &sides[i];
		CHECK(s->send_marker == 0 && s->recv_marker == 0,
		      "%s: the drain markers are the loop's own: none reached the callback (send %" PRIu64 ", recv %" PRIu64 ")",
		      s->name, s->send_marker, s->recv_marker);
		CHECK(s->flush_recv == pending[i] && s->recv_done == s->recv_posted,
		      "%s: the %" PRIu64 " posted receives flushed (IBV_WC_WR_FLUSH_ERR), in order, before the marker (%" PRIu64 " flushed)",
		      s->name, pending[i], s->flush_recv);
		CHECK(s->flush_send == 0 && s->send_done == s->send_posted && s->after_marker == 0,
		      "%s: no send was left to flush, nothing after the markers", s->name);
	}
	CHECK(side_errors() == 0, "drain: every flush completion as expected");
	st = stats_of(l);
	CHECK(st.error_completions == pending[0] + pending[1],
	      "drain: error completions delivered %" PRIu64 " = flushed receives %" PRIu64 " (the markers are not delivered)",
	      st.error_completions, pending[0] + pending[1]);
	info("drain: stats completions %" PRIu64 " wakeups %" PRIu64 " cq_events %" PRIu64 " unacked_now %" PRIu64,
	     st.completions, st.wakeups, st.cq_events, st.unacked_now);
	{
		struct rdmasafe_async_event ev = { .size = sizeof ev };
		while ((r = rdmasafe_async_get(sides[0].id->verbs, &ev, 0)) == 0)
			info("async event after the drain: %s (kind %d, qp_num %u)",
			     rdmasafe_async_event_str(ev.event_type), ev.element_kind, ev.qp_num);
	}
	cur_loop = NULL;
	CHECK_RC(rdmasafe_cq_loop_destroy(l), 0, "drain: rdmasafe_cq_loop_destroy");
}

int main(int argc, char **argv)
{
	const char *addr = getenv("RDMASAFE_TEST_ADDR");
	struct sockaddr_storage ss;
	struct ibv_context *ctx;
	uint64_t n = 2000, lockstep = 200;
	uint16_t port;
	int opt;

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(120);
	while ((opt = getopt(argc, argv, "n:l:a:")) != -1) {
		switch (opt) {
		case 'n':
			n = strtoull(optarg, NULL, 0);
			break;
		case 'l':
			lockstep = strtoull(optarg, NULL, 0);
			break;
		case 'a':
			addr = optarg;
			break;
		default:
			fprintf(stderr, "usage: %s [-n MESSAGES] [-l LOCKSTEP_MESSAGES] [-a ADDR]\n", argv[0]);
			return 2;
		}
	}
	if (!CHECK(addr && *addr && parse_addr(addr) == 0, "RDMASAFE_TEST_ADDR / -a names an address (%s)", addr ? addr : "unset"))
		goto done;

	phase = "listener";
	sch = rdma_create_event_channel();
	cch = rdma_create_event_channel();
	if (!CHECK(sch && cch, "CM event channels") ||
	    !CHECK(rdma_create_id(sch, &listener, NULL, RDMA_PS_TCP) == 0, "listener: rdma_create_id") ||
	    !CHECK(rdma_bind_addr(listener, addr_port(&ss, 0)) == 0, "listener: rdma_bind_addr %s port 0", addr) ||
	    !CHECK(listener->verbs, "listener bound to a device") ||
	    !CHECK(rdma_listen(listener, 4) == 0, "listener: rdma_listen"))
		goto done;
	ctx = listener->verbs;
	port = ntohs(rdma_get_src_port(listener));
	info("device %s, listening on %s port %u, %" PRIu64 " messages each way per mode (window %d), then %" PRIu64 " (window 1)",
	     ibv_get_device_name(ctx->device), addr, port, n, SEND_WINDOW, lockstep);

	test_handles(ctx);
	{
		struct ibv_comp_channel *tch = ibv_create_comp_channel(ctx);
		if (CHECK(tch != NULL, "a completion channel for the handle / signal / fork checks")) {
			test_stale_handles(tch);
			test_cq_options_and_async_removal(ctx, tch);
			test_signals(tch);
			test_fork(tch);
			ibv_destroy_comp_channel(tch);
		}
	}
	test_async(ctx);

	if (connect_pair(ctx, port) == 0) {
		static const int modes[] = { RDMASAFE_MODE_EVENT, RDMASAFE_MODE_BUSY_POLL, RDMASAFE_MODE_ADAPTIVE,
					     RDMASAFE_MODE_LEARNING };
		for (int i = 0; i < 4; i++)
			stream_mode(modes[i], n, SEND_WINDOW, 1, i == 0);
		for (int i = 0; i < 4; i++)
			stream_mode(modes[i], lockstep, 1, 0, 0);
		stream_run_once(RUN_ONCE_MESSAGES);
		disconnect_pair();
		drain_pair();
	}

	phase = "teardown: rdma_destroy_qp";
	alarm(60);
	for (int i = 0; i < 2; i++)
		if (sides[i].id && sides[i].id->qp)
			rdma_destroy_qp(sides[i].id);
	phase = "teardown: ibv_destroy_cq after rdmasafe_cq_loop_destroy";
	{
		int destroyed = 0, want = 0;
		double t0 = now_ms();
		struct ibv_cq *cqs[] = { sides[0].scq, sides[0].rcq, sides[1].scq, sides[1].rcq, spare_cq, spare_cq2 };
		for (size_t i = 0; i < sizeof cqs / sizeof cqs[0]; i++) {
			if (!cqs[i])
				continue;
			want++;
			if (ibv_destroy_cq(cqs[i]) == 0)
				destroyed++;
		}
		CHECK(want == 6 && destroyed == want,
		      "ibv_destroy_cq returned 0 for all %d CQs of the channel after the loops were destroyed (%.1f ms)",
		      destroyed, now_ms() - t0);
	}
	if (comp)
		CHECK(ibv_destroy_comp_channel(comp) == 0, "ibv_destroy_comp_channel");
	phase = "teardown: ids";
	for (int i = 1; i >= 0; i--)
		if (sides[i].id)
			CHECK(rdma_destroy_id(sides[i].id) == 0, "%s: rdma_destroy_id", sides[i].name);
	if (mr)
		ibv_dereg_mr(mr);
	if (pd)
		ibv_dealloc_pd(pd);
	free(membuf);
	alarm(120);
done:
	phase = "end";
	if (listener)
		rdma_destroy_id(listener);
	if (sch)
		rdma_destroy_event_channel(sch);
	if (cch)
		rdma_destroy_event_channel(cch);
	{
		struct rdmasafe_cm_counters c = { .size = sizeof c };
		if (rdmasafe_cm_get_counters(&c) == 0)
			CHECK(c.outstanding == 0, "CM copies: copied %" PRIu64 ", outstanding %" PRIu64, c.copied, c.outstanding);
	}
	printf("cq_loop_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
