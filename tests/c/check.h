/*
 * check.h: the output of the C test programs in tests/c (one copy for all).
 *
 * Each program prints one line per check, "ok   ..." or "FAIL ..." (a
 * failure names its source line), "info ..." lines, and at the end its
 * counts of `passed` and `failed`; the Rust harness
 * (rdmasafe-capi/tests/c_programs.rs) reads these lines. A program run as
 * two processes names its side in `side` ("server", "client"): then every
 * line says "ok   server: ...". A SIGALRM watchdog (`on_alarm`, armed by
 * the program) turns a hang into a failure line naming the `phase`, and
 * exit status 3.
 *
 * Every function here is static and marked unused: a program that uses
 * only some of them builds without warnings (-Wall -Werror).
 */
#ifndef RDMASAFE_TEST_CHECK_H
#define RDMASAFE_TEST_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK_FN static __attribute__((unused))

static int passed, failed;
/* What the program does now, for the watchdog's line (set as it goes). */
static const char *volatile phase = "start";
/* The process's side in a two-process test; NULL in a one-process test. */
static const char *volatile side;

/* Prints "side: " when the program has sides. */
CHECK_FN void print_side(void)
{
	const char *s = side;

	if (s)
		printf("%s: ", s);
}

CHECK_FN void vcheck(int ok, const char *file, int line, const char *fmt, va_list ap)
{
	const char *base = strrchr(file, '/');

	flockfile(stdout); /* one line at a time: other threads print too */
	printf("%s ", ok ? "ok  " : "FAIL");
	print_side();
	vprintf(fmt, ap);
	if (!ok)
		printf("  [%s:%d]", base ? base + 1 : file, line);
	printf("\n");
	fflush(stdout);
	if (ok)
		passed++;
	else
		failed++;
	funlockfile(stdout);
}

CHECK_FN int check_at(const char *file, int line, int ok, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
CHECK_FN int check_at(const char *file, int line, int ok, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vcheck(ok, file, line, fmt, ap);
	va_end(ap);
	return ok;
}
/* One check: its line, and whether it held (returned). */
#define CHECK(ok, ...) check_at(__FILE__, __LINE__, !!(ok), __VA_ARGS__)

CHECK_FN void info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
CHECK_FN void info(const char *fmt, ...)
{
	va_list ap;

	flockfile(stdout); /* one line at a time: other threads print too */
	printf("info ");
	print_side();
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	funlockfile(stdout);
}

/* From a signal handler: "<what>[side: ]<phase>", then _exit(code).
 * Async-signal-safe output only. */
CHECK_FN void say_and_exit(const char *what, int code)
{
	const char *p = phase, *s = side;

	if (write(STDOUT_FILENO, what, strlen(what)) < 0 ||
	    (s && (write(STDOUT_FILENO, s, strlen(s)) < 0 || write(STDOUT_FILENO, ": ", 2) < 0)) ||
	    write(STDOUT_FILENO, p, strlen(p)) < 0 ||
	    write(STDOUT_FILENO, "\n", 1) < 0)
		_exit(4);
	_exit(code);
}

/* The SIGALRM watchdog: a hang is a failure, exit status 3. */
CHECK_FN void on_alarm(int sig)
{
	(void)sig;
	say_and_exit("FAIL watchdog fired (hang) in phase: ", 3);
}

/* "EINVAL" for EINVAL; "0" for no error. */
CHECK_FN const char *ename(int e)
{
	const char *s = strerrorname_np(e);

	return s ? s : (e ? "E?" : "0");
}

/* CLOCK_MONOTONIC in ms. */
CHECK_FN double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

#endif
