/*
 * auth.c: users and roles, and the lines of the operator's files that hold them (a users file,
 * a config file). Users come from --user NAME:ROLE:PASSWORD flags and --users-file (one such
 * line each; the file must not be readable by group or others). With no users, a connection's
 * role follows its listener: unix socket admin, TCP worker. AUTH compares the name and the
 * password with every user's, over SRV_NAME_MAX and SRV_PASSWORD_MAX bytes, so its time tells
 * neither whether a name exists nor how long a password is. A users file that names no user is
 * refused: it would leave every connection unauthenticated. Names are printable ASCII without
 * blanks or the characters that frame them in logs and audit entries; neither a name nor a
 * password holds a control byte.
 */
#include "server.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int auth_role_parse(const char *s)
{
    if (strcmp(s, "worker") == 0) return ROLE_WORKER;
    if (strcmp(s, "reader") == 0) return ROLE_READER;
    if (strcmp(s, "admin") == 0) return ROLE_ADMIN;
    return ROLE_NONE;
}

const char *auth_role_name(int role)
{
    switch (role) {
    case ROLE_WORKER:
        return "worker";
    case ROLE_READER:
        return "reader";
    case ROLE_ADMIN:
        return "admin";
    default:
        return "none";
    }
}

/* The bytes a user name may not hold: blanks and control bytes, and those that frame it where
 * it is written (key="value" log lines, the audit actor user@peer, a client name in parens). */
static int name_byte_bad(unsigned char c)
{
    return c <= 0x20 || c >= 0x7f || strchr("@\"=()", c);
}

int auth_user_add(srv_config *cfg, const char *spec, char *err, size_t err_len)
{
    const char *c1 = strchr(spec, ':');
    const char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    char role[16];
    if (!c1 || !c2 || c1 == spec || c2 == c1 + 1) {
        snprintf(err, err_len, "user must be NAME:ROLE:PASSWORD");
        return -1;
    }
    size_t name_len = (size_t)(c1 - spec), role_len = (size_t)(c2 - c1 - 1);
    size_t pw_len = strlen(c2 + 1);
    const char *why = cfg->nusers >= SRV_USERS_MAX ? "more users than the limit"
                      : name_len >= SRV_NAME_MAX   ? "user name too long"
                      : role_len >= sizeof role    ? "role too long"
                      : pw_len >= SRV_PASSWORD_MAX ? "password too long"
                                                   : NULL;
    if (why) {
        snprintf(err, err_len, "%s (at most %d users, names of %d bytes, passwords of %d)", why,
                 SRV_USERS_MAX, SRV_NAME_MAX - 1, SRV_PASSWORD_MAX - 1);
        return -1;
    }
    if (pw_len == 0) {
        snprintf(err, err_len, "empty password");
        return -1;
    }
    for (size_t i = 0; i < name_len; i++) {
        if (name_byte_bad((unsigned char)spec[i])) {
            unsigned char c = (unsigned char)spec[i];
            char what[16];
            snprintf(what, sizeof what, c > 0x20 && c < 0x7f ? "'%c'" : "byte 0x%02x", c);
            snprintf(err, err_len,
                     "user name holds %s: names are printable ASCII without blanks, @, \", =, ( "
                     "or )",
                     what);
            return -1;
        }
    }
    for (size_t i = 0; i < pw_len; i++) {
        unsigned char c = (unsigned char)c2[1 + i];
        if (c < 0x20 || c == 0x7f) {
            snprintf(err, err_len, "the password holds a control byte (0x%02x)", c);
            return -1;
        }
    }
    memcpy(role, c1 + 1, role_len);
    role[role_len] = '\0';
    srv_user *u = &cfg->users[cfg->nusers];
    u->role = auth_role_parse(role);
    if (u->role == ROLE_NONE) {
        /* Not echoed: a line written NAME:PASSWORD:ROLE holds the password there. */
        snprintf(err, err_len, "role must be worker, reader or admin (NAME:ROLE:PASSWORD)");
        return -1;
    }
    memcpy(u->name, spec, name_len);
    u->name[name_len] = '\0';
    memcpy(u->password, c2 + 1, pw_len + 1);
    for (int i = 0; i < cfg->nusers; i++) {
        if (strcmp(cfg->users[i].name, u->name) == 0) {
            snprintf(err, err_len, "user '%s' given twice", u->name);
            return -1;
        }
    }
    cfg->nusers++;
    return 0;
}

/* Where the text of a line read so far starts: past a BOM (on the first line) and blanks. */
static size_t conf_text_start(const char *line, size_t len, int first)
{
    size_t t = first && len >= 3 && memcmp(line, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
    while (t < len && (line[t] == ' ' || line[t] == '\t'))
        t++;
    return t;
}

int conf_line_next(FILE *f, const char *path, char *line, size_t size, int *lineno, char **text,
                   char *err, size_t err_len)
{
    /* Read byte by byte into line: a NUL within a line is a byte of it (fgets and strlen would
     * end the line there, and take the rest for the next one), and a line longer than line is
     * refused as soon as it is seen to be no comment or blank line, so no file costs memory (a
     * device that never ends a line, a file that is no config at all). */
    for (;;) {
        size_t len = 0, t;
        int c, over = 0, any = 0, skip = 0;
        errno = 0;
        while ((c = getc(f)) != EOF && c != '\n') {
            any = 1;
            if (len < size - 1) {
                line[len++] = (char)c;
                continue;
            }
            /* Longer than line: a blank line or a comment (of any length) is skipped, anything
             * else refused below. c is the first byte not kept. */
            over = 1;
            t = conf_text_start(line, len, *lineno == 0);
            if (t == len) {
                while (c == ' ' || c == '\t')
                    c = getc(f);
                if (c == '\r' && (c = getc(f)) != '\n' && c != EOF) {
                    ungetc(c, f); /* a CR within the line: refused below */
                    c = '\r';
                }
            }
            int hash = t < len ? line[t] == '#' : c == '#';
            skip = hash || (t == len && (c == '\n' || c == EOF));
            while (hash && (c = getc(f)) != EOF && c != '\n')
                ;
            break;
        }
        if (c == EOF && ferror(f)) {
            snprintf(err, err_len, "cannot read %s: %s", path, strerror(errno ? errno : EIO));
            return -1;
        }
        if (c == EOF && !any) return 0;
        ++*lineno;
        if (skip) continue;
        if (!over && len > 0 && line[len - 1] == '\r') len--;
        t = conf_text_start(line, len, *lineno == 1);
        if (!over && (t == len || line[t] == '#')) continue; /* blank, or a comment */
        if (over || len > size - 2) {
            snprintf(err, err_len, "%s:%d: line longer than %zu bytes", path, *lineno, size - 2);
            return -1;
        }
        const char *why = NULL;
        for (size_t i = t; i < len && !why; i++)
            if (((unsigned char)line[i] < 0x20 && line[i] != '\t') || line[i] == 0x7f)
                why = "a control byte";
        if (!why && (line[len - 1] == ' ' || line[len - 1] == '\t'))
            why = "blanks at the end of the line (they would be part of the value, a password)";
        for (size_t i = t + 1; i < len && !why; i++)
            if (line[i] == '#' && (line[i - 1] == ' ' || line[i - 1] == '\t'))
                why = "a '#' after a blank: comments take a line of their own (it would be part "
                      "of the value, a password)";
        if (why) {
            snprintf(err, err_len, "%s:%d: %s", path, *lineno, why);
            return -1;
        }
        line[len] = '\0';
        *text = line + t;
        return 1;
    }
}

int auth_users_file(srv_config *cfg, const char *path, char *err, size_t err_len)
{
    struct stat st;
    char line[SRV_NAME_MAX + SRV_PASSWORD_MAX + 32];
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "cannot open users file %s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fileno(f), &st) != 0 || (st.st_mode & (S_IRWXG | S_IRWXO))) {
        snprintf(err, err_len,
                 "users file %s must not be accessible by group or others "
                 "(chmod 600)",
                 path);
        fclose(f);
        return -1;
    }
    int rc = 0, lineno = 0, before = cfg->nusers;
    char *text;
    while (rc == 0 &&
           (rc = conf_line_next(f, path, line, sizeof line, &lineno, &text, err, err_len)) > 0) {
        rc = 0;
        if (text > line && (text[-1] == ' ' || text[-1] == '\t')) {
            snprintf(err, err_len,
                     "%s:%d: blanks at the start of a line (they would be part of the name)", path,
                     lineno);
            rc = -1;
            break;
        }
        char why[160];
        if (auth_user_add(cfg, text, why, sizeof why) < 0) {
            snprintf(err, err_len, "%s:%d: %s", path, lineno, why);
            rc = -1;
        }
    }
    if (rc == 0 && cfg->nusers == before) {
        snprintf(err, err_len,
                 "users file %s names no user (without users every connection would be let in "
                 "unauthenticated)",
                 path);
        rc = -1;
    }
    fclose(f);
    return rc;
}

int auth_check(const srv_config *cfg, const char *user, const uint8_t *pw, uint32_t pw_len)
{
    int role = ROLE_NONE;
    for (int i = 0; i < cfg->nusers; i++) {
        const srv_user *u = &cfg->users[i];
        size_t ul = strlen(u->password), nl = strlen(u->name), gl = strlen(user);
        unsigned diff = (unsigned)(ul != pw_len) | (unsigned)(nl != gl);
        for (size_t k = 0; k < SRV_NAME_MAX; k++) {
            uint8_t a = k < nl ? (uint8_t)u->name[k] : 0, b = k < gl ? (uint8_t)user[k] : 0;
            diff |= (unsigned)(a ^ b);
        }
        for (size_t k = 0; k < SRV_PASSWORD_MAX; k++) {
            uint8_t a = k < ul ? (uint8_t)u->password[k] : 0, b = k < pw_len ? pw[k] : 0;
            diff |= (unsigned)(a ^ b);
        }
        if (diff == 0) role = u->role;
    }
    return role;
}

int auth_initial_role(const srv_config *cfg, int is_unix)
{
    if (cfg->nusers > 0) return ROLE_NONE;
    return is_unix ? ROLE_ADMIN : ROLE_WORKER;
}
