/* An open-loop HTTP/1.1 load generator for benchmarks/reliability/overload.py.
 *
 * Requests arrive as a Poisson process at a piecewise-constant rate, whatever the
 * server answers: each arrival takes an idle keep-alive connection (one request out
 * per connection at a time), or waits for one while more are opened, up to a limit.
 * Every arrival's scheduled time, send time, answer time and status are written out,
 * so the Python side computes goodput, deadline overruns and recovery from them.
 *
 * Written in C so that the generator costs little CPU and reads every answer the
 * moment it arrives: a Python generator on the same small machine fell behind at a
 * few times a small model's capacity and its own lag counted as the server's.
 *
 *   openloop HOST PORT REQUESTS OUT MAX_CONNECTIONS PREOPEN GRACE_S SEED RATE SECONDS [RATE SECONDS]...
 *
 * REQUESTS: raw HTTP requests, each as a native uint32 length then its bytes, cycled.
 * OUT: "OLG1", uint64 n, uint32 phases, double starts[phases + 1], then per arrival
 * double scheduled, sent, done, int32 status (0: never answered, -1: its connection
 * failed) and int32 the connection it went out on, then for each non-200 status the first answer body seen:
 * int32 status, uint32 length, bytes. Times are seconds on CLOCK_MONOTONIC from the
 * start of the first phase. Linux only (epoll).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CONNECTING, IDLE, BUSY, CLOSED };

/* connections opened at once before the load starts */
#define PREOPEN_WAVE 128

typedef struct {
    int fd, state;
    long index;          /* the arrival being answered, -1: none */
    const char *out;     /* unsent part of the request */
    size_t out_len;
    char *buf;
    size_t len, cap;
} Conn;

typedef struct { double scheduled, sent, done; int32_t status, conn; } Record;

static Conn *conns;
static int nconns, open_count, max_conns;
static int *idle, nidle;
static long *backlog, bl_head, bl_tail;
static Record *rec;
static long n, answered_count;
static char **reqs;
static uint32_t *req_lens;
static int nreqs;
static int epfd;
static struct sockaddr_in addr;
static double base;
static int sample_status[64], nsamples;
static char *sample_body[64];
static uint32_t sample_len[64];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9 - base;
}

static void die(const char *what) { perror(what); exit(2); }

static void watch(Conn *c, uint32_t events, int op) {
    struct epoll_event ev = {.events = events, .data.u32 = (uint32_t)(c - conns)};
    if (epoll_ctl(epfd, op, c->fd, &ev) < 0) die("epoll_ctl");
}

static void fail(long index) {
    if (index >= 0 && rec[index].status == 0) {
        rec[index].done = now();
        rec[index].status = -1;
        answered_count++;
    }
}

static void drop(Conn *c) {
    if (c->state == CLOSED) return;
    close(c->fd);
    if (c->state == IDLE) {
        for (int i = 0; i < nidle; i++)
            if (idle[i] == (int)(c - conns)) { idle[i] = idle[--nidle]; break; }
    }
    c->state = CLOSED;
    open_count--;
    fail(c->index);
    c->index = -1;
}

static void flush(Conn *c) {
    while (c->out_len) {
        ssize_t w = write(c->fd, c->out, c->out_len);
        if (w < 0) {
            if (errno == EAGAIN) { watch(c, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD); return; }
            drop(c);
            return;
        }
        c->out += w;
        c->out_len -= (size_t)w;
    }
}

static void send_on(Conn *c, long index) {
    c->state = BUSY;
    c->index = index;
    c->out = reqs[index % nreqs];
    c->out_len = req_lens[index % nreqs];
    c->len = 0;
    rec[index].sent = now();
    rec[index].conn = (int32_t)(c - conns);
    flush(c);
}

static void opened(Conn *c);

static void connect_one(void) {
    Conn *c = NULL;
    for (int i = 0; i < nconns; i++)
        if (conns[i].state == CLOSED) { c = &conns[i]; break; }
    if (!c) return;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) { if (bl_head < bl_tail) fail(backlog[bl_head++]); return; }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    c->index = -1;
    c->len = 0;
    c->out_len = 0;
    open_count++;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) {
        c->state = IDLE;
        watch(c, EPOLLIN, EPOLL_CTL_ADD);
        opened(c);
    } else if (errno == EINPROGRESS) {
        c->state = CONNECTING;
        watch(c, EPOLLOUT, EPOLL_CTL_ADD);
    } else {
        close(fd);
        c->state = CLOSED;
        open_count--;
        if (bl_head < bl_tail) fail(backlog[bl_head++]);
    }
}

static int connecting(void) {
    int k = 0;
    for (int i = 0; i < nconns; i++) k += conns[i].state == CONNECTING;
    return k;
}

/* a connection became free: the oldest waiting arrival takes it, else it waits idle */
static void opened(Conn *c) {
    if (bl_head < bl_tail) send_on(c, backlog[bl_head++]);
    else { c->state = IDLE; c->index = -1; idle[nidle++] = (int)(c - conns); }
}

static int pending_connects;

static void arrive(long index) {
    if (nidle) { send_on(&conns[idle[--nidle]], index); return; }
    backlog[bl_tail++] = index;
    if (open_count < max_conns && pending_connects < 64) { connect_one(); pending_connects = connecting(); }
}

static const char *find_ci(const char *hay, size_t len, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= len; i++)
        if (strncasecmp(hay + i, needle, k) == 0) return hay + i;
    return NULL;
}

static void keep_sample(int status, const char *body, size_t len) {
    for (int i = 0; i < nsamples; i++) if (sample_status[i] == status) return;
    if (nsamples == 64) return;
    if (len > 200) len = 200;
    sample_status[nsamples] = status;
    sample_body[nsamples] = malloc(len);
    memcpy(sample_body[nsamples], body, len);
    sample_len[nsamples++] = (uint32_t)len;
}

static void readable(Conn *c) {
    for (;;) {
        if (c->cap - c->len < 4096) {
            c->cap = c->cap ? c->cap * 2 : 8192;
            c->buf = realloc(c->buf, c->cap);
        }
        ssize_t r = read(c->fd, c->buf + c->len, c->cap - c->len);
        if (r < 0) { if (errno == EAGAIN) break; drop(c); return; }
        if (r == 0) { drop(c); return; }
        c->len += (size_t)r;
    }
    char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
    if (!end) return;
    size_t head_len = (size_t)(end - c->buf) + 4;
    const char *cl = find_ci(c->buf, head_len, "\r\ncontent-length:");
    size_t body_len = cl ? strtoul(cl + 17, NULL, 10) : 0;
    if (c->len < head_len + body_len) return;
    int status = atoi(c->buf + 9);
    int close_after = find_ci(c->buf, head_len, "\r\nconnection: close") != NULL;
    long index = c->index;
    if (index >= 0 && rec[index].status == 0) {
        rec[index].done = now();
        rec[index].status = status;
        answered_count++;
        if (status != 200) keep_sample(status, c->buf + head_len, body_len);
    }
    c->index = -1;
    c->len = 0;
    if (close_after) {
        drop(c);
        if (bl_head < bl_tail && open_count < max_conns) connect_one();
        return;
    }
    opened(c);
}

static void writable(Conn *c) {
    if (c->state == CONNECTING) {
        int err = 0;
        socklen_t sl = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl);
        pending_connects = pending_connects > 0 ? pending_connects - 1 : 0;
        if (err) {
            drop(c);
            if (bl_head < bl_tail) fail(backlog[bl_head++]);
            return;
        }
        watch(c, EPOLLIN, EPOLL_CTL_MOD);
        opened(c);
        return;
    }
    watch(c, EPOLLIN, EPOLL_CTL_MOD);
    flush(c);
}

static double expo(double rate) {
    double u = drand48();
    return -log1p(-u) / rate;
}

int main(int argc, char **argv) {
    if (argc < 11 || (argc - 9) % 2) {
        fprintf(stderr, "usage: %s HOST PORT REQUESTS OUT MAX_CONNECTIONS PREOPEN GRACE_S SEED "
                        "RATE SECONDS [RATE SECONDS]...\n", argv[0]);
        return 2;
    }
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &addr.sin_addr) != 1) { fprintf(stderr, "bad host\n"); return 2; }
    max_conns = atoi(argv[5]);
    int preopen = atoi(argv[6]);
    double grace = atof(argv[7]);
    srand48(atol(argv[8]));
    int phases = (argc - 9) / 2;

    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < (rlim_t)max_conns + 64) {
        rl.rlim_cur = rl.rlim_max < (rlim_t)max_conns + 64 ? rl.rlim_max : (rlim_t)max_conns + 64;
        setrlimit(RLIMIT_NOFILE, &rl);
        if ((rlim_t)max_conns + 64 > rl.rlim_cur) max_conns = (int)rl.rlim_cur - 64;
    }

    FILE *f = fopen(argv[3], "rb");
    if (!f) die("requests file");
    uint32_t len;
    while (fread(&len, 4, 1, f) == 1) {
        reqs = realloc(reqs, sizeof *reqs * (nreqs + 1));
        req_lens = realloc(req_lens, sizeof *req_lens * (nreqs + 1));
        reqs[nreqs] = malloc(len);
        if (fread(reqs[nreqs], 1, len, f) != len) { fprintf(stderr, "short requests file\n"); return 2; }
        req_lens[nreqs++] = len;
    }
    fclose(f);
    if (!nreqs) { fprintf(stderr, "no requests\n"); return 2; }

    /* arrival times, relative to the start of the first phase */
    double *starts = malloc(sizeof *starts * (phases + 1));
    long cap = 1 << 16;
    double *arrivals = malloc(sizeof *arrivals * cap);
    double t = 0;
    for (int p = 0; p < phases; p++) {
        double rate = atof(argv[9 + 2 * p]), secs = atof(argv[10 + 2 * p]);
        starts[p] = t;
        double end = t + secs, a = t + expo(rate);
        while (a < end) {
            if (n == cap) { cap *= 2; arrivals = realloc(arrivals, sizeof *arrivals * cap); }
            arrivals[n++] = a;
            a += expo(rate);
        }
        t = end;
    }
    starts[phases] = t;
    rec = calloc((size_t)n, sizeof *rec);
    backlog = malloc(sizeof *backlog * (size_t)(n + 1));
    nconns = max_conns;
    conns = calloc((size_t)nconns, sizeof *conns);
    idle = malloc(sizeof *idle * (size_t)nconns);
    for (int i = 0; i < nconns; i++) { conns[i].state = CLOSED; conns[i].index = -1; }
    epfd = epoll_create1(0);
    if (epfd < 0) die("epoll_create1");
    struct epoll_event *events = malloc(sizeof *events * 1024);

    /* open PREOPEN connections before the first arrival, PREOPEN_WAVE at a time (at
     * most 20 s): a burst of thousands of connects overflows the server's accept queue,
     * and the kernel then completes the last handshakes only after retransmitting them a
     * second or more later, which would count as the server's delay */
    base = 0;
    double t0 = now();
    base = t0;
    for (int opened_n = 0; opened_n < preopen && opened_n < max_conns && now() < 20.0;) {
        for (int i = 0; i < PREOPEN_WAVE && opened_n < preopen && opened_n < max_conns; i++, opened_n++)
            connect_one();
        while (connecting() && now() < 20.0) {
            int k = epoll_wait(epfd, events, 1024, 100);
            for (int e = 0; e < k; e++) {
                Conn *c = &conns[events[e].data.u32];
                if (c->state == CONNECTING) writable(c);
            }
        }
        struct timespec pause = {0, 20 * 1000 * 1000};  /* let the server accept the wave */
        nanosleep(&pause, NULL);
    }
    pending_connects = 0;

    struct timespec r0;
    clock_gettime(CLOCK_MONOTONIC, &r0);
    base = r0.tv_sec + r0.tv_nsec * 1e-9;
    for (long i = 0; i < n; i++) rec[i].scheduled = arrivals[i];
    long next = 0;
    double stop_at = starts[phases] + grace;
    for (;;) {
        double tn = now();
        while (next < n && arrivals[next] <= tn) arrive(next++);
        if (next >= n && (answered_count >= n || tn >= stop_at)) break;
        int timeout_ms;
        if (next < n) {
            double wait = arrivals[next] - now();
            timeout_ms = wait <= 0 ? 0 : (int)(wait * 1000.0);  /* sub-ms waits: spin */
        } else {
            timeout_ms = 20;
        }
        int k = epoll_wait(epfd, events, 1024, timeout_ms);
        for (int e = 0; e < k; e++) {
            Conn *c = &conns[events[e].data.u32];
            if (c->state == CLOSED) continue;
            uint32_t ev = events[e].events;
            if (ev & EPOLLOUT) writable(c);
            if (c->state != CLOSED && (ev & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
                if (c->state == CONNECTING) writable(c);
                else readable(c);
            }
        }
    }

    FILE *o = fopen(argv[4], "wb");
    if (!o) die("out file");
    uint64_t n64 = (uint64_t)n;
    uint32_t ph = (uint32_t)phases;
    fwrite("OLG1", 1, 4, o);
    fwrite(&n64, 8, 1, o);
    fwrite(&ph, 4, 1, o);
    fwrite(starts, sizeof *starts, (size_t)phases + 1, o);
    fwrite(rec, sizeof *rec, (size_t)n, o);
    for (int i = 0; i < nsamples; i++) {
        fwrite(&sample_status[i], 4, 1, o);
        fwrite(&sample_len[i], 4, 1, o);
        fwrite(sample_body[i], 1, sample_len[i], o);
    }
    fclose(o);
    fprintf(stderr, "openloop: %ld arrivals, %ld answered, %d connections open\n",
            n, answered_count, open_count);
    return 0;
}
