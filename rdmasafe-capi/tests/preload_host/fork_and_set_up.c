/* Forks around the preload's first-use set-up; run in check mode with the
 * stand-in (see preload_host.rs). argv[1] picks the case:
 *
 * handler: the program registers fork handlers before its first
 *   interposed call (as a program that sets up its own locks at start
 *   does), and they make interposed calls: its prepare handler gets and
 *   acks a CQ event, and so does its child handler. Then it forks N
 *   times (argv[2]). The preload's handlers must not be holding its books
 *   while the program's own handlers run.
 *
 * set-up: a thread makes the process's first interposed call, and the
 *   set-up it starts blocks (RDMASAFE_LOG=debug: its debug line goes to
 *   stderr, a pipe this program filled); the main thread forks once
 *   while it is blocked (seen in /proc/self/task/TID/syscall), and a
 *   drainer empties the pipe 200 ms after the fork began (the program's
 *   own prepare handler says when). The child must not inherit the
 *   set-up under way.
 *
 * report FIFO: as set-up, with check mode's report file (its path argv[2],
 *   made a FIFO here, RDMASAFE_CHECK_FILE set to it) instead of stderr:
 *   the thread's first interposed call and its first report (an ack of
 *   more events than it got) block in the open of the FIFO until the
 *   drainer opens it for reading. The child must not inherit the opening
 *   under way: it reports too.
 *
 * late-set-up: run with slow_prepare.c's library preloaded after the
 *   preload. A thread waits for that library's prepare handler, which
 *   runs after the preload's, and then makes the process's first
 *   interposed calls, over and over, while the fork goes on. The child must
 *   not inherit check mode's books held by that thread.
 *
 * slow-reserve: run in copy mode with slow_reserve.c's library preloaded
 *   after the preload. A thread makes the process's first interposed
 *   call; the main thread forks while the CM copies' storage is being
 *   reserved (a slow mmap), and the child sets itself up again.
 *
 * Each child gets and acks one event (in the report case, then acks too
 * many) and exits 0; a hung child is ended by
 * its alarm after 10 s, a hung parent by its own after 30 s. Prints how
 * many children failed and exits 0 if none did, 1 at the first that did,
 * 2 if the case could not be set up. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static const char *fifo; /* the report case */

static void get_and_ack(void)
{
	struct ibv_comp_channel channel;
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(&channel, &cq, &ctx) == 0) {
		ibv_ack_cq_events(cq, 1);
		if (fifo)
			ibv_ack_cq_events(cq, 5); /* reported */
	}
}

/* Forks once: 0 if the child exited 0, 1 (said on stdout) if not. */
static int fork_one(int i, int n)
{
	int st;
	pid_t pid = fork();

	if (pid < 0) {
		perror("fork");
		exit(2);
	}
	if (pid == 0) {
		alarm(10);
		get_and_ack();
		_exit(0);
	}
	if (waitpid(pid, &st, 0) != pid) {
		perror("waitpid");
		exit(2);
	}
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		printf("child %d of %d failed: %s %d\n", i + 1, n, WIFSIGNALED(st) ? "signal" : "exit status",
		       WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
		return 1;
	}
	return 0;
}

/* Forks one child: 0 (said) if it exited 0, else 1. */
static int one_child(void)
{
	if (fork_one(0, 1))
		return 1;
	printf("0 of 1 children failed\n");
	return 0;
}

static int handler_case(int n)
{
	if (pthread_atfork(get_and_ack, 0, get_and_ack)) {
		fprintf(stderr, "pthread_atfork failed\n");
		return 2;
	}
	get_and_ack(); /* the preload's set-up */
	for (int i = 0; i < n; i++)
		if (fork_one(i, n))
			return 1;
	printf("0 of %d children failed\n", n);
	return 0;
}

static int pipe_out = -1;
static pthread_mutex_t fork_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fork_cond = PTHREAD_COND_INITIALIZER;
static int fork_began;
static volatile pid_t setter_tid;

static void prepare(void)
{
	pthread_mutex_lock(&fork_lock);
	fork_began = 1;
	pthread_cond_signal(&fork_cond);
	pthread_mutex_unlock(&fork_lock);
}

static void *drainer(void *arg)
{
	char buf[4096];
	int err = *(int *)arg;
	ssize_t r;

	pthread_mutex_lock(&fork_lock);
	while (!fork_began)
		pthread_cond_wait(&fork_cond, &fork_lock);
	pthread_mutex_unlock(&fork_lock);
	usleep(200 * 1000);
	if (fifo)
		pipe_out = open(fifo, O_RDONLY);
	/* Passed on to the real stderr, for the test's message (not the
	 * filling). */
	while ((r = read(pipe_out, buf, sizeof(buf))) > 0) {
		ssize_t n = 0;

		for (ssize_t k = 0; k < r; k++)
			if (buf[k] != 'x')
				buf[n++] = buf[k];
		if (n && write(err, buf, (size_t)n) < 0)
			break;
	}
	return 0;
}

static void *setter(void *arg)
{
	(void)arg;
	setter_tid = (pid_t)syscall(SYS_gettid);
	get_and_ack(); /* the process's first interposed call */
	return 0;
}

/* The thread `tid` is blocked where the case blocks it: in write(2, ...),
 * or in openat() (of the FIFO: the only file it opens). */
static int blocked(pid_t tid)
{
	char path[64], line[128] = "";
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", (int)tid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	if (!fgets(line, sizeof(line), f))
		line[0] = 0;
	fclose(f);
	return strncmp(line, fifo ? "257 " : "1 0x2 ", fifo ? 4 : 6) == 0;
}

static int set_up_case(void)
{
	static int err;
	int p[2], fl;
	pthread_t d, s;
	char fill[4096];

	memset(fill, 'x', sizeof(fill));
	if (fifo) {
		if (mkfifo(fifo, 0600) || setenv("RDMASAFE_CHECK_FILE", fifo, 1)) {
			perror("mkfifo");
			return 2;
		}
		err = 2;
		goto threads;
	}
	err = dup(2);
	if (err < 0 || pipe(p) || dup2(p[1], 2) < 0) {
		perror("pipe");
		return 2;
	}
	close(p[1]);
	pipe_out = p[0];
	/* Fill the pipe: the set-up's first write to stderr blocks. */
	fl = fcntl(2, F_GETFL);
	fcntl(2, F_SETFL, fl | O_NONBLOCK);
	while (write(2, fill, sizeof(fill)) > 0 || errno == EINTR)
		;
	fcntl(2, F_SETFL, fl);
threads:
	if (pthread_atfork(prepare, 0, 0) || pthread_create(&d, 0, drainer, &err) || pthread_create(&s, 0, setter, 0)) {
		dprintf(err, "pthread_atfork / pthread_create failed\n");
		return 2;
	}
	/* Seen blocked twice, 20 ms apart (not a passing openat of /proc). */
	while (!setter_tid || !blocked(setter_tid) || (usleep(20 * 1000), !blocked(setter_tid)))
		usleep(1000);
	return one_child();
}

static volatile int *began;

static void *late(void *arg)
{
	(void)arg;
	while (!*began)
		;
	for (;;)
		get_and_ack();
	return 0;
}

/* Points `began` at the flag `sym` of a library preloaded after the
 * preload and starts `fn` on a thread: 0, or 2 (said) if either fails. */
static int start_with(const char *sym, void *(*fn)(void *))
{
	pthread_t t;

	began = dlsym(RTLD_DEFAULT, sym);
	if (!began || pthread_create(&t, 0, fn, 0)) {
		fprintf(stderr, "no library with %s preloaded, or no thread\n", sym);
		return 2;
	}
	return 0;
}

static int late_set_up_case(void)
{
	if (start_with("slow_prepare_began", late))
		return 2;
	return one_child();
}

static void *first_call(void *arg)
{
	(void)arg;
	get_and_ack();
	return 0;
}

static int slow_reserve_case(void)
{
	if (start_with("slow_reserve_began", first_call))
		return 2;
	while (!*began)
		usleep(100);
	return one_child();
}

int main(int argc, char **argv)
{
	const char *what = argc > 1 ? argv[1] : "";

	alarm(30);
	setvbuf(stdout, 0, _IONBF, 0);
	if (!strcmp(what, "handler"))
		return handler_case(argc > 2 ? atoi(argv[2]) : 5);
	if (!strcmp(what, "set-up"))
		return set_up_case();
	if (!strcmp(what, "late-set-up"))
		return late_set_up_case();
	if (!strcmp(what, "slow-reserve"))
		return slow_reserve_case();
	if (!strcmp(what, "report") && argc > 2) {
		fifo = argv[2];
		return set_up_case();
	}
	fprintf(stderr, "usage: %s handler [N] | set-up | report FIFO | late-set-up | slow-reserve\n", argv[0]);
	return 2;
}
