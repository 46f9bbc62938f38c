/* timeshift: a clock for redis-server that a test moves forward (tests/history/clock.py).
 *
 * LD_PRELOADed into redis-server, it adds to the wall clock (CLOCK_REALTIME, gettimeofday,
 * time) the offset, in microseconds, held by the 8-byte file CQ_TIME_OFFSET_FILE names,
 * mapped once and read on every call: the test writes a larger offset and every expiry,
 * TIME and PEXPIRETIME of the server follows at once. libfaketime does the same but
 * recurses into clock_gettime from jemalloc's start-up in Debian's redis-server; this reads
 * the real clock with the raw system call and allocates nothing.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile const int64_t *offset_us;
static int initialised;

static int64_t offset(void) {
  if (!initialised) {
    initialised = 1;
    const char *path = getenv("CQ_TIME_OFFSET_FILE");
    if (path != NULL) {
      int fd = open(path, O_RDONLY);
      if (fd >= 0) {
        void *map = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
        if (map != MAP_FAILED) offset_us = map;
        close(fd);
      }
    }
  }
  return offset_us != NULL ? *offset_us : 0;
}

static void shift(struct timespec *ts) {
  int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + offset() * 1000;
  ts->tv_sec = ns / 1000000000;
  ts->tv_nsec = ns % 1000000000;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
  long r = syscall(SYS_clock_gettime, id, ts);
  if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
  return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
  (void)tz;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  tv->tv_sec = ts.tv_sec;
  tv->tv_usec = ts.tv_nsec / 1000;
  return 0;
}

time_t time(time_t *out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out != NULL) *out = ts.tv_sec;
  return ts.tv_sec;
}
