/* Forks while another thread is inside the preload's CQ book-keeping: one
 * thread gets and acks CQ events in a loop (the stand-in's get returns at
 * once, so that thread holds the book's lock much of the time) while the
 * main thread forks N times (argv[1], default 200). Each child gets and
 * acks one event and exits 0; a child that inherited the book locked by
 * the other thread (which it does not have) hangs in its get, and its
 * alarm ends it after 10 s. Prints how many children failed and exits 0
 * if none did, 1 at the first that did. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static void get_and_ack(void)
{
	struct ibv_comp_channel channel;
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(&channel, &cq, &ctx) == 0)
		ibv_ack_cq_events(cq, 1);
}

static void *busy(void *arg)
{
	(void)arg;
	for (;;)
		get_and_ack();
	return 0;
}

int main(int argc, char **argv)
{
	int forks = argc > 1 ? atoi(argv[1]) : 200;
	pthread_t t;

	get_and_ack(); /* the preload set up before the thread starts */
	if (pthread_create(&t, 0, busy, 0)) {
		perror("pthread_create");
		return 2;
	}
	for (int i = 0; i < forks; i++) {
		int st;
		pid_t pid = fork();

		if (pid < 0) {
			perror("fork");
			return 2;
		}
		if (pid == 0) {
			alarm(10);
			get_and_ack();
			_exit(0);
		}
		if (waitpid(pid, &st, 0) != pid) {
			perror("waitpid");
			return 2;
		}
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			printf("child %d of %d failed: %s %d\n", i + 1, forks,
			       WIFSIGNALED(st) ? "signal" : "exit status",
			       WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
			return 1;
		}
	}
	printf("0 of %d children failed\n", forks);
	return 0;
}
