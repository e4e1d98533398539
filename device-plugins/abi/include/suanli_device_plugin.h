/*
 * suanli_device_plugin.h: the contract between suanli's node agent and a device plugin.
 *
 * A device plugin is a shared library (.so) that a vendor ships and the agent loads at run
 * time. This header is the whole contract: every rule the conformance kit (`suanli plugin
 * check`) enforces and every agent behaviour a plugin depends on is stated here. Nothing else
 * about the agent may be assumed. docs/plugin-abi.md is a guided tour of the same rules.
 *
 * VERSIONING. The ABI has a major and a minor version (below: 1.3). A major change is breaking:
 * the agent refuses a plugin whose major differs from its own and names both versions. A minor
 * change only appends: new function pointers at the END of SuanliDpApi, new fields at the END
 * of an argument struct. Every struct begins with `struct_size` (set by whoever fills the
 * struct to sizeof of the struct it was compiled against), so each side can tell which fields
 * exist:
 *   - the agent reads a function pointer only if api->struct_size covers it;
 *   - a plugin reads an argument field only if args->struct_size covers it.
 * A plugin built against an older minor keeps working with a newer agent, and a newer-minor
 * plugin with an older agent (whose calls simply never use the additions). abi_minor and
 * struct_size must agree: a table claiming minor 2 must be at least the 1.2 size (the kit fails
 * a plugin whose struct_size covers less than its abi_minor claims; the agent then uses only the
 * calls the size covers). History: 1.0 init, fingerprint, reserve, stats, shutdown, errors,
 * buffers; 1.1 health_events; 1.2 release, and ReserveRequest.reservation_id / .shares; 1.3
 * reset, and HealthEvent.event_class (device-error remediation).
 *
 * PAYLOADS. Requests and responses are protocol buffers of package `suanli.v1` (message names
 * below). The schema is suanli's proto/suanli/v1/device.proto (proto3). For C, the file
 * suanli_device.proto next to this header is the same messages in proto2 syntax, which
 * protobuf-c 1.4 (Debian 12, RHEL 9's protobuf-c-compiler) compiles; a test keeps the two
 * wire-identical. Fields are only ever added, never renumbered, so a payload is as versioned as
 * the ABI. Unknown fields must be ignored by both sides; an absent scalar means 0 / empty.
 *
 * OWNERSHIP.
 *   - Every pointer the agent passes IN (config, request) is borrowed for the duration of the
 *     call only; the plugin copies what it wants to keep. request may be NULL when its length
 *     is 0 (an empty message).
 *   - Every buffer the plugin passes OUT (args->response) is allocated by the plugin and
 *     owned by the agent after the call returns; the agent returns it exactly once with
 *     api->buffer_free(data, len). A response of length 0 may have data == NULL. A call that
 *     returns an error leaves response NULL and response_len 0 (the agent ignores them then).
 *     A response longer than 8 MiB (8388608 bytes) is refused as an INTERNAL error.
 *   - A non-NULL SuanliDpError* returned by a call is owned by the agent, which reads it with
 *     error_code/error_message and releases it exactly once with error_destroy. The string
 *     from error_message lives until error_destroy; the agent reads at most 4096 bytes of it.
 *     error_code must be one of the SUANLI_DP_* codes (another value is treated as INTERNAL).
 *   - plugin_name / plugin_version are static strings owned by the plugin: non-empty UTF-8, at
 *     most 64 bytes, no control characters (else the library is refused).
 *   - The SuanliDpApi table returned by the entry point is static and lives as long as the
 *     library stays loaded.
 *
 * THREADS. Calls on one SuanliDpPlugin may arrive from several threads at once (up to 16:
 * stats while a reserve runs); a plugin must be safe for that. `init` and `shutdown` are never
 * concurrent with any other call on the same instance.
 *
 * DEADLINES (the agent's defaults; an operator may change them in the agent's config:
 * plugin_call_timeout_ms, plugin_fingerprint_timeout_ms, 10 ms to 600 s):
 *     entry point, load       5 s   (the plugin host's Hello)
 *     init, fingerprint      30 s
 *     reserve, release,       5 s
 *     stats, health_events
 *     reset                  30 s   (the fingerprint deadline: a GPU reset takes seconds)
 *     shutdown                5 s   (then the host process is killed)
 * A call past its deadline gets the plugin host process killed (SIGKILL) and restarted.
 *
 * HOW THE AGENT RUNS A PLUGIN. Each plugin runs in its own child process (`suanli plugin-host
 * LIB.so`), so a plugin cannot take the agent down, and must not try to:
 *   - A crash, an abort, a hang past a deadline or an exit kills the host; the plugin is DOWN,
 *     all its devices are reported unhealthy (the control plane stops the tasks on them), and
 *     the host is restarted with backoff (200 ms doubling to 30 s) and runs init again with the
 *     same config. The plugin is UP again only when one probe — fingerprint, health_events and
 *     stats — succeeds as a whole.
 *   - Never call exit() or abort() on an error you could return. Never write to stdout: fd 1
 *     is a pipe the host forwards to the agent's log (stderr) and counts; the kit warns.
 *     stderr goes to the agent's log.
 *   - Error codes decide what the agent does:
 *       INTERNAL or UNAVAILABLE from fingerprint or health_events, INTERNAL from stats: the
 *         plugin is down (devices unhealthy) until the next probe succeeds; the host process is
 *         not restarted for it. Other codes from these calls are logged and change nothing.
 *       UNAVAILABLE from stats: that probe has no stats; the devices stay as they are
 *         (transient telemetry trouble does not stop tasks).
 *       UNAVAILABLE from init (a driver that loads late at boot): the agent retries init with
 *         the same backoff, the plugin down and its devices unknown meanwhile. Any other init
 *         error, and any load error, is final until the agent restarts.
 *       An error from reserve fails that task's start (it is placed again); the plugin stays up.
 *       An error from release is logged; the task is gone whatever it says.
 *   - The library file and its directory must be owned by root or the agent's user and not
 *     writable by group or others (mode 0755 / 0644), or the agent refuses to load it.
 *   - Plugin file names and configuration: the agent loads every *.so of its plugin_dir (or
 *     those named in `plugins`); a file libsuanli_plugin_NAME.so is configured under the key
 *     NAME or libsuanli_plugin_NAME (plugin_config.NAME.config_path -> PluginConfig.config_path,
 *     plugin_config.NAME.options -> PluginConfig.options).
 *
 * THE CALLS (request -> response; every rule below is checked by `suanli plugin check`).
 *   init          PluginConfig -> (sets args->plugin). Open the vendor library here, not in
 *                 the entry point.
 *   fingerprint   FingerprintRequest -> Inventory. Every device with its health and topology:
 *                 - id: unique on the node, 1..128 bytes, no whitespace or control characters;
 *                   stable across calls and restarts (it is what the scheduler places on);
 *                 - kind: "gpu" or "npu" (devices of another kind are ignored by the agent);
 *                 - model: 1..128 bytes, the name a job's spec asks for
 *                   (constraints.device_models = ["Ascend910B"]) and the price catalog is
 *                   keyed by: the vendor's marketing model, stable across driver versions;
 *                 - identity (ids, kinds, models, memory, links, partitions) must not change
 *                   between calls unless the hardware did (then the node registers again);
 *                   health may change;
 *                 - links name devices of the same inventory, never the device itself; kind is
 *                   an open vocabulary ("nvlink", "hccs", "xgmi", "pcie", a vendor's own): the
 *                   scheduler treats devices sharing a peer_group as one fast island (gangs
 *                   are packed into islands) and uses links only for display and bandwidth; an
 *                   unknown kind is kept, not refused;
 *                 - partition_of names a device of the same inventory (MIG, vNPU);
 *                 - share_isolation: 0 advisory (a fractional share is only told its size), 1
 *                   enforced (reserve limits each share: MPS, a vNPU); another value fails
 *                   the kit; jobs may require enforced devices for their fractional shares;
 *                 - at most 4096 devices (the agent keeps the first 1024);
 *                 - NUMA node ids unique;
 *                 - topology (optional, ABI 1.2 agents read it): the node's rack, network block
 *                   (leaf switch) and multi-node NVLink domain, each empty (unknown) or 1..253
 *                   bytes of printable ASCII without spaces; the agent turns them into the node
 *                   labels topology.suanli.io/{rack,block,nvlink-domain} (its own config's
 *                   labels win) and the scheduler keeps multi-node gangs in the fewest blocks.
 *                 A device is healthy for the scheduler when the plugin is up, its latest
 *                 fingerprint says healthy, and no health event marked it unhealthy since that
 *                 fingerprint (a later fingerprint replaces what the events said).
 *   reserve       ReserveRequest -> Reservation. What a task given these devices needs: env
 *                 (a gpu or npu reservation sets at least one variable, e.g.
 *                 CUDA_VISIBLE_DEVICES; names non-empty without '=' or NUL), device_files and
 *                 mounts (absolute paths). A request with no device ids gets an empty
 *                 Reservation. An unknown id: NOT_FOUND (or INVALID_ARGUMENT); an unhealthy
 *                 device: FAILED_PRECONDITION. Since 1.2 the agent sends reservation_id
 *                 (unique on the node, the same for every reserve of one task) and one share
 *                 per device (milli: 1000 is the whole device; memory_mib: 0 is no limit). A
 *                 plugin that enforces shares (MPS limits, a vNPU) sets them up here and may
 *                 refuse a share it cannot give with FAILED_PRECONDITION; a reserve repeating a
 *                 held reservation_id must be answered as the first one and hold nothing more:
 *                 the agent repeats every held reservation after the plugin host restarts and
 *                 after an agent restart adopts running tasks. A 1.1 plugin's reserve must be
 *                 stateless (there is no release) and idempotent.
 *   release       (1.2) ReleaseRequest -> ReleaseResponse. The task holding reservation_id has
 *                 ended and its processes are gone (or it never started): undo what reserve set
 *                 up. Called before the task's end is reported, so its devices are free before
 *                 the scheduler can give them to another task. Releasing an id not held (a
 *                 repeat, or one from before a restart) succeeds.
 *   stats         StatsRequest -> StatsResponse. device_ids empty: every device; otherwise only
 *                 those, each at most once. An unknown id: NOT_FOUND (or leave it out; never
 *                 report it). Percentages within 0..100, power and counts not negative.
 *   health_events (1.1) HealthRequest -> HealthEvents. Events since the previous call, each
 *                 naming a device of the inventory; polled about once a second. After an event
 *                 with healthy = false, fingerprint reports the device unhealthy and reserve
 *                 refuses it with FAILED_PRECONDITION until an event or fingerprint says it is
 *                 healthy again. A 1.0 plugin lacks it; health then comes from fingerprint.
 *                 Since 1.3 an event carries event_class, which decides the remedy:
 *                 1 application, sent with healthy = true (the task's own fault: the device
 *                 stays in service, the tasks on it are told), and with healthy = false:
 *                 2 recoverable (the device leaves service, its tasks
 *                 checkpoint and move; once nothing holds it the agent calls reset and returns
 *                 it after a healthy fingerprint), 3 fatal (quarantined until an operator clears
 *                 it). 0 (a 1.2 plugin) keeps the 1.2 meaning: unhealthy until an event or a
 *                 fingerprint says healthy. A device whose resets keep failing is quarantined.
 *   reset         (1.3) ResetRequest -> ResetResponse. Return device_id to a clean state (a GPU
 *                 reset). Called only when no reservation holds the device, after a recoverable
 *                 event; the agent fingerprints right after and takes the device back only if the
 *                 fingerprint says healthy. UNIMPLEMENTED: the plugin cannot reset; the agent
 *                 then waits for the device to report healthy by itself. An unknown id:
 *                 NOT_FOUND.
 *   shutdown      Releases the instance; no call follows.
 *
 * RESOURCES. Across repeated calls the plugin host's resident memory and open descriptors must
 * stay flat: the kit fails 32 MiB of growth (or a descriptor per call), and warns from 8 MiB.
 * Export only the entry point (-fvisibility=hidden): other exported symbols can interpose on the
 * vendor libraries the plugin loads; the kit warns about them.
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
#define SUANLI_DP_ABI_MINOR 3

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

/* The function table a plugin returns from its entry point. Payloads and rules of each call:
 * THE CALLS above. */
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

  /* ---- ABI 1.2 ---- */

  /* request: ReleaseRequest; response: ReleaseResponse (empty). The task that held the
   * reservation `reservation_id` ended, or never started: undo what reserve set up for it (an
   * MPS client limit, a vNPU, a share counted against the device). Called once per reservation
   * that a 1.2 reserve granted, after the task's processes are gone; releasing an id the plugin
   * does not hold (a repeat, or one granted before the plugin host restarted) succeeds. A 1.1
   * plugin lacks it; reserve is then stateless by contract. */
  SuanliDpError *(*release)(SuanliDpCallArgs *args);

  /* ---- ABI 1.3 ---- */

  /* request: ResetRequest; response: ResetResponse (empty). Reset one device after a
   * recoverable error; called only when no reservation holds it, then followed by a fingerprint.
   * UNIMPLEMENTED when the plugin cannot reset. A 1.2 plugin lacks it. */
  SuanliDpError *(*reset)(SuanliDpCallArgs *args);
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
