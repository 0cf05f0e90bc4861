/*
 * LD_PRELOAD allocation counter for the benchmarks: counts every call of
 * malloc, calloc, realloc, posix_memalign, aligned_alloc, memalign and
 * valloc in the process (librdmacm's, libibverbs', rdmasafe's, the
 * program's own) and forwards it to glibc. A program reads the count with
 * allocount_allocs() (declared weak in bench_common.h, so it reads 0
 * without the preload).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t size);
extern void *__libc_memalign(size_t align, size_t size);
extern void __libc_free(void *p);

static uint64_t count;

static inline void bump(void)
{
	__atomic_fetch_add(&count, 1, __ATOMIC_RELAXED);
}

uint64_t allocount_allocs(void)
{
	return __atomic_load_n(&count, __ATOMIC_RELAXED);
}

void *malloc(size_t size)
{
	bump();
	return __libc_malloc(size);
}

void *calloc(size_t n, size_t size)
{
	bump();
	return __libc_calloc(n, size);
}

void *realloc(void *p, size_t size)
{
	bump();
	return __libc_realloc(p, size);
}

void free(void *p)
{
	__libc_free(p);
}

void *memalign(size_t align, size_t size)
{
	bump();
	return __libc_memalign(align, size);
}

void *aligned_alloc(size_t align, size_t size)
{
	bump();
	return __libc_memalign(align, size);
}

void *valloc(size_t size)
{
	bump();
	return __libc_memalign(4096, size);
}

int posix_memalign(void **out, size_t align, size_t size)
{
	if (align < sizeof(void *) || (align & (align - 1)) != 0)
		return EINVAL;
	bump();
	void *p = __libc_memalign(align, size);
	if (!p)
		return ENOMEM;
	*out = p;
	return 0;
}
