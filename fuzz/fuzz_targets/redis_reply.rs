#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzz::redis_reply(data));
