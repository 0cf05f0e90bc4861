/*
 * Diagnostic LD_PRELOAD: serves clock_gettime(CLOCK_MONOTONIC) in user
 * space from the TSC (calibrated for 20 ms against the kernel at start),
 * like the vDSO does on a machine whose clocksource is the TSC.
 *
 * Why: the Soft-RoCE guest runs under TCG with clocksource hpet, where the
 * vDSO cannot read the clock and every clock_gettime is a real system call
 * plus an emulated HPET read. Runs with and without this shim tell how
 * much of a time gap comes from reading the clock (the benchmark clients'
 * own stamps; rdmasafe's CQ loop reads it only with timing statistics on,
 * in a spin, or for a deadline, the hand-written loop not at all). Other
 * clocks go to the kernel unchanged. Not for production use.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

static double ns_per_tick;
static uint64_t tick0;
static int64_t ns0;

static int64_t kernel_mono(void)
{
	struct timespec ts;
	syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

__attribute__((constructor)) static void calibrate(void)
{
	int64_t a = kernel_mono(), b;
	uint64_t ta = __rdtsc(), tb;
	do {
		b = kernel_mono();
		tb = __rdtsc();
	} while (b - a < 20000000);
	if (tb > ta) {
		ns_per_tick = (double)(b - a) / (double)(tb - ta);
		tick0 = tb;
		ns0 = b;
	}
}

int clock_gettime(clockid_t clk, struct timespec *ts)
{
	if (clk == CLOCK_MONOTONIC && ns_per_tick > 0) {
		int64_t ns = ns0 + (int64_t)((double)(__rdtsc() - tick0) * ns_per_tick);
		ts->tv_sec = ns / 1000000000;
		ts->tv_nsec = ns % 1000000000;
		return 0;
	}
	return (int)syscall(SYS_clock_gettime, clk, ts);
}
