/*
 * record.h: the encoding of one version of a record in a WAL_T_RECORD frame payload.
 *
 * Layout (little-endian, offsets in bytes):
 *    0 u8  state (enum idem_state)      1 u8 flags (REC_F_*)       2 u16 key_len
 *    4 u16 owner_len                    6 u16 note_len
 *    8 u32 result_len (bytes stored)   12 u32 result_raw_len (bytes before compression)
 *   16 i64 first_seen_ms               24 i64 expires_at_ms        32 i64 last_seen_ms
 *   40 u64 seen_count                  48 i64 lease_until_ms       56 i64 token
 *   64 i64 last_grant_ms               72 u32 attempts             76 u32 reserved (0)
 *   80 u64 mismatch_count              88 i64 last_mismatch_ms     96 u64 version
 *  104 u8[16] fp                      120 u8[16] last_mismatch_fp
 *  136 key, owner, note, result (stored form)
 * A record is immutable once written; every change writes a new version.
 */
#ifndef IDEM_RECORD_H
#define IDEM_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "idem.h"

#define REC_FIXED_BYTES 136u

#define REC_F_FP  0x1u /* fp holds the content fingerprint */
#define REC_F_MFP 0x2u /* last_mismatch_fp is set */
#define REC_F_LZ4 0x4u /* the result is lz4-compressed */

/* A decoded record: fixed fields by value, variable fields pointing into the frame. */
struct rec {
    uint8_t state, flags;
    uint16_t key_len, owner_len, note_len;
    uint32_t result_len, result_raw_len;
    int64_t first_seen_ms, expires_at_ms, last_seen_ms;
    uint64_t seen_count;
    int64_t lease_until_ms, token, last_grant_ms;
    uint32_t attempts;
    uint64_t mismatch_count;
    int64_t last_mismatch_ms;
    uint64_t version;
    uint8_t fp[16], last_mismatch_fp[16];
    const uint8_t *key, *owner, *note, *result;
};

/* Decodes payload[0, len). Returns 0 or IDEM_ECORRUPT if the lengths do not fit. */
int rec_decode(const uint8_t *payload, uint32_t len, struct rec *r);
/* Writes the fixed part of r into out[REC_FIXED_BYTES]. The variable parts follow it in the
 * frame in the order key, owner, note, result (the caller passes them as frame parts). */
void rec_encode_fixed(const struct rec *r, uint8_t out[REC_FIXED_BYTES]);

#endif
