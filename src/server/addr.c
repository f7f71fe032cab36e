/*
 * addr.c: the TCP addresses idemd listens on and names: `--bind ADDR` and `--metrics-listen
 * ADDR:PORT` parsed into socket addresses, and peers written as `1.2.3.4:5` or `[::1]:5`.
 *
 * Invariants: an address is an IPv4 dotted quad or an IPv6 address (brackets allowed alone, and
 * required in ADDR:PORT, where the last colon would be ambiguous); no name is looked up, so a
 * flag's value means one address on every start. Scope ids (`%eth0`) are not taken.
 */
#include "server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int srv_addr_parse(const char *addr, int port, struct sockaddr_storage *ss, socklen_t *len)
{
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *in = (struct sockaddr_in *)ss;
    if (inet_pton(AF_INET, addr, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons((uint16_t)port);
        *len = sizeof *in;
        return 0;
    }
    char a[INET6_ADDRSTRLEN];
    size_t n = strlen(addr);
    if (n >= 2 && addr[0] == '[' && addr[n - 1] == ']') addr++, n -= 2;
    if (n >= sizeof a) return -1;
    memcpy(a, addr, n);
    a[n] = '\0';
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET6, a, &in6->sin6_addr) != 1) return -1;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons((uint16_t)port);
    *len = sizeof *in6;
    return 0;
}

int srv_hostport_split(const char *v, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(v, ':');
    if (!colon || colon == v || (size_t)(colon - v) >= cap) return -1;
    size_t hl = (size_t)(colon - v);
    /* An IPv6 address in brackets: without them, 2001:db8::1:80 could be either */
    if (memchr(v, ':', hl) && (v[0] != '[' || v[hl - 1] != ']')) return -1;
    memcpy(host, v, hl);
    host[hl] = '\0';
    char *end;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (colon[1] < '0' || colon[1] > '9' || *end != '\0' || p < 1 || p > 65535) return -1;
    struct sockaddr_storage ss;
    socklen_t len;
    if (srv_addr_parse(host, (int)p, &ss, &len) < 0) return -1;
    *port = (int)p;
    return 0;
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
        inet_ntop(AF_INET6, &in6->sin6_addr, a, sizeof a);
        snprintf(out, cap, "[%s]:%u", a, ntohs(in6->sin6_port));
    } else {
        snprintf(out, cap, "unix");
    }
}
