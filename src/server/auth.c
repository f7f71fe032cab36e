/*
 * auth.c: users and roles. Users come from --user NAME:ROLE:PASSWORD flags and --users-file
 * (one such line each; the file must not be readable by group or others). With no users, a
 * connection's role follows its listener: unix socket admin, TCP worker. AUTH compares the
 * password with every user's, each over SRV_PASSWORD_MAX bytes, so its time tells neither whether
 * a name exists nor how long a password is. A users file that names no user is refused: it
 * would leave every connection unauthenticated.
 */
#include "server.h"

#include <errno.h>
#include <stdio.h>
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
    memcpy(role, c1 + 1, role_len);
    role[role_len] = '\0';
    srv_user *u = &cfg->users[cfg->nusers];
    u->role = auth_role_parse(role);
    if (u->role == ROLE_NONE) {
        snprintf(err, err_len, "role must be worker, reader or admin, not '%s'", role);
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
    while (rc == 0 && fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(err, err_len, "%s:%d: line longer than %zu bytes", path, lineno,
                     sizeof line - 2);
            rc = -1;
            break;
        }
        line[strcspn(line, "\r\n")] = '\0';
        const char *text = line + strspn(line, " \t");
        if (text[0] == '\0' || text[0] == '#') continue; /* blank, or a comment */
        size_t len = strlen(line);
        if (text != line || line[len - 1] == ' ' || line[len - 1] == '\t') {
            snprintf(err, err_len,
                     "%s:%d: blanks at the start or end of a line (they would be part of the "
                     "name or the password)",
                     path, lineno);
            rc = -1;
            break;
        }
        char why[128];
        if (auth_user_add(cfg, line, why, sizeof why) < 0) {
            snprintf(err, err_len, "%s:%d: %s", path, lineno, why);
            rc = -1;
        }
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, err_len, "cannot read users file %s: %s", path, strerror(errno));
        rc = -1;
    } else if (rc == 0 && cfg->nusers == before) {
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
        size_t ul = strlen(u->password);
        unsigned diff = (unsigned)(ul != pw_len) | (unsigned)(strcmp(u->name, user) != 0);
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
