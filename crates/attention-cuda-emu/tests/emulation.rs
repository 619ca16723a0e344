//! The emulator itself, on its own test kernels (`emu/selftest.cu`): warp shuffles equal their
//! definition for every lane mask, block reductions across warps are exact, the portable f16
//! and fp8 e4m3 decoders (and the tensor-core forms' e4m3 pair conversion) equal the host's
//! for every bit pattern, `__syncthreads_or` agrees in
//! every thread, and a barrier mismatch is reported as a typed error instead of hanging.

use attention::AttentionError;
use attention_cuda::{Device, KernelArg, LaunchConfig};
#[cfg(unix)]
use attention_cuda_emu::Placement;
use attention_cuda_emu::{emu_or_skip, EmuBuffer, EmuDevice};

fn upload(dev: &EmuDevice, v: &[f32]) -> EmuBuffer {
    let mut b = dev.alloc_zeroed(v.len() * 4).unwrap();
    dev.write(&mut b, 0, bytemuck::cast_slice(v)).unwrap();
    b
}

fn download(dev: &EmuDevice, b: &EmuBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    dev.read(b, 0, bytemuck::cast_slice_mut(&mut out)).unwrap();
    out
}

/// Runs a self-test kernel over `blocks` blocks of `threads` with `input` and an output of
/// `out_len` floats, and returns the output.
fn run(
    dev: &EmuDevice,
    kernel: &str,
    (blocks, threads): (usize, usize),
    input: &[f32],
    out_len: usize,
) -> Vec<f32> {
    let x = upload(dev, input);
    let out = dev.alloc_zeroed(out_len * 4).unwrap();
    let cfg = LaunchConfig {
        grid: [blocks as u32, 1, 1],
        block: threads as u32,
    };
    let args = [KernelArg::Buf(&x), KernelArg::Buf(&out)];
    dev.launch_selftest(kernel, cfg, &args).unwrap();
    download(dev, &out, out_len)
}

#[test]
fn warp_shuffles_follow_their_definition() {
    let Some(dev) = emu_or_skip("warp_shuffles_follow_their_definition") else {
        return;
    };
    let (blocks, threads) = (3usize, 96usize);
    let n = blocks * threads;
    let input: Vec<f32> = (0..n).map(|i| (i * 7 % 101) as f32).collect();
    let got = run(&dev, "shfl_xor_table", (blocks, threads), &input, 32 * n);
    for m in 0..32 {
        for i in 0..n {
            assert_eq!(got[m * n + i], input[i ^ m], "mask {m} thread {i}");
        }
    }
}

#[test]
fn kernel_decoders_equal_the_hosts_for_every_bit_pattern() {
    let Some(dev) = emu_or_skip("kernel_decoders_equal_the_hosts_for_every_bit_pattern") else {
        return;
    };
    let got = run(&dev, "decode_tables", (256, 256), &[0.0], 65536 + 256 + 512);
    let check = |dtype: kv_pool::KvDtype, bytes: &[u8], got: &[f32]| {
        let mut want = vec![0f32; got.len()];
        kv_pool::dtype::decode_to_f32(dtype, bytes, 1.0, &mut want);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{dtype} pattern {i:#x}: kernel {g:e}, host {w:e}"
            );
        }
    };
    let f16: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    check(kv_pool::KvDtype::F16, &f16, &got[..65536]);
    let e4m3: Vec<u8> = (0..=u8::MAX).collect();
    check(kv_pool::KvDtype::Fp8E4m3, &e4m3, &got[65536..65792]);
    // The tensor-core forms' pair conversion: bytes b and b ^ 0x5a, each the host's value.
    let pairs: Vec<u8> = (0..=u8::MAX).flat_map(|b| [b, b ^ 0x5a]).collect();
    check(kv_pool::KvDtype::Fp8E4m3, &pairs, &got[65792..]);
}

#[test]
fn block_reductions_are_exact() {
    let Some(dev) = emu_or_skip("block_reductions_are_exact") else {
        return;
    };
    for threads in [32usize, 128, 256, 1024] {
        let blocks = 4;
        let input: Vec<f32> = (0..blocks * threads)
            .map(|i| ((i * 37) % 997) as f32)
            .collect();
        let got = run(&dev, "block_reduce", (blocks, threads), &input, 2 * blocks);
        for b in 0..blocks {
            let row = &input[b * threads..(b + 1) * threads];
            assert_eq!(got[b], row.iter().sum::<f32>(), "sum, {threads} threads");
            assert_eq!(
                got[blocks + b],
                row.iter().copied().fold(f32::MIN, f32::max)
            );
        }
    }
}

/// `__syncthreads_or` (what the attention kernels' in-kernel split merge tells every thread
/// with) is non-zero in every thread exactly when some thread's predicate is: one thread's
/// (the first, the last, one in the middle), none, all; three calls in a row per block.
#[test]
fn syncthreads_or_tells_every_thread_whether_any_predicate_held() {
    let Some(dev) = emu_or_skip("syncthreads_or_tells_every_thread") else {
        return;
    };
    let threads = 96usize;
    let chosen = [0.0f32, 95.0, 40.0, -1.0];
    let got = run(
        &dev,
        "syncthreads_or",
        (chosen.len(), threads),
        &chosen,
        3 * chosen.len(),
    );
    for (b, &c) in chosen.iter().enumerate() {
        let any = if c >= 0.0 { threads as f32 } else { 0.0 };
        assert_eq!(
            &got[3 * b..3 * b + 3],
            &[any, 0.0, threads as f32],
            "block {b}"
        );
    }
}

/// A block's shared memory starts as 0xff bytes (NaN as f32), refilled before every block: a
/// kernel that reads it before writing it sees NaN, not what the previous block left. (ELF
/// targets only: the arrays' linker section is how the runtime finds them.)
#[test]
#[cfg(target_os = "linux")]
fn shared_memory_reads_before_writes_see_nan() {
    let Some(dev) = emu_or_skip("shared_memory_reads_before_writes_see_nan") else {
        return;
    };
    let got = run(&dev, "shared_before_write", (3, 64), &[0.0], 3 * 64);
    assert!(got.iter().all(|v| v.to_bits() == u32::MAX), "{got:?}");
}

/// Device memory is fenced by guard pages: a kernel's store at a buffer's last element lands,
/// and one just past its end (a buffer of 64 floats, so its end is where the guard page
/// begins) kills the process with SIGSEGV instead of writing another buffer. The store past
/// the end runs in a child copy of this test binary.
#[test]
#[cfg(unix)]
fn a_store_past_a_buffers_end_faults() {
    store_outside_faults(
        "a_store_past_a_buffers_end_faults",
        Placement::End,
        63.0,
        64.0,
    );
}

/// With buffers placed against the guard page before them (`Placement::Start`), a store at
/// element 0 lands and one at element −1 faults.
#[test]
#[cfg(unix)]
fn a_store_before_a_buffers_start_faults() {
    store_outside_faults(
        "a_store_before_a_buffers_start_faults",
        Placement::Start,
        0.0,
        -1.0,
    );
}

/// `store_at` into a buffer of 64 floats on a device of `placement`: at `inside`, the value
/// lands; at `outside`, run in a child copy of this test binary, the process dies of a fault.
#[cfg(unix)]
fn store_outside_faults(test: &str, placement: Placement, inside: f32, outside: f32) {
    use std::os::unix::process::ExitStatusExt;
    const CHILD: &str = "KVS_EMU_STORE_OUTSIDE";
    let Some(dev) = emu_or_skip(test) else {
        return;
    };
    let dev = dev.with_placement(placement);
    let in_child = std::env::var(CHILD).is_ok();
    let index = if in_child { outside } else { inside };
    let got = run(&dev, "store_at", (1, 32), &[index], 64);
    if in_child {
        panic!("the store at {outside} did not fault: {got:?}");
    }
    assert_eq!(got[inside as usize], 1.0);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    // SIGSEGV (Linux); macOS may report a guard page's fault as SIGBUS.
    assert!(
        matches!(out.status.signal(), Some(libc::SIGSEGV | libc::SIGBUS)),
        "{:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn mismatched_barriers_are_reported_not_hung() {
    let Some(dev) = emu_or_skip("mismatched_barriers_are_reported_not_hung") else {
        return;
    };
    let out = dev.alloc_zeroed(64 * 4).unwrap();
    let cfg = LaunchConfig {
        grid: [1, 1, 1],
        block: 64,
    };
    match dev.launch_selftest("mismatched_barriers", cfg, &[KernelArg::Buf(&out)]) {
        Err(AttentionError::Device(msg)) => assert!(msg.contains("never complete"), "{msg}"),
        other => panic!("expected a barrier error, got {other:?}"),
    }
    // The device still works afterwards.
    block_reductions_are_exact();
}
