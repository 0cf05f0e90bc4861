/* A batch get on a blocking-mode channel (rdmasafe_get_events waits for
 * the first event, then looks for more without waiting), run under
 * valgrind's memcheck against the installed librdmasafe.so: no error may
 * be reported (valgrind --error-exitcode). The look for more once
 * computed a poll timeout from the unset payload of a no-wait value,
 * which valgrind reported as "Conditional jump or move depends on
 * uninitialised value(s)" (found by a review of a Ceph-style server run
 * under valgrind). Run on the host against the librdmacm stand-in
 * (standin_rdmacm.c): the channel is a pipe, a byte an event. Prints
 * "valgrind_batch: ok". */
#include <stdio.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>
#include <rdmasafe.h>

int main(void)
{
	struct rdma_event_channel channel;
	struct rdma_cm_event *evs[4];
	int p[2], n, i;

	if (pipe(p))
		return 2;
	channel.fd = p[0];
	if (write(p[1], "xy", 2) != 2)
		return 2;
	n = rdmasafe_get_events(&channel, evs, 4, -1);
	if (n != 2) {
		fprintf(stderr, "rdmasafe_get_events -> %d, want 2 (two events queued)\n", n);
		return 1;
	}
	for (i = 0; i < n; i++)
		if (rdmasafe_event_free(evs[i])) {
			perror("rdmasafe_event_free");
			return 2;
		}
	printf("valgrind_batch: ok\n");
	return 0;
}
