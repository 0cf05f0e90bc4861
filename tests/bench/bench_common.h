/*
 * Shared helpers of the rdmasafe benchmark programs (tests/bench/).
 *
 * Every program is built twice from one source: with -DUSE_RDMASAFE=1 it
 * goes through rdmasafe's C API, without it through plain librdmacm /
 * libibverbs calls. Results are printed as single lines
 *   RESULT {"key":value,...}
 * on stdout (flushed at once), which tests/bench/guest.sh tags with the
 * case and repeat and tests/bench/report.py turns into docs/BENCHMARKS.md.
 *
 * Counting hooks (no effect when not active):
 *  - mark(): a getppid() system call that tests/bench/guest.sh uses as a
 *    marker in strace logs, so only the measured window is counted;
 *  - CALLGRIND_TOGGLE_COLLECT around the same window (valgrind --tool=callgrind
 *    --collect-atstart=no counts user-space instructions of that window only);
 *  - allocs(): the malloc/calloc/realloc/memalign count of allocount.so when
 *    it is LD_PRELOADed, else 0.
 */
#ifndef RDMASAFE_BENCH_COMMON_H
#define RDMASAFE_BENCH_COMMON_H

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__has_include) && __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else /* no valgrind headers: no instruction counts, everything else works */
#define CALLGRIND_TOGGLE_COLLECT
#endif

#ifdef USE_RDMASAFE
#define VARIANT "rdmasafe"
#else
#define VARIANT "raw"
#endif

#define DIE(...)                                                               \
	do {                                                                   \
		fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                \
		fprintf(stderr, __VA_ARGS__);                                  \
		fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno));  \
		exit(2);                                                       \
	} while (0)

static inline uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* user and system CPU seconds of this process so far */
static inline void cpu_secs(double *user, double *sys)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	*user = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6;
	*sys = ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

/* strace marker: the measured window lies between two getppid() calls */
static inline void mark(void)
{
	(void)syscall(SYS_getppid);
}

/* window start / end: strace marker + callgrind collection toggle */
static inline void window_begin(void)
{
	mark();
	CALLGRIND_TOGGLE_COLLECT;
}

static inline void window_end(void)
{
	CALLGRIND_TOGGLE_COLLECT;
	mark();
}

/* allocation counter of allocount.so (weak: 0 without the preload) */
extern uint64_t allocount_allocs(void) __attribute__((weak));
static inline uint64_t allocs(void)
{
	return allocount_allocs ? allocount_allocs() : 0;
}

/* ---- a tiny JSON line builder ---- */
struct jline {
	char buf[1 << 16];
	size_t len;
};

static inline void j_raw(struct jline *j, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(j->buf + j->len, sizeof(j->buf) - j->len, fmt, ap);
	va_end(ap);
	if (n > 0)
		j->len += (size_t)n < sizeof(j->buf) - j->len ? (size_t)n : sizeof(j->buf) - j->len - 1;
}

static inline void j_begin(struct jline *j)
{
	j->len = 0;
	j_raw(j, "RESULT {\"variant\":\"%s\"", VARIANT);
}

static inline void j_str(struct jline *j, const char *k, const char *v)
{
	j_raw(j, ",\"%s\":\"%s\"", k, v);
}

static inline void j_u64(struct jline *j, const char *k, uint64_t v)
{
	j_raw(j, ",\"%s\":%llu", k, (unsigned long long)v);
}

static inline void j_dbl(struct jline *j, const char *k, double v)
{
	j_raw(j, ",\"%s\":%.9g", k, v);
}

static inline void j_end(struct jline *j)
{
	j_raw(j, "}\n");
	fputs(j->buf, stdout);
	fflush(stdout);
}

static inline int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* percentile p (0..100) of a sorted array, nearest rank */
static inline uint64_t pct(const uint64_t *sorted, size_t n, double p)
{
	if (n == 0)
		return 0;
	size_t i = (size_t)(p / 100.0 * (double)n);
	if (i >= n)
		i = n - 1;
	return sorted[i];
}

/*
 * -T of cm_evcost and cm_storm: one more thread, blocked for the whole run
 * on a pipe nobody writes to. From the first pthread_create on, glibc
 * takes its multi-threaded paths in the whole process, and the kernel
 * counts the process's memory as used on every CPU its threads ran on, as
 * in rdmasafe's program (its ack-deadline thread) and in any program that
 * has threads anyway: the raw program with -T is the comparison at the
 * same threading state.
 */
struct idle_thread {
	int pipe[2];
	pthread_t tid;
};

static void *idle_thread_main(void *arg)
{
	char c;
	while (read(*(int *)arg, &c, 1) < 0 && errno == EINTR)
		;
	return NULL;
}

static inline void idle_thread_start(struct idle_thread *t)
{
	if (pipe(t->pipe))
		DIE("idle thread: pipe");
	int e = pthread_create(&t->tid, NULL, idle_thread_main, &t->pipe[0]);
	if (e) {
		errno = e; /* pthread_create returns its error, DIE prints errno */
		DIE("idle thread: pthread_create");
	}
}

static inline void idle_thread_stop(struct idle_thread *t)
{
	close(t->pipe[1]); /* the idle thread's read returns 0 */
	pthread_join(t->tid, NULL);
	close(t->pipe[0]);
}

#endif
