/*
 * An example suanli device plugin in plain C99, written against suanli_device_plugin.h only.
 *
 * It reports two fake GPUs, "example0" and "example1" (linked to each other), and encodes its
 * protobuf payloads by hand with a tiny varint / length-delimited encoder, to show that nothing
 * beyond the header and device.proto is needed. It keeps no state beyond its instance, so it is
 * safe to call from several threads at once.
 *
 * Build:
 *   cc -shared -fPIC -std=c99 -Wall -Werror -I device-plugins/abi/include \
 *      -o libsuanli_plugin_example.so device-plugins/examples/c/plugin.c
 *   suanli plugin check ./libsuanli_plugin_example.so
 *
 * Compile-time switches:
 *   EXAMPLE_ABI_MAJOR / EXAMPLE_ABI_MINOR  the ABI the table claims (default: the header's).
 *       -DEXAMPLE_ABI_MAJOR=2 builds a plugin for a newer, incompatible major (the agent refuses
 *       it); -DEXAMPLE_ABI_MINOR=0 builds an ABI 1.0 plugin, whose table ends before
 *       health_events (struct_size = offsetof(SuanliDpApi, health_events)).
 *   TEST ONLY, to exercise the agent's isolation; never ship a plugin built with them:
 *   EXAMPLE_CRASH=segv|hang|abort  fingerprint raises SIGSEGV, sleeps forever, or calls abort().
 *   EXAMPLE_CHATTY                 every call writes a line to stdout (which the plugin host
 *                                  must keep off its frame channel).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "suanli_device_plugin.h"

#ifndef EXAMPLE_ABI_MAJOR
#define EXAMPLE_ABI_MAJOR SUANLI_DP_ABI_MAJOR
#endif
#ifndef EXAMPLE_ABI_MINOR
#define EXAMPLE_ABI_MINOR SUANLI_DP_ABI_MINOR
#endif

#if EXAMPLE_ABI_MAJOR == 1 && EXAMPLE_ABI_MINOR == 0
#define EXAMPLE_API_SIZE offsetof(SuanliDpApi, health_events)
#else
#define EXAMPLE_API_SIZE sizeof(SuanliDpApi)
#endif

/* EXAMPLE_CRASH=segv|hang|abort -> EXAMPLE_CRASH_MODE 1|2|3 (0: none). */
#define EXAMPLE_FAULT_segv 1
#define EXAMPLE_FAULT_hang 2
#define EXAMPLE_FAULT_abort 3
#define EXAMPLE_CAT_(a, b) a##b
#define EXAMPLE_CAT(a, b) EXAMPLE_CAT_(a, b)
#ifdef EXAMPLE_CRASH
#define EXAMPLE_CRASH_MODE EXAMPLE_CAT(EXAMPLE_FAULT_, EXAMPLE_CRASH)
#if EXAMPLE_CRASH_MODE < 1 || EXAMPLE_CRASH_MODE > 3
#error "EXAMPLE_CRASH must be segv, hang or abort"
#endif
#else
#define EXAMPLE_CRASH_MODE 0
#endif

#ifdef EXAMPLE_CHATTY
#define CHATTER(call) (printf("example plugin: %s\n", call), fflush(stdout))
#else
#define CHATTER(call) ((void)0)
#endif

#define NUM_DEVICES 2
#define PLUGIN_MAGIC 0x45584d50u /* "EXMP" */

/* ---- errors ---- */

struct SuanliDpError {
  int32_t code;
  char message[256];
};

/* A static error for when malloc fails: error_destroy never frees it. */
static SuanliDpError OUT_OF_MEMORY = {SUANLI_DP_INTERNAL, "example plugin: out of memory"};

static SuanliDpError *make_error(int32_t code, const char *fmt, ...) {
  SuanliDpError *e = malloc(sizeof *e);
  va_list ap;
  if (e == NULL) return &OUT_OF_MEMORY;
  e->code = code;
  va_start(ap, fmt);
  vsnprintf(e->message, sizeof e->message, fmt, ap);
  va_end(ap);
  return e;
}

static void error_destroy(SuanliDpError *e) {
  if (e != NULL && e != &OUT_OF_MEMORY) free(e);
}

static const char *error_message(const SuanliDpError *e) { return e ? e->message : "(null error)"; }

static int32_t error_code(const SuanliDpError *e) { return e ? e->code : SUANLI_DP_INTERNAL; }

static void buffer_free(uint8_t *data, size_t len) {
  (void)len;
  free(data);
}

/* ---- a growable byte buffer and the protobuf encoder ---- */

typedef struct Buf {
  uint8_t *data;
  size_t len;
  size_t cap;
  int failed; /* set when an allocation failed; the buffer is then unusable */
} Buf;

static void buf_put(Buf *b, const void *p, size_t n) {
  if (b->failed || n == 0) return;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 64;
    uint8_t *d;
    while (cap < b->len + n) cap *= 2;
    d = realloc(b->data, cap);
    if (d == NULL) {
      b->failed = 1;
      return;
    }
    b->data = d;
    b->cap = cap;
  }
  memcpy(b->data + b->len, p, n);
  b->len += n;
}

static void put_varint(Buf *b, uint64_t v) {
  uint8_t tmp[10];
  size_t n = 0;
  do {
    uint8_t byte = (uint8_t)(v & 0x7f);
    v >>= 7;
    tmp[n++] = byte | (v ? 0x80 : 0);
  } while (v);
  buf_put(b, tmp, n);
}

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };

static void put_tag(Buf *b, uint32_t field, uint32_t wire) { put_varint(b, ((uint64_t)field << 3) | wire); }

/* proto3: fields equal to their default are not written. */
static void put_uint(Buf *b, uint32_t field, uint64_t v) {
  if (v == 0) return;
  put_tag(b, field, WIRE_VARINT);
  put_varint(b, v);
}

/* An `optional` scalar: written even when 0, so that presence is kept. */
static void put_optional_uint(Buf *b, uint32_t field, uint64_t v) {
  put_tag(b, field, WIRE_VARINT);
  put_varint(b, v);
}

static void put_len(Buf *b, uint32_t field, const void *p, size_t n) {
  put_tag(b, field, WIRE_LEN);
  put_varint(b, n);
  buf_put(b, p, n);
}

static void put_string(Buf *b, uint32_t field, const char *s) {
  if (s == NULL || *s == '\0') return;
  put_len(b, field, s, strlen(s));
}

static void put_double(Buf *b, uint32_t field, double v) {
  uint64_t bits;
  uint8_t le[8];
  int i;
  if (v == 0.0) return;
  memcpy(&bits, &v, sizeof bits);
  for (i = 0; i < 8; i++) le[i] = (uint8_t)(bits >> (8 * i));
  put_tag(b, field, WIRE_FIXED64);
  buf_put(b, le, 8);
}

/* Appends `sub` as a length-delimited field and frees it. */
static void put_message(Buf *b, uint32_t field, Buf *sub) {
  if (sub->failed) b->failed = 1;
  put_len(b, field, sub->data, sub->len);
  free(sub->data);
  sub->data = NULL;
}

/* Hands a finished buffer to the agent (owned by it until buffer_free). */
static SuanliDpError *respond(SuanliDpCallArgs *args, Buf *b) {
  if (b->failed) {
    free(b->data);
    return &OUT_OF_MEMORY;
  }
  args->response = b->data; /* NULL when len == 0, as the header allows */
  args->response_len = b->len;
  return NULL;
}

/* ---- the decoder (only as much as the requests need) ---- */

typedef struct Reader {
  const uint8_t *p;
  size_t len;
  size_t pos;
} Reader;

static int get_varint(Reader *r, uint64_t *out) {
  uint64_t v = 0;
  int shift;
  for (shift = 0; shift < 64; shift += 7) {
    uint8_t byte;
    if (r->pos >= r->len) return -1;
    byte = r->p[r->pos++];
    v |= (uint64_t)(byte & 0x7f) << shift;
    if (!(byte & 0x80)) {
      *out = v;
      return 0;
    }
  }
  return -1;
}

/* Reads one field header; for WIRE_LEN fields also the bytes. 1: a field, 0: end, -1: malformed. */
static int next_field(Reader *r, uint32_t *field, uint32_t *wire, const uint8_t **data, size_t *n) {
  uint64_t key, v;
  if (r->pos == r->len) return 0;
  if (get_varint(r, &key) != 0 || (key >> 3) == 0 || (key >> 3) > 0x1fffffff) return -1;
  *field = (uint32_t)(key >> 3);
  *wire = (uint32_t)(key & 7);
  *data = NULL;
  *n = 0;
  switch (*wire) {
    case WIRE_VARINT:
      return get_varint(r, &v) == 0 ? 1 : -1;
    case WIRE_FIXED64:
      if (r->len - r->pos < 8) return -1;
      r->pos += 8;
      return 1;
    case WIRE_FIXED32:
      if (r->len - r->pos < 4) return -1;
      r->pos += 4;
      return 1;
    case WIRE_LEN:
      if (get_varint(r, &v) != 0 || v > r->len - r->pos) return -1;
      *data = r->p + r->pos;
      *n = (size_t)v;
      r->pos += (size_t)v;
      return 1;
    default:
      return -1;
  }
}

/* ---- the devices ---- */

typedef struct Device {
  const char *id;
  const char *uuid;
  uint32_t index;
  double utilization_pct;
} Device;

static const Device DEVICES[NUM_DEVICES] = {
    {"example0", "EXAMPLE-00000000-0000-0000-0000-000000000000", 0, 12.5},
    {"example1", "EXAMPLE-00000000-0000-0000-0000-000000000001", 1, 37.5},
};

static int find_device(const uint8_t *id, size_t n) {
  int i;
  for (i = 0; i < NUM_DEVICES; i++) {
    if (strlen(DEVICES[i].id) == n && memcmp(DEVICES[i].id, id, n) == 0) return i;
  }
  return -1;
}

/*
 * Reads the repeated `device_ids` (field 1) of a ReserveRequest or StatsRequest into `chosen`
 * (indices into DEVICES, in request order). Returns NULL or an error.
 */
static SuanliDpError *read_device_ids(const SuanliDpCallArgs *args, const char *call, int *chosen, int *count) {
  Reader r;
  uint32_t field, wire;
  const uint8_t *data;
  size_t n;
  int rc;
  *count = 0;
  if (args->request == NULL && args->request_len != 0) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: request is NULL but request_len is %zu", call,
                      args->request_len);
  }
  r.p = args->request;
  r.len = args->request_len;
  r.pos = 0;
  while ((rc = next_field(&r, &field, &wire, &data, &n)) == 1) {
    int i, k;
    if (field != 1) continue; /* unknown or uninteresting fields are ignored */
    if (wire != WIRE_LEN) return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: device_ids has wire type %u", call, wire);
    i = find_device(data, n);
    if (i < 0) {
      return make_error(SUANLI_DP_NOT_FOUND, "%s: unknown device id \"%.*s\" (known: example0, example1)", call,
                        (int)(n > 64 ? 64 : n), (const char *)data);
    }
    for (k = 0; k < *count; k++) {
      if (chosen[k] == i) return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: device id %s given twice", call, DEVICES[i].id);
    }
    chosen[(*count)++] = i;
  }
  if (rc < 0) return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: the request does not decode", call);
  return NULL;
}

/* ---- the instance ---- */

struct SuanliDpPlugin {
  uint32_t magic;
};

static SuanliDpError *check_call(const SuanliDpCallArgs *args, const char *call) {
  if (args == NULL) return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: args is NULL", call);
  if (args->struct_size < sizeof(SuanliDpCallArgs)) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: args struct_size %zu is smaller than %zu", call,
                      args->struct_size, sizeof(SuanliDpCallArgs));
  }
  if (args->plugin == NULL || args->plugin->magic != PLUGIN_MAGIC) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "%s: args->plugin is not an instance from init", call);
  }
  return NULL;
}

static SuanliDpError *init(SuanliDpInitArgs *args) {
  Reader r;
  uint32_t field, wire;
  const uint8_t *data;
  size_t n;
  int rc;
  SuanliDpPlugin *p;
  CHATTER("init");
  if (args == NULL || args->struct_size < sizeof(SuanliDpInitArgs)) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "init: args is NULL or its struct_size is too small");
  }
  if (args->config == NULL && args->config_len != 0) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "init: config is NULL but config_len is %zu", args->config_len);
  }
  /* The example has nothing to configure; it only checks that the PluginConfig is well-formed. */
  r.p = args->config;
  r.len = args->config_len;
  r.pos = 0;
  while ((rc = next_field(&r, &field, &wire, &data, &n)) == 1) {
  }
  if (rc < 0) return make_error(SUANLI_DP_INVALID_ARGUMENT, "init: the PluginConfig does not decode");
  p = malloc(sizeof *p);
  if (p == NULL) return &OUT_OF_MEMORY;
  p->magic = PLUGIN_MAGIC;
  args->plugin = p;
  return NULL;
}

static void encode_device(Buf *out, const Device *d, const Device *peer) {
  Buf dev = {0}, link = {0};
  put_string(&dev, 1, d->id);
  put_string(&dev, 2, "gpu");
  put_string(&dev, 3, "example");
  put_string(&dev, 4, "ExampleGPU-16G");
  put_uint(&dev, 5, 16384);          /* memory_mib */
  put_uint(&dev, 6, 1);              /* healthy */
  put_uint(&dev, 8, 0);              /* numa_node */
  put_string(&link, 1, peer->id);    /* PeerLink.peer */
  put_string(&link, 2, "nvlink");    /* PeerLink.kind */
  put_uint(&link, 3, 300000);        /* PeerLink.bandwidth_mbps */
  put_message(&dev, 9, &link);       /* links */
  put_string(&dev, 11, d->uuid);
  put_uint(&dev, 12, d->index);
  put_optional_uint(&dev, 13, 0);    /* peer_group: both devices are one island */
  put_message(out, 6, &dev);         /* Inventory.devices */
}

static SuanliDpError *fingerprint(SuanliDpCallArgs *args) {
  Buf inv = {0};
  Buf numa = {0};
  SuanliDpError *err = check_call(args, "fingerprint");
  if (err) return err;
  CHATTER("fingerprint");
#if EXAMPLE_CRASH_MODE == 1
  {
    /* A real invalid write, not raise(SIGSEGV): a host process may have a SIGSEGV handler (Rust's
     * stack-overflow detector) that returns from a raised signal; a faulting write re-faults. The
     * address comes through a volatile so that the compiler cannot see (or warn about) it. */
    volatile uintptr_t addr = 16;
    *(volatile int *)addr = 1;
  }
#elif EXAMPLE_CRASH_MODE == 2
  for (;;) {
    struct timespec ts = {3600, 0};
    nanosleep(&ts, NULL);
  }
#elif EXAMPLE_CRASH_MODE == 3
  abort();
#endif
  put_string(&inv, 1, "example");
  put_uint(&inv, 2, 1); /* fake: these GPUs do not exist */
  put_string(&inv, 3, "two example GPUs from the C example plugin");
  encode_device(&inv, &DEVICES[0], &DEVICES[1]);
  encode_device(&inv, &DEVICES[1], &DEVICES[0]);
  put_optional_uint(&numa, 1, 0); /* NumaNode.id 0 (proto3 would skip it; writing it is also valid) */
  put_message(&inv, 7, &numa);
  put_string(&inv, 10, "example-1.0");
  return respond(args, &inv);
}

static SuanliDpError *reserve(SuanliDpCallArgs *args) {
  int chosen[NUM_DEVICES], count = 0, k;
  char visible[64] = "";
  Buf out = {0}, entry = {0};
  SuanliDpError *err = check_call(args, "reserve");
  if (err) return err;
  CHATTER("reserve");
  err = read_device_ids(args, "reserve", chosen, &count);
  if (err) return err;
  if (count == 0) return make_error(SUANLI_DP_INVALID_ARGUMENT, "reserve: device_ids is empty");
  for (k = 0; k < count; k++) {
    char idx[16];
    snprintf(idx, sizeof idx, k ? ",%u" : "%u", (unsigned)DEVICES[chosen[k]].index);
    strncat(visible, idx, sizeof visible - strlen(visible) - 1);
  }
  /* Reservation.env is a map<string, string>: entries of {key = 1, value = 2}. */
  put_string(&entry, 1, "EXAMPLE_VISIBLE_DEVICES");
  put_string(&entry, 2, visible);
  put_message(&out, 1, &entry);
  return respond(args, &out);
}

static SuanliDpError *stats(SuanliDpCallArgs *args) {
  int chosen[NUM_DEVICES], count = 0, k;
  Buf out = {0};
  SuanliDpError *err = check_call(args, "stats");
  if (err) return err;
  CHATTER("stats");
  err = read_device_ids(args, "stats", chosen, &count);
  if (err) return err;
  if (count == 0) { /* empty: all devices */
    for (k = 0; k < NUM_DEVICES; k++) chosen[k] = k;
    count = NUM_DEVICES;
  }
  for (k = 0; k < count; k++) {
    const Device *d = &DEVICES[chosen[k]];
    Buf s = {0};
    put_string(&s, 1, d->id);
    put_double(&s, 2, d->utilization_pct);
    put_uint(&s, 3, 2048);   /* memory_used_mib */
    put_double(&s, 4, 75.0); /* power_w */
    put_double(&s, 5, 41.0); /* temperature_c */
    put_message(&out, 1, &s);
  }
  return respond(args, &out);
}

#if EXAMPLE_ABI_MINOR >= 1
static SuanliDpError *health_events(SuanliDpCallArgs *args) {
  Buf out = {0}; /* no events: an empty HealthEvents is zero bytes */
  SuanliDpError *err = check_call(args, "health_events");
  if (err) return err;
  CHATTER("health_events");
  return respond(args, &out);
}
#endif

static SuanliDpError *shutdown(SuanliDpShutdownArgs *args) {
  CHATTER("shutdown");
  if (args == NULL || args->struct_size < sizeof(SuanliDpShutdownArgs)) {
    return make_error(SUANLI_DP_INVALID_ARGUMENT, "shutdown: args is NULL or its struct_size is too small");
  }
  if (args->plugin != NULL) {
    args->plugin->magic = 0;
    free(args->plugin);
    args->plugin = NULL;
  }
  return NULL;
}

static const SuanliDpApi API = {
    EXAMPLE_API_SIZE,
    EXAMPLE_ABI_MAJOR,
    EXAMPLE_ABI_MINOR,
    "example",
    "0.1.0",
    error_destroy,
    error_message,
    error_code,
    buffer_free,
    init,
    fingerprint,
    reserve,
    stats,
    shutdown,
#if EXAMPLE_ABI_MINOR >= 1
    health_events,
#else
    NULL,
#endif
};

const SuanliDpApi *suanli_device_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
  /* The table is returned whatever the agent's version: the agent compares the versions and, on
   * a mismatch, refuses the plugin with a message that names both. */
  (void)host_abi_major;
  (void)host_abi_minor;
  return &API;
}
