/*
 * check_cm_bugs: small librdmacm programs with (or without) a CM event
 * handling bug, for librdmasafe-preload.so's check mode
 * (LD_PRELOAD=... RDMASAFE_CHECK=1). Plain librdmacm: no rdmasafe call.
 *
 *   check_cm_bugs -m MODE [-w REPORT_FILE] [-t WATCHDOG_S]
 *
 * Every mode creates an event channel and an id and resolves the address
 * in $RDMASAFE_TEST_ADDR (a local address: ADDR_RESOLVED comes without any
 * peer), then:
 *   ok       acks it, resolves the route, acks ROUTE_RESOLVED, destroys the
 *            id and the channel: correct, check mode reports nothing;
 *   held     keeps the event un-acked until REPORT_FILE (check mode's
 *            RDMASAFE_CHECK_FILE) names it as held, then acks it and
 *            tears down: a held event, reported whatever the timing;
 *   leak     exits without acking it (nor destroying the id);
 *   destroy  calls rdma_destroy_id without acking it: that call waits
 *            forever (the harness kills the program);
 *   double   acks it twice (with raw librdmacm a double free);
 *   forkheld acks it, destroys the id, then forks: the child (whose
 *            process never got a CM event of its own) does what "held"
 *            does with an id and an event of its own, printed as
 *            "child got ... event %p of id %p"; the parent waits for it
 *            and exits as it did (check mode's watcher must run in the
 *            child too, though the parent's started before the fork).
 *
 * Prints what it does, with the event's and id's addresses as %p (check
 * mode's reports name them the same way), then "check_cm_bugs: done" and
 * exits 0; 1 on a setup failure; 3 from the SIGALRM watchdog.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

/* The process main started in (a forked child's lines say "child"). */
static pid_t first_pid;

static void on_alarm(int sig)
{
	static const char msg[] = "check_cm_bugs: watchdog expired\n";

	(void)sig;
	if (write(STDOUT_FILENO, msg, sizeof msg - 1) < 0)
		_exit(3);
	_exit(3);
}

static void die(const char *what)
{
	printf("check_cm_bugs: %s: %s\n", what, strerror(errno));
	exit(1);
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;

	if (rdma_get_cm_event(ch, &ev))
		die("rdma_get_cm_event");
	if (ev->event != want || ev->status) {
		printf("check_cm_bugs: got %s status %d, wanted %s\n", rdma_event_str(ev->event), ev->status,
		       rdma_event_str(want));
		exit(1);
	}
	printf("%sgot %s event %p of id %p\n", getpid() == first_pid ? "" : "child ", rdma_event_str(ev->event),
	       (void *)ev, (void *)ev->id);
	return ev;
}

/* Until FILE has a line with "held: " and NEEDLE (polls every 20 ms; the
 * watchdog ends a wait that never succeeds). */
static void wait_for_report(const char *file, const char *needle)
{
	char line[1024];

	for (;;) {
		FILE *f = fopen(file, "r");

		if (f) {
			while (fgets(line, sizeof line, f)) {
				if (strstr(line, "held: ") && strstr(line, needle)) {
					fclose(f);
					return;
				}
			}
			fclose(f);
		}
		usleep(20000);
	}
}

/* Holds EV (of ID) until REPORT names it as held, then acks it. */
static void hold_until_reported(const char *report, struct rdma_cm_event *ev, struct rdma_cm_id *id)
{
	char needle[64];

	snprintf(needle, sizeof needle, "event %p of id %p", (void *)ev, (void *)id);
	printf("holding it until %s reports it\n", report);
	wait_for_report(report, needle);
	printf("reported as held: acking it now\n");
	if (rdma_ack_cm_event(ev))
		die("rdma_ack_cm_event");
}

/* forkheld's child: "held" with a channel, an id and an event of its own. */
static void held_in_a_child(const char *report, struct sockaddr_in *dst, int watchdog)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;

	alarm(watchdog); /* a child inherits no alarm */
	ch = rdma_create_event_channel();
	if (!ch)
		die("rdma_create_event_channel (child)");
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		die("rdma_create_id (child)");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)dst, 5000))
		die("rdma_resolve_addr (child)");
	hold_until_reported(report, expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED), id);
	if (rdma_destroy_id(id))
		die("rdma_destroy_id (child)");
	rdma_destroy_event_channel(ch);
	printf("child: done\n");
	exit(0);
}

int main(int argc, char **argv)
{
	const char *mode = NULL, *report = NULL, *addr = getenv("RDMASAFE_TEST_ADDR");
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;
	struct rdma_cm_event *ev;
	struct sockaddr_in dst = { .sin_family = AF_INET, .sin_port = htons(7999) };
	int watchdog = 120, op, ret, err;

	while ((op = getopt(argc, argv, "m:w:t:")) != -1) {
		switch (op) {
		case 'm':
			mode = optarg;
			break;
		case 'w':
			report = optarg;
			break;
		case 't':
			watchdog = atoi(optarg);
			break;
		default:
			return 2;
		}
	}
	if (!mode || !addr || inet_pton(AF_INET, addr, &dst.sin_addr) != 1) {
		printf("usage: RDMASAFE_TEST_ADDR=A check_cm_bugs -m ok|held|leak|destroy|double|forkheld [-w FILE]\n");
		return 2;
	}
	first_pid = getpid();
	if ((!strcmp(mode, "held") || !strcmp(mode, "forkheld")) && !report) {
		printf("check_cm_bugs: -m %s needs -w REPORT_FILE\n", mode);
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(watchdog);

	ch = rdma_create_event_channel();
	if (!ch)
		die("rdma_create_event_channel");
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 5000))
		die("rdma_resolve_addr");
	ev = expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);

	if (!strcmp(mode, "ok")) {
		if (rdma_ack_cm_event(ev))
			die("rdma_ack_cm_event");
		if (rdma_resolve_route(id, 5000))
			die("rdma_resolve_route");
		ev = expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
		if (rdma_ack_cm_event(ev))
			die("rdma_ack_cm_event");
	} else if (!strcmp(mode, "held")) {
		hold_until_reported(report, ev, id);
	} else if (!strcmp(mode, "forkheld")) {
		pid_t child;
		int st;

		if (rdma_ack_cm_event(ev))
			die("rdma_ack_cm_event");
		fflush(stdout);
		child = fork();
		if (child < 0)
			die("fork");
		if (child == 0)
			held_in_a_child(report, &dst, watchdog);
		if (waitpid(child, &st, 0) != child)
			die("waitpid");
		printf("child exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
		if (!WIFEXITED(st) || WEXITSTATUS(st))
			return 1;
	} else if (!strcmp(mode, "leak")) {
		printf("exiting without acking it\n");
		printf("check_cm_bugs: done\n");
		return 0;
	} else if (!strcmp(mode, "destroy")) {
		printf("rdma_destroy_id without acking it (waits until it is acked)\n");
		ret = rdma_destroy_id(id);
		printf("rdma_destroy_id returned %d\n", ret);
		printf("check_cm_bugs: done\n");
		return 0;
	} else if (!strcmp(mode, "double")) {
		ret = rdma_ack_cm_event(ev);
		printf("first rdma_ack_cm_event: %d\n", ret);
		errno = 0;
		ret = rdma_ack_cm_event(ev);
		err = errno;
		printf("second rdma_ack_cm_event of the same event: %d (%s)\n", ret, ret ? strerror(err) : "no error");
	} else {
		printf("check_cm_bugs: unknown mode %s\n", mode);
		return 2;
	}
	if (rdma_destroy_id(id))
		die("rdma_destroy_id");
	rdma_destroy_event_channel(ch);
	printf("check_cm_bugs: done\n");
	return 0;
}
