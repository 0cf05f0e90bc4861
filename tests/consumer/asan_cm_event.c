/* An application built with AddressSanitizer (its LeakSanitizer on, as by
 * default) gets CM events through the installed librdmasafe.so, with the
 * default ack deadline (which starts rdmasafe's ack thread), and exits:
 * it must exit 0, with no leak reported. Run on the host against the
 * librdmacm stand-in (standin_rdmacm.c). Prints "asan_cm_event: ok". */
#include <stdio.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>
#include <rdmasafe.h>

int main(void)
{
	struct rdma_event_channel channel;
	struct rdma_cm_event *ev;
	int p[2], i;

	if (pipe(p))
		return 2;
	channel.fd = p[0];
	for (i = 0; i < 3; i++) {
		if (write(p[1], "x", 1) != 1)
			return 2;
		if (rdmasafe_get_event(&channel, &ev)) {
			perror("rdmasafe_get_event");
			return 2;
		}
		if (rdmasafe_event_free(ev)) {
			perror("rdmasafe_event_free");
			return 2;
		}
	}
	/* the ack thread runs meanwhile (it started at the first get) */
	usleep(300000);
	printf("asan_cm_event: ok\n");
	return 0;
}
