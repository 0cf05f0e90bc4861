// cxx_consumer: rdmasafe.h used from C++ (the header's extern "C" block),
// linked against the installed librdmasafe and run on the host: nothing
// here needs an RDMA device. Built by tests/consumer/cmake (find_package)
// and tests/consumer/make (pkg-config) as C++11.
//
// Checks the two error conventions (-1 with errno for the drop-in CM calls,
// a negative errno for everything else), event names, the copy counters,
// the log callback (a captureless lambda), and RAII wrappers around copies
// and loops. The header's struct and function names are distinct, so the
// types are used here by their plain names, as C++ code would.
// Prints one line per check, then
// "cxx_consumer: N passed, M failed"; exits 0 only if M is 0.
#include <rdmasafe.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

int passed, failed;

void check(bool ok, const std::string &what)
{
	std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
	std::fflush(stdout);
	(ok ? passed : failed)++;
}

// An event copy is freed with rdmasafe_event_free (never rdma_ack_cm_event).
struct EventFree {
	void operator()(rdma_cm_event *ev) const noexcept { rdmasafe_event_free(ev); }
};
using Event = std::unique_ptr<rdma_cm_event, EventFree>;

struct LoopDestroy {
	void operator()(rdmasafe_cq_loop *loop) const noexcept { rdmasafe_cq_loop_destroy(loop); }
};
using Loop = std::unique_ptr<rdmasafe_cq_loop, LoopDestroy>;

// The -1/errno convention: returns "-1/EINVAL"-style text.
std::string errno_result(int r)
{
	if (r != -1)
		return std::to_string(r) + "/-";
	return "-1/" + std::string(errno == EINVAL ? "EINVAL" : std::to_string(errno));
}

} // namespace

static_assert(std::is_standard_layout<struct rdmasafe_cm_counters>::value, "plain C struct");
static_assert(std::is_trivially_copyable<rdmasafe_cq_loop_stats>::value, "plain C struct");
static_assert(sizeof(static_cast<rdmasafe_cq_loop_stats *>(nullptr)->completions_per_wakeup) ==
		      16 * sizeof(std::uint64_t),
	      "16 histogram buckets");
static_assert(std::is_same<decltype(&rdmasafe_get_event),
			   int (*)(rdma_event_channel *, rdma_cm_event **)>::value,
	      "rdmasafe_get_event has rdma_get_cm_event's signature");
static_assert(std::is_same<decltype(&rdmasafe_event_free), int (*)(rdma_cm_event *)>::value,
	      "rdmasafe_event_free has rdma_ack_cm_event's signature");

int main()
{
	check(std::string(rdmasafe_event_str(RDMA_CM_EVENT_ESTABLISHED)) == "RDMA_CM_EVENT_ESTABLISHED",
	      "rdmasafe_event_str(RDMA_CM_EVENT_ESTABLISHED)");
	check(std::string(rdmasafe_event_str(1000)) == "RDMA_CM_EVENT_UNKNOWN",
	      "rdmasafe_event_str(1000) = RDMA_CM_EVENT_UNKNOWN");
	check(std::string(rdmasafe_async_event_str(IBV_EVENT_CQ_ERR)) == "IBV_EVENT_CQ_ERR",
	      "rdmasafe_async_event_str(IBV_EVENT_CQ_ERR)");

	// -1 with errno, like librdmacm
	rdma_cm_event *raw = nullptr;
	errno = 0;
	std::string r = errno_result(rdmasafe_get_event(nullptr, &raw));
	check(r == "-1/EINVAL" && raw == nullptr, "rdmasafe_get_event(nullptr, &ev) -> " + r);
	errno = 0;
	r = errno_result(rdmasafe_get_event_timeout(nullptr, &raw, 0));
	check(r == "-1/EINVAL", "rdmasafe_get_event_timeout(nullptr, &ev, 0) -> " + r);
	rdma_cm_event *batch[4] = {};
	errno = 0;
	r = errno_result(rdmasafe_get_events(nullptr, batch, 0, 0));
	check(r == "-1/EINVAL", "rdmasafe_get_events(nullptr, ev, 0, 0) -> " + r);
	check(rdmasafe_event_free(nullptr) == 0, "rdmasafe_event_free(nullptr) -> 0");
	rdma_cm_event not_a_copy{};
	errno = 0;
	r = errno_result(rdmasafe_event_free(&not_a_copy));
	check(r == "-1/EINVAL", "rdmasafe_event_free(a struct it did not hand out) -> " + r);
	{
		Event none; // an empty holder frees nothing
	}

	// a negative errno, errno untouched
	rdmasafe_cm_counters k{}; // the type name alone works in C++
	check(rdmasafe_cm_get_counters(&k) == -EINVAL, "rdmasafe_cm_get_counters with size unset -> -EINVAL");
	k.size = sizeof k;
	check(rdmasafe_cm_get_counters(&k) == 0 && k.copied == 0 && k.outstanding == 0,
	      "rdmasafe_cm_counters: nothing copied, nothing outstanding");
	check(rdmasafe_cm_get_counters(nullptr) == -EINVAL, "rdmasafe_cm_get_counters(nullptr) -> -EINVAL");
	int held = rdmasafe_cm_reserve(8);
	check(held >= 8, "rdmasafe_cm_reserve(8) -> " + std::to_string(held));
	check(rdmasafe_cm_reserve(-1) == -EINVAL, "rdmasafe_cm_reserve(-1) -> -EINVAL");
	// Read first: the message is an argument too, and C++ leaves the order
	// of argument evaluation open (g++ built it before the read).
	int got = rdmasafe_cm_get_counters(&k);
	check(got == 0 && k.slots_allocated >= 8, "slots_allocated after the reserve: " + std::to_string(k.slots_allocated));

	rdmasafe_cq_loop *loop_out = nullptr;
	check(rdmasafe_cq_loop_create(nullptr, nullptr, &loop_out) == -EINVAL && loop_out == nullptr,
	      "rdmasafe_cq_loop_create(nullptr channel) -> -EINVAL");
	{
		Loop loop(loop_out); // nullptr: the deleter is not called
	}
	struct rdmasafe_cq_loop_stats st{};
	st.size = sizeof st;
	check(rdmasafe_cq_loop_get_stats(nullptr, &st) == -EINVAL, "rdmasafe_cq_loop_get_stats(nullptr) -> -EINVAL");
	check(rdmasafe_cq_loop_stop(nullptr) == -EINVAL, "rdmasafe_cq_loop_stop(nullptr) -> -EINVAL");
	check(rdmasafe_cq_loop_fd(nullptr) == -EINVAL, "rdmasafe_cq_loop_fd(nullptr) -> -EINVAL");
	check(rdmasafe_cq_loop_destroy(nullptr) == -EINVAL, "rdmasafe_cq_loop_destroy(nullptr) -> -EINVAL");
	rdmasafe_async_event ae{};
	ae.size = sizeof ae;
	check(rdmasafe_async_get(nullptr, &ae, 0) == -EINVAL, "rdmasafe_async_get(nullptr) -> -EINVAL");

	// logging: a captureless lambda converts to the C callback type
	std::vector<std::string> logged;
	check(rdmasafe_set_log_level(9) == -EINVAL, "rdmasafe_set_log_level(9) -> -EINVAL");
	check(rdmasafe_set_log_callback(
		      [](void *ctx, int level, const char *msg) {
			      static_cast<std::vector<std::string> *>(ctx)->push_back(
				      std::to_string(level) + " " + msg);
		      },
		      &logged) == 0,
	      "rdmasafe_set_log_callback(lambda) -> 0");
	check(rdmasafe_set_log_level(5) == 0, "rdmasafe_set_log_level(5) -> 0");
	rdmasafe_event_free(&not_a_copy); // may log; must not crash
	check(rdmasafe_set_log_callback(nullptr, nullptr) == 0 && rdmasafe_set_log_level(0) == 0,
	      "log callback and level reset (" + std::to_string(logged.size()) + " message(s) logged)");

	std::printf("cxx_consumer: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
