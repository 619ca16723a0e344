// The CUDA emulation header: compiles kvserve's .cu kernel sources for the CPU with g++
// (C++20), so tests execute the kernels' logic without a GPU.
//
// A launch runs the grid's blocks one after another on the calling OS thread. The threads of a
// block are fibers (user-mode stacks switched by kvs_emu_switch in runtime.cpp), run in turn
// until each reaches a barrier: __syncthreads() is a block-wide barrier, and a warp shuffle is
// a per-warp barrier over a scratch row (double-buffered, so one barrier per shuffle). Because
// blocks run one at a time and every fiber of a launch shares the OS thread, __shared__ arrays
// are static storage, and a specialisation runs one launch at a time (its dispatcher holds a
// mutex of its own: thread_local arrays, summed over every specialisation, made static TLS of
// megabytes, which glibc carves out of each new thread's stack). What this cannot check: the memory model (fibers switch
// only at barriers, so races the barriers hide stay hidden) and speed.
//
// Included before a kernel source's #defines, common.cuh and the source itself; those go inside
// a namespace per specialisation (see the crate's build.rs), so this header's names are global.
#pragma once

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

struct dim3 {
    unsigned int x, y, z;
};

extern thread_local dim3 kvs_emu_thread_idx;
extern thread_local dim3 kvs_emu_block_idx;
extern thread_local dim3 kvs_emu_block_dim;
extern thread_local dim3 kvs_emu_grid_dim;

#define threadIdx kvs_emu_thread_idx
#define blockIdx kvs_emu_block_idx
#define blockDim kvs_emu_block_dim
#define gridDim kvs_emu_grid_dim

#define __global__
#define __device__
// __shared__ arrays are static storage in a linker section of their translation unit's own
// (KVS_EMU_SHARED_SECTION, defined by each unit before the kernel sources; see
// KVS_EMU_SHARED_UNIT), which the runtime fills with 0xff bytes (NaN as f32) before every
// block: on a GPU a block's shared memory starts undefined, so a kernel that reads it before
// writing it shows NaN here instead of a stale value that happens to work. Named sections
// with __start_/__stop_ symbols are ELF's; elsewhere (Mach-O, PE) the arrays are plain static
// storage and are not refilled.
#if defined(__ELF__)
#define __shared__ static __attribute__((section(KVS_EMU_SHARED_SECTION)))
// Declares, in a unit whose section is "kvs_sh_" #NAME, that section's anchor and
// kvs_emu_poison_shared(), which fills the section. The function reads the anchor, so the
// linker keeps the section (with the unit's arrays) wherever the dispatcher is linked, and the
// section exists even where the unit has no shared arrays.
#define KVS_EMU_SHARED_UNIT(NAME)                                                              \
    __attribute__((section("kvs_sh_" #NAME), used)) static char kvs_emu_shared_anchor;         \
    extern "C" char __start_kvs_sh_##NAME[], __stop_kvs_sh_##NAME[];                           \
    static void kvs_emu_poison_shared() {                                                      \
        (void)*(volatile char*)&kvs_emu_shared_anchor;                                         \
        memset(__start_kvs_sh_##NAME, 0xff,                                                    \
               (size_t)(__stop_kvs_sh_##NAME - __start_kvs_sh_##NAME));                        \
    }
#else
#define __shared__ static
#define KVS_EMU_SHARED_UNIT(NAME) static void kvs_emu_poison_shared() {}
#endif
#define KVS_KERNEL
#define WARP_SIZE 32

// The block-wide barrier of the calling fiber's block.
void kvs_emu_syncthreads();
// The barrier of the calling fiber's warp.
void kvs_emu_warp_sync();
// The scratch row (WARP_SIZE words) of the calling fiber's warp for its next shuffle, and its
// lane.
uint64_t* kvs_emu_shfl_row(unsigned int* lane);

#define __syncthreads() kvs_emu_syncthreads()

inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
inline float __int_as_float(unsigned int x) { return __int_as_float((int)x); }
inline float __uint_as_float(unsigned int x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int x;
    memcpy(&x, &f, sizeof x);
    return x;
}

inline long long __double_as_longlong(double d) {
    long long x;
    memcpy(&x, &d, sizeof x);
    return x;
}

// A shuffle: every lane of the calling fiber's warp posts v, and gets the v of lane
// src_of(its lane) % WARP_SIZE.
template <class T, class F>
inline T kvs_emu_shuffle(T v, F src_of) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled values are at most 8 bytes");
    unsigned int lane;
    uint64_t* row = kvs_emu_shfl_row(&lane);
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    row[lane] = bits;
    kvs_emu_warp_sync();
    T r;
    memcpy(&r, &row[src_of(lane) % WARP_SIZE], sizeof(T));
    return r;
}

template <class T>
inline T __shfl_xor_sync(unsigned int /*mask*/, T v, int lane_mask) {
    return kvs_emu_shuffle(v, [lane_mask](unsigned int lane) { return lane ^ (unsigned int)lane_mask; });
}

template <class T>
inline T __shfl_sync(unsigned int /*mask*/, T v, int src_lane) {
    return kvs_emu_shuffle(v, [src_lane](unsigned int) { return (unsigned int)src_lane; });
}

// The warp's barrier (every lane of the calling fiber's warp arrives before any goes on).
#define __syncwarp() kvs_emu_warp_sync()

// __threadfence: blocks run one after another and a block's fibers share one OS thread, so
// every write is already visible to every later read.
inline void __threadfence() {}

// __syncthreads_or: a block barrier that returns non-zero in every thread when any thread's
// predicate is non-zero. A block's fibers share one OS thread (and its blocks run one after
// another), so they OR into one thread-local word between two barriers and each clears it
// after a third: every fiber has cleared it before any passes the next call's first barrier.
inline int __syncthreads_or(int predicate) {
    static thread_local int any = 0;
    kvs_emu_syncthreads();
    if (predicate) {
        any = 1;
    }
    kvs_emu_syncthreads();
    const int result = any;
    kvs_emu_syncthreads();
    any = 0;
    return result;
}

// cp.async, as the kernels use it (KVS_EMU_CP_ASYNC selects these in attention.cu): a copy of
// `bytes` into shared memory from `src_bytes` of global memory (the rest zero-filled) is
// queued in the calling thread's open group, its destination filled with 0xff bytes (NaN as
// f32: undefined until the copy completes); kvs_emu_cp_commit closes the group;
// kvs_emu_cp_wait(n) completes every committed group but the n newest (cp.async.wait_group).
// So a kernel that reads a stage before waiting for its copies, or reads another thread's
// copies without a barrier after that thread's wait, reads NaN.
#define KVS_EMU_CP_ASYNC 1
void kvs_emu_cp_async(void* dst, const void* src, unsigned int bytes, unsigned int src_bytes);
void kvs_emu_cp_commit();
void kvs_emu_cp_wait(unsigned int n);

// atomicAdd: fibers switch only at barriers, so a plain read-modify-write is atomic here.
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

namespace kvs_emu {

// Holds a specialisation's launch mutex for a scope (see the top of this file). pthread's, not
// std::mutex: <mutex> takes g++ half a second to parse, in each of the ~100 translation units.
struct LaunchLock {
    pthread_mutex_t* m;
    explicit LaunchLock(pthread_mutex_t* m) : m(m) { pthread_mutex_lock(m); }
    ~LaunchLock() { pthread_mutex_unlock(m); }
    LaunchLock(const LaunchLock&) = delete;
    LaunchLock& operator=(const LaunchLock&) = delete;
};

using Entry = void (*)(void*);

// Runs `entry(ctx)` as every thread of every block of the grid. 0 on success; -3 when the
// threads of a block wait on barriers that can never complete (divergent __syncthreads);
// -4 for an empty grid or a block of 0 or more than 1024 threads; -5 when the launch passes a
// different number of arguments than the kernel takes.
// `poison`, when set, runs before each block (it fills the unit's shared memory).
int run(const unsigned int* grid, unsigned int block, Entry entry, void* ctx,
        void (*poison)() = nullptr);

template <class... A, size_t... I>
void call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

// cuLaunchKernel's convention: params[i] points at the value of the kernel's i-th parameter.
// `poison` fills the kernel's unit's shared memory before each block.
template <class... A>
int launch(void (*kernel)(A...), const unsigned int* grid, unsigned int block, void** params,
           unsigned int nparams, void (*poison)()) {
    if (nparams != sizeof...(A)) {
        return -5;
    }
    struct Ctx {
        void (*kernel)(A...);
        void** params;
    } ctx{kernel, params};
    return run(grid, block,
               [](void* c) {
                   Ctx* x = static_cast<Ctx*>(c);
                   call(x->kernel, x->params, std::index_sequence_for<A...>{});
               },
               &ctx, poison);
}

}  // namespace kvs_emu
