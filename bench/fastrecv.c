/* The load generator's receiving side in C, for the fan-out measurements (bench/loadgen.py, --fast-receivers).

   Python reads a socket, walks its frames and records the latency in ~5 us; with 1,000 subscriber sockets on
   two CPUs that alone is ~5 ms per message, and it is in every latency it measures. This program does the
   same bookkeeping as bench/clients.py's Tally and parsers (upsycle frames and MQTT 3.1.1 PUBLISH with its
   PUBACK) for sockets a Python process has already set up (handshake, JOIN or SUBSCRIBE), so the figures
   measure the systems rather than the reader.

   Usage: fastrecv upsycle|mqtt FD...   (the FDs are inherited, already connected and subscribed)
   Commands on stdin, one per line:  "phase EXPECTED LATENCY T0_NS IDLE_NS MAX_NS PHASE" | "stop".
   For each phase it writes one JSON line to stdout, then NLAT little-endian int64 latencies (ns) if the JSON
   says "nlat": NLAT, then 2 x NMSG int64 if it says "nmsg": NMSG - each message's first and then each one's
   last delivery's latency over this process's sockets (0 for a message none of them received): how late a
   message began to arrive and how long its fan-out took, apart. Buffers (partial frames) carry over from one phase to the next, as in Python. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const unsigned char MAGIC[4] = {'U', 'P', 'B', 'N'};
enum { HEAD = 4 + 4 + 8 + 8 }; /* MAGIC, then >IQQ: phase, seq, offset_ns */

typedef struct {
    int fd, closed;
    unsigned char *buf;
    size_t len, cap;
    /* the phase's tally */
    unsigned char *seen;
    long count, dups, other;
    int64_t first, last;
} Conn;

static int MQTT;
static uint32_t cur_phase;
static long expected;
static int latency;
static int64_t t0;
static int64_t *lat;
static size_t nlat, caplat;
static int64_t *mfirst, *mlast; /* per message (seq): first and last delivery's latency, 0 if none */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static void hit(Conn *c, const unsigned char *p, size_t n, int64_t now) {
    const unsigned char *m = memmem(p, n, MAGIC, 4);
    if (m == NULL || (size_t)(p + n - m) < HEAD) {
        c->other++;
        return;
    }
    uint32_t phase = (uint32_t)be(m + 4, 4);
    uint64_t seq = be(m + 8, 8), off = be(m + 16, 8);
    if (phase != cur_phase || seq >= (uint64_t)expected) {
        c->other++;
        return;
    }
    if (c->seen[seq]) {
        c->dups++;
        return;
    }
    c->seen[seq] = 1;
    c->count++;
    if (!c->first) c->first = now;
    c->last = now;
    if (latency) {
        if (nlat == caplat) {
            caplat = caplat ? caplat * 2 : 1 << 16;
            lat = realloc(lat, caplat * sizeof *lat);
            if (lat == NULL) { perror("realloc"); exit(2); }
        }
        int64_t l = now - t0 - (int64_t)off;
        lat[nlat++] = l;
        if (!mfirst[seq] || l < mfirst[seq]) mfirst[seq] = l ? l : 1;
        if (!mlast[seq] || l > mlast[seq]) mlast[seq] = l ? l : 1;
    }
}

static void send_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return;
        }
        p += k;
        n -= (size_t)k;
    }
}

/* Walk the complete frames/packets at the start of the buffer; return the bytes consumed. */
static size_t parse(Conn *c, int64_t now) {
    size_t pos = 0, n = c->len;
    unsigned char *b = c->buf;
    if (!MQTT) {
        while (n - pos >= 4) {
            size_t len = (size_t)be(b + pos, 4);
            if (pos + 4 + len > n) break;
            hit(c, b + pos + 4, len, now);
            pos += 4 + len;
        }
        return pos;
    }
    unsigned char acks[4096];
    size_t na = 0;
    while (pos < n) {
        unsigned b0 = b[pos];
        size_t i = pos + 1, rl = 0, mult = 1;
        int complete = 0;
        while (i < n) {
            unsigned d = b[i++];
            rl += (d & 0x7F) * mult;
            if (d < 0x80) { complete = 1; break; }
            mult *= 128;
        }
        if (!complete || i + rl > n) break;
        size_t end = i + rl;
        if ((b0 >> 4) == 3) {
            unsigned qos = (b0 >> 1) & 3;
            size_t j = i + 2 + ((size_t)b[i] << 8 | b[i + 1]);
            if (qos) {
                if (na + 4 > sizeof acks) { send_all(c->fd, acks, na); na = 0; }
                acks[na++] = 0x40; acks[na++] = 0x02; acks[na++] = b[j]; acks[na++] = b[j + 1];
                j += 2;
            }
            hit(c, b + j, end - j, now);
        }
        pos = end;
    }
    if (na) send_all(c->fd, acks, na);
    return pos;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: fastrecv upsycle|mqtt FD...\n"); return 2; }
    MQTT = strcmp(argv[1], "mqtt") == 0;
    int nc = argc - 2;
    Conn *cs = calloc((size_t)nc, sizeof *cs);
    int ep = epoll_create1(0);
    if (cs == NULL || ep < 0) { perror("setup"); return 2; }
    for (int k = 0; k < nc; k++) {
        cs[k].fd = atoi(argv[k + 2]);
        cs[k].cap = 1 << 16;
        cs[k].buf = malloc(cs[k].cap);
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)k};
        if (cs[k].buf == NULL || epoll_ctl(ep, EPOLL_CTL_ADD, cs[k].fd, &ev) < 0) { perror("epoll_ctl"); return 2; }
    }
    struct epoll_event *evs = malloc(sizeof *evs * (size_t)nc);
    char line[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        if (strncmp(line, "stop", 4) == 0) break;
        long long a_exp, a_t0, a_idle, a_max;
        int a_lat;
        unsigned a_phase;
        if (sscanf(line, "phase %lld %d %lld %lld %lld %u", &a_exp, &a_lat, &a_t0, &a_idle, &a_max, &a_phase) != 6) {
            fprintf(stderr, "fastrecv: bad command: %s", line);
            return 2;
        }
        expected = (long)a_exp; latency = a_lat; t0 = a_t0; cur_phase = a_phase; nlat = 0;
        free(mfirst);
        free(mlast);
        mfirst = calloc((size_t)expected + 1, sizeof *mfirst);
        mlast = calloc((size_t)expected + 1, sizeof *mlast);
        if (mfirst == NULL || mlast == NULL) { perror("calloc"); return 2; }
        for (int k = 0; k < nc; k++) {
            Conn *c = &cs[k];
            free(c->seen);
            c->seen = calloc((size_t)expected + 1, 1);
            c->count = c->dups = c->other = 0;
            c->first = c->last = 0;
        }
        int64_t deadline = t0 + a_max, last_progress = now_ns();
        if (last_progress < t0) last_progress = t0;
        long total = 0, count = 0;
        int not_done = expected > 0 ? nc : 0, nclosed = 0;
        for (int k = 0; k < nc; k++) nclosed += cs[k].closed;
        for (;;) {
            int ne = epoll_wait(ep, evs, nc, 200);
            if (ne < 0 && errno != EINTR) { perror("epoll_wait"); return 2; }
            int got = 0;
            for (int e = 0; e < ne; e++) {
                Conn *c = &cs[evs[e].data.u32];
                if (c->cap - c->len < (1 << 15)) {
                    c->cap *= 2;
                    c->buf = realloc(c->buf, c->cap);
                    if (c->buf == NULL) { perror("realloc"); return 2; }
                }
                ssize_t k = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
                if (k < 0) continue;
                int64_t now = now_ns();
                if (k == 0) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                    c->closed = 1;
                    nclosed++;
                    continue;
                }
                got = 1;
                c->len += (size_t)k;
                long before = c->count;
                int was_done = c->count >= expected;
                size_t used = parse(c, now);
                if (used) {
                    memmove(c->buf, c->buf + used, c->len - used);
                    c->len -= used;
                }
                count += c->count - before;
                if (!was_done && c->count >= expected) not_done--;
            }
            int64_t now = now_ns();
            if (count != total || got) { total = count; last_progress = now; }
            if (not_done <= 0 || nclosed == nc) break;
            if (now > deadline || now - last_progress > a_idle) break;
        }
        long received = 0, dups = 0, other = 0;
        int64_t first = 0, last = 0;
        for (int k = 0; k < nc; k++) {
            Conn *c = &cs[k];
            received += c->count; dups += c->dups; other += c->other;
            if (c->first && (!first || c->first < first)) first = c->first;
            if (c->last > last) last = c->last;
        }
        printf("{\"conns\": %d, \"received\": %ld, \"dups\": %ld, \"other\": %ld, \"closed\": %d, "
               "\"first_ns\": %lld, \"last_ns\": %lld, \"nlat\": %zu, \"nmsg\": %ld, \"per_conn\": [",
               nc, received, dups, other, nclosed, (long long)first, (long long)last, latency ? nlat : (size_t)0,
               latency ? expected : 0L);
        for (int k = 0; k < nc; k++) printf(k ? ", %ld" : "%ld", cs[k].count);
        printf("]}\n");
        if (latency && nlat) fwrite(lat, sizeof *lat, nlat, stdout);
        if (latency && expected > 0) {
            fwrite(mfirst, sizeof *mfirst, (size_t)expected, stdout);
            fwrite(mlast, sizeof *mlast, (size_t)expected, stdout);
        }
        fflush(stdout);
    }
    return 0;
}
