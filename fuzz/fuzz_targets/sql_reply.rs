#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzz::sql_reply(data));
