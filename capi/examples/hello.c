/*
 * hello.c: nvpoll's C interface end to end. Connects to the controller a transport ID names (with TLS when a
 * PSK is given), writes a pattern to a few blocks of its first namespace with callbacks, reads them back by
 * reaping, compares, flushes, and frees everything. Between polls it sleeps in poll(2) on the queue pair's
 * completion fd.
 *
 *   hello 'trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN hostnqn:HOSTNQN' [NVMeTLSkey-1:01:...:]
 *
 * Prints one line and exits 0 when everything read back is what was written; otherwise says what failed
 * and exits 1. scripts/capi-test.sh builds and runs it (also under valgrind).
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvpoll.h"

#define IOS 4
#define IO_BYTES 4096

/* What the write callbacks count. */
struct progress {
    int done;
    int failed;
};

static void write_done(void *arg, int status)
{
    struct progress *p = arg;
    p->done++;
    if (status != NVPOLL_OK) {
        p->failed++;
        /* During a callback the last error message describes this completion's failure. */
        fprintf(stderr, "hello: a write failed: %s\n", nvpoll_last_error_message());
    }
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "hello: %s: %s (%d): %s\n", what, nvpoll_strerror(rc), rc, nvpoll_last_error_message());
    exit(1);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleeps until the queue pair may have completions (or 100 ms pass), and keeps the controller alive. */
static void wait_for_completions(struct nvpoll_ctrl *ctrl, int fd, double deadline)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (now() > deadline) {
        fprintf(stderr, "hello: no completion in time\n");
        exit(1);
    }
    if (poll(&p, 1, 100) < 0) {
        perror("hello: poll");
        exit(1);
    }
    int rc = nvpoll_ctrl_poll_admin(ctrl);
    if (rc < 0)
        die("the controller's admin queue", rc);
}

static unsigned char pattern(int io, size_t i)
{
    return (unsigned char)((io * 31 + i * 7) % 251);
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s TRID [PSK]\n", argv[0]);
        return 2;
    }
    struct nvpoll_ctrl_opts opts = {0};
    opts.psk = argc == 3 ? argv[2] : NULL;

    struct nvpoll_pool *pool;
    int rc = nvpoll_pool_create(64, 1 << 16, 4, &pool);
    if (rc < 0)
        die("DMA pool", rc);
    struct nvpoll_ctrl *ctrl;
    rc = nvpoll_ctrl_open(argv[1], &opts, pool, &ctrl);
    if (rc < 0)
        die("opening the controller", rc);
    if (nvpoll_ctrl_namespace_count(ctrl) < 1) {
        fprintf(stderr, "hello: the controller has no active namespace\n");
        return 1;
    }
    struct nvpoll_ns_info ns;
    rc = nvpoll_ctrl_namespace_info(ctrl, 0, &ns);
    if (rc < 0)
        die("namespace info", rc);
    uint32_t blocks = IO_BYTES / ns.block_size;
    if (blocks == 0 || (uint64_t)IOS * blocks > ns.blocks) {
        fprintf(stderr, "hello: namespace %u is too small or its blocks too large\n", ns.nsid);
        return 1;
    }
    struct nvpoll_qpair *qp;
    rc = nvpoll_qpair_create(ctrl, 16, &qp);
    if (rc < 0)
        die("queue pair", rc);
    int fd = nvpoll_qpair_completion_fd(qp);
    if (fd < 0)
        die("completion fd", fd);

    struct nvpoll_buf *bufs[IOS];
    for (int i = 0; i < IOS; i++) {
        rc = nvpoll_buf_alloc(pool, IO_BYTES, &bufs[i]);
        if (rc < 0)
            die("DMA buffer", rc);
        unsigned char *d = nvpoll_buf_data(bufs[i]);
        for (size_t j = 0; j < IO_BYTES; j++)
            d[j] = pattern(i, j);
    }

    /* Writes, with a callback each: the buffers are the queue pair's until their callbacks run. */
    struct progress writes = {0};
    for (int i = 0; i < IOS; i++) {
        rc = nvpoll_submit_write(qp, ns.nsid, (uint64_t)i * blocks, blocks, bufs[i], write_done, &writes);
        if (rc < 0)
            die("submitting a write", rc);
    }
    rc = nvpoll_qpair_flush(qp);
    if (rc < 0)
        die("flush", rc);
    double deadline = now() + 60;
    while (writes.done < IOS) {
        wait_for_completions(ctrl, fd, deadline);
        rc = nvpoll_qpair_process_completions(qp, 0);
        if (rc < 0)
            die("processing completions", rc);
    }
    if (writes.failed)
        return 1;

    /* Reads back into the same buffers, zeroed, without callbacks: reaped, each tagged with its index. */
    for (int i = 0; i < IOS; i++) {
        memset(nvpoll_buf_data(bufs[i]), 0, IO_BYTES);
        rc = nvpoll_submit_read(qp, ns.nsid, (uint64_t)i * blocks, blocks, bufs[i], NULL,
                                (void *)(uintptr_t)i);
        if (rc < 0)
            die("submitting a read", rc);
    }
    rc = nvpoll_qpair_flush(qp);
    if (rc < 0)
        die("flush", rc);
    int reaped = 0, mismatches = 0;
    while (reaped < IOS) {
        struct nvpoll_completion c[IOS];
        int n = nvpoll_qpair_reap(qp, c, IOS);
        if (n < 0)
            die("reaping", n);
        for (int k = 0; k < n; k++) {
            int i = (int)(uintptr_t)c[k].arg;
            if (c[k].status != NVPOLL_OK || c[k].buf != bufs[i]) {
                fprintf(stderr, "hello: read %d: %s (NVMe status 0x%x)\n", i, nvpoll_strerror(c[k].status),
                        c[k].nvme_status);
                return 1;
            }
            const unsigned char *d = nvpoll_buf_data(c[k].buf);
            for (size_t j = 0; j < IO_BYTES; j++) {
                if (d[j] != pattern(i, j)) {
                    mismatches++;
                    break;
                }
            }
        }
        reaped += n;
        if (reaped < IOS)
            wait_for_completions(ctrl, fd, deadline);
    }

    /* A Flush of the write cache, with a callback. */
    struct progress flush = {0};
    rc = nvpoll_submit_flush(qp, ns.nsid, write_done, &flush);
    if (rc < 0)
        die("submitting a flush", rc);
    rc = nvpoll_qpair_flush(qp);
    if (rc < 0)
        die("flush", rc);
    while (flush.done < 1) {
        wait_for_completions(ctrl, fd, deadline);
        rc = nvpoll_qpair_process_completions(qp, 0);
        if (rc < 0)
            die("processing completions", rc);
    }

    for (int i = 0; i < IOS; i++) {
        rc = nvpoll_buf_free(bufs[i]);
        if (rc < 0)
            die("freeing a buffer", rc);
    }
    if ((rc = nvpoll_qpair_free(qp)) < 0)
        die("freeing the queue pair", rc);
    if ((rc = nvpoll_ctrl_close(ctrl)) < 0)
        die("closing the controller", rc);
    if ((rc = nvpoll_pool_free(pool)) < 0)
        die("freeing the pool", rc);
    if (mismatches || flush.failed) {
        fprintf(stderr, "hello: %d of %d blocks read back differ from what was written\n", mismatches, IOS);
        return 1;
    }
    printf("hello: wrote, read back and compared %d x %d bytes at LBA 0-%u of namespace %u (%s): OK\n", IOS,
           IO_BYTES, IOS * blocks - 1, ns.nsid, opts.psk ? "TLS" : "no TLS");
    return 0;
}
