/*
 * A decode-then-infer loop written against ascend_pool.h only, as a C application would:
 * per frame, a host buffer is filled, copied on a stream into DVPP memory (the decoder's
 * input), the "decoder" copies it into 128-aligned model input, and the result is read back
 * and checked. Frees are stream-ordered, so a frame's memory is reused while its copies may
 * still be queued. Then bad input of every sort, each refused with its status and the pool
 * left intact.
 *
 * usage: pipeline sim|acl FRAMES      prints "ok" and the counters; exits 1 on any failure.
 */
#include "ascend_pool.h"
#include "expect.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ap_error_detail as the library's #[repr(C)] ErrorDetail lays it out (capi/src/lib.rs
 * checks the same offsets): a caller's older, smaller struct relies on every offset. */
_Static_assert(sizeof(ap_error_detail) == 104, "ap_error_detail size");
_Static_assert(_Alignof(ap_error_detail) == 8, "ap_error_detail alignment");
_Static_assert(offsetof(ap_error_detail, size) == 0, "size");
_Static_assert(offsetof(ap_error_detail, status) == 4, "status");
_Static_assert(offsetof(ap_error_detail, figures) == 8, "figures");
_Static_assert(offsetof(ap_error_detail, kind) == 12, "kind");
_Static_assert(offsetof(ap_error_detail, requested) == 16, "requested");
_Static_assert(offsetof(ap_error_detail, reserved) == 24, "reserved");
_Static_assert(offsetof(ap_error_detail, in_use) == 32, "in_use");
_Static_assert(offsetof(ap_error_detail, largest_free) == 40, "largest_free");
_Static_assert(offsetof(ap_error_detail, limit) == 48, "limit");
_Static_assert(offsetof(ap_error_detail, source_code) == 56, "source_code");
_Static_assert(offsetof(ap_error_detail, reserved_pad) == 60, "reserved_pad");
_Static_assert(offsetof(ap_error_detail, elsewhere) == 64, "elsewhere");
_Static_assert(sizeof(((ap_error_detail *)0)->elsewhere) == 5 * 8, "elsewhere's length");

int failures;

enum { FRAME = 1920 * 1080 * 3 / 2 };

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "sim") && strcmp(argv[1], "acl"))) {
        fprintf(stderr, "usage: %s sim|acl FRAMES\n", argv[0]);
        return 2;
    }
    ap_source source = strcmp(argv[1], "sim") ? AP_SOURCE_ACL : AP_SOURCE_SIM;
    int frames = atoi(argv[2]);

    /* The header's layouts are the library's (it asserts 32 and 128 bytes on its side). */
    CHECK(sizeof(ap_region_info) == 32 && offsetof(ap_region_info, kind) == 24);
    CHECK(sizeof(ap_stats) == 128 && offsetof(ap_stats, cached_regions) == 120);
    CHECK(sizeof(ap_segment_info) == 40 && offsetof(ap_segment_info, pending) == 36);

    ap_pool pool = 0;
    EXPECT(ap_pool_create(source, "chunk_size:32m", &pool), AP_OK);
    if (failures) return 1;
    ap_stream stream;
    EXPECT(ap_stream_create(pool, &stream), AP_OK);

    ap_region host;
    EXPECT(ap_alloc(pool, AP_KIND_HOST, FRAME, &host), AP_OK);
    unsigned char *bytes = NULL;
    unsigned char *back = malloc(FRAME);
    uint64_t dvpp_addr_first = 0, reused = 0;
    for (int f = 0; f < frames && !failures; f++) {
        EXPECT(ap_host_ptr(pool, host, (void **)&bytes), AP_OK);
        for (size_t i = 0; i < FRAME; i++) bytes[i] = (unsigned char)(i * 7 + f);

        ap_region input, tensor;
        EXPECT(ap_alloc_on(pool, AP_KIND_DVPP, FRAME, stream, &input), AP_OK);
        /* Every other frame's tensor is ordered on the stream its copy runs on. */
        if (f % 2)
            EXPECT(ap_alloc_model_input_on(pool, FRAME, stream, &tensor), AP_OK);
        else
            EXPECT(ap_alloc_model_input(pool, FRAME, &tensor), AP_OK);
        ap_region_info ii, ti;
        EXPECT(ap_region_get_info(pool, input, &ii), AP_OK);
        EXPECT(ap_region_get_info(pool, tensor, &ti), AP_OK);
        CHECK(ii.addr % 128 == 0 && ii.len == FRAME && ii.kind == AP_KIND_DVPP);
        CHECK(ti.addr % 128 == 0 && ti.align >= 128 && ti.kind == AP_KIND_DEVICE);
        if (f == 0) dvpp_addr_first = ii.addr;
        reused += ii.addr == dvpp_addr_first;

        EXPECT(ap_copy_async(pool, input, 0, host, 0, FRAME, stream), AP_OK);
        EXPECT(ap_copy_async(pool, tensor, 0, input, 0, FRAME, stream), AP_OK);
        /* Freed with the copies maybe still queued: the next frame's input may take it. */
        EXPECT(ap_free(pool, input), AP_OK);
        /* Waits for the stream's copies into the tensor before reading it. */
        EXPECT(ap_copy_to_host(pool, tensor, 0, back, FRAME), AP_OK);
        for (size_t i = 0; i < FRAME; i++) {
            if (back[i] != (unsigned char)(i * 7 + f)) {
                fprintf(stderr, "frame %d byte %zu: %u\n", f, i, back[i]);
                failures++;
                break;
            }
        }
        EXPECT(ap_free(pool, tensor), AP_OK);
    }
    EXPECT(ap_stream_synchronize(pool, stream), AP_OK);
    EXPECT(ap_pool_validate(pool), AP_OK);
    uint64_t before = live_regions(pool);

    /* Bad input: each refused with its status, nothing allocated, the pool intact. */
    ap_region r = 0, dead;
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, 0, &r), AP_ERR_INVALID_SIZE);
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, UINT64_MAX, &r), AP_ERR_INVALID_SIZE);
    EXPECT(ap_alloc(pool, (ap_kind)9, 64, &r), AP_ERR_INVALID_ARGUMENT);
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, 64, NULL), AP_ERR_NULL_ARGUMENT);
    EXPECT(ap_alloc_aligned(pool, 4096, 96, &r), AP_ERR_INVALID_SIZE);
    EXPECT(ap_alloc_on(pool, AP_KIND_HOST, 64, stream, &r), AP_ERR_WRONG_KIND);
    EXPECT(ap_alloc_model_input_on(pool, 0, stream, &r), AP_ERR_INVALID_SIZE);
    EXPECT(ap_alloc_model_input_on(pool, 64, 0, &r), AP_ERR_BAD_STREAM);
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, 256, &dead), AP_OK);
    EXPECT(ap_free(pool, dead), AP_OK);
    EXPECT(ap_free(pool, dead), AP_ERR_BAD_REGION);
    EXPECT(ap_free(pool, 0), AP_ERR_BAD_REGION);
    EXPECT(ap_memset(pool, dead, 0, 1, 1), AP_ERR_BAD_REGION);
    EXPECT(ap_copy_from_host(pool, host, FRAME - 8, back, 16), AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_copy_from_host(pool, host, UINT64_MAX, back, 16), AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_copy_to_host(pool, host, 0, back, 0), AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_copy_to_host(pool, host, 0, NULL, 16), AP_ERR_NULL_ARGUMENT);
    EXPECT(ap_copy(pool, host, 0, host, 64, 64), AP_ERR_INVALID_ARGUMENT);
    ap_region dev;
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, 4096, &dev), AP_OK);
    EXPECT(ap_copy_async(pool, dev, 32, host, 0, 64, stream), AP_ERR_MISALIGNED);
    /* No async copy runs within the host: two host regions are refused, the sync copy works. */
    ap_region host2;
    EXPECT(ap_alloc(pool, AP_KIND_HOST, 4096, &host2), AP_OK);
    EXPECT(ap_copy_async(pool, host2, 0, host, 0, 64, stream), AP_ERR_WRONG_KIND);
    EXPECT(ap_copy(pool, host2, 0, host, 0, 64), AP_OK);
    EXPECT(ap_free(pool, host2), AP_OK);
    EXPECT(ap_host_ptr(pool, dev, (void **)&bytes), AP_ERR_WRONG_KIND);
    EXPECT(ap_memset_async(pool, dev, 0, 0, 4096, stream + 1000), AP_ERR_BAD_STREAM);

    ap_pool other;
    EXPECT(ap_pool_create(AP_SOURCE_SIM, NULL, &other), AP_OK);
    EXPECT(ap_free(other, dev), AP_ERR_BAD_REGION); /* a region of another pool */
    EXPECT(ap_record_stream(other, dev, stream), AP_ERR_BAD_REGION);
    EXPECT(ap_pool_create(AP_SOURCE_SIM, "chunk_size:lots", &r), AP_ERR_CONFIG);
    EXPECT(ap_pool_create((ap_source)7, NULL, &r), AP_ERR_INVALID_ARGUMENT);
    EXPECT(ap_pool_destroy(other, NULL), AP_OK);
    EXPECT(ap_pool_validate(other), AP_ERR_BAD_POOL);

    /* What a refusal's figures tell: the kind's own limit, or the total over the device
     * kinds and what the other kinds hold. */
    ap_pool capped;
    ap_region c_dev, c_dvpp;
    ap_error_detail d = {.size = sizeof d};
    EXPECT(ap_pool_create(source, "limit:2m,total_limit:4m,thread_cache:off", &capped), AP_OK);
    EXPECT(ap_alloc(capped, AP_KIND_DEVICE, 1 << 20, &c_dev), AP_OK);
    EXPECT(ap_alloc(capped, AP_KIND_DVPP, 1 << 20, &c_dvpp), AP_OK);
    EXPECT(ap_alloc(capped, AP_KIND_CACHED, 1 << 20, &r), AP_ERR_LIMIT_EXCEEDED);
    EXPECT(ap_last_error_detail(&d), AP_OK);
    CHECK(d.size == sizeof d && d.status == AP_ERR_LIMIT_EXCEEDED);
    CHECK(d.figures == AP_FIGURES_TOTAL_LIMIT && d.kind == AP_KIND_CACHED);
    CHECK(d.limit == 4 << 20 && d.reserved == 4 << 20 && d.requested == 1 << 20);
    CHECK(d.elsewhere[AP_KIND_DEVICE] == 2 << 20 && d.elsewhere[AP_KIND_DVPP] == 2 << 20);
    EXPECT(ap_alloc(capped, AP_KIND_DEVICE, 3 << 20, &r), AP_ERR_LIMIT_EXCEEDED);
    EXPECT(ap_last_error_detail(&d), AP_OK);
    CHECK(d.figures == AP_FIGURES_LIMIT && d.kind == AP_KIND_DEVICE && d.limit == 2 << 20);
    CHECK(d.reserved == 2 << 20 && d.in_use >= 1 << 20 && d.largest_free < 3 << 20);
    EXPECT(ap_alloc(capped, AP_KIND_DEVICE, 0, &r), AP_ERR_INVALID_SIZE);
    EXPECT(ap_last_error_detail(&d), AP_OK);
    CHECK(d.status == AP_ERR_INVALID_SIZE && d.figures == AP_FIGURES_NONE && d.requested == 0);
    EXPECT(ap_last_error_detail(NULL), AP_ERR_NULL_ARGUMENT);
    EXPECT(ap_pool_destroy(capped, NULL), AP_OK);

    CHECK(live_regions(pool) == before + 1);
    EXPECT(ap_pool_validate(pool), AP_OK);
    char msg[8];
    EXPECT(ap_free(pool, dead), AP_ERR_BAD_REGION);
    CHECK(ap_last_error(msg, sizeof msg) > sizeof msg && msg[sizeof msg - 1] == 0);
    EXPECT(ap_free(pool, dev), AP_OK);
    CHECK(ap_last_error(msg, sizeof msg) == 0 && msg[0] == 0);

    ap_stats device, dvpp;
    EXPECT(ap_pool_stats(pool, AP_KIND_DEVICE, &device), AP_OK);
    EXPECT(ap_pool_stats(pool, AP_KIND_DVPP, &dvpp), AP_OK);
    /* What is still live: the host frame alone, which the destroy below frees. A first call
     * with no buffer asks for the size. The inputs freed with copies queued are listed too
     * (as pending) until the pool has seen their streams finish. */
    EXPECT(ap_pool_synchronize(pool), AP_OK);
    size_t count = 0;
    ap_segment_info seg[2];
    ap_region_info hi;
    EXPECT(ap_pool_leak_report(pool, NULL, 0, &count), AP_ERR_BUFFER_TOO_SMALL);
    CHECK(count == 1);
    EXPECT(ap_pool_leak_report(pool, seg, 2, &count), AP_OK);
    EXPECT(ap_region_get_info(pool, host, &hi), AP_OK);
    CHECK(count == 1 && seg[0].addr == hi.addr && seg[0].len == FRAME);
    CHECK(seg[0].kind == AP_KIND_HOST && !seg[0].pending && seg[0].footprint >= FRAME + 32);
    size_t json_len = 0;
    EXPECT(ap_pool_snapshot_json(pool, NULL, 0, &json_len), AP_ERR_BUFFER_TOO_SMALL);
    char *json = malloc(json_len);
    EXPECT(ap_pool_snapshot_json(pool, json, json_len, &json_len), AP_OK);
    CHECK(json[0] == '{' && strlen(json) + 1 == json_len && strstr(json, "\"dvpp\""));
    free(json);

    EXPECT(ap_stream_destroy(pool, stream), AP_OK);
    EXPECT(ap_stream_destroy(pool, stream), AP_ERR_BAD_STREAM);
    uint64_t freed = 0;
    EXPECT(ap_pool_destroy(pool, &freed), AP_OK);
    EXPECT(ap_pool_destroy(pool, &freed), AP_ERR_BAD_POOL);
    free(back);
    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    printf("ok frames=%d dvpp_reused=%llu dvpp_source_allocs=%llu device_source_allocs=%llu "
           "freed_at_destroy=%llu\n",
           frames, (unsigned long long)reused, (unsigned long long)dvpp.source_alloc_calls,
           (unsigned long long)device.source_alloc_calls, (unsigned long long)freed);
    return 0;
}
