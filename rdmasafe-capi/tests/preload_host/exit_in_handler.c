/* A CQ event loop whose SIGALRM handler ends the program with exit(0), as
 * many tools' SIGINT handlers do: the signal lands while the loop is
 * inside ibv_get_cq_event or ibv_ack_cq_events (the stand-in's return at
 * once, so it is inside them, or the preload's book-keeping around them,
 * most of the time). Exits 0 from the handler. */
#include <signal.h>
#include <stdlib.h>
#include <sys/time.h>

#include <infiniband/verbs.h>

static void on_alarm(int sig)
{
	(void)sig;
	exit(0);
}

int main(void)
{
	struct itimerval it = { .it_value = { 0, 50000 } };
	struct ibv_comp_channel channel;
	struct ibv_cq *cq;
	void *ctx;

	signal(SIGALRM, on_alarm);
	setitimer(ITIMER_REAL, &it, 0);
	for (;;) {
		if (ibv_get_cq_event(&channel, &cq, &ctx) == 0)
			ibv_ack_cq_events(cq, 1);
	}
}
