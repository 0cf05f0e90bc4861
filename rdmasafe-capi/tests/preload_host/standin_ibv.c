/* A stand-in for libibverbs' CQ event calls, for host tests of the
 * preload's own logic (no RDMA claim rests on it): preloaded after
 * librdmasafe_preload.so, so that the preload's lookup of the real
 * functions (RTLD_NEXT) finds these. Every get returns at once. */
#include <infiniband/verbs.h>

static struct ibv_cq standin_cq;

int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context)
{
	(void)channel;
	*cq = &standin_cq;
	*cq_context = 0;
	return 0;
}

void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
	(void)cq;
	(void)nevents;
}

int ibv_destroy_cq(struct ibv_cq *cq)
{
	(void)cq;
	return 0;
}
