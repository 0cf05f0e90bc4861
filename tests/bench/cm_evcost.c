/*
 * CM event cost micro-benchmark: what one get + release of a CM event costs,
 * rdmasafe's copy-then-ack (rdmasafe_get_event + rdmasafe_event_free)
 * against raw librdmacm (rdma_get_cm_event + rdma_ack_cm_event).
 *
 * Each round creates K ids on one (blocking) channel, resolves all their
 * addresses to ADDR (a local address: ADDR_RESOLVED comes within
 * microseconds), waits until the K events must have been queued, then
 * drains them in a tight loop: only that drain is timed, and it is the
 * window for strace / callgrind / the allocation counter (bench_common.h).
 * Warm-up rounds run first and are not counted.
 *
 *   cm_evcost -a ADDR [-k K (1000)] [-r ROUNDS (5)] [-w WARMUP (1)] [-l L (0)] [-T]
 *
 * -l L: L more ids live on the measured channel for the whole run, each
 * bound to ADDR with port 0 (a live, bound id that makes no event), created
 * before the first round: the per-event cost against the number of live ids
 * (issue 14 target 5, CM half).
 *
 * -T: one more thread, started before the first round and blocked for the
 * whole run. From the first pthread_create on, glibc takes its
 * multi-threaded paths in the whole process (the cancellation wrappers
 * around librdmacm's write, the atomic paths of its mutexes), as in every
 * program that has threads anyway. rdmasafe's ack-deadline thread does the
 * same to its program, so raw -T against rdmasafe is the comparison at the
 * same threading state.
 *
 * Prints one RESULT line; "late" counts rounds in which an event had not
 * arrived before the drain started (the drain then includes a wait).
 */
#include "bench_common.h"

#include <getopt.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#ifdef USE_RDMASAFE
#include "rdmasafe.h"
#define GET_EVENT(ch, ev) rdmasafe_get_event((ch), (ev))
#define RELEASE_EVENT(ev) rdmasafe_event_free(ev)
#else
#define GET_EVENT(ch, ev) rdma_get_cm_event((ch), (ev))
#define RELEASE_EVENT(ev) rdma_ack_cm_event(ev)
#endif

int main(int argc, char **argv)
{
	const char *addr = NULL;
	int k = 1000, rounds = 5, warm = 1, live = 0, thread = 0, op;
	while ((op = getopt(argc, argv, "a:k:r:w:l:T")) != -1) {
		switch (op) {
		case 'a':
			addr = optarg;
			break;
		case 'k':
			k = atoi(optarg);
			break;
		case 'r':
			rounds = atoi(optarg);
			break;
		case 'w':
			warm = atoi(optarg);
			break;
		case 'l':
			live = atoi(optarg);
			break;
		case 'T':
			thread = 1;
			break;
		default:
			fprintf(stderr, "usage: %s -a ADDR [-k K] [-r ROUNDS] [-w WARMUP] [-l LIVE_IDS] [-T]\n", argv[0]);
			return 2;
		}
	}
	if (!addr || k < 1 || rounds < 1 || warm < 0 || live < 0)
		DIE("bad arguments");
	alarm(300);
	struct idle_thread idle;
	if (thread)
		idle_thread_start(&idle);
	struct rdma_addrinfo hints = { .ai_port_space = RDMA_PS_TCP }, *ai;
	if (rdma_getaddrinfo(addr, "7610", &hints, &ai))
		DIE("rdma_getaddrinfo");
	struct rdma_event_channel *ch = rdma_create_event_channel();
	if (!ch)
		DIE("channel");
	struct rdma_cm_id **ids = calloc((size_t)k, sizeof(*ids));
	if (!ids)
		DIE("calloc");
	/* the live ids: bound to ADDR, port 0 (any free port), no events */
	struct rdma_cm_id **extra = calloc((size_t)live + 1, sizeof(*extra));
	if (!extra)
		DIE("calloc");
	struct sockaddr_storage any;
	memcpy(&any, ai->ai_dst_addr, ai->ai_dst_len);
	if (any.ss_family == AF_INET)
		((struct sockaddr_in *)&any)->sin_port = 0;
	else
		((struct sockaddr_in6 *)&any)->sin6_port = 0;
	for (int i = 0; i < live; i++) {
		if (rdma_create_id(ch, &extra[i], NULL, RDMA_PS_TCP))
			DIE("rdma_create_id (live)");
		if (rdma_bind_addr(extra[i], (struct sockaddr *)&any))
			DIE("rdma_bind_addr (live)");
	}

	uint64_t ns = 0, events = 0, alloc_n = 0, late = 0, wrong = 0;
	double cpu_u = 0, cpu_s = 0;
#ifdef USE_RDMASAFE
	uint64_t slots_in_window = 0;
	/* storage for k copies plus the free list's quarantine, up front */
	if (rdmasafe_cm_reserve(k) < k)
		DIE("rdmasafe_cm_reserve");
#endif
	for (int r = 0; r < warm + rounds; r++) {
		int measured = r >= warm;
		for (int i = 0; i < k; i++)
			if (rdma_create_id(ch, &ids[i], NULL, RDMA_PS_TCP))
				DIE("rdma_create_id");
		for (int i = 0; i < k; i++)
			if (rdma_resolve_addr(ids[i], NULL, ai->ai_dst_addr, 5000))
				DIE("rdma_resolve_addr");
		/* resolving a local address takes ~50 us per id under TCG */
		usleep(100000 + (useconds_t)k * 200);
		struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
		if (poll(&pfd, 1, 0) != 1)
			late++;
#ifdef USE_RDMASAFE
		struct rdmasafe_cm_counters c0 = { .size = sizeof c0 }, c1 = { .size = sizeof c1 };
		rdmasafe_cm_get_counters(&c0);
#endif
		double u0, s0, u1, s1;
		cpu_secs(&u0, &s0);
		uint64_t a0 = allocs();
		if (measured)
			window_begin();
		uint64_t t0 = now_ns();
		for (int i = 0; i < k; i++) {
			struct rdma_cm_event *e;
			if (GET_EVENT(ch, &e))
				DIE("get event");
			wrong += e->event != RDMA_CM_EVENT_ADDR_RESOLVED;
			if (RELEASE_EVENT(e))
				DIE("release event");
		}
		uint64_t t1 = now_ns();
		if (measured)
			window_end();
		uint64_t a1 = allocs();
		cpu_secs(&u1, &s1);
#ifdef USE_RDMASAFE
		rdmasafe_cm_get_counters(&c1);
#endif
		if (measured) {
			ns += t1 - t0;
			events += (uint64_t)k;
			alloc_n += a1 - a0;
			cpu_u += u1 - u0;
			cpu_s += s1 - s0;
#ifdef USE_RDMASAFE
			slots_in_window += c1.slots_allocated - c0.slots_allocated;
#endif
		}
		for (int i = 0; i < k; i++)
			rdma_destroy_id(ids[i]);
	}
	struct jline j;
	j_begin(&j);
	j_u64(&j, "events", events);
	j_u64(&j, "k", k);
	j_u64(&j, "rounds", rounds);
	j_u64(&j, "live_ids", live);
	j_u64(&j, "idle_thread", thread);
	j_u64(&j, "late_rounds", late);
	j_u64(&j, "wrong_type", wrong);
	j_dbl(&j, "ns_per_event", events ? (double)ns / events : 0);
	j_dbl(&j, "cpu_user_ns_per_event", events ? cpu_u * 1e9 / events : 0);
	j_dbl(&j, "cpu_sys_ns_per_event", events ? cpu_s * 1e9 / events : 0);
	j_u64(&j, "allocs_window", alloc_n);
	j_dbl(&j, "allocs_per_event", events ? (double)alloc_n / events : 0);
#ifdef USE_RDMASAFE
	j_u64(&j, "rs_slots_allocated_in_window", slots_in_window);
#endif
	j_end(&j);
	free(ids);
	for (int i = 0; i < live; i++)
		rdma_destroy_id(extra[i]);
	free(extra);
	rdma_destroy_event_channel(ch);
	rdma_freeaddrinfo(ai);
	if (thread)
		idle_thread_stop(&idle);
	return wrong ? 1 : 0;
}
