/*
 * rdmasafe_rdma_server: a server that rdma-core's stock `rdma_client`
 * (rdmacm-utils) talks to, written on an rdmasafe event channel (see
 * rdmasafe_interop.h for what the stock client expects).
 *
 *   rdmasafe_rdma_server [-s ADDR] [-p PORT] [-n CONNECTIONS] [-t WATCHDOG_SECS]
 *
 * Defaults as the stock rdma_server: 0.0.0.0, port 7471, one connection.
 * Per connection: CONNECT_REQUEST -> QP (1 send, 1 recv, inline 16), post
 * a 16-byte receive, accept; ESTABLISHED; receive the client's 16 bytes;
 * send 16 bytes back; the client disconnects: DISCONNECTED ->
 * rdma_disconnect (the DREP its synchronous disconnect waits for); destroy.
 * The listener's channel is left blocking: the waits use
 * rdmasafe_get_event_timeout.
 */
#define _GNU_SOURCE /* strerrorname_np */
#include <getopt.h>
#include <netdb.h>

#include "rdmasafe_interop.h"

static const char reply[STOCK_MSG_LEN + 1] = "rdmasafe server!";

static int serve_one(struct rdma_event_channel *ch, struct rdma_cm_id *listener)
{
	struct rdma_cm_event *ev;
	struct rdma_cm_id *id;
	struct peer p;
	struct ibv_wc wc;
	int ret = -1;

	memset(&p, 0, sizeof p);
	if (!(ev = expect_event(ch, RDMA_CM_EVENT_CONNECT_REQUEST, NULL)))
		return -1;
	id = ev->id; /* the new id is ours: accept it, or reject and destroy it */
	if (ev->listen_id != listener)
		printf("%s: request for another listener?\n", prog);
	rdmasafe_event_free(ev);

	if (peer_setup(id, &p) || post_recv(id, &p)) {
		rdma_reject(id, NULL, 0);
		goto out;
	}
	if (rdma_accept(id, NULL)) { /* defaults, as the stock server */
		printf("%s: rdma_accept: %s\n", prog, errname(errno));
		goto out;
	}
	if (expect_and_free(ch, RDMA_CM_EVENT_ESTABLISHED, id))
		goto out;
	if (wait_completion(&p, IBV_WC_RECV, &wc))
		goto out;
	print_bytes("received", p.recv_buf, wc.byte_len);
	if (wc.byte_len != STOCK_MSG_LEN) {
		printf("%s: expected %d bytes from rdma_client\n", prog, STOCK_MSG_LEN);
		goto out;
	}
	if (post_send(id, &p, reply) || wait_completion(&p, IBV_WC_SEND, &wc))
		goto out;
	printf("%s: sent %d bytes \"%s\"\n", prog, STOCK_MSG_LEN, reply);
	/* the stock client disconnects once it has our message */
	if (expect_and_free(ch, RDMA_CM_EVENT_DISCONNECTED, id))
		goto out;
	if (rdma_disconnect(id))
		printf("%s: rdma_disconnect: %s\n", prog, errname(errno));
	ret = 0;
out:
	peer_teardown(id, &p);
	if (rdma_destroy_id(id)) {
		printf("%s: rdma_destroy_id: %s\n", prog, errname(errno));
		ret = -1;
	}
	return ret;
}

int main(int argc, char **argv)
{
	const char *addr = "0.0.0.0", *port = "7471";
	unsigned watchdog = 60, n = 1, ok = 0;
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE }, *res;
	struct rdma_event_channel *ch;
	struct rdma_cm_id *listener;
	int op, r, status;

	prog = "rdmasafe_rdma_server";
	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((op = getopt(argc, argv, "s:p:n:t:")) != -1) {
		switch (op) {
		case 's': addr = optarg; break;
		case 'p': port = optarg; break;
		case 'n': n = (unsigned)strtoul(optarg, NULL, 0); break;
		case 't': watchdog = (unsigned)strtoul(optarg, NULL, 0); break;
		default:
			fprintf(stderr, "usage: %s [-s ADDR] [-p PORT] [-n CONNECTIONS] [-t WATCHDOG_SECS]\n", argv[0]);
			return 2;
		}
	}
	signal(SIGALRM, on_alarm);
	alarm(watchdog);

	if ((r = getaddrinfo(addr, port, &hints, &res))) {
		printf("%s: %s:%s: %s\n", prog, addr, port, gai_strerror(r));
		return 1;
	}
	if (!(ch = rdma_create_event_channel()) || rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(listener, res->ai_addr) || rdma_listen(listener, 4)) {
		printf("%s: listening on %s:%s: %s\n", prog, addr, port, errname(errno));
		return 1;
	}
	freeaddrinfo(res);
	printf("%s: listening on %s port %s\n", prog, addr, port);
	for (unsigned i = 0; i < n; i++)
		if (serve_one(ch, listener) == 0)
			ok++;
	rdma_destroy_id(listener);
	rdma_destroy_event_channel(ch);
	status = (ok == n && print_counters() == 0) ? 0 : 1;
	printf("%s: %u of %u connections OK, exit %d\n", prog, ok, n, status);
	return status;
}
