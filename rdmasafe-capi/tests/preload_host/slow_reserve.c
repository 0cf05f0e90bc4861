/* A library preloaded after the preload, for fork_and_set_up's
 * slow-reserve case: its mmap makes the CM copies' address-space
 * reservation (PROT_NONE, MAP_NORESERVE, 1 GiB or more) take 1 s, as an
 * mmap stuck on the kernel's mmap lock would, and says when one began
 * (slow_reserve_began). Every other mmap goes straight to the kernel. */
#define _GNU_SOURCE
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

volatile int slow_reserve_began;

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	if (prot == PROT_NONE && (flags & MAP_NORESERVE) && len >= (1UL << 30)) {
		slow_reserve_began = 1;
		usleep(1000 * 1000);
	}
	return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}
