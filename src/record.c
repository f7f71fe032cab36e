/*
 * record.c: encoding and decoding of record versions (layout in record.h).
 */
#include "record.h"

#include <string.h>

#include "util.h"

int rec_decode(const uint8_t *p, uint32_t len, struct rec *r)
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
    uint64_t need =
        (uint64_t)REC_FIXED_BYTES + r->key_len + r->owner_len + r->note_len + r->result_len;
    /* A compressed result is inflated into memory of its declared length: no store holds one
     * longer than IDEM_RESULT_BYTES_LIMIT (fuzz_wal_replay: a frame whose checksum held once
     * asked for 2 GiB). */
    if (need > len || r->key_len == 0 || r->state < IDEM_STATE_IN_FLIGHT ||
        r->state > IDEM_STATE_REVIEW ||
        ((r->flags & REC_F_LZ4) && r->result_raw_len > IDEM_RESULT_BYTES_LIMIT))
        return IDEM_ECORRUPT;
    r->key = p + REC_FIXED_BYTES;
    r->owner = r->key + r->key_len;
    r->note = r->owner + r->owner_len;
    r->result = r->note + r->note_len;
    return 0;
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
