/*
 * late_cm_plugin: the librdmacm side of tests/preload/late_cm.c, a shared
 * object linked with librdmacm that the program loads with dlopen. One
 * function: resolve an address on a channel of its own, get the event,
 * ack it, tear down.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include <rdma/rdma_cma.h>

int late_cm_resolve(const char *addr, char *msg, size_t len);

/* "<call>: <ret> <errno name>" into msg; -1. */
static int failed(char *msg, size_t len, const char *call, int ret)
{
	int e = errno;
	const char *name = strerrorname_np(e);

	snprintf(msg, len, "%s: %d %s", call, ret, name ? name : "E?");
	return -1;
}

int late_cm_resolve(const char *addr, char *msg, size_t len)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id = NULL;
	struct rdma_cm_event *ev = NULL;
	struct sockaddr_in sin;
	int ret, rc = 0;

	memset(&sin, 0, sizeof(sin));
	sin.sin_family = AF_INET;
	if (inet_pton(AF_INET, addr, &sin.sin_addr) != 1) {
		snprintf(msg, len, "no IPv4 address: %s", addr);
		return -1;
	}
	ch = rdma_create_event_channel();
	if (!ch)
		return failed(msg, len, "rdma_create_event_channel", -1);
	ret = rdma_create_id(ch, &id, NULL, RDMA_PS_TCP);
	if (ret) {
		rc = failed(msg, len, "rdma_create_id", ret);
		goto out;
	}
	ret = rdma_resolve_addr(id, NULL, (struct sockaddr *)&sin, 2000);
	if (ret) {
		rc = failed(msg, len, "rdma_resolve_addr", ret);
		goto out;
	}
	ret = rdma_get_cm_event(ch, &ev);
	if (ret) {
		rc = failed(msg, len, "rdma_get_cm_event", ret);
		goto out;
	}
	if (ev->event != RDMA_CM_EVENT_ADDR_RESOLVED || ev->status != 0) {
		snprintf(msg, len, "rdma_get_cm_event: %s status %d", rdma_event_str(ev->event), ev->status);
		rc = -1;
	}
	ret = rdma_ack_cm_event(ev);
	if (ret && rc == 0)
		rc = failed(msg, len, "rdma_ack_cm_event", ret);
out:
	if (id && rdma_destroy_id(id) && rc == 0)
		rc = failed(msg, len, "rdma_destroy_id", -1);
	rdma_destroy_event_channel(ch);
	return rc;
}
