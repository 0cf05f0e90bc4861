/*
 * cpurun LABEL CMD ARGS...: runs CMD, then prints on stderr one line
 *   CPURUN LABEL {"wall_s":..,"cpu_user_s":..,"cpu_sys_s":..,"exit":..}
 * with the child's wall time and CPU time (wait4 rusage), and exits with
 * the child's status. Used for the stock tools (cmtime, ibv_rc_pingpong,
 * ib_send_lat), which do not report their CPU use.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: cpurun LABEL CMD [ARGS...]\n");
		return 2;
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	pid_t pid = fork();
	if (pid < 0) {
		perror("fork");
		return 2;
	}
	if (pid == 0) {
		execvp(argv[2], argv + 2);
		perror(argv[2]);
		_exit(127);
	}
	int st;
	struct rusage ru;
	if (wait4(pid, &st, 0, &ru) < 0) {
		perror("wait4");
		return 2;
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
	fprintf(stderr, "CPURUN %s {\"wall_s\":%.6f,\"cpu_user_s\":%.6f,\"cpu_sys_s\":%.6f,\"exit\":%d}\n", argv[1],
		(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9,
		ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6, ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6, code);
	return code;
}
