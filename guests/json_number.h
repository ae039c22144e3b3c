/* Numbers between bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum) as digit-wise
 * automata, exact: integers of at most 16 digits; numbers of at most 16 integer and 16 fraction digits
 * (bounds with at most 16 fraction digits).
 *
 * Each sign has a range of magnitudes for the integer part, [lo, hi] as digit strings. While the
 * integer part is written, a frame keeps its digit count and how it compares with lo's and hi's first
 * digits (less, equal, greater): with the count that decides the comparison of whole magnitudes, so a
 * digit is allowed only if some magnitude in range still begins with the digits so far. A number's
 * fraction is bounded only where the integer part is lo's (x > 3: "3.5"; x >= 2.25: "2.25") or hi's
 * (x <= 3: "3.0"; x < 2.5: "2.4"): then its digits are compared with the bound's fraction digits the
 * same way. Bounded numbers are written without an exponent.
 */
#ifndef JSON_NUMBER_H
#define JSON_NUMBER_H

#include "json_value.h"

#define NUM_MAX_DIGITS 16
#define NUM_MAX_MAGNITUDE 9999999999999999LL /* 16 digits: the most the automaton writes */
#define NUM_HUGE 100000000000000000LL        /* 10^17: a bound past anything written */

/* The magnitudes of one sign (on: the sign is allowed): integer parts lo to hi. */
typedef struct {
    uint8_t on, lo_len, hi_len;
    uint8_t lo_open;     /* the integer part lo does not end a number: a fraction past lo_frac must follow */
    uint8_t lo_strict;   /* at lo, the fraction exceeds lo_frac (else it may equal it) */
    uint8_t hi_fraction; /* at hi, the fraction is at most hi_frac (below it if hi_strict) */
    uint8_t hi_strict, lo_frac_len, hi_frac_len;
    uint32_t multiple;   /* integers: multipleOf (1: none) */
    char lo[NUM_MAX_DIGITS + 1], hi[NUM_MAX_DIGITS + 1], lo_frac[NUM_MAX_DIGITS + 1], hi_frac[NUM_MAX_DIGITS + 1];
} mag_range;

enum { CMP_EQ = 0, CMP_LT = 1, CMP_GT = 2 };

/* How the first k+1 digits compare with bound's, from how the first k did and digit b. */
static int cmp_next(int cmp, int k, const char *bound, int len, int b) {
    if (k >= len) return CMP_GT;
    if (cmp != CMP_EQ) return cmp;
    return b < bound[k] ? CMP_LT : b > bound[k] ? CMP_GT : CMP_EQ;
}

static int64_t pow10(int j) {
    int64_t p = 1;
    while (j-- > 0) p *= 10;
    return p;
}

/* The number written by digits[k..len). */
static int64_t digits_from(const char *digits, int k, int len) {
    int64_t v = 0;
    for (int i = k; i < len; i++) v = v * 10 + (digits[i] - '0');
    return v;
}

/* The fewest digits to add to a k-digit integer part (cl, ch: its comparison with lo's and hi's first
 * k digits; rem: its remainder modulo the range's multiple) to reach a magnitude that may end the
 * number (in [lo, hi], above lo if lo_open, a multiple); -1 if none. closed: no digit may follow
 * (after a leading 0, or at 16 digits). For each length n, the j = n - k digits to come are a number x
 * in an interval the bounds set (lo's last j digits or more where the digits so far equal lo's, hi's or
 * less where they equal hi's, any j digits elsewhere): is there one, and one that makes a multiple? */
static int mag_rest(const mag_range *r, int k, int cl, int ch, int closed, uint32_t rem) {
    int top = closed ? k : NUM_MAX_DIGITS;
    for (int n = k ? k : 1; n <= top; n++) {
        int j = n - k;
        int64_t lo = k == 0 && n > 1 ? pow10(n - 1) : 0, hi = pow10(j) - 1; /* no leading zero */
        if (n < r->lo_len || (n == r->lo_len && cl == CMP_LT)) continue;
        if (n > r->hi_len || (n == r->hi_len && ch == CMP_GT)) continue;
        if (n == r->lo_len && cl == CMP_EQ) {
            int64_t at = digits_from(r->lo, k, n) + r->lo_open;
            if (at > lo) lo = at;
        }
        if (n == r->hi_len && ch == CMP_EQ) {
            int64_t at = digits_from(r->hi, k, n);
            if (at < hi) hi = at;
        }
        if (lo > hi) continue;
        if (r->multiple > 1) { /* the least x >= lo with rem * 10^j + x a multiple */
            int64_t m = r->multiple, shift = 1;
            for (int i = 0; i < j; i++) shift = shift * 10 % m;
            int64_t want = (m - (int64_t)rem * shift % m) % m, x = lo + ((want - lo % m) % m + m) % m;
            if (x > hi) continue;
        }
        return j;
    }
    return -1;
}

/* How the first k+1 fraction digits compare with a bound's fraction (zeros past its end). */
static int frac_cmp_next(int cmp, int k, const char *frac, int len, int b) {
    if (cmp != CMP_EQ) return cmp;
    int d = k < len ? frac[k] : '0';
    return b < d ? CMP_LT : b > d ? CMP_GT : CMP_EQ;
}

/* The number written by frac[k..k+j) (zeros past len), and whether a nonzero digit follows it. */
static int64_t frac_digits(const char *frac, int len, int k, int j, int *more) {
    int64_t v = 0;
    for (int i = k; i < k + j; i++) v = v * 10 + (i < len ? frac[i] - '0' : 0);
    *more = 0;
    for (int i = k + j; i < len; i++) *more |= frac[i] != '0';
    return v;
}

/* The fewest digits to add to a fraction of k digits (clf, chf: how they compare with lo_frac's and
 * hi_frac's first k; la, ha: whether those bind, the integer part being lo's or hi's) to end the
 * number; -1 if none. At least one digit follows the point. For each count j, the digits to come are a
 * number in an interval the bounds set: is there one? */
static int frac_rest(const mag_range *r, int k, int clf, int chf, int la, int ha) {
    if ((la && clf == CMP_LT) || (ha && chf == CMP_GT)) return -1;
    for (int j = k ? 0 : 1; k + j <= NUM_MAX_DIGITS; j++) {
        int64_t lo = 0, hi = pow10(j) - 1;
        int more;
        if (la && clf == CMP_EQ) lo = frac_digits(r->lo_frac, r->lo_frac_len, k, j, &more) + (r->lo_strict || more);
        if (ha && chf == CMP_EQ) {
            int64_t top = frac_digits(r->hi_frac, r->hi_frac_len, k, j, &more);
            if (r->hi_strict && !more) top--;
            if (top < hi) hi = top;
        }
        if (lo <= hi) return j;
    }
    return -1;
}

/* The fewest bytes that end the value from there: mag_rest, or (a number whose integer part lo does not
 * end it) lo's remaining digits, the point and the fraction's; -1 if neither. */
static int mag_need(const mag_range *r, int k, int cl, int ch, int closed, int number, uint32_t rem) {
    int best = mag_rest(r, k, cl, ch, closed, rem);
    if (number && r->lo_open && cl == CMP_EQ && k <= r->lo_len && (!closed || k == r->lo_len)) {
        int ha = r->hi_fraction && r->lo_len == r->hi_len && !mem_cmp(r->lo, r->hi, r->lo_len);
        int frac = frac_rest(r, 0, CMP_EQ, CMP_EQ, 1, ha);
        int via_lo = frac < 0 ? -1 : r->lo_len - k + 1 + frac;
        if (via_lo >= 0 && (best < 0 || via_lo < best)) best = via_lo;
    }
    return best;
}

/* Whether a k-digit integer part lies in [lo, hi] (so a fraction may follow). */
static int mag_within(const mag_range *r, int k, int cl, int ch) {
    return (k > r->lo_len || (k == r->lo_len && cl != CMP_LT)) && (k < r->hi_len || (k == r->hi_len && ch != CMP_GT));
}

/* The floor of a JSON number's value, saturated at +-NUM_HUGE; *whole: the value is an integer
 * (1e3 and 2.0 are). */
static int64_t number_floor(const char *t, uint32_t n, int *whole) {
    uint32_t i = 0;
    int neg = i < n && t[i] == '-', seen_point = 0, nonzero_past = 0;
    i += (uint32_t)neg;
    char digits[40];
    int nd = 0, point = 0; /* the value is 0.d1d2... * 10^point */
    for (; i < n && ((t[i] >= '0' && t[i] <= '9') || t[i] == '.'); i++) {
        if (t[i] == '.') { seen_point = 1; continue; }
        if (nd == 0 && t[i] == '0') { point -= seen_point; continue; }
        if (nd < (int)sizeof digits) digits[nd++] = t[i];
        else if (t[i] != '0') nonzero_past = 1;
        point += !seen_point;
    }
    if (i < n && (t[i] == 'e' || t[i] == 'E')) {
        int eneg = ++i < n && t[i] == '-', e = 0;
        if (i < n && (t[i] == '-' || t[i] == '+')) i++;
        for (; i < n && t[i] >= '0' && t[i] <= '9'; i++) e = e < 10000 ? e * 10 + (t[i] - '0') : e;
        point += eneg ? -e : e;
    }
    int64_t whole_part = 0;
    int frac = nonzero_past;
    for (int j = 0; j < nd; j++) {
        if (j < point) whole_part = whole_part >= NUM_HUGE ? NUM_HUGE : whole_part * 10 + (digits[j] - '0');
        else if (digits[j] != '0') frac = 1;
    }
    for (int j = nd; j < point && whole_part < NUM_HUGE; j++) whole_part *= 10;
    if (whole_part > NUM_HUGE) whole_part = NUM_HUGE;
    *whole = !frac;
    return neg ? -whole_part - frac : whole_part;
}

static uint8_t mag_digits(int64_t v, char *out) {
    char tmp[20];
    int n = 0;
    do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v);
    for (int i = 0; i < n; i++) out[i] = tmp[n - 1 - i];
    out[n] = 0;
    return (uint8_t)n;
}

/* An integer sign's range: magnitudes [lo, hi] (hi past 16 digits: to the largest written); off when
 * empty. */
static void mag_set(mag_range *r, int64_t lo, int64_t hi) {
    if (hi > NUM_MAX_MAGNITUDE) hi = NUM_MAX_MAGNITUDE;
    r->on = lo <= hi;
    if (!r->on) return;
    r->lo_len = mag_digits(lo, r->lo), r->hi_len = mag_digits(hi, r->hi);
}

/* A JSON number as a decimal: its sign, integer part (saturated at NUM_HUGE) and fraction digits
 * (trailing zeros dropped); 0 if the fraction has more than 16 digits. */
typedef struct { int neg; int64_t whole; uint8_t frac_len; char frac[NUM_MAX_DIGITS + 1]; } decimal;

static int number_decimal(const char *t, uint32_t n, decimal *d) {
    int whole;
    __builtin_memset(d, 0, sizeof *d);
    int64_t floor = number_floor(t, n, &whole);
    uint32_t i = t[0] == '-';
    char digits[40];
    int nd = 0, point = 0, seen_point = 0, past = 0;
    for (; i < n && ((t[i] >= '0' && t[i] <= '9') || t[i] == '.'); i++) { /* as number_floor reads them */
        if (t[i] == '.') { seen_point = 1; continue; }
        if (nd == 0 && t[i] == '0') { point -= seen_point; continue; }
        if (nd < (int)sizeof digits) digits[nd++] = t[i];
        else past |= t[i] != '0';
        point += !seen_point;
    }
    if (i < n && (t[i] == 'e' || t[i] == 'E')) {
        int eneg = ++i < n && t[i] == '-', e = 0;
        if (i < n && (t[i] == '-' || t[i] == '+')) i++;
        for (; i < n && t[i] >= '0' && t[i] <= '9'; i++) e = e < 10000 ? e * 10 + (t[i] - '0') : e;
        point += eneg ? -e : e;
    }
    for (int at = point < 0 ? point : 0, p = 0; at < nd; at++) {
        if (at < point) continue;
        p = at - point;
        char c = at < 0 ? '0' : digits[at];
        if (p >= NUM_MAX_DIGITS) { if (c != '0') return 0; continue; }
        d->frac[p] = c;
        if (c != '0') d->frac_len = (uint8_t)(p + 1);
    }
    if (past) return 0;
    d->neg = t[0] == '-' && (floor != 0 || d->frac_len);
    d->whole = d->neg ? -floor - (d->frac_len > 0) : floor;
    return 1;
}

/* -1, 0, 1 as a is below, equal to, above b. */
static int decimal_cmp(const decimal *a, const decimal *b) {
    if (a->neg != b->neg) return a->neg ? -1 : 1;
    int m = a->whole < b->whole ? -1 : a->whole > b->whole ? 1 : 0;
    for (int i = 0; !m && i < NUM_MAX_DIGITS; i++) {
        char x = i < a->frac_len ? a->frac[i] : '0', y = i < b->frac_len ? b->frac[i] : '0';
        m = x < y ? -1 : x > y ? 1 : 0;
    }
    return a->neg ? -m : m;
}

/* A number sign's range: magnitudes from lo (above it if lo_strict) to hi (NULL: none; below it if
 * hi_strict); off when empty (also where only a fraction could lie between and none does: that is
 * found by mag_need from the start). */
static void mag_set_number(mag_range *r, const decimal *lo, int lo_strict, const decimal *hi, int hi_strict) {
    int64_t top = hi ? hi->whole : NUM_HUGE;
    int fraction = hi != 0;
    if (hi && !hi->frac_len && hi_strict) top--, fraction = 0; /* x < 3: integer parts to 2, any fraction */
    if (top > NUM_MAX_MAGNITUDE) top = NUM_MAX_MAGNITUDE, fraction = 0;
    r->on = top >= 0 && lo->whole <= top;
    if (!r->on) return;
    r->lo_len = mag_digits(lo->whole, r->lo), r->hi_len = mag_digits(top, r->hi);
    r->lo_open = lo->frac_len > 0 || lo_strict, r->lo_strict = (uint8_t)lo_strict;
    r->lo_frac_len = lo->frac_len;
    __builtin_memcpy(r->lo_frac, lo->frac, sizeof r->lo_frac);
    r->hi_fraction = (uint8_t)fraction, r->hi_strict = (uint8_t)hi_strict;
    if (fraction) r->hi_frac_len = hi->frac_len, __builtin_memcpy(r->hi_frac, hi->frac, sizeof r->hi_frac);
}

#endif
