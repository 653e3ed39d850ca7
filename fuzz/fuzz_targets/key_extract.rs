#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzz::key_extract(data));
