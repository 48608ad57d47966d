/*
 * Proves the sanitizer the C programs run under reports what it should (c_program's
 * `the_sanitizer_reports_bugs_in_the_c_programs`): a program it stays silent on may just not be
 * instrumented.
 *
 *   sanitizer_probe library   the library writes past the end of a caller's buffer
 *   sanitizer_probe race      two threads write one variable with nothing ordering them
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ascend_pool.h"

static volatile long shared_counter;

static void *bump(void *arg) {
    (void)arg;
    for (int i = 0; i < 100000; i++) shared_counter++;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "library") == 0) {
        /* A failed call leaves a message far longer than 8 bytes; the buffer claims 256. */
        ap_pool pool = 0;
        if (ap_pool_destroy(pool, NULL) == AP_OK) return 2;
        char *buf = malloc(8);
        size_t len = ap_last_error(buf, 256);
        free(buf);
        return len > 8 ? 0 : 3;
    }
    if (argc == 2 && strcmp(argv[1], "race") == 0) {
        pthread_t a, b;
        pthread_create(&a, NULL, bump, NULL);
        pthread_create(&b, NULL, bump, NULL);
        pthread_join(a, NULL);
        pthread_join(b, NULL);
        return 0;
    }
    return 2;
}
