/*
 * A tiny stand-in for libascendcl.so, for tests that need no CANN.
 *
 * Build flags:
 *   (none)                  every call works, on host memory;
 *   -DFAIL_CODE=<code>      every call but aclInit and aclrtSetDevice returns <code>;
 *   -DINIT_CODE=<code>      aclInit returns <code> (default 0);
 *   -DSETDEV_CODE=<code>    aclrtSetDevice returns <code> (default 0);
 *   -DOMIT_MALLOC           aclrtMalloc and aclrtFree are not exported;
 *   -DOMIT_DVPP             acldvppMalloc and acldvppFree are not exported;
 *   -DOLD_QUERY             aclrtQueryEvent is exported instead of aclrtQueryEventStatus;
 *   -DDEVICE_COUNT=<n>      aclrtGetDeviceCount is exported and counts <n> devices
 *                           (older runtimes lack it);
 *   -DWITH_VMM              the virtual-memory functions are exported, and accept any
 *                           argument: what reaches them was not refused by the caller;
 *   -DWITH_MBUF             acltdtAllocBuf, acltdtGetBufData and acltdtFreeBuf are exported:
 *                           a buffer is its own data area, of the size asked.
 * Sharing functions are never exported.
 *
 * The fake_* globals let a test see what reached the runtime; fake_event_done is written
 * by tests to choose what an event query answers.
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
int fake_finalize_calls = 0;
/* The device of the last aclrtSetDevice (one thread at a time in the tests that read it). */
int fake_current_device = -1;
/* The current device when the last aclrtMemcpy or aclrtMemset ran. */
int fake_copy_device = -1;
/* The attribute class of the last aclrtGetMemInfo. */
int fake_mem_attr = -1;
/* Whether a queried event has completed. */
int fake_event_done = 1;
int fake_map_calls = 0;
int fake_unmap_calls = 0;
int fake_release_calls = 0;
/* The flags of the last aclrtReserveMemAddress (1: huge pages), -1 before any. */
int fake_reserve_flags = -1;
int fake_free_physical_calls = 0;

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
int aclFinalize(void) { fake_finalize_calls++; return 0; }
int aclrtSetDevice(int32_t dev) {
    fake_set_device_calls++;
    if (SETDEV_CODE == 0) fake_current_device = dev;
    return SETDEV_CODE;
}
int aclrtResetDevice(int32_t dev) { (void)dev; fake_reset_device_calls++; return 0; }
#ifdef DEVICE_COUNT
int aclrtGetDeviceCount(uint32_t *count) {
    if (count == NULL) return 100000;
    RET(*count = DEVICE_COUNT);
}
#endif

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
#ifndef OMIT_DVPP
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
#endif

int aclrtMemcpy(void *dst, size_t max, const void *src, size_t n, unsigned kind) {
    (void)kind;
    fake_copy_device = fake_current_device;
    if (n > max) return 100000;
    RET(memmove(dst, src, n));
}
int aclrtMemcpyAsync(void *dst, size_t max, const void *src, size_t n, unsigned kind, void *s) {
    (void)kind; (void)s;
    if (n > max) return 100000;
    RET(memmove(dst, src, n));
}
int aclrtMemset(void *dst, size_t max, int32_t v, size_t n) {
    fake_copy_device = fake_current_device;
    if (n > max) return 100000;
    RET(memset(dst, v, n));
}
int aclrtMemsetAsync(void *dst, size_t max, int32_t v, size_t n, void *s) {
    (void)s;
    if (n > max) return 100000;
    RET(memset(dst, v, n));
}
int aclrtGetMemInfo(unsigned attr, size_t *free_, size_t *total) {
    fake_mem_attr = (int)attr;
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
#ifdef OLD_QUERY
/* ACL_EVENT_STATUS_COMPLETE is 0, NOT_READY 1. */
int aclrtQueryEvent(void *e, unsigned *status) { (void)e; RET(*status = fake_event_done ? 0 : 1); }
#else
/* ACL_EVENT_RECORDED_STATUS_NOT_READY is 0, COMPLETE 1. */
int aclrtQueryEventStatus(void *e, unsigned *status) { (void)e; RET(*status = fake_event_done ? 1 : 0); }
#endif
int aclrtStreamWaitEvent(void *s, void *e) { (void)s; (void)e; RET((void)0); }
int aclrtSynchronizeEvent(void *e) { (void)e; RET((void)0); }

#ifdef WITH_VMM
/* Addresses handed out by aclrtReserveMemAddress: never touched, so any value will do. */
static uintptr_t next_va = (uintptr_t)1 << 40;
int aclrtMemGetAllocationGranularity(void *prop, unsigned option, size_t *g) {
    (void)prop; (void)option;
    RET(*g = (size_t)2 << 20);
}
/* The documented rules: alignment and hint reserved (0 and null), flags 0 or 1. */
int aclrtReserveMemAddress(void **va, size_t size, size_t align, void *hint, uint64_t flags) {
    if (align != 0 || hint != NULL || flags > 1) return 100000;
    fake_reserve_flags = (int)flags;
    RET((*va = (void *)next_va, next_va += size + ((size_t)2 << 20)));
}
/* One count for all ranges: enough to see that mappings go before what they use. */
static int live_mappings = 0;
int aclrtReleaseMemAddress(void *va) {
    (void)va;
    if (live_mappings > 0) return 100000;
    RET(fake_release_calls++);
}
int aclrtMallocPhysical(void **h, size_t size, const void *prop, uint64_t flags) {
    (void)size; (void)prop; (void)flags;
    RET(new_token(h));
}
int aclrtFreePhysical(void *h) {
    if (live_mappings > 0) return 207002;
    RET((free(h), fake_free_physical_calls++));
}
/* Offset 0 only, flags 0 only. */
int aclrtMapMem(void *va, size_t size, size_t offset, void *h, uint64_t flags) {
    (void)va; (void)size; (void)h;
    if (offset != 0 || flags != 0) return 100000;
    RET((fake_map_calls++, live_mappings++));
}
int aclrtUnmapMem(void *va) { (void)va; RET((fake_unmap_calls++, live_mappings--)); }
#endif

#ifdef WITH_MBUF
/* A buffer is a block whose first bytes say its size; the data area follows them. */
int acltdtAllocBuf(size_t size, uint32_t type, void **buf) {
    (void)type;
    if (buf == NULL || size == 0) return 100000;
    size_t *b = NULL;
    int code = alloc_aligned((void **)&b, size + 64, 64);
    if (code != 0) return code;
    *b = size;
    *buf = b;
    return 0;
}
int acltdtGetBufData(void *buf, void **data, size_t *size) {
    if (buf == NULL || data == NULL || size == NULL) return 100000;
    *data = (char *)buf + 64;
    *size = *(size_t *)buf;
    return 0;
}
int acltdtFreeBuf(void *buf) { return release(buf); }
#endif
