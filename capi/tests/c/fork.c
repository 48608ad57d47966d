/*
 * A process forked while other threads are inside calls on its pools. The child inherits
 * the parent's handles but not its threads, its streams or (on hardware) its device context:
 * every call on an inherited pool or region answers AP_ERR_FORKED, destroying an inherited
 * pool only forgets its handle (it must not hang on a call the fork cut short, nor free the
 * parent's memory), and the child makes, uses and destroys pools of its own. The parent's
 * pool is untouched by all of it.
 *
 * Two threads keep allocating and freeing on the shared pool, and creating and destroying
 * pools of their own, while the main thread forks ROUNDS children, so some forks land while
 * a thread holds a table's lock or announces the pool. A child that hangs is killed by its
 * alarm and counted as a failure.
 *
 * usage: fork      prints "ok"; exits 1 on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#include "ascend_pool.h"
#include "expect.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int failures;

enum { ROUNDS = 24, LEN = 4096, HAMMERS = 2 };

static ap_pool shared;
/* Memory of a pool over virtual memory, published and opened by this same process: a
 * mapping and a shared buffer, both in process-wide tables. */
static ap_mapping mapping;
static ap_shared_mbuf opened;
static atomic_int stop;
/* The hammers' failed calls (`failures` is the main thread's). */
static atomic_int hammer_failures;

static void *hammer(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        ap_region r;
        ap_pool own;
        int ok = ap_alloc(shared, AP_KIND_DEVICE, LEN, &r) == AP_OK && ap_free(shared, r) == AP_OK;
        ok = ok && ap_pool_create(AP_SOURCE_SIM, NULL, &own) == AP_OK;
        /* Left live: the destroy frees it. */
        ok = ok && ap_alloc(own, AP_KIND_HOST, LEN, &r) == AP_OK;
        ok = ok && ap_pool_destroy(own, NULL) == AP_OK;
        if (!ok) atomic_fetch_add(&hammer_failures, 1);
    }
    return NULL;
}

/* A pool over virtual memory with a region holding `pattern`, published and opened again by
 * this process as `opened_mapping`. */
static ap_pool published_pool(const unsigned char *pattern, ap_region *region,
                              ap_mapping *opened_mapping) {
    ap_pool vm = 0;
    char desc[4096];
    size_t needed;
    EXPECT(ap_pool_create(AP_SOURCE_VMM_SIM, NULL, &vm), AP_OK);
    EXPECT(ap_alloc(vm, AP_KIND_DEVICE, LEN, region), AP_OK);
    EXPECT(ap_copy_from_host(vm, *region, 0, pattern, LEN), AP_OK);
    EXPECT(ap_share_publish(vm, *region, NULL, 0, desc, sizeof desc, &needed), AP_OK);
    EXPECT(ap_share_open(AP_SOURCE_SIM, 0, desc, opened_mapping), AP_OK);
    return vm;
}

/* What a child checks; its exit status is the number of failures (capped). */
static void child(ap_region inherited, const unsigned char *pattern) {
    /* A hang is a failure: the parent sees the signal. */
    alarm(20);
    /* The parent's count came along with its memory. */
    failures = 0;
    ap_region r = 0;
    EXPECT(ap_alloc(shared, AP_KIND_DEVICE, LEN, &r), AP_ERR_FORKED);
    CHECK(r == 0);
    ap_region_info info;
    EXPECT(ap_region_get_info(shared, inherited, &info), AP_ERR_FORKED);
    EXPECT(ap_free(shared, inherited), AP_ERR_FORKED);
    ap_stats stats;
    EXPECT(ap_pool_stats(shared, AP_KIND_DEVICE, &stats), AP_ERR_FORKED);
    char msg[256];
    ap_last_error(msg, sizeof msg);
    CHECK(strstr(msg, "fork") != NULL);
    CHECK(strcmp(ap_status_name(AP_ERR_FORKED), "AP_ERR_FORKED") == 0);
    /* Destroying it forgets the handle and frees nothing of the parent's. */
    uint64_t freed = 99;
    EXPECT(ap_pool_destroy(shared, &freed), AP_OK);
    CHECK(freed == 0);
    EXPECT(ap_pool_destroy(shared, NULL), AP_ERR_BAD_POOL);
    EXPECT(ap_alloc(shared, AP_KIND_DEVICE, LEN, &r), AP_ERR_BAD_POOL);
    /* The same for what the parent opened: refused, and a close only forgets. */
    unsigned char back[LEN];
    EXPECT(ap_mapping_read(mapping, 0, back, LEN), AP_ERR_FORKED);
    EXPECT(ap_shared_mbuf_read(opened, 0, back, LEN), AP_ERR_FORKED);
    EXPECT(ap_mapping_close(mapping), AP_OK);
    EXPECT(ap_mapping_close(mapping), AP_ERR_BAD_MAPPING);
    EXPECT(ap_shared_mbuf_close(opened), AP_OK);
    EXPECT(ap_shared_mbuf_read(opened, 0, back, LEN), AP_ERR_BAD_BUFFER);

    /* A pool of the child's own works as anywhere. */
    ap_pool own;
    EXPECT(ap_pool_create(AP_SOURCE_SIM, NULL, &own), AP_OK);
    EXPECT(ap_alloc(own, AP_KIND_DEVICE, LEN, &r), AP_OK);
    EXPECT(ap_copy_from_host(own, r, 0, pattern, LEN), AP_OK);
    EXPECT(ap_copy_to_host(own, r, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, pattern, LEN) == 0);
    CHECK(live_regions(own) == 1);
    EXPECT(ap_free(own, r), AP_OK);
    EXPECT(ap_pool_validate(own), AP_OK);
    EXPECT(ap_pool_destroy(own, &freed), AP_OK);
    CHECK(freed == 0);

    /* Memory of its own, published and opened again: through an export service and a
     * runtime of the child's own (its parent's are not in it). */
    ap_region mine;
    ap_mapping own_mapping;
    ap_pool own_vm = published_pool(pattern, &mine, &own_mapping);
    memset(back, 0, LEN);
    EXPECT(ap_mapping_read(own_mapping, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, pattern, LEN) == 0);
    EXPECT(ap_mapping_close(own_mapping), AP_OK);
    EXPECT(ap_free(own_vm, mine), AP_OK);
    EXPECT(ap_pool_destroy(own_vm, NULL), AP_OK);
    fflush(stderr);
    _exit(failures > 100 ? 100 : failures);
}

int main(void) {
    unsigned char pattern[LEN], back[LEN];
    for (int i = 0; i < LEN; i++) pattern[i] = (unsigned char)(i * 7 + 3);
    EXPECT(ap_pool_create(AP_SOURCE_SIM, NULL, &shared), AP_OK);
    ap_region kept;
    EXPECT(ap_alloc(shared, AP_KIND_DEVICE, LEN, &kept), AP_OK);
    EXPECT(ap_copy_from_host(shared, kept, 0, pattern, LEN), AP_OK);

    ap_region published;
    ap_mbuf mbuf;
    char desc[4096];
    size_t needed;
    ap_pool vm = published_pool(pattern, &published, &mapping);
    EXPECT(ap_mbuf_alloc(vm, LEN, AP_MBUF_NORMAL, &mbuf), AP_OK);
    EXPECT(ap_mbuf_write(vm, mbuf, 0, pattern, LEN), AP_OK);
    EXPECT(ap_mbuf_publish(vm, mbuf, NULL, 0, desc, sizeof desc, &needed), AP_OK);
    EXPECT(ap_shared_mbuf_open(AP_SOURCE_SIM, 0, desc, &opened), AP_OK);
    if (failures) return 1;

    pthread_t threads[HAMMERS];
    for (int i = 0; i < HAMMERS; i++) CHECK(pthread_create(&threads[i], NULL, hammer, NULL) == 0);
    for (int round = 0; round < ROUNDS; round++) {
        /* Let the hammers run into their calls. */
        nanosleep(&(struct timespec){.tv_nsec = 2000000}, NULL);
        fflush(stderr);
        pid_t pid = fork();
        if (pid == 0) child(kept, pattern);
        CHECK(pid > 0);
        if (pid < 0) break;
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        if (WIFSIGNALED(status)) {
            fprintf(stderr, "fork.c: child %d killed by signal %d (%s)\n", round,
                    WTERMSIG(status), WTERMSIG(status) == SIGALRM ? "hung" : "crashed");
            failures++;
        } else if (WEXITSTATUS(status) != 0) {
            fprintf(stderr, "fork.c: child %d failed %d checks\n", round, WEXITSTATUS(status));
            failures++;
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < HAMMERS; i++) pthread_join(threads[i], NULL);
    CHECK(atomic_load(&hammer_failures) == 0);

    /* The parent's pool and region are as they were. */
    EXPECT(ap_copy_to_host(shared, kept, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, pattern, LEN) == 0);
    CHECK(live_regions(shared) == 1);
    EXPECT(ap_pool_validate(shared), AP_OK);
    uint64_t freed = 0;
    EXPECT(ap_pool_destroy(shared, &freed), AP_OK);
    CHECK(freed == 1);
    memset(back, 0, LEN);
    EXPECT(ap_mapping_read(mapping, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, pattern, LEN) == 0);
    memset(back, 0, LEN);
    EXPECT(ap_shared_mbuf_read(opened, 0, back, LEN), AP_OK);
    CHECK(memcmp(back, pattern, LEN) == 0);
    EXPECT(ap_mapping_close(mapping), AP_OK);
    EXPECT(ap_shared_mbuf_close(opened), AP_OK);
    EXPECT(ap_mbuf_free(vm, mbuf), AP_OK);
    EXPECT(ap_free(vm, published), AP_OK);
    EXPECT(ap_pool_destroy(vm, &freed), AP_OK);
    CHECK(freed == 0);
    if (failures) return 1;
    printf("ok\n");
    return 0;
}
