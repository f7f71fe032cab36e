/*
 * record.h: the encoding of one version of a record in a WAL_T_RECORD frame payload.
 *
 * Two forms, told apart by byte 0. Both end with the variable parts key, owner, note, result
 * (stored form), back to back. A record is immutable once written; every change writes a new
 * version.
 *
 * Compact form (byte 0 = REC_COMPACT | state; written since superblock feature 0x4):
 *    0 u8  REC_COMPACT | state     1 u8 flags (REC_F_*)     2 u16 key_len
 *    4 u16 present (REC_P_*)       6 u16 fields_len
 *    8 fields, fields_len bytes:
 *        first_seen_ms                 zigzag varint
 *        each field whose present bit is set, in bit order, a LEB128 varint:
 *          lengths and counters        the value
 *          times                       zigzag of (time - first_seen_ms), mod 2^64
 *        fp (16 bytes)                 if flags has REC_F_FP
 *        last_mismatch_fp (16 bytes)   if flags has REC_F_MFP
 *    8 + fields_len: key, owner, note, result
 *   A field whose bit is clear is 0 (as are fp and last_mismatch_fp without their flag). The
 *   fields must fill fields_len exactly. A claim takes 30 to 40 bytes before its key.
 *
 * Fixed form (byte 0 = state; every version before feature 0x4, and this one when the compact
 * form would be longer, which only extreme field values make it), little-endian offsets:
 *    0 u8  state (enum idem_state)      1 u8 flags (REC_F_*)       2 u16 key_len
 *    4 u16 owner_len                    6 u16 note_len
 *    8 u32 result_len (bytes stored)   12 u32 result_raw_len (bytes before compression)
 *   16 i64 first_seen_ms               24 i64 expires_at_ms        32 i64 last_seen_ms
 *   40 u64 seen_count                  48 i64 lease_until_ms       56 i64 token
 *   64 i64 last_grant_ms               72 u32 attempts             76 u32 reserved (0)
 *   80 u64 mismatch_count              88 i64 last_mismatch_ms     96 u64 version
 *  104 u8[16] fp                      120 u8[16] last_mismatch_fp
 *  136 key, owner, note, result
 */
#ifndef IDEM_RECORD_H
#define IDEM_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "idem.h"
#include "util.h"

#define REC_FIXED_BYTES 136u            /* the fixed form's part before the key */
#define REC_HEAD_MAX    REC_FIXED_BYTES /* rec_encode never writes more before the key */
#define REC_C_HEAD      8u              /* the compact form's head, before its fields */
#define REC_COMPACT     0x80u
/* The room rec_encode may use while it writes: the head, 15 varints of up to 10 bytes, two
 * fingerprints, and 8 bytes for its stores of 8 bytes at once. */
#define REC_ENCODE_ROOM (REC_C_HEAD + 15u * 10u + 32u + 8u)

#define REC_F_FP    0x1u /* fp holds the content fingerprint */
#define REC_F_MFP   0x2u /* last_mismatch_fp is set */
#define REC_F_LZ4   0x4u /* the result is lz4-compressed */
#define REC_F_KNOWN 0x7u

/* Present bits of the compact form, in the order their fields follow first_seen_ms (version and
 * mismatch_count first: rec_facts reads them without decoding the rest). */
enum {
    REC_P_VERSION = 1u << 0,
    REC_P_MISMATCHES = 1u << 1,
    REC_P_OWNER_LEN = 1u << 2,
    REC_P_NOTE_LEN = 1u << 3,
    REC_P_RESULT_LEN = 1u << 4,
    REC_P_RESULT_RAW_LEN = 1u << 5,
    REC_P_EXPIRES = 1u << 6,   /* time */
    REC_P_LAST_SEEN = 1u << 7, /* time */
    REC_P_SEEN_COUNT = 1u << 8,
    REC_P_LEASE_UNTIL = 1u << 9, /* time */
    REC_P_TOKEN = 1u << 10,
    REC_P_LAST_GRANT = 1u << 11, /* time */
    REC_P_ATTEMPTS = 1u << 12,
    REC_P_LAST_MISMATCH = 1u << 13, /* time */
    REC_P_KNOWN = (1u << 14) - 1,
};

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

/* Decodes payload[0, len), either form. Returns 0 or IDEM_ECORRUPT if it does not decode. */
int rec_decode(const uint8_t *payload, uint32_t len, struct rec *r);
/* Writes the part of r that comes before its key into out (compact form, or fixed where that is
 * shorter) and returns its length (<= REC_HEAD_MAX; out[] past it may be overwritten). The variable
 * parts follow it in the frame in the order key, owner, note, result (the caller passes them as
 * frame parts). */
uint32_t rec_encode(const struct rec *r, uint8_t out[REC_ENCODE_ROOM]);
/* Writes the fixed form's part before the key (tests, and rec_encode's fallback). */
void rec_encode_fixed(const struct rec *r, uint8_t out[REC_FIXED_BYTES]);

/* The version and mismatch_count of the record in payload[0, len), without decoding the rest
 * (a change reads them from the version it replaces). Returns 0 or IDEM_ECORRUPT. */
int rec_facts(const uint8_t *payload, uint32_t len, uint64_t *version, uint64_t *mismatch_count);

/* The key of the record in payload[0, len) and its length, without decoding the rest; NULL if
 * the payload is too short to hold it. A lookup compares keys with this alone. */
static inline const uint8_t *rec_key(const uint8_t *p, uint32_t len, uint32_t *key_len)
{
    if (len < REC_C_HEAD) return NULL;
    uint32_t at = (p[0] & REC_COMPACT) ? REC_C_HEAD + util_get_u16(p + 6) : REC_FIXED_BYTES;
    *key_len = util_get_u16(p + 2);
    return (uint64_t)at + *key_len <= len ? p + at : NULL;
}

#endif
