/work/main/kernels-gpu/target/debug/deps/flash_attn_kernels-b716fab3951c2fe1.d: src/lib.rs src/config.rs src/params.rs

/work/main/kernels-gpu/target/debug/deps/libflash_attn_kernels-b716fab3951c2fe1.rmeta: src/lib.rs src/config.rs src/params.rs

src/lib.rs:
src/config.rs:
src/params.rs:
