/*
 * addr.c: the TCP addresses idemd listens on and names: `--bind ADDR` and `--metrics-listen
 * ADDR:PORT` parsed into socket addresses, and peers written as `1.2.3.4:5` or `[::1]:5`.
 *
 * Invariants: an address is an IPv4 dotted quad or an IPv6 address (brackets allowed alone, and
 * required in ADDR:PORT, where the last colon would be ambiguous); no name is looked up, so a
 * flag's value means one address on every start. Link-local IPv6 addresses are refused: they
 * need a scope id (`%eth0`), which is not taken. An IPv4 peer of a dual-stack listener (`::`)
 * is written as IPv4, as it would be under `0.0.0.0`, so logs and audit entries name a client
 * the same way whatever the bind.
 */
#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int srv_addr_parse(const char *addr, int port, struct sockaddr_storage *ss, socklen_t *len)
{
    memset(ss, 0, sizeof *ss);
    struct in_addr v4;
    if (inet_pton(AF_INET, addr, &v4) == 1) {
        struct sockaddr_in *in = (struct sockaddr_in *)ss;
        in->sin_family = AF_INET;
        in->sin_port = htons((uint16_t)port);
        in->sin_addr = v4;
        *len = sizeof *in;
        return 0;
    }
    char a[INET6_ADDRSTRLEN];
    size_t n = strlen(addr);
    if (n >= 2 && addr[0] == '[' && addr[n - 1] == ']') addr++, n -= 2;
    if (n >= sizeof a) return -1;
    memcpy(a, addr, n);
    a[n] = '\0';
    struct in6_addr v6;
    if (inet_pton(AF_INET6, a, &v6) != 1 || IN6_IS_ADDR_LINKLOCAL(&v6)) return -1;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons((uint16_t)port);
    in6->sin6_addr = v6;
    *len = sizeof *in6;
    return 0;
}

int srv_addr_port(const char *v, int min, int *port)
{
    char *end;
    if (*v < '0' || *v > '9') return -1;
    errno = 0;
    unsigned long p = strtoul(v, &end, 10);
    if (errno || *end != '\0' || p < (unsigned long)min || p > 65535) return -1;
    *port = (int)p;
    return 0;
}

int srv_addr_split(const char *v, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(v, ':');
    if (!colon || colon == v || (size_t)(colon - v) >= cap) return -1;
    size_t hl = (size_t)(colon - v);
    /* Without brackets an IPv6 host could end at either colon (2001:db8::1:80). */
    if (memchr(v, ':', hl) && (v[0] != '[' || v[hl - 1] != ']')) return -1;
    memcpy(host, v, hl);
    host[hl] = '\0';
    struct sockaddr_storage ss;
    socklen_t len;
    return srv_addr_port(colon + 1, 1, port) == 0 && srv_addr_parse(host, *port, &ss, &len) == 0
               ? 0
               : -1;
}

void srv_addr_format(const struct sockaddr *sa, char *out, size_t cap)
{
    char a[INET6_ADDRSTRLEN];
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, a, sizeof a);
        snprintf(out, cap, "%s:%u", a, ntohs(in->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
            inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], a, sizeof a);
            snprintf(out, cap, "%s:%u", a, ntohs(in6->sin6_port));
        } else {
            inet_ntop(AF_INET6, &in6->sin6_addr, a, sizeof a);
            snprintf(out, cap, "[%s]:%u", a, ntohs(in6->sin6_port));
        }
    } else {
        snprintf(out, cap, "unix");
    }
}
