/*
 * Two processes share device memory through the C interface, on the simulator (`sim`) or
 * over libascendcl.so (`acl`): R below.
 *
 *   share export R a pool over virtual memory fills a 4 MiB region, reads the importer's id
 *                  ("id N") on stdin, publishes the region to that process alone and prints
 *                  "desc JSON"; it publishes a region of a second pool to process 1 alone and
 *                  prints "refused JSON", and a shared buffer to the importer, "mbuf JSON";
 *                  after "done" on stdin it checks what the importer wrote into the region
 *                  and prints "ok".
 *   share import R prints "id N", opens the first descriptor it reads, checks the bytes,
 *                  overwrites the first 64 KiB, closes the mapping; the second descriptor
 *                  must be refused; the buffer opens read-only with its data length, user
 *                  data and bytes. Prints "done", then "ok".
 *
 * Whoever runs the two passes the lines between them (the test, capi/tests/c_program.rs).
 */
#include "ascend_pool.h"
#include "expect.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int failures;
/* The runtime: AP_SOURCE_SIM or AP_SOURCE_ACL; pools over its virtual memory. */
static ap_source runtime = AP_SOURCE_SIM, vmm = AP_SOURCE_VMM_SIM;

enum { LEN = 4 << 20, WRITTEN = 64 << 10, LINE = 1 << 16, MBUF = 256 << 10, MBUF_LEN = 1000 };
static const char TAG[] = "seq=42";

static unsigned char pattern(size_t i, int round) { return (unsigned char)(i * 7 + round * 13); }

/* The next line on stdin that starts with `key` and a space: what follows, without the
 * newline. Exits on end of input. */
static char *expect_line(char *buf, const char *key) {
    size_t k = strlen(key);
    if (!fgets(buf, LINE, stdin) || strncmp(buf, key, k) || buf[k] != ' ') {
        fprintf(stderr, "wanted a line \"%s ...\", got \"%s\"\n", key, buf);
        exit(3);
    }
    buf[strcspn(buf, "\n")] = 0;
    return buf + k + 1;
}

/* Publishes `region` of `pool` to `pids` (NULL: any process) and prints "key DESCRIPTOR". */
static void publish(ap_pool pool, ap_region region, const int32_t *pids, size_t npids,
                    const char *key) {
    size_t needed = 0;
    EXPECT(ap_share_publish(pool, region, pids, npids, NULL, 0, &needed),
           AP_ERR_BUFFER_TOO_SMALL);
    char *desc = malloc(needed);
    EXPECT(ap_share_publish(pool, region, pids, npids, desc, needed, &needed), AP_OK);
    printf("%s %s\n", key, failures ? "{}" : desc);
    fflush(stdout);
    free(desc);
}

static int exporter(void) {
    char *line = malloc(LINE);
    unsigned char *bytes = malloc(LEN);
    ap_pool pool, other;
    ap_region region, fenced;
    EXPECT(ap_pool_create(vmm, "chunk_size:8m", &pool), AP_OK);
    EXPECT(ap_pool_create(vmm, "chunk_size:8m", &other), AP_OK);
    if (failures) return 1;
    EXPECT(ap_alloc(pool, AP_KIND_DEVICE, LEN, &region), AP_OK);
    EXPECT(ap_alloc(other, AP_KIND_DEVICE, 4096, &fenced), AP_OK);
    for (size_t i = 0; i < LEN; i++) bytes[i] = pattern(i, 0);
    EXPECT(ap_copy_from_host(pool, region, 0, bytes, LEN), AP_OK);

    int32_t importer = atoi(expect_line(line, "id"));
    publish(pool, region, &importer, 1, "desc");
    int32_t init = 1;
    publish(other, fenced, &init, 1, "refused");

    ap_mbuf mbuf;
    EXPECT(ap_mbuf_alloc(pool, MBUF, AP_MBUF_NORMAL, &mbuf), AP_OK);
    for (size_t i = 0; i < MBUF; i++) bytes[i] = pattern(i, 2);
    EXPECT(ap_mbuf_write(pool, mbuf, 0, bytes, MBUF), AP_OK);
    EXPECT(ap_mbuf_set_data_len(pool, mbuf, MBUF_LEN), AP_OK);
    EXPECT(ap_mbuf_set_user_data(pool, mbuf, 0, TAG, sizeof TAG), AP_OK);
    size_t needed = 0;
    EXPECT(ap_mbuf_publish(pool, mbuf, &importer, 1, NULL, 0, &needed), AP_ERR_BUFFER_TOO_SMALL);
    char *desc = malloc(needed);
    EXPECT(ap_mbuf_publish(pool, mbuf, &importer, 1, desc, needed, &needed), AP_OK);
    printf("mbuf %s\n", failures ? "{}" : desc);
    fflush(stdout);
    free(desc);
    expect_line(line, "done");
    EXPECT(ap_mbuf_free(pool, mbuf), AP_OK);

    /* The importer's writes, through its own mapping of the same physical memory. */
    EXPECT(ap_copy_to_host(pool, region, 0, bytes, LEN), AP_OK);
    size_t wrong = 0;
    for (size_t i = 0; i < LEN; i++) wrong += bytes[i] != pattern(i, i < WRITTEN ? 1 : 0);
    CHECK(wrong == 0);
    EXPECT(ap_free(pool, region), AP_OK);
    EXPECT(ap_free(other, fenced), AP_OK);
    EXPECT(ap_pool_destroy(pool, NULL), AP_OK);
    EXPECT(ap_pool_destroy(other, NULL), AP_OK);
    free(bytes);
    free(line);
    if (failures) return 1;
    printf("ok exporter\n");
    return 0;
}

static int importer(void) {
    char *line = malloc(LINE);
    unsigned char *bytes = malloc(LEN);
    int32_t me = 0;
    EXPECT(ap_share_process_id(runtime, &me), AP_OK);
    printf("id %d\n", (int)me);
    fflush(stdout);

    ap_mapping m = 0, refused = 0;
    EXPECT(ap_share_open(runtime, 0, expect_line(line, "desc"), &m), AP_OK);
    ap_mapping_info info;
    EXPECT(ap_mapping_get_info(m, &info), AP_OK);
    CHECK(info.len == LEN && info.exporter != me && info.addr != 0 && info.exporter_addr != 0);
    EXPECT(ap_mapping_read(m, 0, bytes, LEN), AP_OK);
    size_t wrong = 0;
    for (size_t i = 0; i < LEN; i++) wrong += bytes[i] != pattern(i, 0);
    CHECK(wrong == 0);
    for (size_t i = 0; i < WRITTEN; i++) bytes[i] = pattern(i, 1);
    EXPECT(ap_mapping_write(m, 0, bytes, WRITTEN), AP_OK);
    EXPECT(ap_mapping_read(m, LEN - 8, bytes, 16), AP_ERR_OUT_OF_BOUNDS);
    EXPECT(ap_mapping_close(m), AP_OK);
    EXPECT(ap_mapping_read(m, 0, bytes, 16), AP_ERR_BAD_MAPPING);

    /* Published to process 1 alone: this process is refused. */
    EXPECT(ap_share_open(runtime, 0, expect_line(line, "refused"), &refused),
           AP_ERR_SHARE_REFUSED);
    CHECK(refused == 0);

    /* A buffer, read-only: what the exporter wrote, header and data. */
    ap_shared_mbuf buf;
    EXPECT(ap_shared_mbuf_open(runtime, 0, expect_line(line, "mbuf"), &buf), AP_OK);
    ap_shared_mbuf_info bi;
    EXPECT(ap_shared_mbuf_get_info(buf, &bi), AP_OK);
    CHECK(bi.size == MBUF && bi.data_len == MBUF_LEN);
    char tag[sizeof TAG];
    EXPECT(ap_shared_mbuf_get_user_data(buf, 0, tag, sizeof tag), AP_OK);
    CHECK(!memcmp(tag, TAG, sizeof TAG));
    EXPECT(ap_shared_mbuf_read(buf, 0, bytes, MBUF), AP_OK);
    wrong = 0;
    for (size_t i = 0; i < MBUF; i++) wrong += bytes[i] != pattern(i, 2);
    CHECK(wrong == 0);
    EXPECT(ap_shared_mbuf_close(buf), AP_OK);
    printf("done %d\n", failures);
    fflush(stdout);
    free(bytes);
    free(line);
    if (failures) return 1;
    printf("ok importer\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[2], "acl")) {
        runtime = AP_SOURCE_ACL;
        vmm = AP_SOURCE_VMM_ACL;
    } else if (argc != 3 || strcmp(argv[2], "sim")) {
        argc = 0;
    }
    if (argc == 3 && !strcmp(argv[1], "export")) return exporter();
    if (argc == 3 && !strcmp(argv[1], "import")) return importer();
    fprintf(stderr, "usage: %s export|import sim|acl\n", argv[0]);
    return 2;
}
