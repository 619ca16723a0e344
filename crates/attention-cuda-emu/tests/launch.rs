//! The emulated device refuses launches it cannot run with typed errors (never a crash), and
//! its buffers bound-check host copies.

use attention::AttentionError;
use attention_cuda::{kernels, Device, KernelArg, LaunchConfig};
use attention_cuda_emu::emu_or_skip;

fn device_err(r: attention::Result<()>, want: &str) {
    match r {
        Err(AttentionError::Device(msg)) => assert!(msg.contains(want), "{msg}"),
        other => panic!("expected a device error with {want:?}, got {other:?}"),
    }
}

#[test]
fn bad_launches_are_typed_errors() {
    let Some(dev) = emu_or_skip("bad_launches_are_typed_errors") else {
        return;
    };
    let mut x = dev.alloc_zeroed(16).unwrap();
    dev.write(&mut x, 0, bytemuck_f32(&[1.0, 2.0, 3.0, 4.0]))
        .unwrap();
    let y = dev.alloc_zeroed(16).unwrap();
    let cfg = LaunchConfig {
        grid: [1, 1, 1],
        block: 32,
    };
    let args = [KernelArg::Buf(&x), KernelArg::Buf(&y), KernelArg::U32(4)];
    let dense = kernels::dense();
    // The right launch works: x += y (y is zero).
    dev.launch(&dense, "add_assign", cfg, &args).unwrap();
    device_err(
        dev.launch(&dense, "add_assign", cfg, &args[..2]),
        "wrong number of arguments",
    );
    device_err(
        dev.launch(&dense, "no_such_kernel", cfg, &args),
        "no such kernel",
    );
    let missing = attention_cuda::Spec {
        source: attention_cuda::Source::Attention,
        defines: vec![("HEAD_DIM", 7)],
    };
    device_err(
        dev.launch(&missing, "merge_states", cfg, &args),
        "no such specialisation",
    );
    for bad in [
        LaunchConfig {
            grid: [1, 1, 1],
            block: 0,
        },
        LaunchConfig {
            grid: [1, 1, 1],
            block: 2048,
        },
        LaunchConfig {
            grid: [0, 1, 1],
            block: 32,
        },
    ] {
        device_err(dev.launch(&dense, "add_assign", bad, &args), "block");
    }
    let mut out = [0u8; 16];
    dev.read(&x, 0, &mut out).unwrap();
    assert_eq!(&out[..], bytemuck_f32(&[1.0, 2.0, 3.0, 4.0]));
    device_err(dev.read(&x, 8, &mut out), "overrun");
    device_err(dev.write(&mut x, usize::MAX, &out), "overrun");
}

fn bytemuck_f32(v: &[f32; 4]) -> &[u8] {
    bytemuck::cast_slice(v)
}
