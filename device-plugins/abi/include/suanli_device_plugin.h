/*
 * suanli_device_plugin.h: the contract between suanli's node agent and a device plugin.
 *
 * A device plugin is a shared library (.so) that a vendor ships and the agent loads at run
 * time. This header is the whole contract; nothing else about the agent may be assumed.
 *
 * Versioning. The ABI has a major and a minor version. A major change is breaking: the agent
 * refuses a plugin whose major differs from its own and says both versions. A minor change
 * only appends: new function pointers at the END of SuanliDpApi, new fields at the END of an
 * argument struct. Every struct begins with `struct_size` (set by whoever fills the struct to
 * sizeof of the struct it was compiled against), so each side can tell which fields exist:
 *   - the agent reads a function pointer only if api->struct_size covers it;
 *   - a plugin reads an argument field only if args->struct_size covers it.
 * A plugin built against an older minor therefore keeps working with a newer agent, and a
 * newer-minor plugin with an older agent (whose calls simply never use the additions).
 *
 * Payloads. Requests and responses are protocol buffers of package `suanli.v1`, defined in
 * suanli's proto/suanli/v1/device.proto (messages named below). Fields are only ever added
 * there, never renumbered, so a payload is as versioned as the ABI. Unknown fields must be
 * ignored by both sides.
 *
 * Ownership.
 *   - Every pointer the agent passes IN (config, request) is borrowed for the duration of the
 *     call only; the plugin copies what it wants to keep.
 *   - Every buffer the plugin passes OUT (args->response) is allocated by the plugin and
 *     owned by the agent after the call returns; the agent returns it exactly once with
 *     api->buffer_free(data, len). A response of length 0 may have data == NULL. A call that
 *     returns an error leaves response NULL and response_len 0 (the agent ignores them then).
 *   - A non-NULL SuanliDpError* returned by a call is owned by the agent, which reads it with
 *     error_code/error_message and releases it exactly once with error_destroy. The string
 *     from error_message lives until error_destroy.
 *   - plugin_name / plugin_version are static strings owned by the plugin.
 *   - The SuanliDpApi table returned by the entry point is static and lives as long as the
 *     library stays loaded.
 *
 * Threads. Calls on one SuanliDpPlugin may arrive from several threads at once (stats while a
 * reserve runs); a plugin must be safe for that. `init` and `shutdown` are never concurrent
 * with any other call on the same instance.
 *
 * Failure. A call must return within its deadline (the agent's default is 5 s; fingerprint
 * 30 s). The agent runs each plugin in a child `suanli plugin-host` process: a plugin that
 * crashes, hangs past its deadline or aborts is killed and restarted with backoff, and its
 * devices are reported unhealthy meanwhile. A plugin must never call exit() or abort() on
 * an error it could report instead, and must not write to stdout (the host's channel);
 * stderr goes to the agent's log.
 */
#ifndef SUANLI_DEVICE_PLUGIN_H
#define SUANLI_DEVICE_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version this header describes. */
#define SUANLI_DP_ABI_MAJOR 1
#define SUANLI_DP_ABI_MINOR 1

/* The one symbol a plugin exports. */
#define SUANLI_DP_ENTRY_SYMBOL "suanli_device_plugin_entry"

/* Error codes (the values of error_code). 0 is never an error. */
#define SUANLI_DP_INVALID_ARGUMENT 1   /* a request field is malformed or out of range */
#define SUANLI_DP_NOT_FOUND 2          /* a device id the plugin does not know */
#define SUANLI_DP_UNAVAILABLE 3        /* the vendor library or the device is not available now */
#define SUANLI_DP_FAILED_PRECONDITION 4 /* e.g. reserve of an unhealthy device */
#define SUANLI_DP_UNIMPLEMENTED 5      /* the call is not supported by this plugin */
#define SUANLI_DP_INTERNAL 6           /* a bug or an unexpected vendor error */

/* An error. Opaque: created by the plugin, read and destroyed by the agent. */
typedef struct SuanliDpError SuanliDpError;

/* One initialized plugin instance. Opaque: created by init, destroyed by shutdown. */
typedef struct SuanliDpPlugin SuanliDpPlugin;

/* Arguments of init. */
typedef struct SuanliDpInitArgs {
  size_t struct_size;          /* in: sizeof(SuanliDpInitArgs) as the agent knows it */
  const uint8_t *config;       /* in: a PluginConfig payload (borrowed) */
  size_t config_len;           /* in */
  SuanliDpPlugin *plugin;      /* out: the new instance; non-NULL when init returns NULL */
} SuanliDpInitArgs;

/* Arguments of every request/response call (fingerprint, reserve, stats, health_events). */
typedef struct SuanliDpCallArgs {
  size_t struct_size;          /* in: sizeof(SuanliDpCallArgs) as the agent knows it */
  SuanliDpPlugin *plugin;      /* in: the instance from init */
  const uint8_t *request;      /* in: the request payload (borrowed; may be NULL when len 0) */
  size_t request_len;          /* in */
  uint8_t *response;           /* out: the response payload, owned by the agent afterwards */
  size_t response_len;         /* out */
} SuanliDpCallArgs;

/* Arguments of shutdown. */
typedef struct SuanliDpShutdownArgs {
  size_t struct_size;          /* in: sizeof(SuanliDpShutdownArgs) as the agent knows it */
  SuanliDpPlugin *plugin;      /* in: the instance; invalid after the call */
} SuanliDpShutdownArgs;

/* The function table a plugin returns from its entry point. */
typedef struct SuanliDpApi {
  /* These five fields keep their place in every major version, so that an agent can always
   * tell which ABI a plugin implements and name it in a refusal. */
  size_t struct_size;          /* sizeof(SuanliDpApi) as the plugin knows it */
  uint32_t abi_major;          /* the ABI the plugin implements */
  uint32_t abi_minor;
  const char *plugin_name;     /* static, NUL-terminated, e.g. "nvidia" */
  const char *plugin_version;  /* static, NUL-terminated, e.g. "1.4.2" */

  /* ---- ABI 1.0 ---- */

  /* Errors and buffers handed to the agent. */
  void (*error_destroy)(SuanliDpError *error);
  const char *(*error_message)(const SuanliDpError *error);
  int32_t (*error_code)(const SuanliDpError *error);
  void (*buffer_free)(uint8_t *data, size_t len);

  /* config: PluginConfig. Sets args->plugin. */
  SuanliDpError *(*init)(SuanliDpInitArgs *args);
  /* request: FingerprintRequest; response: Inventory (every device, its health and topology). */
  SuanliDpError *(*fingerprint)(SuanliDpCallArgs *args);
  /* request: ReserveRequest; response: Reservation (what to inject into the task). */
  SuanliDpError *(*reserve)(SuanliDpCallArgs *args);
  /* request: StatsRequest; response: StatsResponse. */
  SuanliDpError *(*stats)(SuanliDpCallArgs *args);
  /* Releases the instance. */
  SuanliDpError *(*shutdown)(SuanliDpShutdownArgs *args);

  /* ---- ABI 1.1 ---- */

  /* request: HealthRequest; response: HealthEvents (events since the previous call; XID-like
   * errors, a device turning unhealthy or healthy again). Agents poll it about once a second.
   * A 1.0 plugin lacks it; the agent then derives health from fingerprint. */
  SuanliDpError *(*health_events)(SuanliDpCallArgs *args);
} SuanliDpApi;

/*
 * The entry point. The agent calls it once after loading, with its own ABI version. The
 * plugin returns its function table, or NULL if it cannot serve an agent of that major
 * version (returning the table anyway is better: the agent then compares the versions itself
 * and names both in its refusal). It must not do any work beyond returning the table (no
 * vendor library calls: those belong in init).
 */
typedef const SuanliDpApi *(*SuanliDpEntryFn)(uint32_t host_abi_major, uint32_t host_abi_minor);
const SuanliDpApi *suanli_device_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

#ifdef __cplusplus
}
#endif

#endif /* SUANLI_DEVICE_PLUGIN_H */
