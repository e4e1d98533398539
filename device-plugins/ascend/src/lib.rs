//! suanli's Ascend plugin: Huawei Ascend NPUs through the DCMI library (`libdcmi.so`), loaded at
//! run time, so this library builds and loads on machines without the Ascend driver.
//!
//! ```text
//!  init ──▶ find libdcmi.so (option dcmi_lib, $SUANLI_DCMI_LIB, the driver's paths, then the
//!           loader's search path) ──▶ dcmi_init
//!           └─ none loads / init fails ─▶ "absent": zero devices, message naming what was tried
//!  fingerprint ─▶ cards ▶ chips ▶ chip info (model), HBM, health, logic id
//!  stats ───────▶ AI Core utilization, HBM used, power, temperature
//!  reserve ─────▶ ASCEND_RT_VISIBLE_DEVICES=<logic ids>, /dev/davinci<phy id>, /dev/davinci_manager,
//!                 /dev/devmm_svm, /dev/hisi_hdc
//!  health_events ▶ health changes since the previous call
//! ```
//!
//! Device ids are `npu<logic id>`. Every DCMI call is serialized behind one lock (the library's
//! thread safety is not documented). See [`dcmi`] for the C declarations relied on; they have
//! not been exercised on real Ascend hardware here, only against a stub library compiled from C.

pub mod dcmi;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use suanli_device_abi::{Code, DevicePlugin, PluginError, pb};

use dcmi::Dcmi;

/// The driver's install locations, tried after the option and the environment variable.
pub const DEFAULT_PATHS: [&str; 3] =
    ["/usr/local/Ascend/driver/lib64/driver/libdcmi.so", "/usr/local/dcmi/libdcmi.so", "libdcmi.so"];

const MIB_PER_MB: u64 = 1; // DCMI's "MB" are MiB in practice (64 GB HBM reads 65536).

/// The library candidates, in order: the plugin option, `$SUANLI_DCMI_LIB`, then [`DEFAULT_PATHS`].
pub fn search_paths(option: Option<&str>, env: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for p in option.into_iter().chain(env).filter(|p| !p.is_empty()) {
        v.push(p.to_string());
    }
    v.extend(DEFAULT_PATHS.iter().map(|p| p.to_string()));
    v
}

/// What a DCMI health value means: (healthy, reason).
pub fn health_meaning(h: u32) -> (bool, String) {
    match h {
        0 => (true, String::new()),
        1 => (true, "minor alarm (DCMI health 1)".into()),
        2 => (false, "major alarm (DCMI health 2)".into()),
        3 => (false, "critical alarm (DCMI health 3)".into()),
        0xFFFF_FFFF => (false, "device does not exist (DCMI health 0xFFFFFFFF)".into()),
        v => (false, format!("unknown DCMI health value {v}")),
    }
}

/// The model name from the chip info: `Ascend` + `910B3` → `Ascend910B3`.
pub fn model_name(chip_type: &str, chip_name: &str) -> String {
    if chip_name.starts_with(chip_type) { chip_name.to_string() } else { format!("{chip_type}{chip_name}") }
}

/// One NPU chip as enumerated.
#[derive(Debug, Clone)]
struct Chip {
    id: String,
    card: i32,
    chip: i32,
    logic: Option<u32>,
    phy: Option<u32>,
    model: String,
    memory_mib: u64,
    healthy: bool,
    reason: String,
}

/// The Ascend plugin instance.
pub struct AscendPlugin {
    backend: Backend,
}

enum Backend {
    Absent { message: String },
    Live { dcmi: Mutex<Dcmi>, last_health: Mutex<BTreeMap<String, (bool, String)>> },
}

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>, PluginError> {
    m.lock().map_err(|_| PluginError::internal("ascend plugin lock poisoned"))
}

fn enumerate(d: &Dcmi) -> Result<Vec<Chip>, PluginError> {
    let mut out = Vec::new();
    for card in d.cards().map_err(PluginError::unavailable)? {
        let n = match d.chips(card) {
            Ok(n) => n,
            Err(e) => {
                out.push(Chip {
                    id: format!("npu-card{card}"),
                    card,
                    chip: -1,
                    logic: None,
                    phy: None,
                    model: "unknown".into(),
                    memory_mib: 0,
                    healthy: false,
                    reason: e,
                });
                continue;
            }
        };
        for chip in 0..n {
            let mut problems = Vec::new();
            let logic = d.logic_id(card, chip).map_err(|e| problems.push(e)).ok();
            let phy = logic.and_then(|l| d.phy_id(l)).and_then(Result::ok).or(logic);
            let model = match d.chip_info(card, chip) {
                Ok(ci) => model_name(&dcmi::c_text(&ci.chip_type), &dcmi::c_text(&ci.chip_name)),
                Err(e) => {
                    problems.push(e);
                    "unknown".into()
                }
            };
            let memory_mib = match d.hbm(card, chip) {
                Some(Ok(h)) if h.memory_size > 0 => h.memory_size * MIB_PER_MB,
                _ => match d.memory_v3(card, chip) {
                    Some(Ok(m)) => m.memory_size * MIB_PER_MB,
                    _ => 0,
                },
            };
            let (mut healthy, mut reason) = match d.health(card, chip) {
                Ok(h) => health_meaning(h),
                Err(e) => (false, e),
            };
            if !problems.is_empty() {
                healthy = false;
                if !reason.is_empty() {
                    problems.insert(0, reason);
                }
                reason = problems.join("; ");
            }
            let id = match logic {
                Some(l) => format!("npu{l}"),
                None => format!("npu-card{card}-chip{chip}"),
            };
            out.push(Chip { id, card, chip, logic, phy, model, memory_mib, healthy, reason });
        }
    }
    Ok(out)
}

fn find<'a>(chips: &'a [Chip], id: &str) -> Result<&'a Chip, PluginError> {
    chips
        .iter()
        .find(|c| c.id == id)
        .ok_or_else(|| PluginError::not_found(format!("device {id:?} is not an NPU on this node")))
}

impl AscendPlugin {
    /// Whether a DCMI library was loaded and initialized.
    pub fn dcmi_loaded(&self) -> bool {
        matches!(self.backend, Backend::Live { .. })
    }

    /// Loads the first library of `paths` that opens and initializes.
    pub fn load(paths: &[String]) -> AscendPlugin {
        let mut tried = Vec::new();
        for p in paths {
            match Dcmi::open(p).and_then(|d| d.init().map(|()| d)) {
                Ok(d) => {
                    return AscendPlugin {
                        backend: Backend::Live { dcmi: Mutex::new(d), last_health: Mutex::new(BTreeMap::new()) },
                    };
                }
                Err(e) => tried.push(format!("{p}: {e}")),
            }
        }
        let message = format!("Ascend DCMI library not available: tried {}", tried.join("; "));
        eprintln!("suanli ascend plugin: {message}");
        AscendPlugin { backend: Backend::Absent { message } }
    }

    fn absent_not_found(message: &str, ids: &[String]) -> Result<(), PluginError> {
        match ids.first() {
            None => Ok(()),
            Some(id) => Err(PluginError::not_found(format!("device {id:?}: no Ascend devices ({message})"))),
        }
    }
}

impl DevicePlugin for AscendPlugin {
    const NAME: &'static str = "ascend";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");

    fn init(config: pb::PluginConfig) -> Result<Self, PluginError> {
        let env = std::env::var("SUANLI_DCMI_LIB").ok();
        Ok(Self::load(&search_paths(config.options.get("dcmi_lib").map(String::as_str), env.as_deref())))
    }

    fn fingerprint(&self) -> Result<pb::Inventory, PluginError> {
        let (dcmi, _) = match &self.backend {
            Backend::Absent { message } => {
                return Ok(pb::Inventory { vendor: "ascend".into(), message: message.clone(), ..Default::default() });
            }
            Backend::Live { dcmi, last_health } => (dcmi, last_health),
        };
        let d = lock(dcmi)?;
        let chips = enumerate(&d)?;
        let devices = chips
            .iter()
            .map(|c| pb::PluginDevice {
                id: c.id.clone(),
                kind: "npu".into(),
                vendor: "huawei".into(),
                model: c.model.clone(),
                memory_mib: c.memory_mib,
                healthy: c.healthy,
                health_reason: c.reason.clone(),
                index: c.logic.unwrap_or(0),
                ..Default::default()
            })
            .collect::<Vec<_>>();
        Ok(pb::Inventory {
            vendor: "ascend".into(),
            message: format!("{} Ascend NPU(s) through DCMI ({})", devices.len(), d.path),
            devices,
            ..Default::default()
        })
    }

    fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, PluginError> {
        let dcmi = match &self.backend {
            Backend::Absent { message } => {
                Self::absent_not_found(message, &req.device_ids)?;
                return Ok(pb::Reservation::default());
            }
            Backend::Live { dcmi, .. } => dcmi,
        };
        let mut res = pb::Reservation::default();
        if req.device_ids.is_empty() {
            return Ok(res);
        }
        let chips = enumerate(&*lock(dcmi)?)?;
        let mut logic = Vec::new();
        let mut phys = BTreeSet::new();
        for id in &req.device_ids {
            let c = find(&chips, id)?;
            if !c.healthy {
                return Err(PluginError::new(
                    Code::FailedPrecondition,
                    format!("device {id:?} is unhealthy: {}", c.reason),
                ));
            }
            let (Some(l), Some(p)) = (c.logic, c.phy) else {
                return Err(PluginError::unavailable(format!("device {id:?}: no logic id ({})", c.reason)));
            };
            logic.push(l.to_string());
            phys.insert(p);
        }
        res.env.insert("ASCEND_RT_VISIBLE_DEVICES".into(), logic.join(","));
        let file = |p: String| pb::DeviceFile { host_path: p.clone(), container_path: p, permissions: "rw".into() };
        for p in phys {
            res.device_files.push(file(format!("/dev/davinci{p}")));
        }
        for f in ["/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"] {
            res.device_files.push(file(f.into()));
        }
        Ok(res)
    }

    fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, PluginError> {
        let dcmi = match &self.backend {
            Backend::Absent { message } => {
                Self::absent_not_found(message, &req.device_ids)?;
                return Ok(pb::StatsResponse::default());
            }
            Backend::Live { dcmi, .. } => dcmi,
        };
        let d = lock(dcmi)?;
        let chips = enumerate(&d)?;
        let wanted: Vec<&Chip> = if req.device_ids.is_empty() {
            chips.iter().filter(|c| c.chip >= 0).collect()
        } else {
            req.device_ids.iter().map(|id| find(&chips, id)).collect::<Result<_, _>>()?
        };
        let devices = wanted
            .into_iter()
            .map(|c| {
                let hbm = d.hbm(c.card, c.chip).and_then(Result::ok);
                pb::DeviceStats {
                    id: c.id.clone(),
                    utilization_pct: d
                        .utilization(c.card, c.chip, dcmi::UTIL_AI_CORE)
                        .and_then(Result::ok)
                        .map_or(0.0, f64::from),
                    memory_used_mib: hbm.map_or(0, |h| h.memory_usage * MIB_PER_MB),
                    power_w: d
                        .power_decawatts(c.card, c.chip)
                        .and_then(Result::ok)
                        .map_or(0.0, |p| f64::from(p) / 10.0),
                    temperature_c: d.temperature(c.card, c.chip).and_then(Result::ok).map_or(0.0, f64::from),
                    ecc_errors: 0,
                    xid_errors: 0,
                }
            })
            .collect();
        Ok(pb::StatsResponse { devices, cpu_utilization_pct: 0.0 })
    }

    fn health_events(&self) -> Result<pb::HealthEvents, PluginError> {
        let (dcmi, last) = match &self.backend {
            Backend::Absent { .. } => return Ok(pb::HealthEvents::default()),
            Backend::Live { dcmi, last_health } => (dcmi, last_health),
        };
        let chips = enumerate(&*lock(dcmi)?)?;
        let mut last = lock(last)?;
        let mut events = Vec::new();
        for c in &chips {
            let now = (c.healthy, c.reason.clone());
            // The first call reports only devices that are not healthy.
            let before = last.get(&c.id).cloned().unwrap_or((true, String::new()));
            if before.0 != now.0 {
                events.push(pb::HealthEvent {
                    device: c.id.clone(),
                    healthy: c.healthy,
                    reason: if c.healthy { "healthy again".into() } else { c.reason.clone() },
                    code: 0,
                    // DCMI's health state has no remediation class: the 1.2 meaning (unhealthy
                    // while DCMI says so), no reset.
                    event_class: 0,
                });
            }
            last.insert(c.id.clone(), now);
        }
        Ok(pb::HealthEvents { events })
    }
}

suanli_device_abi::export_plugin!(AscendPlugin);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_ascend_tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn helpers() {
        let p = search_paths(Some("/opt/x.so"), Some("/env.so"));
        assert_eq!(p[..2], ["/opt/x.so".to_string(), "/env.so".to_string()]);
        assert_eq!(p.len(), 5);
        assert_eq!(search_paths(None, Some("")).len(), 3);
        assert_eq!(health_meaning(0), (true, String::new()));
        assert!(health_meaning(1).0);
        assert!(!health_meaning(2).0);
        assert!(health_meaning(0xFFFF_FFFF).1.contains("does not exist"));
        assert_eq!(model_name("Ascend", "910B3"), "Ascend910B3");
        assert_eq!(model_name("Ascend", "Ascend310P"), "Ascend310P");
    }

    #[test]
    fn without_dcmi_zero_devices_and_a_clear_message() {
        let p = AscendPlugin::load(&search_paths(Some("/nonexistent/libdcmi.so"), None));
        assert!(!p.dcmi_loaded());
        let inv = p.fingerprint().unwrap();
        assert_eq!(inv.vendor, "ascend");
        assert!(inv.devices.is_empty());
        let m = &inv.message;
        assert!(m.starts_with("Ascend DCMI library not available: tried /nonexistent/libdcmi.so: "), "{m}");
        assert!(m.contains("No such file or directory"), "{m}");
        assert!(m.contains("/usr/local/Ascend/driver/lib64/driver/libdcmi.so"), "{m}");
        assert!(p.stats(pb::StatsRequest::default()).unwrap().devices.is_empty());
        assert!(p.health_events().unwrap().events.is_empty());
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["npu0".into()], alloc_id: 1, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::NotFound);
    }

    /// A stub libdcmi.so: card 3 holds chips 0 and 1 (logic ids 0, 1; physical 4, 5), card 7
    /// holds one chip (logic 2, physical 6) whose health is read from the file HEALTH_FILE (a
    /// placeholder replaced by a path when the stub is built).
    const STUB: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include <string.h>
struct dcmi_chip_info { unsigned char chip_type[32]; unsigned char chip_name[32]; unsigned char chip_ver[32]; unsigned int aicore_cnt; };
struct dcmi_hbm_info { unsigned long long memory_size; unsigned int freq; unsigned long long memory_usage; int temp; unsigned int bandwith_util_rate; };
struct dcmi_get_memory_info_stru { unsigned long long memory_size; unsigned long long memory_available; unsigned int freq;
  unsigned long hugepagesize; unsigned long hugepages_total; unsigned long hugepages_free; unsigned int utiliza; unsigned char reserve[60]; };
size_t stub_sizes(int which) { return which == 0 ? sizeof(struct dcmi_chip_info) : which == 1 ? sizeof(struct dcmi_hbm_info) : sizeof(struct dcmi_get_memory_info_stru); }
static int logic(int card, int dev) { return card == 3 ? dev : card == 7 ? 2 : -1; }
int dcmi_init(void) { return 0; }
int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len) { if (list_len < 2) return -8001; *card_num = 2; card_list[0] = 3; card_list[1] = 7; return 0; }
int dcmi_get_device_num_in_card(int card, int *n) { if (card == 3) { *n = 2; return 0; } if (card == 7) { *n = 1; return 0; } return -8007; }
int dcmi_get_device_chip_info(int card, int dev, struct dcmi_chip_info *ci) {
  if (logic(card, dev) < 0) return -8007; memset(ci, 0, sizeof *ci); strcpy((char *)ci->chip_type, "Ascend"); strcpy((char *)ci->chip_name, "910B3"); strcpy((char *)ci->chip_ver, "V1"); ci->aicore_cnt = 20; return 0; }
int dcmi_get_device_health(int card, int dev, unsigned int *h) {
  if (logic(card, dev) < 0) return -8007; *h = 0;
  if (card == 7) { FILE *fp = fopen("HEALTH_FILE", "r"); if (fp) { if (fscanf(fp, "%u", h) != 1) *h = 0; fclose(fp); } }
  return 0; }
int dcmi_get_device_logic_id(int *id, int card, int dev) { int l = logic(card, dev); if (l < 0) return -8007; *id = l; return 0; }
int dcmi_get_device_phyid_from_logicid(unsigned int l, unsigned int *p) { if (l > 2) return -8007; *p = l + 4; return 0; }
int dcmi_get_device_hbm_info(int card, int dev, struct dcmi_hbm_info *h) { if (logic(card, dev) < 0) return -8007; memset(h, 0, sizeof *h); h->memory_size = 65536; h->memory_usage = 1000 + logic(card, dev); h->temp = 40; return 0; }
int dcmi_get_device_utilization_rate(int card, int dev, int type, unsigned int *u) { if (type != 2) return -8001; *u = 10 * (logic(card, dev) + 1); return 0; }
int dcmi_get_device_temperature(int card, int dev, int *t) { *t = 50 + logic(card, dev); return 0; }
int dcmi_get_device_power_info(int card, int dev, int *p) { *p = 2505; return 0; }
"#;

    struct Stub {
        dir: PathBuf,
        lib: PathBuf,
    }

    impl Drop for Stub {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn build_stub(source: &str) -> Stub {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "suanli-dcmi-stub-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let c = dir.join("dcmi_stub.c");
        std::fs::write(&c, source.replace("HEALTH_FILE", &dir.join("health7").display().to_string())).unwrap();
        let lib = dir.join("libdcmi.so");
        let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(&lib)
            .arg(&c)
            .output()
            .expect("a C compiler (cc) is needed to build the stub DCMI library");
        assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
        Stub { dir, lib }
    }

    fn plugin_with(lib: &Path) -> AscendPlugin {
        let mut cfg = pb::PluginConfig::default();
        cfg.options.insert("dcmi_lib".into(), lib.display().to_string());
        AscendPlugin::init(cfg).unwrap()
    }

    #[allow(unsafe_code)]
    #[test]
    fn struct_layouts_agree_with_the_c_compiler() {
        let stub = build_stub(STUB);
        // SAFETY: the stub is the library just compiled above, and stub_sizes has this signature.
        unsafe {
            let lib = libloading::Library::new(&stub.lib).unwrap();
            let f: libloading::Symbol<'_, unsafe extern "C" fn(i32) -> usize> = lib.get(b"stub_sizes\0").unwrap();
            assert_eq!(f(0), std::mem::size_of::<dcmi::ChipInfo>());
            assert_eq!(f(1), std::mem::size_of::<dcmi::HbmInfo>());
            assert_eq!(f(2), std::mem::size_of::<dcmi::MemoryInfoV3>());
        }
    }

    #[test]
    fn with_a_stub_dcmi_library() {
        let stub = build_stub(STUB);
        let health = stub.dir.join("health7");
        std::fs::write(&health, "0").unwrap();
        let p = plugin_with(&stub.lib);
        assert!(p.dcmi_loaded());
        let inv = p.fingerprint().unwrap();
        let ids: Vec<_> = inv.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["npu0", "npu1", "npu2"]);
        assert!(inv.devices.iter().all(|d| d.model == "Ascend910B3" && d.memory_mib == 65536 && d.kind == "npu"));
        assert!(inv.devices.iter().all(|d| d.healthy), "{inv:?}");
        assert_eq!(inv.devices[2].index, 2);
        assert!(inv.message.contains("3 Ascend NPU(s)"), "{}", inv.message);

        let r = p
            .reserve(pb::ReserveRequest {
                device_ids: vec!["npu2".into(), "npu0".into()],
                alloc_id: 1,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.env["ASCEND_RT_VISIBLE_DEVICES"], "2,0");
        let files: Vec<_> = r.device_files.iter().map(|f| f.host_path.as_str()).collect();
        assert_eq!(
            files,
            ["/dev/davinci4", "/dev/davinci6", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
        );

        let s = p.stats(pb::StatsRequest { device_ids: vec!["npu1".into()] }).unwrap();
        let d = &s.devices[0];
        assert_eq!((d.utilization_pct, d.memory_used_mib, d.power_w, d.temperature_c), (20.0, 1001, 250.5, 51.0));
        assert_eq!(p.stats(pb::StatsRequest::default()).unwrap().devices.len(), 3);
        let e = p.stats(pb::StatsRequest { device_ids: vec!["npu9".into()] }).unwrap_err();
        assert_eq!(e.code, Code::NotFound);

        // Card 7 turns critical: fingerprint, reserve and health_events all see it.
        assert!(p.health_events().unwrap().events.is_empty());
        std::fs::write(&health, "3").unwrap();
        let inv = p.fingerprint().unwrap();
        assert!(!inv.devices[2].healthy);
        assert!(inv.devices[2].health_reason.contains("critical alarm"), "{}", inv.devices[2].health_reason);
        let e = p
            .reserve(pb::ReserveRequest { device_ids: vec!["npu2".into()], alloc_id: 2, ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code, Code::FailedPrecondition);
        let ev = p.health_events().unwrap().events;
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].device.as_str(), ev[0].healthy), ("npu2", false));
        std::fs::write(&health, "0").unwrap();
        let ev = p.health_events().unwrap().events;
        assert_eq!((ev.len(), ev[0].healthy), (1, true));
    }

    #[test]
    fn a_library_missing_a_required_function_is_refused_clearly() {
        let src = STUB.replace("int dcmi_get_device_health(", "int renamed_health(");
        let stub = build_stub(&src);
        let p = plugin_with(&stub.lib);
        assert!(!p.dcmi_loaded());
        let m = p.fingerprint().unwrap().message;
        assert!(m.contains("missing symbol dcmi_get_device_health"), "{m}");
    }

    #[test]
    fn a_failing_dcmi_init_is_reported() {
        let src = STUB.replace("int dcmi_init(void) { return 0; }", "int dcmi_init(void) { return -8005; }");
        let stub = build_stub(&src);
        let m = plugin_with(&stub.lib).fingerprint().unwrap().message;
        assert!(m.contains("dcmi_init() returned -8005 (inner error)"), "{m}");
    }
}
