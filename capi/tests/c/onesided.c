/*
 * One-sided writes from C, over the drop-in libascendcl.so (its simulator has eight devices,
 * each a rank): rank 1 registers a 2 MiB window, rank 0 writes a region into it with
 * ap_write_remote and frees the region at once, and the bytes land. Then the same with HCCL's
 * notifications: rank 0 records one after its write, rank 1's stream waits for it before it
 * copies the window (and a wait no record answers times out). Then bad input, each
 * refused with its status and both pools left intact. The drop-in's ascendSim* functions
 * stand in for the communicator, which a real application has from HCCL.
 *
 * usage: ASCEND_POOL_ACL_LIB=<drop-in> onesided      prints "ok"; exits 1 on any failure.
 */
#include "ascend_pool.h"
#include "expect.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int failures;

enum { WINDOW = 2 << 20, LEN = 8192 };

typedef int32_t (*acquire_thread_fn)(void *stream, uint64_t *thread);
typedef int32_t (*acquire_channel_fn)(int32_t local, int32_t remote, uint64_t *channel);
typedef int32_t (*register_window_fn)(int32_t device, void *addr, uint64_t len);
typedef int32_t (*deregister_window_fn)(void *addr);
typedef int32_t (*notify_record_fn)(uint64_t thread, uint64_t channel, uint32_t idx);
typedef int32_t (*notify_wait_fn)(uint64_t thread, uint64_t channel, uint32_t idx,
                                  uint32_t timeout_ms);

int main(void) {
    const char *path = getenv("ASCEND_POOL_ACL_LIB");
    void *lib = path ? dlopen(path, RTLD_NOW) : NULL;
    if (!lib) {
        fprintf(stderr, "onesided: set ASCEND_POOL_ACL_LIB to the drop-in (%s)\n", dlerror());
        return 2;
    }
    acquire_thread_fn acquire_thread = (acquire_thread_fn)dlsym(lib, "ascendSimAcquireThread");
    acquire_channel_fn acquire_channel =
        (acquire_channel_fn)dlsym(lib, "ascendSimAcquireChannel");
    register_window_fn register_window =
        (register_window_fn)dlsym(lib, "ascendSimRegisterWindow");
    deregister_window_fn deregister_window =
        (deregister_window_fn)dlsym(lib, "ascendSimDeregisterWindow");
    notify_record_fn notify_record =
        (notify_record_fn)dlsym(lib, "HcommChannelNotifyRecordOnThread");
    notify_wait_fn notify_wait = (notify_wait_fn)dlsym(lib, "HcommChannelNotifyWaitOnThread");
    CHECK(acquire_thread && acquire_channel && register_window && deregister_window &&
          notify_record && notify_wait);
    if (failures) return 1;

    ap_pool rank0 = 0, rank1 = 0;
    EXPECT(ap_pool_create(AP_SOURCE_ACL, "device:0", &rank0), AP_OK);
    EXPECT(ap_pool_create(AP_SOURCE_ACL, "device:1", &rank1), AP_OK);
    if (failures) return 1;

    /* Rank 1's window, registered as HCCL would (start and length multiples of 2 MiB). */
    ap_region window;
    ap_region_info info;
    EXPECT(ap_alloc_aligned(rank1, WINDOW, WINDOW, &window), AP_OK);
    EXPECT(ap_region_get_info(rank1, window, &info), AP_OK);
    CHECK(info.addr % WINDOW == 0);
    EXPECT(ap_memset(rank1, window, 0, 0, WINDOW), AP_OK);
    CHECK(register_window(1, (void *)(uintptr_t)info.addr, WINDOW) == 0);

    /* Rank 0's stream, and the communicator's thread on it and channel to rank 1. */
    ap_stream stream;
    uint64_t native = 0, thread = 0, channel = 0;
    EXPECT(ap_stream_create(rank0, &stream), AP_OK);
    EXPECT(ap_stream_native(rank0, stream, &native), AP_OK);
    CHECK(acquire_thread((void *)(uintptr_t)native, &thread) == 0);
    CHECK(acquire_channel(0, 1, &channel) == 0);
    if (failures) return 1;

    unsigned char *bytes = malloc(LEN), *back = malloc(LEN + 64);
    for (int i = 0; i < LEN; i++) bytes[i] = (unsigned char)(i * 13 + 1);
    ap_region src;
    EXPECT(ap_alloc(rank0, AP_KIND_DEVICE, LEN, &src), AP_OK);
    EXPECT(ap_copy_from_host(rank0, src, 0, bytes, LEN), AP_OK);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, info.addr, WINDOW, 4096, src, 0, LEN),
           AP_OK);
    EXPECT(ap_free(rank0, src), AP_OK); /* safe: reused only once the stream passes the write */
    EXPECT(ap_stream_synchronize(rank0, stream), AP_OK);
    EXPECT(ap_copy_to_host(rank1, window, 4096 - 64, back, LEN + 64), AP_OK);
    for (int i = 0; i < 64; i++) CHECK(back[i] == 0);
    CHECK(memcmp(back + 64, bytes, LEN) == 0);

    /* With notifications, as HCCL's sample does it: rank 0 writes and records notification 1;
     * rank 1's stream waits for it, then copies the window into a region of its own. */
    ap_stream stream1;
    uint64_t native1 = 0, thread1 = 0, back_channel = 0;
    EXPECT(ap_stream_create(rank1, &stream1), AP_OK);
    EXPECT(ap_stream_native(rank1, stream1, &native1), AP_OK);
    CHECK(acquire_thread((void *)(uintptr_t)native1, &thread1) == 0);
    CHECK(acquire_channel(1, 0, &back_channel) == 0);
    for (int i = 0; i < LEN; i++) bytes[i] = (unsigned char)(i * 5 + 2);
    ap_region src2, copy;
    EXPECT(ap_alloc(rank0, AP_KIND_DEVICE, LEN, &src2), AP_OK);
    EXPECT(ap_alloc(rank1, AP_KIND_DEVICE, LEN, &copy), AP_OK);
    EXPECT(ap_copy_from_host(rank0, src2, 0, bytes, LEN), AP_OK);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, info.addr, WINDOW, 0, src2, 0, LEN),
           AP_OK);
    CHECK(notify_record(thread, channel, 1) == 0);
    CHECK(notify_wait(thread1, back_channel, 1, 0) == 0);
    EXPECT(ap_copy_async(rank1, copy, 0, window, 0, LEN, stream1), AP_OK);
    EXPECT(ap_stream_synchronize(rank1, stream1), AP_OK);
    EXPECT(ap_copy_to_host(rank1, copy, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, bytes, LEN) == 0);
    /* A wait no record answers times out: the stream's next synchronize fails, once. */
    CHECK(notify_wait(thread1, back_channel, 1, 20) == 0);
    EXPECT(ap_stream_synchronize(rank1, stream1), AP_ERR_RUNTIME);
    EXPECT(ap_stream_synchronize(rank1, stream1), AP_OK);
    /* An index past the channel's notifications (HCCL_E_PARA), an unknown thread
     * (HCCL_E_NOT_FOUND). */
    CHECK(notify_record(thread, channel, 8) == 1);
    CHECK(notify_wait(999999, back_channel, 0, 0) == 6);
    EXPECT(ap_free(rank0, src2), AP_OK);
    EXPECT(ap_free(rank1, copy), AP_OK);
    EXPECT(ap_stream_synchronize(rank0, stream), AP_OK);
    EXPECT(ap_stream_destroy(rank1, stream1), AP_OK);

    /* Bad input. */
    ap_region host, device;
    EXPECT(ap_alloc(rank0, AP_KIND_HOST, 4096, &host), AP_OK);
    EXPECT(ap_alloc(rank0, AP_KIND_DEVICE, 4096, &device), AP_OK);
    uint64_t a = info.addr;
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, 0, device, 0, 0),
           AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, WINDOW - 64, device, 0, 128),
           AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, 0, device, 4000, 128),
           AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, UINT64_MAX, device, 0, 2),
           AP_ERR_OUT_OF_BOUNDS);
    /* A window whose given end lies past the end of the address space. */
    EXPECT(ap_write_remote(rank0, thread, stream, channel, UINT64_MAX, WINDOW, 64, device, 0, 64),
           AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, 0, host, 0, 64),
           AP_ERR_WRONG_KIND);
    EXPECT(ap_write_remote(rank0, thread, stream + 1000, channel, a, WINDOW, 0, device, 0, 64),
           AP_ERR_BAD_STREAM);
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, 0, window, 0, 64),
           AP_ERR_BAD_REGION); /* a region of the other pool */
    EXPECT(ap_write_remote(rank0 + 1000, thread, stream, channel, a, WINDOW, 0, device, 0, 64),
           AP_ERR_BAD_POOL);
    /* What only the communicator can tell: past the registered window, an unknown channel. */
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, 2 * WINDOW, WINDOW, device, 0, 64),
           AP_ERR_RUNTIME);
    EXPECT(ap_write_remote(rank0, thread, stream, 999999, a, WINDOW, 0, device, 0, 64),
           AP_ERR_RUNTIME);
    EXPECT(ap_stream_native(rank0, stream, NULL), AP_ERR_NULL_ARGUMENT);
    EXPECT(ap_stream_native(rank0, stream + 1000, &native), AP_ERR_BAD_STREAM);

    /* Deregistered (the writes above have landed: their stream was synchronized), the window
     * takes no more writes, and its region may go back to the pool. */
    CHECK(deregister_window((void *)(uintptr_t)info.addr) == 0);
    CHECK(deregister_window((void *)(uintptr_t)info.addr) == 1); /* HCCL_E_PARA: none there */
    EXPECT(ap_write_remote(rank0, thread, stream, channel, a, WINDOW, 0, device, 0, 64),
           AP_ERR_RUNTIME);
    EXPECT(ap_free(rank0, host), AP_OK);
    EXPECT(ap_free(rank0, device), AP_OK);
    EXPECT(ap_free(rank1, window), AP_OK);
    EXPECT(ap_stream_destroy(rank0, stream), AP_OK);
    EXPECT(ap_pool_synchronize(rank0), AP_OK);
    EXPECT(ap_pool_synchronize(rank1), AP_OK); /* the frees behind rank 1's copy */
    for (int r = 0; r < 2; r++) {
        ap_pool p = r ? rank1 : rank0;
        EXPECT(ap_pool_validate(p), AP_OK);
        CHECK(live_regions(p) == 0);
        uint64_t freed = 1;
        EXPECT(ap_pool_destroy(p, &freed), AP_OK);
        CHECK(freed == 0);
    }
    free(bytes);
    free(back);
    dlclose(lib);
    if (failures) return 1;
    printf("ok\n");
    return 0;
}
