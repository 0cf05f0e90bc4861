/*
 * late_cm: a program that is not linked with librdmacm and loads a plugin
 * that is (tests/preload/late_cm_plugin.c) with dlopen, the way MPI
 * transports and storage plugins load theirs. Under librdmasafe-preload.so
 * the plugin's rdma_get_cm_event / rdma_ack_cm_event bind to the preload
 * (it comes first in the global scope), and reach librdmacm's real
 * functions, although the program itself never loaded librdmacm. (The
 * preload depends on librdmacm and libibverbs, so they come with it; an
 * "info" line says whether librdmacm was loaded at the start.)
 *
 *   late_cm ADDR PLUGIN [-g] [-v]
 *
 *   ADDR    the RDMA device's IPv4 address (the plugin resolves it);
 *   PLUGIN  the plugin's path;
 *   -g      dlopen it RTLD_GLOBAL (default RTLD_LOCAL);
 *   -v      before loading it, a libibverbs call the preload interposes
 *           (a CQ created and destroyed: ibv_destroy_cq), so the preload
 *           sets itself up before the plugin is there.
 *
 * Prints "ok"/"FAIL" lines (tests/c/check.h), then "late_cm: N passed, M
 * failed"; exits 0 when nothing failed, 1 otherwise, 3 from the watchdog.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "../c/check.h"

/* late_cm_plugin.c's one function: 0, or -1 with what failed in msg. */
typedef int (*resolve_fn)(const char *addr, char *msg, size_t len);

static void verbs_first(void)
{
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_cq *cq = NULL;
	int n = 0;

	phase = "a CQ created and destroyed before the plugin";
	list = ibv_get_device_list(&n);
	if (CHECK(list && n > 0, "an RDMA device (%d)", n))
		ctx = ibv_open_device(list[0]);
	if (CHECK(ctx != NULL, "ibv_open_device"))
		cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	if (CHECK(cq != NULL, "ibv_create_cq"))
		CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq (interposed) before the plugin is loaded");
	if (ctx)
		ibv_close_device(ctx);
	if (list)
		ibv_free_device_list(list);
}

int main(int argc, char **argv)
{
	int global = 0, verbs = 0, i;
	void *plugin;
	resolve_fn resolve = NULL;
	char msg[256] = "";

	if (argc < 3) {
		fprintf(stderr, "usage: late_cm ADDR PLUGIN [-g] [-v]\n");
		return 1;
	}
	for (i = 3; i < argc; i++) {
		if (!strcmp(argv[i], "-g"))
			global = 1;
		else if (!strcmp(argv[i], "-v"))
			verbs = 1;
	}
	signal(SIGALRM, on_alarm);
	alarm(60);
	info("librdmacm loaded at the start: %s",
	     dlopen("librdmacm.so.1", RTLD_LAZY | RTLD_NOLOAD) ? "yes (a dependency of a preload?)" : "no");
	if (verbs)
		verbs_first();
	phase = "dlopen of the plugin";
	plugin = dlopen(argv[2], RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
	if (CHECK(plugin != NULL, "dlopen(plugin, %s): %s", global ? "RTLD_GLOBAL" : "RTLD_LOCAL",
		  plugin ? "loaded" : dlerror()))
		resolve = (resolve_fn)dlsym(plugin, "late_cm_resolve");
	if (CHECK(resolve != NULL, "the plugin's late_cm_resolve")) {
		phase = "the plugin's address resolution";
		CHECK(resolve(argv[1], msg, sizeof(msg)) == 0,
		      "the plugin gets and acks ADDR_RESOLVED through rdma_get_cm_event / rdma_ack_cm_event%s%s",
		      msg[0] ? ": " : "", msg);
	}
	if (plugin)
		dlclose(plugin);
	printf("late_cm: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
