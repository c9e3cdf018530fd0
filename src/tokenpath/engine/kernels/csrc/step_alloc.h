// Where a step's scratch vectors get their memory: fresh pages straight from the kernel (mmap) for
// buffers of at least kPageAllocMin bytes, and given straight back (munmap) when a buffer grows.
// Included by forward.cpp inside its anonymous namespace; ActBuf (a QAct's buffers) lives here too.
//
// Why not malloc: the step buffers grow with the largest step seen (a 256-row prefill, then a
// 512-row one), and glibc raises its mmap threshold to the size of each mapped chunk it frees, so
// the grown buffers come from the heap and the outgrown ones are freed into it, where their pages
// stay resident until something reuses or trims them: 6 MiB of SmolLM2's peak RSS after a
// 256-row and a 512-row prefill were such leftovers. A buffer is resized only when a step needs
// more rows than any before, so the mapping calls are rare; a steady step allocates nothing.
//
// A grown buffer is zero without being written: mapped pages are the kernel's zero pages until a
// step writes them (the small ones are cleared in allocate), so `resize` constructs nothing
// (construct() default-initializes). A buffer sized for every row but written for some (the
// residual bytes of a prompt step whose rows take bf16 tiles) then holds only the pages used:
// value-initializing wrote all of them, 2 MiB of SmolLM2's 512-row prefill peak.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

constexpr size_t kPageAllocMin = size_t(64) << 10;  // smaller ones: operator new, as std::allocator

template <class T>
struct PageAlloc {
    using value_type = T;
    PageAlloc() = default;
    template <class U>
    PageAlloc(const PageAlloc<U>&) {}  // NOLINT(google-explicit-constructor): the allocator contract
    T* allocate(size_t n) {
        const size_t bytes = n * sizeof(T);
        if (bytes < kPageAllocMin) return static_cast<T*>(__builtin_memset(::operator new(bytes), 0, bytes));
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        return static_cast<T*>(p);
    }
    void deallocate(T* p, size_t n) {
        const size_t bytes = n * sizeof(T);
        if (bytes < kPageAllocMin) ::operator delete(p);
        else munmap(p, bytes);
    }
    template <class U>
    void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }  // no write: allocate's memory is zero
    template <class U, class... A>
    void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(static_cast<A&&>(a)...); }
};
template <class T, class U>
bool operator==(const PageAlloc<T>&, const PageAlloc<U>&) { return true; }
template <class T, class U>
bool operator!=(const PageAlloc<T>&, const PageAlloc<U>&) { return false; }

// A step buffer (Model's and ActBuf's): a std::vector on PageAlloc.
template <class T>
using StepVec = std::vector<T, PageAlloc<T>>;

// Grows a step buffer to at least n elements, zeroed, without keeping what it held (every step
// writes its buffers before it reads them). The outgrown pages go back before the new ones are
// touched: resize alone would copy the old contents over, holding both at once (+3 MiB at the
// peak of SmolLM2's 512-row step after a 256-row one).
template <class T>
inline void grow(StepVec<T>& v, size_t n) {
    if (v.size() >= n) return;
    StepVec<T>().swap(v);
    v.resize(n);
}

// A step buffer's bytes, and giving them all back (tp_model_step_buffers: the engine went idle);
// a buffer of kPageAllocMin or more is unmapped.
template <class T>
inline size_t held(const StepVec<T>& v) { return v.capacity() * sizeof(T); }
template <class T>
inline void drop(StepVec<T>& v) { StepVec<T>().swap(v); }

// The buffers behind one QAct (see make_act in step_acts.h).
struct ActBuf {
    StepVec<int8_t> q, q2;
    StepVec<int16_t> q16;
    StepVec<float> d, s, f, fs;
    StepVec<int32_t> qsum, qsum16;
    StepVec<uint16_t> bf;
};
