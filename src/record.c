/*
 * record.c: encoding and decoding of record versions, in both forms of record.h.
 *
 * Invariants: rec_decode accepts only what its form defines (known present bits and flags,
 * fields that fill fields_len exactly, lengths within the payload), whatever the bytes; and
 * rec_decode(rec_encode(r)) gives back every field of r, for every value (times travel as
 * differences mod 2^64, so no value overflows).
 */
#include "record.h"

#include <string.h>

#include "util.h"

/* ---- Varints ---- */

static uint64_t zigzag(uint64_t v)
{
    return (v << 1) ^ (0 - (v >> 63));
}

static uint64_t unzigzag(uint64_t z)
{
    return (z >> 1) ^ (0 - (z & 1));
}

struct rec_writer {
    uint8_t *p;
    uint32_t present;
    uint64_t base; /* first_seen_ms: times are written as differences from it */
};

/* Values below 2^56 are spread into 7-bit groups in three steps and stored as 8 bytes at once,
 * of which the varint's own are kept (the buffer has room for the excess). */
static inline void put_varint(struct rec_writer *w, uint64_t v)
{
    if (v < 0x80) {
        *w->p++ = (uint8_t)v;
        return;
    }
    if (v >> 56) {
        while (v >= 0x80) {
            *w->p++ = (uint8_t)(v | 0x80);
            v >>= 7;
        }
        *w->p++ = (uint8_t)v;
        return;
    }
    uint32_t bytes = (uint32_t)(64 - __builtin_clzll(v) + 6) / 7; /* 2..8 */
    uint64_t x = v;
    x = (x & UINT64_C(0x000000000fffffff)) | ((x & UINT64_C(0x00fffffff0000000)) << 4);
    x = (x & UINT64_C(0x00003fff00003fff)) | ((x & UINT64_C(0x0fffc0000fffc000)) << 2);
    x = (x & UINT64_C(0x007f007f007f007f)) | ((x & UINT64_C(0x3f803f803f803f80)) << 1);
    x |= UINT64_C(0x8080808080808080) & ((UINT64_C(1) << (8 * (bytes - 1))) - 1);
    util_put_u64(w->p, x);
    w->p += bytes;
}

static inline void put_value(struct rec_writer *w, uint32_t bit, uint64_t v)
{
    if (!v) return;
    w->present |= bit;
    put_varint(w, v);
}

static inline void put_time(struct rec_writer *w, uint32_t bit, int64_t t)
{
    if (!t) return;
    w->present |= bit;
    put_varint(w, zigzag((uint64_t)t - w->base));
}

struct rec_reader {
    const uint8_t *p, *end; /* the fields */
    const uint8_t *limit;   /* the payload's end: loads of 8 bytes may reach up to it */
    uint32_t present;
    uint64_t base;
    int bad;
};

/* Out of line: values of two bytes or more, and damage. */
static uint64_t get_varint_slow(struct rec_reader *d)
{
    uint64_t v = 0;
    for (uint32_t shift = 0; shift < 64; shift += 7) {
        if (d->p >= d->end) break;
        uint8_t b = *d->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            if (shift == 63 && b > 1) break; /* more than 64 bits */
            return v;
        }
    }
    d->bad = 1;
    return 0;
}

/* Up to 8 bytes at once where 8 can be loaded: the first byte without its top bit ends the
 * varint, and the 7-bit groups below it are packed together in three steps. */
static inline uint64_t get_varint(struct rec_reader *d)
{
    if (d->p < d->end && *d->p < 0x80) return *d->p++;
    if (d->limit - d->p < 8) return get_varint_slow(d);
    uint64_t x = util_get_u64(d->p);
    uint64_t stop = ~x & UINT64_C(0x8080808080808080);
    if (!stop) return get_varint_slow(d); /* 9 or 10 bytes */
    uint32_t bits = (uint32_t)__builtin_ctzll(stop) + 1, bytes = bits / 8;
    if (bytes > (size_t)(d->end - d->p)) return get_varint_slow(d); /* runs past the fields */
    if (bits < 64) x &= (UINT64_C(1) << bits) - 1;
    x = (x & UINT64_C(0x007f007f007f007f)) | ((x & UINT64_C(0x7f007f007f007f00)) >> 1);
    x = (x & UINT64_C(0x00003fff00003fff)) | ((x & UINT64_C(0x3fff00003fff0000)) >> 2);
    x = (x & UINT64_C(0x000000000fffffff)) | ((x & UINT64_C(0x0fffffff00000000)) >> 4);
    d->p += bytes;
    return x;
}

/* The field of bit if present, else 0; bad if it exceeds max. */
static inline uint64_t get_value(struct rec_reader *d, uint32_t bit, uint64_t max)
{
    if (!(d->present & bit)) return 0;
    uint64_t v = get_varint(d);
    if (v > max) d->bad = 1;
    return v;
}

static inline int64_t get_time(struct rec_reader *d, uint32_t bit)
{
    if (!(d->present & bit)) return 0;
    return (int64_t)(d->base + unzigzag(get_varint(d)));
}

static void get_bytes(struct rec_reader *d, uint8_t out[16], int present)
{
    memset(out, 0, 16);
    if (!present) return;
    if (d->end - d->p < 16) {
        d->bad = 1;
        return;
    }
    memcpy(out, d->p, 16);
    d->p += 16;
}

/* ---- Decoding ---- */

static int decode_fixed(const uint8_t *p, uint32_t len, struct rec *r)
{
    if (len < REC_FIXED_BYTES) return IDEM_ECORRUPT;
    r->state = p[0];
    r->flags = p[1];
    r->key_len = util_get_u16(p + 2);
    r->owner_len = util_get_u16(p + 4);
    r->note_len = util_get_u16(p + 6);
    r->result_len = util_get_u32(p + 8);
    r->result_raw_len = util_get_u32(p + 12);
    r->first_seen_ms = (int64_t)util_get_u64(p + 16);
    r->expires_at_ms = (int64_t)util_get_u64(p + 24);
    r->last_seen_ms = (int64_t)util_get_u64(p + 32);
    r->seen_count = util_get_u64(p + 40);
    r->lease_until_ms = (int64_t)util_get_u64(p + 48);
    r->token = (int64_t)util_get_u64(p + 56);
    r->last_grant_ms = (int64_t)util_get_u64(p + 64);
    r->attempts = util_get_u32(p + 72);
    r->mismatch_count = util_get_u64(p + 80);
    r->last_mismatch_ms = (int64_t)util_get_u64(p + 88);
    r->version = util_get_u64(p + 96);
    memcpy(r->fp, p + 104, 16);
    memcpy(r->last_mismatch_fp, p + 120, 16);
    return 0;
}

/* Reads the head of a compact record and its first field; 0 if the head cannot be right. */
static int compact_head(const uint8_t *p, uint32_t len, struct rec_reader *d)
{
    if (len < REC_C_HEAD) return 0;
    uint32_t fields_len = util_get_u16(p + 6), present = util_get_u16(p + 4);
    if ((present & ~REC_P_KNOWN) || (p[1] & ~REC_F_KNOWN) || REC_C_HEAD + fields_len > len)
        return 0;
    *d = (struct rec_reader){.p = p + REC_C_HEAD,
                             .end = p + REC_C_HEAD + fields_len,
                             .limit = p + len,
                             .present = present};
    d->base = unzigzag(get_varint(d));
    return 1;
}

/* Returns the offset of the key, or 0 if the fields do not decode. */
static uint32_t decode_compact(const uint8_t *p, uint32_t len, struct rec *r)
{
    struct rec_reader d;
    if (!compact_head(p, len, &d)) return 0;
    r->state = p[0] & (uint8_t)~REC_COMPACT;
    r->flags = p[1];
    r->key_len = util_get_u16(p + 2);
    r->first_seen_ms = (int64_t)d.base;
    r->version = get_value(&d, REC_P_VERSION, UINT64_MAX);
    r->mismatch_count = get_value(&d, REC_P_MISMATCHES, UINT64_MAX);
    r->owner_len = (uint16_t)get_value(&d, REC_P_OWNER_LEN, UINT16_MAX);
    r->note_len = (uint16_t)get_value(&d, REC_P_NOTE_LEN, UINT16_MAX);
    r->result_len = (uint32_t)get_value(&d, REC_P_RESULT_LEN, UINT32_MAX);
    r->result_raw_len = (uint32_t)get_value(&d, REC_P_RESULT_RAW_LEN, UINT32_MAX);
    r->expires_at_ms = get_time(&d, REC_P_EXPIRES);
    r->last_seen_ms = get_time(&d, REC_P_LAST_SEEN);
    r->seen_count = get_value(&d, REC_P_SEEN_COUNT, UINT64_MAX);
    r->lease_until_ms = get_time(&d, REC_P_LEASE_UNTIL);
    r->token = (int64_t)get_value(&d, REC_P_TOKEN, UINT64_MAX);
    r->last_grant_ms = get_time(&d, REC_P_LAST_GRANT);
    r->attempts = (uint32_t)get_value(&d, REC_P_ATTEMPTS, UINT32_MAX);
    r->last_mismatch_ms = get_time(&d, REC_P_LAST_MISMATCH);
    get_bytes(&d, r->fp, r->flags & REC_F_FP);
    get_bytes(&d, r->last_mismatch_fp, r->flags & REC_F_MFP);
    return d.bad || d.p != d.end ? 0 : (uint32_t)(d.end - p);
}

int rec_facts(const uint8_t *p, uint32_t len, uint64_t *version, uint64_t *mismatch_count)
{
    if (len >= 1 && (p[0] & REC_COMPACT)) {
        struct rec_reader d;
        if (!compact_head(p, len, &d)) return IDEM_ECORRUPT;
        *version = get_value(&d, REC_P_VERSION, UINT64_MAX);
        *mismatch_count = get_value(&d, REC_P_MISMATCHES, UINT64_MAX);
        return d.bad ? IDEM_ECORRUPT : 0;
    }
    struct rec r;
    if (decode_fixed(p, len, &r) < 0) return IDEM_ECORRUPT;
    *version = r.version;
    *mismatch_count = r.mismatch_count;
    return 0;
}

int rec_decode(const uint8_t *p, uint32_t len, struct rec *r)
{
    uint32_t at = REC_FIXED_BYTES;
    if (len >= 1 && (p[0] & REC_COMPACT)) {
        at = decode_compact(p, len, r);
        if (!at) return IDEM_ECORRUPT;
    } else if (decode_fixed(p, len, r) < 0) {
        return IDEM_ECORRUPT;
    }
    uint64_t need = (uint64_t)at + r->key_len + r->owner_len + r->note_len + r->result_len;
    /* A compressed result is inflated into memory of its declared length: no store holds one
     * longer than IDEM_RESULT_BYTES_LIMIT (fuzz_wal_replay: a frame whose checksum held once
     * asked for 2 GiB). */
    if (need > len || r->key_len == 0 || r->state < IDEM_STATE_IN_FLIGHT ||
        r->state > IDEM_STATE_REVIEW ||
        ((r->flags & REC_F_LZ4) && r->result_raw_len > IDEM_RESULT_BYTES_LIMIT))
        return IDEM_ECORRUPT;
    r->key = p + at;
    r->owner = r->key + r->key_len;
    r->note = r->owner + r->owner_len;
    r->result = r->note + r->note_len;
    return 0;
}

/* ---- Encoding ---- */

uint32_t rec_encode(const struct rec *r, uint8_t out[REC_ENCODE_ROOM])
{
    struct rec_writer w = {out + REC_C_HEAD, 0, (uint64_t)r->first_seen_ms};
    put_varint(&w, zigzag(w.base));
    put_value(&w, REC_P_VERSION, r->version);
    put_value(&w, REC_P_MISMATCHES, r->mismatch_count);
    put_value(&w, REC_P_OWNER_LEN, r->owner_len);
    put_value(&w, REC_P_NOTE_LEN, r->note_len);
    put_value(&w, REC_P_RESULT_LEN, r->result_len);
    put_value(&w, REC_P_RESULT_RAW_LEN, r->result_raw_len);
    put_time(&w, REC_P_EXPIRES, r->expires_at_ms);
    put_time(&w, REC_P_LAST_SEEN, r->last_seen_ms);
    put_value(&w, REC_P_SEEN_COUNT, r->seen_count);
    put_time(&w, REC_P_LEASE_UNTIL, r->lease_until_ms);
    put_value(&w, REC_P_TOKEN, (uint64_t)r->token);
    put_time(&w, REC_P_LAST_GRANT, r->last_grant_ms);
    put_value(&w, REC_P_ATTEMPTS, r->attempts);
    put_time(&w, REC_P_LAST_MISMATCH, r->last_mismatch_ms);
    if (r->flags & REC_F_FP) {
        memcpy(w.p, r->fp, 16);
        w.p += 16;
    }
    if (r->flags & REC_F_MFP) {
        memcpy(w.p, r->last_mismatch_fp, 16);
        w.p += 16;
    }
    uint32_t n = (uint32_t)(w.p - out);
    if (n > REC_HEAD_MAX) {
        rec_encode_fixed(r, out);
        return REC_FIXED_BYTES;
    }
    out[0] = (uint8_t)(REC_COMPACT | r->state);
    /* A flag no build defines (damage a fixed-form record carried, which its form did not
     * check) is not written on: the compact form refuses it. */
    out[1] = r->flags & REC_F_KNOWN;
    util_put_u16(out + 2, r->key_len);
    util_put_u16(out + 4, (uint16_t)w.present);
    util_put_u16(out + 6, (uint16_t)(n - REC_C_HEAD));
    return n;
}

void rec_encode_fixed(const struct rec *r, uint8_t p[REC_FIXED_BYTES])
{
    p[0] = r->state;
    p[1] = r->flags;
    util_put_u16(p + 2, r->key_len);
    util_put_u16(p + 4, r->owner_len);
    util_put_u16(p + 6, r->note_len);
    util_put_u32(p + 8, r->result_len);
    util_put_u32(p + 12, r->result_raw_len);
    util_put_u64(p + 16, (uint64_t)r->first_seen_ms);
    util_put_u64(p + 24, (uint64_t)r->expires_at_ms);
    util_put_u64(p + 32, (uint64_t)r->last_seen_ms);
    util_put_u64(p + 40, r->seen_count);
    util_put_u64(p + 48, (uint64_t)r->lease_until_ms);
    util_put_u64(p + 56, (uint64_t)r->token);
    util_put_u64(p + 64, (uint64_t)r->last_grant_ms);
    util_put_u32(p + 72, r->attempts);
    util_put_u32(p + 76, 0);
    util_put_u64(p + 80, r->mismatch_count);
    util_put_u64(p + 88, (uint64_t)r->last_mismatch_ms);
    util_put_u64(p + 96, r->version);
    memcpy(p + 104, r->fp, 16);
    memcpy(p + 120, r->last_mismatch_fp, 16);
}
