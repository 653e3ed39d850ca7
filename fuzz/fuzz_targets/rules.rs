#![no_main]
tollgate::fuzz_formats!(Serde);
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzz::rules(data, &Serde));
