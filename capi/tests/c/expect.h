/*
 * Checks for the test programs: a failed check prints where and why on stderr and counts in
 * `failures`, which each program defines; the program goes on and exits 1 at the end.
 */
#ifndef AP_TEST_EXPECT_H
#define AP_TEST_EXPECT_H

#include <stdio.h>

#include "ascend_pool.h"

extern int failures;

/* `call` must return `want`; otherwise its status, the wanted one and ap_last_error(). */
#define EXPECT(call, want)                                                                    \
    do {                                                                                      \
        ap_status got_ = (call);                                                              \
        if (got_ != (want)) {                                                                 \
            char msg_[256];                                                                   \
            ap_last_error(msg_, sizeof msg_);                                                 \
            fprintf(stderr, "%s:%d: %s gave %s, want %s (%s)\n", __FILE__, __LINE__, #call,   \
                    ap_status_name(got_), ap_status_name(want), msg_);                        \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: %s does not hold\n", __FILE__, __LINE__, #cond);          \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

/* Live regions of every kind in `pool`. */
static inline uint64_t live_regions(ap_pool pool) {
    uint64_t n = 0;
    for (int k = AP_KIND_DEVICE; k <= AP_KIND_HOST; k++) {
        ap_stats s;
        EXPECT(ap_pool_stats(pool, (ap_kind)k, &s), AP_OK);
        n += s.live_regions;
    }
    return n;
}

#endif /* AP_TEST_EXPECT_H */
