/*
 * cm_cancel_test: a thread waiting for a CM event can be cancelled
 * (pthread_cancel, then pthread_join), as with librdmacm, whose
 * rdma_get_cm_event is a cancellation point. Programs do this at shutdown
 * (a CM thread cancelled and joined); with rdmasafe it must neither abort
 * the process nor lose anything.
 *
 * For each way of waiting (rdmasafe_get_event; rdmasafe_get_event_timeout
 * with -1 and with 60 s; rdmasafe_get_events with -1; libibverbs'
 * ibv_get_cq_event, which rdmasafe's interposer interposes; and for a
 * device's async events rdmasafe_async_get with -1 and with 60 s, or
 * libibverbs' ibv_get_async_event in the raw build) on a blocking-mode
 * channel with no event: a thread with a cleanup handler waits, main
 * cancels and joins it. Checked: the join reports PTHREAD_CANCELED, the
 * thread's cleanup handler ran, and the thread never returned from the
 * call. The same with a cancellation that is already pending when the
 * call starts (the thread disables cancellation, waits until main has
 * cancelled it, enables cancellation and calls: the first cancellation
 * point inside the call acts on it).
 *
 * Then nothing was lost or leaked: with a limit of one copy
 * (rdmasafe_cm_set_limit(1)) an event is got on the same channel (an id
 * resolves a local address: ADDR_RESOLVED), freed, and the counters show
 * no copy alive. A slot or limit unit kept by a cancelled get would make
 * that get fail with ENOBUFS.
 *
 * rdmasafe build only: rdmasafe_cq_loop_stop called with a cancellation
 * pending is no cancellation point (its wake is a raw write system call):
 * it returns 0, the thread is cancelled at its own next cancellation
 * point, and the stop is kept (the loop's next run returns at once).
 *
 * rdmasafe build only: a trace-level log callback cancels its own thread
 * (the one in rdmasafe_get_event) and calls usleep: the cancellation is
 * deferred while rdmasafe logs, the get returns its event, and the thread
 * is cancelled at its next cancellation point.
 *
 * Built twice: against rdmasafe, and with -DRAW against librdmacm alone
 * (rdma_get_cm_event for the CM ways of waiting, ibv_get_async_event for the
 * async ones): the control that shows the
 * test's shape is librdmacm's own behaviour. Under LD_PRELOAD of
 * rdmasafe's interposer the raw build checks the interposed
 * rdma_get_cm_event the same way.
 *
 * Usage: cm_cancel_test ADDR [destroy]   (ADDR an address of the RDMA
 * device, e.g. 10.77.0.1; "destroy": only the cancelled rdma_destroy_id
 * of cancel_destroy, below). Prints "ok   ..." / "FAIL ..." lines, then
 * "cm_cancel_test: N passed, M failed"; exits 0 only if nothing failed.
 * A watchdog (alarm) turns a hang into a failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

#ifndef RAW
#include "rdmasafe.h"
#endif

#define WATCHDOG_S 120

static int passed, failed;

static int check(int ok, const char *what)
{
	printf("%s %s\n", ok ? "ok  " : "FAIL", what);
	fflush(stdout);
	if (ok)
		passed++;
	else
		failed++;
	return ok;
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "FAIL watchdog: a step hung\n";
	if (write(1, msg, sizeof msg - 1) < 0)
		_exit(98);
	_exit(97);
}

enum way { GET, TIMEOUT_FOREVER, TIMEOUT_60S, BATCH, CQ_EVENT, ASYNC_FOREVER, ASYNC_60S, NWAYS };
static const char *const way_name[NWAYS] = {
#ifdef RAW
	"rdma_get_cm_event",
#else
	"rdmasafe_get_event",
#endif
	"rdmasafe_get_event_timeout(-1)", "rdmasafe_get_event_timeout(60000)",
	"rdmasafe_get_events(-1)", "ibv_get_cq_event",
#ifdef RAW
	"ibv_get_async_event",
#else
	"rdmasafe_async_get(-1)",
#endif
	"rdmasafe_async_get(60000)"
};

struct waiter {
	struct rdma_event_channel *ch;
	struct ibv_comp_channel *cc;
	struct ibv_context *vctx;
	enum way way;
	int pending_first;  /* the cancellation is pending when the call starts */
	atomic_int started;
	atomic_int cancelled; /* main has called pthread_cancel */
	atomic_int cleaned;  /* the cleanup handler ran */
	atomic_int returned; /* the call returned (it must not) */
};

static void cleanup(void *arg)
{
	struct waiter *w = arg;
	atomic_store(&w->cleaned, 1);
}

static int wait_once(struct waiter *w)
{
	struct rdma_cm_event *ev = NULL;
	if (w->way == CQ_EVENT) {
		struct ibv_cq *cq;
		void *ctx;
		return ibv_get_cq_event(w->cc, &cq, &ctx);
	}
#ifdef RAW
	if (w->way == ASYNC_FOREVER) {
		struct ibv_async_event ae;
		return ibv_get_async_event(w->vctx, &ae);
	}
#else
	if (w->way == ASYNC_FOREVER || w->way == ASYNC_60S) {
		struct rdmasafe_async_event ae;
		memset(&ae, 0, sizeof ae);
		ae.size = sizeof ae;
		return rdmasafe_async_get(w->vctx, &ae, w->way == ASYNC_FOREVER ? -1 : 60000);
	}
#endif
#ifdef RAW
	return rdma_get_cm_event(w->ch, &ev);
#else
	struct rdma_cm_event *evs[4];
	switch (w->way) {
	case GET:
		return rdmasafe_get_event(w->ch, &ev);
	case TIMEOUT_FOREVER:
		return rdmasafe_get_event_timeout(w->ch, &ev, -1);
	case TIMEOUT_60S:
		return rdmasafe_get_event_timeout(w->ch, &ev, 60000);
	default:
		return rdmasafe_get_events(w->ch, evs, 4, -1);
	}
#endif
}

static void *waiter_main(void *arg)
{
	struct waiter *w = arg;
	int old;
	if (w->pending_first)
		pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	pthread_cleanup_push(cleanup, w);
	atomic_store(&w->started, 1);
	if (w->pending_first) {
		while (!atomic_load(&w->cancelled))
			usleep(1000);
		pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &old);
	}
	wait_once(w);
	atomic_store(&w->returned, 1);
	pthread_cleanup_pop(0);
	return NULL;
}

#ifndef RAW
struct stopper {
	struct rdmasafe_cq_loop *lp;
	atomic_int started, cancelled, returned, cleaned;
	int rc;
};

static void stopper_cleanup(void *arg)
{
	atomic_store(&((struct stopper *)arg)->cleaned, 1);
}

static void *stopper_main(void *arg)
{
	struct stopper *s = arg;
	int old;
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
	pthread_cleanup_push(stopper_cleanup, s);
	atomic_store(&s->started, 1);
	while (!atomic_load(&s->cancelled))
		usleep(1000);
	pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &old);
	s->rc = rdmasafe_cq_loop_stop(s->lp);
	atomic_store(&s->returned, 1);
	pthread_testcancel();
	pthread_cleanup_pop(0);
	return NULL;
}

static void stop_with_cancel_pending(struct ibv_context *vctx)
{
	const char *w = "rdmasafe_cq_loop_stop (cancel pending at the call): ";
	char what[160];
	struct ibv_comp_channel *lc = ibv_create_comp_channel(vctx);
	struct stopper s = { 0 };
	pthread_t t;
	void *res = NULL;

	if (!check(lc && rdmasafe_cq_loop_create(lc, NULL, &s.lp) == 0, "a loop for the stop"))
		return;
	if (!check(pthread_create(&t, NULL, stopper_main, &s) == 0, "pthread_create"))
		return;
	while (!atomic_load(&s.started))
		usleep(1000);
	check(pthread_cancel(t) == 0, "pthread_cancel");
	atomic_store(&s.cancelled, 1);
	check(pthread_join(t, &res) == 0, "pthread_join");
	snprintf(what, sizeof what, "%sthe join reports PTHREAD_CANCELED", w);
	check(res == PTHREAD_CANCELED, what);
	snprintf(what, sizeof what, "%sit returned 0 (no cancellation point inside)", w);
	check(atomic_load(&s.returned) && s.rc == 0, what);
	snprintf(what, sizeof what, "%sthe thread's cleanup handler ran", w);
	check(atomic_load(&s.cleaned), what);
	snprintf(what, sizeof what, "%sthe stop is kept: the next run returns 0 at once", w);
	check(rdmasafe_cq_loop_run(s.lp) == 0, what);
	check(rdmasafe_cq_loop_destroy(s.lp) == 0, "rdmasafe_cq_loop_destroy");
	ibv_destroy_comp_channel(lc);
}

/* A log callback that cancels its own thread, then calls a cancellation
 * point (usleep): rdmasafe runs its log output with cancellation deferred,
 * so the cancellation must wait until the get has returned (and is acted
 * on at the thread's next cancellation point), never unwind rdmasafe. */
static atomic_int cancel_in_log, log_cancel_returned;
static pthread_t log_getter_thread; /* the only thread the callback cancels */

static void log_cancels(void *ctx, int level, const char *msg)
{
	(void)ctx;
	(void)level;
	(void)msg;
	if (atomic_load(&cancel_in_log) &&
	    pthread_equal(pthread_self(), log_getter_thread) &&
	    atomic_exchange(&cancel_in_log, 0)) {
		pthread_cancel(pthread_self());
		usleep(1000);
		atomic_store(&log_cancel_returned, 1);
	}
}

struct log_getter {
	struct rdma_event_channel *ch;
	struct rdma_cm_event *ev;
	atomic_int got, after;
};

static void *log_getter_main(void *arg)
{
	struct log_getter *g = arg;
	log_getter_thread = pthread_self();
	atomic_store(&cancel_in_log, 1);
	if (rdmasafe_get_event(g->ch, &g->ev) == 0 && g->ev)
		atomic_store(&g->got, 1);
	pthread_testcancel();
	atomic_store(&g->after, 1); /* not reached */
	return NULL;
}

static void cancel_in_log_callback(struct rdma_event_channel *ch,
				   struct sockaddr *dst)
{
	struct log_getter g = { .ch = ch };
	struct rdma_cm_id *id = NULL;
	pthread_t t;
	void *res = NULL;

	rdmasafe_set_log_callback(log_cancels, NULL);
	rdmasafe_set_log_level(5); /* trace: every copy is logged */
	if (!check(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0,
		   "log: rdma_create_id") ||
	    !check(pthread_create(&t, NULL, log_getter_main, &g) == 0,
		   "log: pthread_create"))
		return;
	check(rdma_resolve_addr(id, NULL, dst, 2000) == 0, "log: rdma_resolve_addr");
	check(pthread_join(t, &res) == 0, "pthread_join");
	check(res == PTHREAD_CANCELED,
	      "log callback cancelling its thread: the join reports PTHREAD_CANCELED");
	check(atomic_load(&log_cancel_returned),
	      "log callback cancelling its thread: its usleep returned (cancellation deferred)");
	check(atomic_load(&g.got) && g.ev && g.ev->event == RDMA_CM_EVENT_ADDR_RESOLVED,
	      "log callback cancelling its thread: the get returned its event");
	check(!atomic_load(&g.after),
	      "log callback cancelling its thread: cancelled at its next cancellation point");
	rdmasafe_set_log_level(0);
	rdmasafe_set_log_callback(NULL, NULL);
	if (g.ev)
		check(rdmasafe_event_free(g.ev) == 0, "log: the event freed");
	rdma_destroy_id(id);
}
#endif

struct destroyer {
	struct rdma_cm_id *id;
	atomic_int started, cleaned, returned;
	struct timespec t0; /* just before rdma_destroy_id (CLOCK_MONOTONIC) */
};

static void destroyer_cleanup(void *arg)
{
	atomic_store(&((struct destroyer *)arg)->cleaned, 1);
}

static void *destroyer_main(void *arg)
{
	struct destroyer *d = arg;
	pthread_cleanup_push(destroyer_cleanup, d);
	clock_gettime(CLOCK_MONOTONIC, &d->t0);
	atomic_store(&d->started, 1);
	rdma_destroy_id(d->id); /* waits for the held event's ack */
	atomic_store(&d->returned, 1);
	pthread_cleanup_pop(0);
	return NULL;
}

/* Mode "destroy" (for the preload's check mode): an id's ADDR_RESOLVED is
 * held; a thread destroying the id waits in rdma_destroy_id and is
 * cancelled there and joined. The destroy is over then: check mode must
 * not go on to report it as a destroy that waits. The event is held
 * HOLD_AFTER_MS more (well past a hold threshold of 300 ms, so that the
 * check-mode watcher has run meanwhile) and never acked:
 * librdmacm leaves the id's mutex locked when that wait is cancelled, so
 * an ack would block for good (docs/RDMA-FACTS.md, section 8). Prints
 * how long the destroy waited, from just before the call to the join: a
 * report of a waiting destroy is true only up to then (a busy machine may
 * cancel it late). */
#define HOLD_AFTER_MS 3000
static void cancel_destroy(struct rdma_event_channel *ch, struct sockaddr *dst)
{
	struct destroyer d = { 0 };
	struct rdma_cm_event *ev = NULL;
	pthread_t t;
	void *res = NULL;

	if (!check(rdma_create_id(ch, &d.id, NULL, RDMA_PS_TCP) == 0,
		   "destroy: rdma_create_id") ||
	    !check(rdma_resolve_addr(d.id, NULL, dst, 2000) == 0,
		   "destroy: rdma_resolve_addr"))
		return;
#ifdef RAW
	int r = rdma_get_cm_event(ch, &ev);
#else
	int r = rdmasafe_get_event(ch, &ev);
#endif
	if (!check(r == 0 && ev && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED,
		   "destroy: ADDR_RESOLVED got and held"))
		return;
	printf("info destroy: event %p of id %p held\n", (void *)ev, (void *)d.id);
	if (pthread_create(&t, NULL, destroyer_main, &d)) {
		check(0, "pthread_create");
		return;
	}
	while (!atomic_load(&d.started))
		usleep(1000);
	usleep(100 * 1000); /* inside rdma_destroy_id's wait by now */
	check(pthread_cancel(t) == 0, "pthread_cancel");
	check(pthread_join(t, &res) == 0, "pthread_join");
	{
		struct timespec t1;

		clock_gettime(CLOCK_MONOTONIC, &t1);
		printf("info destroy: waited %ld ms until the join\n",
		       (long)((t1.tv_sec - d.t0.tv_sec) * 1000 + (t1.tv_nsec - d.t0.tv_nsec) / 1000000));
	}
	check(res == PTHREAD_CANCELED,
	      "rdma_destroy_id: the join reports PTHREAD_CANCELED");
	check(atomic_load(&d.cleaned),
	      "rdma_destroy_id: the thread's cleanup handler ran");
	check(!atomic_load(&d.returned), "rdma_destroy_id: the call never returned");
	usleep(HOLD_AFTER_MS * 1000);
	printf("info destroy: held %d ms after the cancel; not acked\n",
	       HOLD_AFTER_MS);
}

static void cancel_one(struct rdma_event_channel *ch,
		       struct ibv_comp_channel *cc, struct ibv_context *vctx,
		       enum way way, int pending_first)
{
	char what[160];
	struct waiter w = { .ch = ch, .cc = cc, .vctx = vctx, .way = way,
			    .pending_first = pending_first };
	pthread_t t;
	void *res = NULL;

	snprintf(what, sizeof what, "%s%s: ", way_name[way],
		 pending_first ? " (cancel pending at the call)" : "");
	if (pthread_create(&t, NULL, waiter_main, &w)) {
		check(0, "pthread_create");
		return;
	}
	while (!atomic_load(&w.started))
		usleep(1000);
	if (!pending_first)
		usleep(200 * 1000); /* most likely inside the wait by now */
	check(pthread_cancel(t) == 0, "pthread_cancel");
	atomic_store(&w.cancelled, 1);
	check(pthread_join(t, &res) == 0, "pthread_join");
	size_t n = strlen(what);
	snprintf(what + n, sizeof what - n, "the join reports PTHREAD_CANCELED");
	check(res == PTHREAD_CANCELED, what);
	snprintf(what + n, sizeof what - n, "the thread's cleanup handler ran");
	check(atomic_load(&w.cleaned), what);
	snprintf(what + n, sizeof what - n, "the call never returned");
	check(!atomic_load(&w.returned), what);
}

int main(int argc, char **argv)
{
	struct addrinfo *ai = NULL;
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id = NULL;
	struct rdma_cm_event *ev = NULL;

	if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "destroy"))) {
		fprintf(stderr, "usage: %s ADDR [destroy]\n", argv[0]);
		return 2;
	}
	signal(SIGALRM, on_alarm);
	alarm(WATCHDOG_S);
	setvbuf(stdout, NULL, _IOLBF, 0);

	ch = rdma_create_event_channel(); /* blocking mode, as created */
	if (!ch) {
		perror("rdma_create_event_channel");
		return 1;
	}
	if (argc == 3) {
		if (getaddrinfo(argv[1], NULL, NULL, &ai) || !ai) {
			check(0, "getaddrinfo");
			return 1;
		}
		cancel_destroy(ch, ai->ai_addr);
		printf("cm_cancel_test: %d passed, %d failed\n", passed, failed);
		_exit(failed ? 1 : 0); /* the half-destroyed id stays as it is */
	}
	struct ibv_device **devs = ibv_get_device_list(NULL);
	struct ibv_context *vctx = devs && devs[0] ? ibv_open_device(devs[0]) : NULL;
	struct ibv_comp_channel *cc = vctx ? ibv_create_comp_channel(vctx) : NULL;
	if (!cc) {
		perror("no device or completion channel");
		return 1;
	}
	/* The async ways wait on a device with nothing queued: take what the
	   device queued so far (a port or GID event soon after boot). */
	while (poll(&(struct pollfd){ .fd = vctx->async_fd, .events = POLLIN }, 1, 0) == 1) {
#ifdef RAW
		struct ibv_async_event ae;
		if (ibv_get_async_event(vctx, &ae))
			break;
		printf("info async event %d queued before the test: taken\n", (int)ae.event_type);
		ibv_ack_async_event(&ae);
#else
		struct rdmasafe_async_event ae;
		memset(&ae, 0, sizeof ae);
		ae.size = sizeof ae;
		if (rdmasafe_async_get(vctx, &ae, 0))
			break;
		printf("info async event %u queued before the test: taken\n", ae.event_type);
#endif
	}
#ifndef RAW
	rdmasafe_cm_set_limit(1);
#endif
	for (int p = 0; p < 2; p++)
		for (int way = 0; way < NWAYS; way++) {
#ifdef RAW
			if (way != GET && way != CQ_EVENT && way != ASYNC_FOREVER)
				continue; /* one way of waiting in each library */
#endif
			cancel_one(ch, cc, vctx, way, p);
		}

	/* The channel still delivers, and nothing of the cancelled gets is
	 * kept: with a limit of one copy, this get would fail with ENOBUFS. */
	if (getaddrinfo(argv[1], NULL, NULL, &ai) || !ai) {
		check(0, "getaddrinfo");
		return 1;
	}
	check(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	check(rdma_resolve_addr(id, NULL, ai->ai_addr, 2000) == 0, "rdma_resolve_addr");
#ifdef RAW
	int r = rdma_get_cm_event(ch, &ev);
#else
	int r = rdmasafe_get_event(ch, &ev);
#endif
	check(r == 0 && ev && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED,
	      "after the cancellations: ADDR_RESOLVED got on the same channel");
	if (r == 0 && ev) {
#ifdef RAW
		check(rdma_ack_cm_event(ev) == 0, "ack");
#else
		check(rdmasafe_event_free(ev) == 0, "free");
		struct rdmasafe_cm_counters c;
		memset(&c, 0, sizeof c);
		c.size = sizeof c;
		check(rdmasafe_cm_get_counters(&c) == 0 && c.outstanding == 0,
		      "no copy alive after the cancelled gets and the free");
#endif
	}
#ifndef RAW
	stop_with_cancel_pending(vctx);
	cancel_in_log_callback(ch, ai->ai_addr);
#endif
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	ibv_destroy_comp_channel(cc);
	ibv_close_device(vctx);
	ibv_free_device_list(devs);
	freeaddrinfo(ai);
	printf("cm_cancel_test: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
