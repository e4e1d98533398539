//! The Ascend DCMI library (`libdcmi.so`), loaded at run time with libloading, and safe wrappers
//! around the few functions the plugin calls.
//!
//! C declarations relied on (from Huawei's `dcmi_interface_api.h`; all return 0 on success and a
//! negative DCMI error code otherwise):
//!
//! ```c
//! int dcmi_init(void);
//! int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len);   // or dcmi_get_card_list
//! int dcmi_get_device_num_in_card(int card_id, int *device_num);
//! int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *chip_info);
//! int dcmi_get_device_health(int card_id, int device_id, unsigned int *health);
//! int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id);
//! // optional:
//! int dcmi_get_device_phyid_from_logicid(unsigned int logicid, unsigned int *phyid);
//! int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info);
//! int dcmi_get_device_memory_info_v3(int card_id, int device_id, struct dcmi_get_memory_info_stru *memory_info);
//! int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type, unsigned int *utilization_rate);
//! int dcmi_get_device_temperature(int card_id, int device_id, int *temperature);
//! int dcmi_get_device_power_info(int card_id, int device_id, int *power);   // unit 0.1 W
//!
//! struct dcmi_chip_info { unsigned char chip_type[32]; unsigned char chip_name[32];
//!                         unsigned char chip_ver[32]; unsigned int aicore_cnt; };
//! struct dcmi_hbm_info { unsigned long long memory_size; /* MB */ unsigned int freq;
//!                        unsigned long long memory_usage; /* MB */ int temp; unsigned int bandwith_util_rate; };
//! struct dcmi_get_memory_info_stru { unsigned long long memory_size; /* MB */
//!     unsigned long long memory_available; unsigned int freq; unsigned long hugepagesize;
//!     unsigned long hugepages_total; unsigned long hugepages_free; unsigned int utiliza;
//!     unsigned char reserve[60]; };
//! ```
//!
//! None of this has run against real Ascend hardware here; the unit tests run it against a
//! stub library compiled from C with the same declarations.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_ulong, c_ulonglong};

use libloading::Library;

/// The most cards enumerated.
pub const MAX_CARDS: usize = 64;
/// The most chips per card.
pub const MAX_CHIPS_PER_CARD: i32 = 16;
/// `dcmi_get_device_utilization_rate` input type for the AI Core.
pub const UTIL_AI_CORE: c_int = 2;

/// `struct dcmi_chip_info`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ChipInfo {
    /// e.g. "Ascend".
    pub chip_type: [u8; 32],
    /// e.g. "910B3".
    pub chip_name: [u8; 32],
    /// e.g. "V1".
    pub chip_ver: [u8; 32],
    /// AI cores.
    pub aicore_cnt: c_uint,
}

/// `struct dcmi_hbm_info`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct HbmInfo {
    /// Total HBM, MB.
    pub memory_size: c_ulonglong,
    /// Frequency, MHz.
    pub freq: c_uint,
    /// HBM in use, MB.
    pub memory_usage: c_ulonglong,
    /// Temperature, °C.
    pub temp: c_int,
    /// Bandwidth utilization, %.
    pub bandwith_util_rate: c_uint,
}

/// `struct dcmi_get_memory_info_stru`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemoryInfoV3 {
    /// Total, MB.
    pub memory_size: c_ulonglong,
    /// Available, MB.
    pub memory_available: c_ulonglong,
    /// Frequency.
    pub freq: c_uint,
    /// Huge page size, KB.
    pub hugepagesize: c_ulong,
    /// Huge pages.
    pub hugepages_total: c_ulong,
    /// Free huge pages.
    pub hugepages_free: c_ulong,
    /// DDR utilization, %.
    pub utiliza: c_uint,
    /// Reserved.
    pub reserve: [u8; 60],
}

type FnInit = unsafe extern "C" fn() -> c_int;
type FnCardList = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type FnDevNum = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type FnChipInfo = unsafe extern "C" fn(c_int, c_int, *mut ChipInfo) -> c_int;
type FnHealth = unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> c_int;
type FnLogicId = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type FnPhyId = unsafe extern "C" fn(c_uint, *mut c_uint) -> c_int;
type FnHbm = unsafe extern "C" fn(c_int, c_int, *mut HbmInfo) -> c_int;
type FnMemV3 = unsafe extern "C" fn(c_int, c_int, *mut MemoryInfoV3) -> c_int;
type FnUtil = unsafe extern "C" fn(c_int, c_int, c_int, *mut c_uint) -> c_int;
type FnInt = unsafe extern "C" fn(c_int, c_int, *mut c_int) -> c_int;

/// Names of the common DCMI error codes.
pub fn error_name(code: c_int) -> &'static str {
    match code {
        -8001 => "invalid parameter",
        -8002 => "operation not permitted",
        -8003 => "memory operation failed",
        -8004 => "secure function failed",
        -8005 => "inner error",
        -8006 => "time out",
        -8007 => "invalid device id",
        -8008 => "device does not exist",
        -8009 => "ioctl failed",
        -8010 => "send message failed",
        -8011 => "receive message failed",
        _ => "unknown error",
    }
}

/// A failed DCMI call: `dcmi_get_device_health(card 0, chip 1) returned -8008 (device does not exist)`.
pub fn call_error(func: &str, args: &str, code: c_int) -> String {
    format!("{func}({args}) returned {code} ({})", error_name(code))
}

/// A loaded DCMI library with its function pointers.
pub struct Dcmi {
    /// Where it was loaded from.
    pub path: String,
    init: FnInit,
    card_list: FnCardList,
    dev_num: FnDevNum,
    chip_info: FnChipInfo,
    health: FnHealth,
    logic_id: FnLogicId,
    phy_id: Option<FnPhyId>,
    hbm: Option<FnHbm>,
    mem_v3: Option<FnMemV3>,
    util: Option<FnUtil>,
    temp: Option<FnInt>,
    power: Option<FnInt>,
    // Declared last: dropped after the function pointers above are gone. Never unloaded while a
    // pointer may still be called, because every call goes through `&self`.
    _lib: Library,
}

/// Copies a function pointer out of the library.
///
/// # Safety
/// `T` must be the symbol's true C type, and the pointer must not be called after `lib` drops.
unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller promises T is the symbol's type; the value is copied out and kept only
    // next to `lib` in `Dcmi`.
    unsafe { lib.get::<T>(name).map(|s| *s).map_err(|e| format!("missing symbol {name}: {}", chain(&e))) }
}

/// An error and its `source()` chain (libloading's Display alone hides dlerror's text).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Dcmi {
    /// Loads `path` and resolves the symbols; it does not call `dcmi_init`.
    pub fn open(path: &str) -> Result<Dcmi, String> {
        // SAFETY: loading a shared library runs its initializers; libdcmi is the vendor's library
        // the operator installed (or named with SUANLI_DCMI_LIB), the same trust as any driver.
        let lib = unsafe { Library::new(path) }.map_err(|e| chain(&e))?;
        // SAFETY (all `sym` calls): the types are the C declarations in this module's docs; the
        // pointers live in the same struct as `lib` and are only called through it.
        unsafe {
            let card_list = match sym::<FnCardList>(&lib, "dcmi_get_card_num_list") {
                Ok(f) => f,
                Err(_) => sym::<FnCardList>(&lib, "dcmi_get_card_list")?,
            };
            Ok(Dcmi {
                path: path.to_string(),
                init: sym(&lib, "dcmi_init")?,
                card_list,
                dev_num: sym(&lib, "dcmi_get_device_num_in_card")?,
                chip_info: sym(&lib, "dcmi_get_device_chip_info")?,
                health: sym(&lib, "dcmi_get_device_health")?,
                logic_id: sym(&lib, "dcmi_get_device_logic_id")?,
                phy_id: sym(&lib, "dcmi_get_device_phyid_from_logicid").ok(),
                hbm: sym(&lib, "dcmi_get_device_hbm_info").ok(),
                mem_v3: sym(&lib, "dcmi_get_device_memory_info_v3").ok(),
                util: sym(&lib, "dcmi_get_device_utilization_rate").ok(),
                temp: sym(&lib, "dcmi_get_device_temperature").ok(),
                power: sym(&lib, "dcmi_get_device_power_info").ok(),
                _lib: lib,
            })
        }
    }

    /// `dcmi_init`.
    pub fn init(&self) -> Result<(), String> {
        // SAFETY: no arguments.
        let rc = unsafe { (self.init)() };
        if rc != 0 { Err(call_error("dcmi_init", "", rc)) } else { Ok(()) }
    }

    /// The card ids.
    pub fn cards(&self) -> Result<Vec<i32>, String> {
        let mut num: c_int = 0;
        let mut list = [0 as c_int; MAX_CARDS];
        // SAFETY: `list` has room for MAX_CARDS ints and its length is passed; `num` is a valid out pointer.
        let rc = unsafe { (self.card_list)(&mut num, list.as_mut_ptr(), MAX_CARDS as c_int) };
        if rc != 0 {
            return Err(call_error("dcmi_get_card_num_list", "", rc));
        }
        let n = usize::try_from(num)
            .ok()
            .filter(|&n| n <= MAX_CARDS)
            .ok_or_else(|| format!("dcmi_get_card_num_list reported {num} cards, expected 0 to {MAX_CARDS}"))?;
        Ok(list[..n].to_vec())
    }

    /// NPU chips on a card.
    pub fn chips(&self, card: i32) -> Result<i32, String> {
        let mut n: c_int = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { (self.dev_num)(card, &mut n) };
        if rc != 0 {
            return Err(call_error("dcmi_get_device_num_in_card", &format!("card {card}"), rc));
        }
        if !(0..=MAX_CHIPS_PER_CARD).contains(&n) {
            return Err(format!(
                "dcmi_get_device_num_in_card(card {card}) reported {n} chips, expected 0 to {MAX_CHIPS_PER_CARD}"
            ));
        }
        Ok(n)
    }

    /// Chip type, name and version.
    pub fn chip_info(&self, card: i32, chip: i32) -> Result<ChipInfo, String> {
        let mut info = ChipInfo { chip_type: [0; 32], chip_name: [0; 32], chip_ver: [0; 32], aicore_cnt: 0 };
        // SAFETY: `info` is a properly sized, writable dcmi_chip_info.
        let rc = unsafe { (self.chip_info)(card, chip, &mut info) };
        if rc != 0 {
            return Err(call_error("dcmi_get_device_chip_info", &format!("card {card}, chip {chip}"), rc));
        }
        Ok(info)
    }

    /// The health value (0 normal, 1 minor, 2 major, 3 critical alarm, 0xFFFFFFFF absent).
    pub fn health(&self, card: i32, chip: i32) -> Result<u32, String> {
        let mut h: c_uint = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { (self.health)(card, chip, &mut h) };
        if rc != 0 {
            return Err(call_error("dcmi_get_device_health", &format!("card {card}, chip {chip}"), rc));
        }
        Ok(h)
    }

    /// The logic id (what ASCEND_RT_VISIBLE_DEVICES takes).
    pub fn logic_id(&self, card: i32, chip: i32) -> Result<u32, String> {
        let mut id: c_int = -1;
        // SAFETY: valid out pointer; note the out argument comes first in this function.
        let rc = unsafe { (self.logic_id)(&mut id, card, chip) };
        if rc != 0 {
            return Err(call_error("dcmi_get_device_logic_id", &format!("card {card}, chip {chip}"), rc));
        }
        u32::try_from(id).map_err(|_| format!("dcmi_get_device_logic_id(card {card}, chip {chip}) gave {id}"))
    }

    /// The physical id (the N of /dev/davinciN), when the library has the function.
    pub fn phy_id(&self, logic: u32) -> Option<Result<u32, String>> {
        let f = self.phy_id?;
        let mut p: c_uint = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { f(logic, &mut p) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_phyid_from_logicid", &format!("logic id {logic}"), rc))
        } else {
            Ok(p)
        })
    }

    /// HBM total and used, MB.
    pub fn hbm(&self, card: i32, chip: i32) -> Option<Result<HbmInfo, String>> {
        let f = self.hbm?;
        let mut h = HbmInfo::default();
        // SAFETY: `h` is a properly sized, writable dcmi_hbm_info.
        let rc = unsafe { f(card, chip, &mut h) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_hbm_info", &format!("card {card}, chip {chip}"), rc))
        } else {
            Ok(h)
        })
    }

    /// Device (DDR) memory, for chips without HBM.
    pub fn memory_v3(&self, card: i32, chip: i32) -> Option<Result<MemoryInfoV3, String>> {
        let f = self.mem_v3?;
        let mut m = MemoryInfoV3 {
            memory_size: 0,
            memory_available: 0,
            freq: 0,
            hugepagesize: 0,
            hugepages_total: 0,
            hugepages_free: 0,
            utiliza: 0,
            reserve: [0; 60],
        };
        // SAFETY: `m` is a properly sized, writable dcmi_get_memory_info_stru.
        let rc = unsafe { f(card, chip, &mut m) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_memory_info_v3", &format!("card {card}, chip {chip}"), rc))
        } else {
            Ok(m)
        })
    }

    /// Utilization of one unit (see [`UTIL_AI_CORE`]), %.
    pub fn utilization(&self, card: i32, chip: i32, kind: c_int) -> Option<Result<u32, String>> {
        let f = self.util?;
        let mut u: c_uint = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { f(card, chip, kind, &mut u) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_utilization_rate", &format!("card {card}, chip {chip}, type {kind}"), rc))
        } else {
            Ok(u)
        })
    }

    /// Temperature, °C.
    pub fn temperature(&self, card: i32, chip: i32) -> Option<Result<i32, String>> {
        let f = self.temp?;
        let mut t: c_int = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { f(card, chip, &mut t) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_temperature", &format!("card {card}, chip {chip}"), rc))
        } else {
            Ok(t)
        })
    }

    /// Power, in units of 0.1 W.
    pub fn power_decawatts(&self, card: i32, chip: i32) -> Option<Result<i32, String>> {
        let f = self.power?;
        let mut p: c_int = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { f(card, chip, &mut p) };
        Some(if rc != 0 {
            Err(call_error("dcmi_get_device_power_info", &format!("card {card}, chip {chip}"), rc))
        } else {
            Ok(p)
        })
    }
}

/// A NUL-terminated (or full) C char array as a string.
pub fn c_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).trim().to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_ascend_dcmi_tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_header() {
        assert_eq!(std::mem::size_of::<ChipInfo>(), 100);
        assert_eq!(std::mem::size_of::<HbmInfo>(), 32);
        assert_eq!(std::mem::offset_of!(HbmInfo, memory_usage), 16);
        // MemoryInfoV3 is checked against the C compiler in the crate's stub-library test.
    }

    #[test]
    fn text_and_errors() {
        let mut b = [0u8; 32];
        b[..6].copy_from_slice(b"Ascend");
        assert_eq!(c_text(&b), "Ascend");
        assert_eq!(c_text(b"910B3"), "910B3");
        assert_eq!(call_error("dcmi_init", "", -8005), "dcmi_init() returned -8005 (inner error)");
        assert_eq!(error_name(-1), "unknown error");
    }
}
