/* The state of one scan and the msgpack reading it is made of (events/wire/_wire_scan.c).
 *
 * Only _wire_scan.c includes this: one translation unit, split so each part reads on
 * its own. Every reader checks bounds and refuses what it does not model (see the
 * rules in _wire_scan.c). */
#ifndef KVINDEX_WIRE_SCAN_READ_H
#define KVINDEX_WIRE_SCAN_READ_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HASHES_PER_EVENT 65536 /* events/wire/vllm.py MAX_HASHES_PER_EVENT */
#define MAX_DP_RANK 4095           /* events/wire/vllm.py MAX_DP_RANK */
#define MAX_DEPTH 32               /* nesting accepted inside a skipped value */

enum { TAG_STORED = 0, TAG_REMOVED = 1, TAG_CLEARED = 2 };

/* A scalar field as sent: absent/nil, an int, or a string (bytes inside the payload). */
enum { A_NIL = 0, A_INT = 1, A_STR = 2 };
typedef struct {
    int kind;
    int neg;    /* A_INT: the value is negative, u holds it as int64 */
    uint64_t u; /* A_INT */
    const uint8_t *s; /* A_STR: UTF-8, validated */
    uint32_t len;
} Attr;

typedef struct {
    int tag;
    int parent_none;
    Attr block_size, medium, group_idx, kind, window, locality;
} Key;

typedef struct {
    Key key;
    uint32_t first, count, start, stop;
} Run;

typedef struct {
    const uint8_t *p, *end;
    uint64_t *hashes;
    size_t n_hashes, cap_hashes;
    int own_hashes;
    Run *runs;
    size_t n_runs, cap_runs;
    int own_runs;
    uint32_t *spans; /* (part, start, stop) per event: where its bytes are */
    size_t n_spans, cap_spans; /* in uint32s */
    int own_spans;
    const uint8_t *base;
    double ts;
    int has_rank;
    uint64_t rank;
    int is_map; /* -1 until the first event says */
} Scan;

/* -- growable arrays (start on the caller's stack) ----------------------------------- */

static int grow(void **buf, size_t *cap, int *own, size_t item) {
    size_t cap2 = *cap * 2;
    void *mem;
    if (*own) {
        mem = realloc(*buf, cap2 * item);
    } else {
        mem = malloc(cap2 * item);
        if (mem != NULL) {
            memcpy(mem, *buf, *cap * item);
        }
    }
    if (mem == NULL) {
        return -1;
    }
    *buf = mem;
    *cap = cap2;
    *own = 1;
    return 0;
}

static inline int push_hash(Scan *s, uint64_t h) {
    if (s->n_hashes == s->cap_hashes &&
        grow((void **)&s->hashes, &s->cap_hashes, &s->own_hashes, sizeof(uint64_t)) < 0) {
        return -1;
    }
    s->hashes[s->n_hashes++] = h;
    return 0;
}

static inline int push_span(Scan *s, uint32_t start, uint32_t stop) {
    if (s->n_spans + 3 > s->cap_spans &&
        grow((void **)&s->spans, &s->cap_spans, &s->own_spans, sizeof(uint32_t)) < 0) {
        return -1;
    }
    uint32_t *at = s->spans + s->n_spans;
    at[0] = 0, at[1] = start, at[2] = stop;
    s->n_spans += 3;
    return 0;
}

/* -- msgpack reading ------------------------------------------------------------------ */

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

/* Strict UTF-8 (what CPython's strict decoder accepts: no overlongs, no surrogates,
 * nothing past U+10FFFF). */
static int utf8_ok(const uint8_t *s, uint32_t n) {
    uint32_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        uint32_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
        } else if (c == 0xE0) {
            need = 2, lo = 0xA0;
        } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
            need = 2;
        } else if (c == 0xED) {
            need = 2, hi = 0x9F;
        } else if (c == 0xF0) {
            need = 3, lo = 0x90;
        } else if (c >= 0xF1 && c <= 0xF3) {
            need = 3;
        } else if (c == 0xF4) {
            need = 3, hi = 0x8F;
        } else {
            return 0;
        }
        if (n - i <= need) {
            return 0;
        }
        if (s[i + 1] < lo || s[i + 1] > hi) {
            return 0;
        }
        for (uint32_t k = 2; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) {
                return 0;
            }
        }
        i += need + 1;
    }
    return 1;
}

/* What the next value is. */
enum { V_NIL, V_BOOL, V_INT, V_FLOAT, V_STR, V_BIN, V_ARR, V_MAP, V_BAD };

typedef struct {
    int type;
    int neg;        /* V_INT */
    uint64_t u;     /* V_INT (int64 bits when neg) */
    double f;       /* V_FLOAT */
    const uint8_t *data; /* V_STR, V_BIN: the bytes (consumed) */
    uint32_t len;   /* V_STR, V_BIN: bytes; V_ARR, V_MAP: items (not consumed) */
} Val;

/* Read one value's header (and a str/bin's bytes). Ext types and the reserved 0xc1 are
 * V_BAD, as is anything cut short. Strings are not validated here. */
static inline int next(Scan *s, Val *v) {
    const uint8_t *p = s->p, *end = s->end;
    if (p >= end) {
        return v->type = V_BAD;
    }
    uint8_t b = *p++;
    size_t avail = (size_t)(end - p);
    uint32_t n;
    if (b <= 0x7f) {
        v->type = V_INT, v->neg = 0, v->u = b;
    } else if (b >= 0xe0) {
        v->type = V_INT, v->neg = 1, v->u = (uint64_t)(int64_t)(int8_t)b;
    } else if (b <= 0x8f) {
        v->type = V_MAP, v->len = b & 0x0f;
    } else if (b <= 0x9f) {
        v->type = V_ARR, v->len = b & 0x0f;
    } else if (b <= 0xbf) {
        n = b & 0x1f;
        if (avail < n) return v->type = V_BAD;
        v->type = V_STR, v->data = p, v->len = n;
        p += n;
    } else {
        switch (b) {
        case 0xc0: v->type = V_NIL; break;
        case 0xc2: v->type = V_BOOL; break;
        case 0xc3: v->type = V_BOOL; break;
        case 0xc4: case 0xd9:
            if (avail < 1 || avail - 1 < p[0]) return v->type = V_BAD;
            v->type = b == 0xc4 ? V_BIN : V_STR, v->len = p[0], v->data = p + 1;
            p += 1 + v->len;
            break;
        case 0xc5: case 0xda:
            if (avail < 2 || avail - 2 < be16(p)) return v->type = V_BAD;
            v->type = b == 0xc5 ? V_BIN : V_STR, v->len = be16(p), v->data = p + 2;
            p += 2 + v->len;
            break;
        case 0xc6: case 0xdb:
            if (avail < 4 || avail - 4 < be32(p)) return v->type = V_BAD;
            v->type = b == 0xc6 ? V_BIN : V_STR, v->len = be32(p), v->data = p + 4;
            p += 4 + v->len;
            break;
        case 0xca: {
            if (avail < 4) return v->type = V_BAD;
            uint32_t bits = be32(p);
            float f;
            memcpy(&f, &bits, 4);
            v->type = V_FLOAT, v->f = (double)f;
            p += 4;
            break;
        }
        case 0xcb: {
            if (avail < 8) return v->type = V_BAD;
            uint64_t bits = be64(p);
            double d;
            memcpy(&d, &bits, 8);
            v->type = V_FLOAT, v->f = d;
            p += 8;
            break;
        }
        case 0xcc: if (avail < 1) return v->type = V_BAD;
            v->type = V_INT, v->neg = 0, v->u = p[0]; p += 1; break;
        case 0xcd: if (avail < 2) return v->type = V_BAD;
            v->type = V_INT, v->neg = 0, v->u = be16(p); p += 2; break;
        case 0xce: if (avail < 4) return v->type = V_BAD;
            v->type = V_INT, v->neg = 0, v->u = be32(p); p += 4; break;
        case 0xcf: if (avail < 8) return v->type = V_BAD;
            v->type = V_INT, v->neg = 0, v->u = be64(p); p += 8; break;
        case 0xd0: if (avail < 1) return v->type = V_BAD;
            v->type = V_INT, v->u = (uint64_t)(int64_t)(int8_t)p[0]; p += 1; break;
        case 0xd1: if (avail < 2) return v->type = V_BAD;
            v->type = V_INT, v->u = (uint64_t)(int64_t)(int16_t)be16(p); p += 2; break;
        case 0xd2: if (avail < 4) return v->type = V_BAD;
            v->type = V_INT, v->u = (uint64_t)(int64_t)(int32_t)be32(p); p += 4; break;
        case 0xd3: if (avail < 8) return v->type = V_BAD;
            v->type = V_INT, v->u = be64(p); p += 8; break;
        case 0xdc: if (avail < 2) return v->type = V_BAD;
            v->type = V_ARR, v->len = be16(p); p += 2; break;
        case 0xdd: if (avail < 4) return v->type = V_BAD;
            v->type = V_ARR, v->len = be32(p); p += 4; break;
        case 0xde: if (avail < 2) return v->type = V_BAD;
            v->type = V_MAP, v->len = be16(p); p += 2; break;
        case 0xdf: if (avail < 4) return v->type = V_BAD;
            v->type = V_MAP, v->len = be32(p); p += 4; break;
        default: return v->type = V_BAD; /* 0xc1, ext */
        }
        if (b >= 0xd0 && b <= 0xd3) {
            v->neg = (int64_t)v->u < 0;
        }
    }
    s->p = p;
    return v->type;
}

/* The length of a value that is a fixed-size scalar (nil, bool, int, float) from its
 * first byte; 0 for anything else. */
static const uint8_t SCALAR_LEN[256] = {
    [0x00 ... 0x7f] = 1, [0xc0] = 1, [0xc2] = 1, [0xc3] = 1,
    [0xca] = 5, [0xcb] = 9, [0xcc] = 2, [0xcd] = 3, [0xce] = 5, [0xcf] = 9,
    [0xd0] = 2, [0xd1] = 3, [0xd2] = 5, [0xd3] = 9, [0xe0 ... 0xff] = 1,
};

/* Skip one value: nil, bools, ints, floats, valid strings, bins, arrays of those. Maps
 * and ext are refused (msgspec may decode them into values this scanner does not
 * model); so is nesting past MAX_DEPTH. Returns 0, or -1 to give up. */
static int skip(Scan *s, int depth) {
    Val v;
    switch (next(s, &v)) {
    case V_NIL: case V_BOOL: case V_INT: case V_FLOAT: case V_BIN:
        return 0;
    case V_STR:
        return utf8_ok(v.data, v.len) ? 0 : -1;
    case V_ARR: {
        if (depth >= MAX_DEPTH) return -1;
        uint32_t n = v.len;
        const uint8_t *end = s->end;
        const uint8_t *p = s->p;
        for (uint32_t i = 0; i < n; i++) {
            /* The common case, token ids: ints, skipped by their first byte's length
             * (a table, not a branch per kind: random ids of 3 and 5 bytes mispredict
             * a branch about every other id). */
            if (end - p >= 9) {
                uint8_t len = SCALAR_LEN[*p];
                if (len) {
                    p += len;
                    continue;
                }
            }
            s->p = p;
            if (skip(s, depth + 1) < 0) return -1;
            p = s->p;
        }
        s->p = p;
        return 0;
    }
    default:
        return -1;
    }
}


#endif /* KVINDEX_WIRE_SCAN_READ_H */
