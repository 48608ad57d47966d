/*
 * A tiny stand-in for libascendcl.so, for tests that need no CANN.
 *
 * Build flags:
 *   (none)                  every call works, on host memory;
 *   -DFAIL_CODE=<code>      every call but aclInit and aclrtSetDevice returns <code>;
 *   -DINIT_CODE=<code>      aclInit returns <code> (default 0);
 *   -DSETDEV_CODE=<code>    aclrtSetDevice returns <code> (default 0);
 *   -DOMIT_MALLOC           aclrtMalloc and aclrtFree are not exported.
 * Virtual memory, sharing and mbuf functions are never exported.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef INIT_CODE
#define INIT_CODE 0
#endif
#ifndef SETDEV_CODE
#define SETDEV_CODE 0
#endif
#ifdef FAIL_CODE
#define RET(ok_expr) return FAIL_CODE
#else
#define RET(ok_expr) do { ok_expr; return 0; } while (0)
#endif

int fake_set_device_calls = 0;
int fake_reset_device_calls = 0;
int fake_live_allocations = 0;

static int alloc_aligned(void **p, size_t size, size_t align) {
    if (p == NULL || size == 0) return 100000;
    if (posix_memalign(p, align, size) != 0) return 207001;
    fake_live_allocations++;
    return 0;
}
static int release(void *p) {
    if (p == NULL) return 100000;
    free(p);
    fake_live_allocations--;
    return 0;
}

int aclInit(const char *config) { (void)config; return INIT_CODE; }
int aclFinalize(void) { return 0; }
int aclrtSetDevice(int32_t dev) { (void)dev; fake_set_device_calls++; return SETDEV_CODE; }
int aclrtResetDevice(int32_t dev) { (void)dev; fake_reset_device_calls++; return 0; }

#ifndef OMIT_MALLOC
int aclrtMalloc(void **p, size_t size, unsigned policy) {
    (void)policy;
#ifdef FAIL_CODE
    (void)p; (void)size; return FAIL_CODE;
#else
    return alloc_aligned(p, size, 64);
#endif
}
int aclrtFree(void *p) {
#ifdef FAIL_CODE
    (void)p; return FAIL_CODE;
#else
    return release(p);
#endif
}
#endif

int aclrtMallocHost(void **p, size_t size) {
#ifdef FAIL_CODE
    (void)p; (void)size; return FAIL_CODE;
#else
    return alloc_aligned(p, size, 64);
#endif
}
int aclrtFreeHost(void *p) {
#ifdef FAIL_CODE
    (void)p; return FAIL_CODE;
#else
    return release(p);
#endif
}
int acldvppMalloc(void **p, size_t size) {
#ifdef FAIL_CODE
    (void)p; (void)size; return FAIL_CODE;
#else
    return alloc_aligned(p, size, 128);
#endif
}
int acldvppFree(void *p) {
#ifdef FAIL_CODE
    (void)p; return FAIL_CODE;
#else
    return release(p);
#endif
}

int aclrtMemcpy(void *dst, size_t max, const void *src, size_t n, unsigned kind) {
    (void)kind;
    if (n > max) return 100000;
    RET(memmove(dst, src, n));
}
int aclrtMemcpyAsync(void *dst, size_t max, const void *src, size_t n, unsigned kind, void *s) {
    (void)kind; (void)s;
    if (n > max) return 100000;
    RET(memmove(dst, src, n));
}
int aclrtMemset(void *dst, size_t max, int32_t v, size_t n) {
    if (n > max) return 100000;
    RET(memset(dst, v, n));
}
int aclrtMemsetAsync(void *dst, size_t max, int32_t v, size_t n, void *s) {
    (void)s;
    if (n > max) return 100000;
    RET(memset(dst, v, n));
}
int aclrtGetMemInfo(unsigned attr, size_t *free_, size_t *total) {
    (void)attr;
    RET((*free_ = (size_t)1 << 30, *total = (size_t)2 << 30));
}

static int new_token(void **out) {
    if (out == NULL) return 100000;
    *out = malloc(1);
    return *out ? 0 : 207001;
}
int aclrtCreateStream(void **s) { RET(new_token(s)); }
int aclrtDestroyStream(void *s) { RET(free(s)); }
int aclrtSynchronizeStream(void *s) { (void)s; RET((void)0); }
int aclrtCreateEvent(void **e) { RET(new_token(e)); }
int aclrtDestroyEvent(void *e) { RET(free(e)); }
int aclrtRecordEvent(void *e, void *s) { (void)e; (void)s; RET((void)0); }
int aclrtQueryEventStatus(void *e, unsigned *status) { (void)e; RET(*status = 1); }
int aclrtStreamWaitEvent(void *s, void *e) { (void)s; (void)e; RET((void)0); }
int aclrtSynchronizeEvent(void *e) { (void)e; RET((void)0); }
