/*
 * rdmasafe_rdma_client: a client for rdma-core's stock `rdma_server`
 * (rdmacm-utils), written on an rdmasafe event channel (see
 * rdmasafe_interop.h for what the stock server expects).
 *
 *   rdmasafe_rdma_client [-s ADDR] [-p PORT] [-t WATCHDOG_SECS]
 *
 * Defaults as the stock rdma_client: 127.0.0.1, port 7471.
 * ADDR_RESOLVED, ROUTE_RESOLVED, QP (1 send, 1 recv, inline 16), post a
 * 16-byte receive, connect; ESTABLISHED; send 16 bytes; receive the
 * server's 16; disconnect (the stock server disconnects too after its send:
 * either way exactly one DISCONNECTED comes); destroy. The channel is
 * non-blocking; the waits use rdmasafe_get_event_timeout.
 */
#define _GNU_SOURCE /* strerrorname_np */
#include <getopt.h>
#include <netdb.h>

#include "rdmasafe_interop.h"

static const char hello[STOCK_MSG_LEN + 1] = "rdmasafe client!";

int main(int argc, char **argv)
{
	const char *addr = "127.0.0.1", *port = "7471";
	unsigned watchdog = 60;
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV }, *res;
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id = NULL;
	struct peer p;
	struct ibv_wc wc;
	int op, r, ok = 0, status;

	prog = "rdmasafe_rdma_client";
	setvbuf(stdout, NULL, _IOLBF, 0);
	memset(&p, 0, sizeof p);
	while ((op = getopt(argc, argv, "s:p:t:")) != -1) {
		switch (op) {
		case 's': addr = optarg; break;
		case 'p': port = optarg; break;
		case 't': watchdog = (unsigned)strtoul(optarg, NULL, 0); break;
		default:
			fprintf(stderr, "usage: %s [-s ADDR] [-p PORT] [-t WATCHDOG_SECS]\n", argv[0]);
			return 2;
		}
	}
	signal(SIGALRM, on_alarm);
	alarm(watchdog);

	if ((r = getaddrinfo(addr, port, &hints, &res))) {
		printf("%s: %s:%s: %s\n", prog, addr, port, gai_strerror(r));
		return 1;
	}
	if (!(ch = rdma_create_event_channel()) ||
	    fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK) ||
	    rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
		printf("%s: channel / id: %s\n", prog, errname(errno));
		return 1;
	}
	printf("%s: connecting to %s port %s\n", prog, addr, port);
	if (rdma_resolve_addr(id, NULL, res->ai_addr, 2000)) {
		printf("%s: rdma_resolve_addr: %s\n", prog, errname(errno));
		goto out;
	}
	if (expect_and_free(ch, RDMA_CM_EVENT_ADDR_RESOLVED, id))
		goto out;
	if (rdma_resolve_route(id, 2000)) {
		printf("%s: rdma_resolve_route: %s\n", prog, errname(errno));
		goto out;
	}
	if (expect_and_free(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, id))
		goto out;
	if (peer_setup(id, &p) || post_recv(id, &p))
		goto out;
	if (rdma_connect(id, NULL)) { /* defaults, as the stock client */
		printf("%s: rdma_connect: %s\n", prog, errname(errno));
		goto out;
	}
	if (expect_and_free(ch, RDMA_CM_EVENT_ESTABLISHED, id))
		goto out;
	if (post_send(id, &p, hello) || wait_completion(&p, IBV_WC_SEND, &wc))
		goto out;
	printf("%s: sent %d bytes \"%s\"\n", prog, STOCK_MSG_LEN, hello);
	if (wait_completion(&p, IBV_WC_RECV, &wc))
		goto out;
	print_bytes("received", p.recv_buf, wc.byte_len);
	if (wc.byte_len != STOCK_MSG_LEN) {
		printf("%s: expected %d bytes from rdma_server\n", prog, STOCK_MSG_LEN);
		goto out;
	}
	/* Sends the DREQ, or the DREP if the server's DREQ came first. */
	if (rdma_disconnect(id)) {
		printf("%s: rdma_disconnect: %s\n", prog, errname(errno));
		goto out;
	}
	if (expect_and_free(ch, RDMA_CM_EVENT_DISCONNECTED, id))
		goto out;
	ok = 1;
out:
	peer_teardown(id, &p);
	if (id && rdma_destroy_id(id)) {
		printf("%s: rdma_destroy_id: %s\n", prog, errname(errno));
		ok = 0;
	}
	rdma_destroy_event_channel(ch);
	freeaddrinfo(res);
	status = (ok && print_counters() == 0) ? 0 : 1;
	printf("%s: %s, exit %d\n", prog, ok ? "OK" : "FAILED", status);
	return status;
}
