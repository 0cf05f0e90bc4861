/* A library preloaded after the preload, for fork_and_set_up's late-set-up
 * case: its constructor runs before the preload's, so its fork prepare
 * handler, registered first, runs after the preload's. That handler lets
 * the program's other thread begin (slow_prepare_began) and gives it
 * 300 ms: the thread makes the process's first interposed call (the
 * preload's set-up) and enters check mode's books over and over, after
 * the preload's prepare handler found nothing set up to hold. */
#include <pthread.h>
#include <unistd.h>

volatile int slow_prepare_began;

static void prepare(void)
{
	slow_prepare_began = 1;
	usleep(300 * 1000);
}

__attribute__((constructor)) static void init(void)
{
	pthread_atfork(prepare, 0, 0);
}
