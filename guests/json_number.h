/* Numbers between bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum) as digit-wise
 * automata: exact for integers; for numbers, exact for bounds that are integers (others are refused).
 *
 * Each sign has a range of magnitudes for the integer part, [lo, hi] as digit strings. While the
 * integer part is written, a frame keeps its digit count and how it compares with lo's and hi's first
 * digits (less, equal, greater): with the count that decides the comparison of whole magnitudes, so a
 * digit is allowed only if some magnitude in range still begins with the digits so far. A number's
 * fraction: nonzero where the integer part is lo of a strict lower bound (x > 3: "3.5"), zero where it
 * is hi of an inclusive upper one (x <= 3: "3.0"). Bounded numbers are written without an exponent.
 */
#ifndef JSON_NUMBER_H
#define JSON_NUMBER_H

#include "json_value.h"

#define NUM_MAX_DIGITS 16
#define NUM_MAX_MAGNITUDE 9999999999999999LL /* 16 digits: the most the automaton writes */
#define NUM_HUGE 100000000000000000LL        /* 10^17: a bound past anything written */

/* The magnitudes of one sign (on: the sign is allowed). */
typedef struct {
    uint8_t on, strict_lo, zero_at_hi, lo_len, hi_len;
    uint32_t multiple; /* integers: multipleOf (1: none) */
    char lo[NUM_MAX_DIGITS + 1], hi[NUM_MAX_DIGITS + 1];
} mag_range;

enum { CMP_EQ = 0, CMP_LT = 1, CMP_GT = 2 };
enum { F_FREE = 0, F_ZEROS = 1, F_NONZERO = 2 }; /* what a bounded number's fraction must be */

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
 * number (in [lo, hi], above lo if strict_lo, a multiple); -1 if none. closed: no digit may follow
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
            int64_t at = digits_from(r->lo, k, n) + r->strict_lo;
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

/* The fewest bytes that end the value from there: mag_rest, or (a number above a strict lo) lo's
 * remaining digits and ".1"; -1 if neither. */
static int mag_need(const mag_range *r, int k, int cl, int ch, int closed, int number, uint32_t rem) {
    int best = mag_rest(r, k, cl, ch, closed, rem);
    if (number && r->strict_lo && cl == CMP_EQ && k <= r->lo_len && (!closed || k == r->lo_len)) {
        int via_lo = r->lo_len - k + 2;
        if (best < 0 || via_lo < best) best = via_lo;
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

/* One sign's range: magnitudes [lo, hi] (hi past 16 digits: to the largest written, no more a bound on
 * the fraction); off when empty. */
static void mag_set(mag_range *r, int64_t lo, int strict_lo, int64_t hi, int zero_at_hi) {
    if (hi > NUM_MAX_MAGNITUDE) hi = NUM_MAX_MAGNITUDE, zero_at_hi = 0;
    r->on = lo <= hi && !(lo == hi && strict_lo && zero_at_hi);
    if (!r->on) return;
    r->strict_lo = (uint8_t)strict_lo, r->zero_at_hi = (uint8_t)zero_at_hi;
    r->lo_len = mag_digits(lo, r->lo), r->hi_len = mag_digits(hi, r->hi);
}

#endif
