/* The floor of the fan-out latency on this machine: the fan-out part's delivery latency (bench/scale.py) with
   no router in it.

   One process writes each message, a SIZE-byte frame, to each of N connected Unix stream sockets in turn (one
   send() per socket, as the router's fan-out does for each subscriber: upsycle_router/transport/_fanout.c);
   a child process reads all N sockets through one epoll set, as bench/fastrecv.c reads the subscribers'
   sockets, and takes the latency of each delivery: the time it read the frame minus the time the writer
   began to write that message. Messages go out RATE a second, one message at a time, like the fan-out part's
   paced phases. The writer runs on CPU_W and the reader on CPU_R (the router's CPU and the load CPU there).

   Usage: fanfloor N SIZE RATE COUNT CPU_W CPU_R
   Output: one JSON line: {"subscribers", "size", "rate", "messages", "deliveries", "p50_ms", "p99_ms",
   "max_ms", "write_ms_p50", "write_ms_p99"} - write_ms: the time one message's N send() calls took. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double pct_ms(int64_t *v, size_t n, double q) {
    if (n == 0) return -1;
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return (double)v[i] / 1e6;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: fanfloor N SIZE RATE COUNT CPU_W CPU_R\n");
        return 2;
    }
    int n = atoi(argv[1]);
    size_t size = (size_t)atol(argv[2]);
    double rate = atof(argv[3]);
    long count = atol(argv[4]);
    int cpu_w = atoi(argv[5]), cpu_r = atoi(argv[6]);
    if (n <= 0 || size < 16 || rate <= 0 || count <= 0) {
        fprintf(stderr, "fanfloor: bad arguments\n");
        return 2;
    }
    int *wfd = malloc(sizeof *wfd * (size_t)n), *rfd = malloc(sizeof *rfd * (size_t)n);
    for (int k = 0; k < n; k++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
            perror("socketpair");
            return 2;
        }
        wfd[k] = sv[0];
        rfd[k] = sv[1];
    }
    int res[2]; /* the reader's latencies back to the writer */
    if (pipe(res) < 0) {
        perror("pipe");
        return 2;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 2;
    }
    if (child == 0) { /* the reader */
        pin(cpu_r);
        int ep = epoll_create1(0);
        for (int k = 0; k < n; k++) {
            close(wfd[k]);
            struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)k};
            epoll_ctl(ep, EPOLL_CTL_ADD, rfd[k], &ev);
        }
        size_t total = (size_t)n * (size_t)count, got = 0;
        int64_t *lat = malloc(sizeof *lat * total);
        size_t *have = calloc((size_t)n, sizeof *have); /* bytes of the current frame read, per socket */
        unsigned char *stamp = calloc((size_t)n, 8);         /* its first 8 bytes, as they come */
        unsigned char *buf = malloc(1 << 16);
        struct epoll_event *evs = malloc(sizeof *evs * (size_t)n);
        int64_t deadline = now_ns() + (int64_t)((double)count / rate * 1e9) + 30000000000LL;
        while (got < total && now_ns() < deadline) {
            int ne = epoll_wait(ep, evs, n, 200);
            for (int i = 0; i < ne; i++) {
                int k = (int)evs[i].data.u32;
                ssize_t r = recv(rfd[k], buf, 1 << 16, MSG_DONTWAIT);
                if (r <= 0) continue;
                int64_t t = now_ns();
                /* frames are SIZE bytes: the first 8 of each hold the writer's start time of its message */
                size_t off = 0;
                while (off < (size_t)r) {
                    size_t take = size - have[k];
                    if (take > (size_t)r - off) take = (size_t)r - off;
                    if (have[k] < 8) { /* (a read may end inside the stamp) */
                        size_t part = 8 - have[k] < take ? 8 - have[k] : take;
                        memcpy(stamp + 8 * (size_t)k + have[k], buf + off, part);
                        if (have[k] + part == 8 && got < total) {
                            int64_t s;
                            memcpy(&s, stamp + 8 * (size_t)k, 8);
                            lat[got++] = t - s;
                        }
                    }
                    have[k] = (have[k] + take) % size;
                    off += take;
                }
            }
        }
        size_t nbytes = got * sizeof *lat;
        write(res[1], &got, sizeof got);
        for (size_t off = 0; off < nbytes;) {
            ssize_t w = write(res[1], (char *)lat + off, nbytes - off);
            if (w <= 0) break;
            off += (size_t)w;
        }
        _exit(0);
    }
    pin(cpu_w);
    for (int k = 0; k < n; k++) close(rfd[k]);
    unsigned char *frame = calloc(1, size);
    int64_t *wr = malloc(sizeof *wr * (size_t)count);
    usleep(200000); /* the reader is in epoll_wait */
    int64_t period = (int64_t)(1e9 / rate), next = now_ns();
    for (long m = 0; m < count; m++) {
        int64_t t;
        while ((t = now_ns()) < next) {
            int64_t left = next - t;
            struct timespec ts = {left / 1000000000LL, left % 1000000000LL};
            nanosleep(&ts, NULL);
        }
        next += period;
        memcpy(frame, &t, 8);
        for (int k = 0; k < n; k++) {
            if (send(wfd[k], frame, size, 0) != (ssize_t)size) {
                perror("send");
                return 2;
            }
        }
        wr[m] = now_ns() - t;
    }
    size_t got = 0;
    if (read(res[0], &got, sizeof got) != sizeof got) return 2;
    int64_t *lat = malloc(sizeof *lat * (got ? got : 1));
    size_t nbytes = got * sizeof *lat;
    for (size_t off = 0; off < nbytes;) {
        ssize_t r = read(res[0], (char *)lat + off, nbytes - off);
        if (r <= 0) return 2;
        off += (size_t)r;
    }
    waitpid(child, NULL, 0);
    qsort(lat, got, sizeof *lat, cmp64);
    qsort(wr, (size_t)count, sizeof *wr, cmp64);
    printf("{\"subscribers\": %d, \"size\": %zu, \"rate\": %g, \"messages\": %ld, \"deliveries\": %zu, "
           "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f, \"write_ms_p50\": %.3f, \"write_ms_p99\": %.3f}\n",
           n, size, rate, count, got, pct_ms(lat, got, 0.5), pct_ms(lat, got, 0.99), pct_ms(lat, got, 1.0),
           pct_ms(wr, (size_t)count, 0.5), pct_ms(wr, (size_t)count, 0.99));
    return got == (size_t)n * (size_t)count ? 0 : 1;
}
