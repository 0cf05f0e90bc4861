/* Gets and acks one CQ event (so the preload's exit handler has work:
 * its exit line, check mode's exit report), then cancels itself
 * (pthread_cancel, deferred: pending) and calls exit(0). The cancellation
 * is acted on at the first cancellation point that exit reaches, which
 * must not be one inside the preload's exit handler (it catches panics:
 * glibc's forced unwind then aborts, "FATAL: exception not rethrown"). A
 * pending cancellation met nowhere leaves exit 0; one met outside the
 * preload ends the thread (the process then exits when its last thread
 * does, 0). */
#include <pthread.h>
#include <stdlib.h>

#include <infiniband/verbs.h>

int main(void)
{
	struct ibv_comp_channel channel;
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(&channel, &cq, &ctx) == 0)
		ibv_ack_cq_events(cq, 1);
	pthread_cancel(pthread_self());
	exit(0);
}
