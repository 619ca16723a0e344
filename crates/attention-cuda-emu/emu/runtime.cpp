// The emulation's scheduler: fibers for a block's threads, the block and warp barriers, and
// the grid loop (see emu.h). Fibers switch with a few instructions on x86-64 (callee-saved
// registers and the stack pointer, no signal mask), elsewhere with ucontext.

#include "emu.h"

#include <stdlib.h>

#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

thread_local dim3 kvs_emu_thread_idx;
thread_local dim3 kvs_emu_block_idx;
thread_local dim3 kvs_emu_block_dim;
thread_local dim3 kvs_emu_grid_dim;

namespace {

constexpr size_t STACK_BYTES = 64 * 1024;

// A queued cp.async (kvs_emu_cp_async): `bytes` at dst from `src_bytes` at src, in group
// `group` of its thread.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned int bytes, src_bytes, group;
};

struct Fiber {
#if defined(__x86_64__)
    void* sp;
#else
    ucontext_t ctx;
#endif
    unsigned int shuffles;
    bool done;
    // The thread's queued copies, oldest first, and the groups it has committed.
    std::vector<AsyncCopy> copies;
    unsigned int groups;
};

struct Warp {
    unsigned int alive, arrived, gen;
    uint64_t scratch[2][WARP_SIZE];
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<char> stacks;
    // The pass's order: order[k] is the k-th fiber to run, pos[i] fiber i's place in it.
    std::vector<unsigned int> order, pos;
    unsigned int n, alive, arrived, gen, current;
    bool progress;
#if defined(__x86_64__)
    void* sched_sp;
#else
    ucontext_t sched;
#endif
    kvs_emu::Entry entry;
    void* ctx;
};

thread_local Block* block_state;

// The order fibers run in within a pass (between two barriers), set by kvs_emu_set_schedule
// for the calling OS thread's launches: 0 in thread order, 1 in reverse, 2 a new permutation
// every pass (SplitMix64 from the seed). A race-free kernel gives the same bits under every
// order; one that reads what another thread writes without a barrier between them does not.
thread_local unsigned int schedule_mode = 0;
thread_local uint64_t schedule_state = 0;

uint64_t splitmix64(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Sets b's order for the next pass.
void order_pass(Block* b) {
    const unsigned int n = b->n;
    for (unsigned int k = 0; k < n; ++k) {
        b->order[k] = schedule_mode == 1 ? n - 1 - k : k;
    }
    if (schedule_mode == 2) {
        for (unsigned int k = n - 1; k > 0; --k) {
            const unsigned int j = (unsigned int)(splitmix64(schedule_state) % (k + 1));
            const unsigned int t = b->order[k];
            b->order[k] = b->order[j];
            b->order[j] = t;
        }
    }
    for (unsigned int k = 0; k < n; ++k) {
        b->pos[b->order[k]] = k;
    }
}

}  // namespace

extern "C" void kvs_emu_set_schedule(unsigned int mode, uint64_t seed) {
    schedule_mode = mode;
    schedule_state = seed;
}

#if defined(__x86_64__)
extern "C" void kvs_emu_switch(void** save_sp, void* to_sp);
extern "C" void kvs_emu_start();
// kvs_emu_switch saves the callee-saved registers on the current stack, stores the stack
// pointer in *save_sp, loads to_sp and pops the other side's registers. kvs_emu_start is where
// a new fiber "returns" to: it calls r13(r12).
asm(R"(
    .text
    .globl kvs_emu_switch
    .type kvs_emu_switch, @function
kvs_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvs_emu_switch, .-kvs_emu_switch

    .globl kvs_emu_start
    .type kvs_emu_start, @function
kvs_emu_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size kvs_emu_start, .-kvs_emu_start
)");
#endif

namespace {

// The first live fiber after place `from` of the pass's order (places from + 1 .. n - 1), or
// n when there is none.
unsigned int next_live(const Block* b, unsigned int from) {
    for (unsigned int k = from + 1; k < b->n; ++k) {
        if (!b->fibers[b->order[k]].done) {
            return b->order[k];
        }
    }
    return b->n;
}

// Hands the OS thread on from the current fiber: to the next live fiber of the pass directly
// (one switch, where going through the scheduler takes two), or back to the scheduler after
// the pass's last one. Returns when the fiber is resumed.
void yield_fiber(Block* b) {
    unsigned int i = b->current;
    unsigned int next = next_live(b, b->pos[i]);
    Fiber& f = b->fibers[i];
    if (next == b->n) {
#if defined(__x86_64__)
        kvs_emu_switch(&f.sp, b->sched_sp);
#else
        swapcontext(&f.ctx, &b->sched);
#endif
        return;
    }
    b->current = next;
    kvs_emu_thread_idx = dim3{next, 0, 0};
#if defined(__x86_64__)
    kvs_emu_switch(&f.sp, b->fibers[next].sp);
#else
    swapcontext(&f.ctx, &b->fibers[next].ctx);
#endif
}

void warp_check(Block* b, Warp& w) {
    if (w.alive > 0 && w.arrived == w.alive) {
        w.arrived = 0;
        ++w.gen;
        b->progress = true;
    }
}

void block_check(Block* b) {
    if (b->alive > 0 && b->arrived == b->alive) {
        b->arrived = 0;
        ++b->gen;
        b->progress = true;
    }
}

// Completes the copies of f's groups below `group`.
void complete_copies(Fiber& f, unsigned int group) {
    size_t done = 0;
    while (done < f.copies.size() && f.copies[done].group < group) {
        const AsyncCopy& c = f.copies[done];
        memcpy(c.dst, c.src, c.src_bytes);
        memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
        ++done;
    }
    f.copies.erase(f.copies.begin(), f.copies.begin() + (ptrdiff_t)done);
}

extern "C" void kvs_emu_fiber_main(void* arg) {
    Block* b = static_cast<Block*>(arg);
    b->entry(b->ctx);
    unsigned int i = b->current;
    // Copies a thread never waited for still land (before the block ends, as on a GPU).
    complete_copies(b->fibers[i], UINT32_MAX);
    b->fibers[i].done = true;
    b->progress = true;
    // A finished thread no longer holds up the barriers of the threads still running.
    --b->alive;
    Warp& w = b->warps[i / WARP_SIZE];
    --w.alive;
    warp_check(b, w);
    block_check(b);
    yield_fiber(b);
    abort();  // never resumed
}

#if !defined(__x86_64__)
void ucontext_main(unsigned int hi, unsigned int lo) {
    uintptr_t p = ((uintptr_t)hi << 32) | lo;
    kvs_emu_fiber_main(reinterpret_cast<void*>(p));
}
#endif

void init_fiber(Block* b, unsigned int i) {
    Fiber& f = b->fibers[i];
    f.done = false;
    f.shuffles = 0;
    f.copies.clear();
    f.groups = 0;
    char* stack = b->stacks.data() + (size_t)i * STACK_BYTES;
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15;
    void** sp = reinterpret_cast<void**>(top - 24 - 6 * sizeof(void*));
    sp[0] = nullptr;                                            // r15
    sp[1] = nullptr;                                            // r14
    sp[2] = reinterpret_cast<void*>(&kvs_emu_fiber_main);       // r13
    sp[3] = b;                                                  // r12
    sp[4] = nullptr;                                            // rbx
    sp[5] = nullptr;                                            // rbp
    sp[6] = reinterpret_cast<void*>(&kvs_emu_start);            // return address
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    uintptr_t p = reinterpret_cast<uintptr_t>(b);
    makecontext(&f.ctx, (void (*)())ucontext_main, 2, (unsigned int)(p >> 32),
                (unsigned int)(p & 0xffffffffu));
#endif
}

void resume(Block* b, unsigned int i) {
    b->current = i;
    kvs_emu_thread_idx = dim3{i, 0, 0};
    Fiber& f = b->fibers[i];
#if defined(__x86_64__)
    kvs_emu_switch(&b->sched_sp, f.sp);
#else
    swapcontext(&b->sched, &f.ctx);
#endif
}

}  // namespace

void kvs_emu_syncthreads() {
    Block* b = block_state;
    unsigned int gen = b->gen;
    ++b->arrived;
    block_check(b);
    while (b->gen == gen) {
        yield_fiber(b);
    }
}

void kvs_emu_warp_sync() {
    Block* b = block_state;
    Warp& w = b->warps[b->current / WARP_SIZE];
    unsigned int gen = w.gen;
    ++w.arrived;
    warp_check(b, w);
    while (w.gen == gen) {
        yield_fiber(b);
    }
}

void kvs_emu_cp_async(void* dst, const void* src, unsigned int bytes, unsigned int src_bytes) {
    Fiber& f = block_state->fibers[block_state->current];
    memset(dst, 0xff, bytes);
    f.copies.push_back(AsyncCopy{dst, src, bytes, src_bytes < bytes ? src_bytes : bytes, f.groups});
}

void kvs_emu_cp_commit() {
    ++block_state->fibers[block_state->current].groups;
}

void kvs_emu_cp_wait(unsigned int n) {
    Fiber& f = block_state->fibers[block_state->current];
    complete_copies(f, f.groups > n ? f.groups - n : 0);
}

uint64_t* kvs_emu_shfl_row(unsigned int* lane) {
    Block* b = block_state;
    Fiber& f = b->fibers[b->current];
    *lane = b->current % WARP_SIZE;
    return b->warps[b->current / WARP_SIZE].scratch[f.shuffles++ & 1];
}

namespace kvs_emu {

int run(const unsigned int* grid, unsigned int block, Entry entry, void* ctx, void (*poison)()) {
    if (block == 0 || block > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        return -4;
    }
    // Stacks and fibers are kept per OS thread and reused by every launch.
    static thread_local Block b;
    if (b.fibers.size() < block) {
        b.fibers.resize(block);
        b.stacks.resize((size_t)block * STACK_BYTES);
        b.order.resize(block);
        b.pos.resize(block);
    }
    unsigned int nwarps = (block + WARP_SIZE - 1) / WARP_SIZE;
    if (b.warps.size() < nwarps) {
        b.warps.resize(nwarps);
    }
    b.n = block;
    b.entry = entry;
    b.ctx = ctx;
    Block* saved = block_state;
    block_state = &b;
    kvs_emu_block_dim = dim3{block, 1, 1};
    kvs_emu_grid_dim = dim3{grid[0], grid[1], grid[2]};
    int rc = 0;
    for (unsigned int z = 0; z < grid[2] && rc == 0; ++z) {
        for (unsigned int y = 0; y < grid[1] && rc == 0; ++y) {
            for (unsigned int x = 0; x < grid[0] && rc == 0; ++x) {
                kvs_emu_block_idx = dim3{x, y, z};
                b.alive = block;
                b.arrived = 0;
                b.gen = 0;
                for (unsigned int w = 0; w < nwarps; ++w) {
                    unsigned int lanes = block - w * WARP_SIZE;
                    b.warps[w].alive = lanes < WARP_SIZE ? lanes : WARP_SIZE;
                    b.warps[w].arrived = 0;
                    b.warps[w].gen = 0;
                }
                for (unsigned int i = 0; i < block; ++i) {
                    init_fiber(&b, i);
                }
                if (poison != nullptr) {
                    poison();  // the block's shared memory starts undefined
                }
                // A pass resumes the first live fiber; each hands on to the next live one at
                // its barrier (yield_fiber), the last back here.
                while (b.alive > 0) {
                    b.progress = false;
                    order_pass(&b);
                    resume(&b, next_live(&b, UINT32_MAX));
                    if (!b.progress) {
                        rc = -3;  // every live thread waits on a barrier that cannot complete
                        break;
                    }
                }
            }
        }
    }
    block_state = saved;
    return rc;
}

}  // namespace kvs_emu
