// The stream-ordered host exchange of jhybrid (docs/design.md, "The host exchange").
//
// Two XLA FFI custom calls per layer and decode step, no Python and no stream synchronisation:
//   submit:  q float32 [B, 1, Hq, D] (and block ids int32 [B, Hkv, k]) -> the layer's pinned host
//            slot; then ready[slot] = seq. GPU: cuMemcpyDtoHAsync + cuStreamWriteValue32 on XLA's
//            stream (the host sees the flag once the copy has landed); CPU: memcpy + a release store.
//   collect: wait until done[slot] >= seq, then o [B, 1, Hq, D], lse [B, 1, Hq] float32 <- the slot.
//            GPU: cuStreamWaitValue32 (the stream waits, the host does not) + cuMemcpyHtoDAsync;
//            CPU: a bounded spin / sleep, an error after the timeout.
// The host worker (host/exchange_worker.py, Numba nogil code on its own thread) polls ready[],
// computes the partial state, writes o / lse into the slot and releases done[slot] = seq. An error
// or a timeout on the host side writes the message here (jh_exchange_fail) and releases every slot,
// so no stream waits forever; the CPU collect then returns the message as the call's error.
// Under tensor parallelism every device of the mesh runs the same calls; each device's calls are
// routed by its XLA device ordinal to that device's own exchange (jh_exchange_route).
//
// No CUDA toolkit is needed to build this file: the CUDA driver (libcuda.so.1) is loaded at run time.

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- the CUDA driver API, resolved at run time ------------------------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;  // the same handle as cudaStream_t
using CUdeviceptr = unsigned long long;
using CUevent = void*;
constexpr unsigned kHostAllocPortable = 0x01, kHostAllocDeviceMap = 0x02;
constexpr unsigned kWaitGeq = 0x0;

struct Driver {
  bool loaded = false;
  std::string error;
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*DeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*PrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*CtxPush)(CUcontext) = nullptr;
  CUresult (*CtxPop)(CUcontext*) = nullptr;
  CUresult (*HostAlloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*FreeHost)(void*) = nullptr;
  CUresult (*HostGetDevicePointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*WriteValue32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*WaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*EventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*EventDestroy)(CUevent) = nullptr;
  CUresult (*EventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*EventElapsedTime)(float*, CUevent, CUevent) = nullptr;

  template <typename F>
  bool Resolve(void* lib, F& fn, const char* name, const char* fallback = nullptr) {
    void* sym = dlsym(lib, name);
    if (sym == nullptr && fallback != nullptr) sym = dlsym(lib, fallback);
    if (sym == nullptr) {
      error = std::string("libcuda.so.1 has no ") + name;
      return false;
    }
    fn = reinterpret_cast<F>(sym);
    return true;
  }

  bool Load() {
    if (loaded) return true;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      error = std::string("cannot load libcuda.so.1: ") + (why ? why : "unknown");
      return false;
    }
    loaded = Resolve(lib, Init, "cuInit") && Resolve(lib, DeviceGet, "cuDeviceGet") &&
             Resolve(lib, PrimaryCtxRetain, "cuDevicePrimaryCtxRetain") &&
             Resolve(lib, CtxPush, "cuCtxPushCurrent_v2", "cuCtxPushCurrent") &&
             Resolve(lib, CtxPop, "cuCtxPopCurrent_v2", "cuCtxPopCurrent") &&
             Resolve(lib, HostAlloc, "cuMemHostAlloc") && Resolve(lib, FreeHost, "cuMemFreeHost") &&
             Resolve(lib, HostGetDevicePointer, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer") &&
             Resolve(lib, MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync") &&
             Resolve(lib, MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync") &&
             Resolve(lib, WriteValue32, "cuStreamWriteValue32_v2", "cuStreamWriteValue32") &&
             Resolve(lib, WaitValue32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32") &&
             Resolve(lib, MemsetD32Async, "cuMemsetD32Async") &&
             Resolve(lib, GetErrorString, "cuGetErrorString") && Resolve(lib, EventCreate, "cuEventCreate") &&
             Resolve(lib, EventDestroy, "cuEventDestroy_v2", "cuEventDestroy") &&
             Resolve(lib, EventRecord, "cuEventRecord") && Resolve(lib, EventElapsedTime, "cuEventElapsedTime");
    return loaded;
  }

  std::string Describe(CUresult r, const char* what) {
    const char* text = nullptr;
    if (GetErrorString != nullptr) GetErrorString(r, &text);
    return std::string(what) + " failed: CUDA error " + std::to_string(r) + (text ? std::string(" (") + text + ")" : "");
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

// ---- one exchange per open hybrid batch --------------------------------------------------------
// One pinned allocation: a header of flags, then one slot per layer (q, ids, o, lse regions).
constexpr size_t kAlign = 64;
size_t RoundUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Exchange {
  int n_slots = 0;
  bool gpu = false;
  size_t q_bytes = 0, ids_bytes = 0, o_bytes = 0, lse_bytes = 0;
  size_t header_bytes = 0, slot_bytes = 0, total_bytes = 0;
  char* host = nullptr;     // host view of the allocation
  CUdeviceptr device = 0;   // device view (GPU), 0 on the CPU
  std::vector<std::atomic<uint32_t>> submitted;  // enqueue-time sequence number per slot
  double timeout_s = 300.0;
  std::mutex message_mu;
  std::string message;      // the host side's error, once set
  // Timing (GPU: events per slot; CPU: clocks): the exchange's own GPU time (copies, flag write)
  // and the time the stream waited for the host, accumulated until jh_exchange_timing reads them.
  bool timing = false;
  std::vector<CUevent> events;  // per slot: submit start, submit end, wait start, wait end, collect end
  std::mutex timing_mu;
  double cpu_wait_s = 0.0;      // CPU path: seconds collects waited
  long cpu_waits = 0;           // CPU path: collects timed
  std::vector<char> recorded;   // per slot: events of the last step recorded

  // header: ready[n_slots], done[n_slots], failed (one 64-byte line each group)
  uint32_t* ready() { return reinterpret_cast<uint32_t*>(host); }
  uint32_t* done() { return reinterpret_cast<uint32_t*>(host + RoundUp(4 * n_slots)); }
  uint32_t* failed() { return reinterpret_cast<uint32_t*>(host + 2 * RoundUp(4 * n_slots)); }
  size_t ready_offset(int slot) const { return 4 * size_t(slot); }
  size_t done_offset(int slot) const { return RoundUp(4 * n_slots) + 4 * size_t(slot); }
  size_t slot_offset(int slot) const { return header_bytes + size_t(slot) * slot_bytes; }
  size_t q_offset(int slot) const { return slot_offset(slot); }
  size_t ids_offset(int slot) const { return q_offset(slot) + RoundUp(q_bytes); }
  size_t o_offset(int slot) const { return ids_offset(slot) + RoundUp(ids_bytes); }
  size_t lse_offset(int slot) const { return o_offset(slot) + RoundUp(o_bytes); }
};

// An exchange id is reserved once per hybrid backend (it is a compile-time attribute of the
// backend's custom calls); each open() of the backend installs a fresh Exchange under it.
constexpr int kMaxExchanges = 1024;
std::atomic<Exchange*> g_exchanges[kMaxExchanges];
bool g_reserved[kMaxExchanges];
std::mutex g_create_mu;

void Destroy(Exchange* ex) {
  if (ex == nullptr) return;
  if (ex->gpu) {
    for (auto event : ex->events)
      if (event != nullptr) driver().EventDestroy(event);
    driver().FreeHost(ex->host);
  } else {
    std::free(ex->host);
  }
  delete ex;
}

Exchange* Lookup(int64_t id) {
  if (id < 0 || id >= kMaxExchanges) return nullptr;
  return g_exchanges[id].load(std::memory_order_acquire);
}

// Tensor parallelism: one traced step calls the same exchange id (a compile-time attribute) on every
// device of the mesh; each device's calls go to that device's own exchange. A route maps (id, XLA
// device ordinal) to that exchange's id; a few per process, scanned without a lock (entries are
// only appended, under g_route_mu, and published by the count).
struct RouteEntry {
  std::atomic<int64_t> id{-1};
  std::atomic<int64_t> ordinal{-1};
  std::atomic<int64_t> target{-1};
};
constexpr int kMaxRoutes = 1024;
RouteEntry g_routes[kMaxRoutes];
std::atomic<int> g_route_count{0};
std::mutex g_route_mu;

int64_t Route(int64_t id, int64_t ordinal) {
  int n = g_route_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    if (g_routes[i].id.load(std::memory_order_relaxed) == id &&
        g_routes[i].ordinal.load(std::memory_order_relaxed) == ordinal) {
      int64_t target = g_routes[i].target.load(std::memory_order_acquire);
      return target >= 0 ? target : id;
    }
  }
  return id;
}

ffi::Error Invalid(const std::string& what) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, what); }
ffi::Error Internal(const std::string& what) { return ffi::Error(ffi::ErrorCode::kInternal, what); }

// Checks shared by the handlers; returns the exchange or sets *error.
Exchange* Check(int64_t id, int64_t slot, ffi::Error* error) {
  Exchange* ex = Lookup(id);
  if (ex == nullptr) {
    *error = Invalid("host exchange " + std::to_string(id) + " is not open (the hybrid backend was closed?)");
    return nullptr;
  }
  if (slot < 0 || slot >= ex->n_slots) {
    *error = Invalid("host exchange: slot " + std::to_string(slot) + " out of range [0, " +
                     std::to_string(ex->n_slots) + ")");
    return nullptr;
  }
  return ex;
}

ffi::Error CheckBytes(const char* what, size_t got, size_t capacity) {
  if (got > capacity)
    return Invalid(std::string("host exchange: ") + what + " of " + std::to_string(got) +
                   " bytes exceeds the slot's " + std::to_string(capacity));
  return ffi::Error::Success();
}

std::string FailureMessage(Exchange* ex, int64_t slot) {
  std::lock_guard<std::mutex> lock(ex->message_mu);
  return ex->message.empty() ? "host exchange: the host side failed at layer " + std::to_string(slot) : ex->message;
}

// ---- CPU handlers ------------------------------------------------------------------------------
ffi::Error SubmitCpuImpl(int32_t ordinal, int64_t id, int64_t slot, ffi::AnyBuffer q, ffi::RemainingArgs rest,
                         ffi::Result<ffi::AnyBuffer> token) {
  ffi::Error error = ffi::Error::Success();
  id = Route(id, ordinal);
  Exchange* ex = Check(id, slot, &error);
  if (ex == nullptr) return error;
  if (auto e = CheckBytes("q", q.size_bytes(), ex->q_bytes); e.failure()) return e;
  std::memcpy(ex->host + ex->q_offset(slot), q.untyped_data(), q.size_bytes());
  if (rest.size() > 0) {
    auto ids = rest.get<ffi::AnyBuffer>(0);
    if (ids.has_error()) return ids.error();
    if (auto e = CheckBytes("block ids", ids->size_bytes(), ex->ids_bytes); e.failure()) return e;
    std::memcpy(ex->host + ex->ids_offset(slot), ids->untyped_data(), ids->size_bytes());
  }
  uint32_t seq = ex->submitted[slot].fetch_add(1) + 1;
  __atomic_store_n(ex->ready() + slot, seq, __ATOMIC_RELEASE);
  *reinterpret_cast<int32_t*>(token->untyped_data()) = static_cast<int32_t>(seq);
  return ffi::Error::Success();
}

ffi::Error CollectCpuImpl(int32_t ordinal, int64_t id, int64_t slot, ffi::RemainingArgs deps, ffi::Result<ffi::AnyBuffer> o,
                          ffi::Result<ffi::AnyBuffer> lse) {
  (void)deps;  // operands that only order this call after the GPU part of the layer
  ffi::Error error = ffi::Error::Success();
  id = Route(id, ordinal);
  Exchange* ex = Check(id, slot, &error);
  if (ex == nullptr) return error;
  if (auto e = CheckBytes("o", o->size_bytes(), ex->o_bytes); e.failure()) return e;
  if (auto e = CheckBytes("lse", lse->size_bytes(), ex->lse_bytes); e.failure()) return e;
  uint32_t seq = ex->submitted[slot].load();
  auto start = std::chrono::steady_clock::now();
  struct AddWait {
    Exchange* ex;
    std::chrono::steady_clock::time_point start;
    ~AddWait() {
      if (!ex->timing) return;
      std::lock_guard<std::mutex> lock(ex->timing_mu);
      ex->cpu_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ex->cpu_waits += 1;
    }
  } add_wait{ex, start};
  for (long spin = 0;; ++spin) {
    uint32_t done = __atomic_load_n(ex->done() + slot, __ATOMIC_ACQUIRE);
    if (static_cast<int32_t>(done - seq) >= 0) break;
    if (__atomic_load_n(ex->failed(), __ATOMIC_ACQUIRE)) return Internal(FailureMessage(ex, slot));
    if (spin > 4096) {
      std::this_thread::sleep_for(std::chrono::microseconds(spin > 65536 ? 200 : 10));
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > ex->timeout_s)
        return Internal("host exchange: layer " + std::to_string(slot) + " not answered after " +
                        std::to_string(ex->timeout_s) + " s (the host worker is stuck or gone)");
    }
  }
  if (__atomic_load_n(ex->failed(), __ATOMIC_ACQUIRE)) return Internal(FailureMessage(ex, slot));
  std::memcpy(o->untyped_data(), ex->host + ex->o_offset(slot), o->size_bytes());
  std::memcpy(lse->untyped_data(), ex->host + ex->lse_offset(slot), lse->size_bytes());
  return ffi::Error::Success();
}

// ---- GPU handlers (they enqueue; the stream does the waiting) -----------------------------------
ffi::Error SubmitGpuImpl(CUstream stream, int32_t ordinal, int64_t id, int64_t slot, ffi::AnyBuffer q, ffi::RemainingArgs rest,
                         ffi::Result<ffi::AnyBuffer> token) {
  ffi::Error error = ffi::Error::Success();
  id = Route(id, ordinal);
  Exchange* ex = Check(id, slot, &error);
  if (ex == nullptr) return error;
  if (!ex->gpu) return Invalid("host exchange " + std::to_string(id) + " was opened for the CPU");
  Driver& cu = driver();
  if (auto e = CheckBytes("q", q.size_bytes(), ex->q_bytes); e.failure()) return e;
  if (ex->timing) cu.EventRecord(ex->events[5 * slot], stream);
  CUresult r = cu.MemcpyDtoHAsync(ex->host + ex->q_offset(slot), reinterpret_cast<CUdeviceptr>(q.untyped_data()),
                                  q.size_bytes(), stream);
  if (r != 0) return Internal(cu.Describe(r, "host exchange: query copy"));
  if (rest.size() > 0) {
    auto ids = rest.get<ffi::AnyBuffer>(0);
    if (ids.has_error()) return ids.error();
    if (auto e = CheckBytes("block ids", ids->size_bytes(), ex->ids_bytes); e.failure()) return e;
    r = cu.MemcpyDtoHAsync(ex->host + ex->ids_offset(slot), reinterpret_cast<CUdeviceptr>(ids->untyped_data()),
                           ids->size_bytes(), stream);
    if (r != 0) return Internal(cu.Describe(r, "host exchange: block-id copy"));
  }
  uint32_t seq = ex->submitted[slot].fetch_add(1) + 1;
  r = cu.WriteValue32(stream, ex->device + ex->ready_offset(slot), seq, 0);  // after the copies, with a barrier
  if (r != 0) return Internal(cu.Describe(r, "host exchange: stream write of the ready flag"));
  r = cu.MemsetD32Async(reinterpret_cast<CUdeviceptr>(token->untyped_data()), seq, 1, stream);
  if (r != 0) return Internal(cu.Describe(r, "host exchange: token write"));
  if (ex->timing) cu.EventRecord(ex->events[5 * slot + 1], stream);
  return ffi::Error::Success();
}

ffi::Error CollectGpuImpl(CUstream stream, int32_t ordinal, int64_t id, int64_t slot, ffi::RemainingArgs deps,
                          ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse) {
  (void)deps;
  ffi::Error error = ffi::Error::Success();
  id = Route(id, ordinal);
  Exchange* ex = Check(id, slot, &error);
  if (ex == nullptr) return error;
  if (!ex->gpu) return Invalid("host exchange " + std::to_string(id) + " was opened for the CPU");
  Driver& cu = driver();
  if (auto e = CheckBytes("o", o->size_bytes(), ex->o_bytes); e.failure()) return e;
  if (auto e = CheckBytes("lse", lse->size_bytes(), ex->lse_bytes); e.failure()) return e;
  uint32_t seq = ex->submitted[slot].load();
  if (ex->timing) cu.EventRecord(ex->events[5 * slot + 2], stream);
  CUresult r = cu.WaitValue32(stream, ex->device + ex->done_offset(slot), seq, kWaitGeq);
  if (ex->timing) cu.EventRecord(ex->events[5 * slot + 3], stream);
  if (r != 0) return Internal(cu.Describe(r, "host exchange: stream wait on the done flag"));
  r = cu.MemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(o->untyped_data()), ex->host + ex->o_offset(slot),
                         o->size_bytes(), stream);
  if (r != 0) return Internal(cu.Describe(r, "host exchange: output copy"));
  r = cu.MemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(lse->untyped_data()), ex->host + ex->lse_offset(slot),
                         lse->size_bytes(), stream);
  if (r != 0) return Internal(cu.Describe(r, "host exchange: lse copy"));
  if (ex->timing) {
    cu.EventRecord(ex->events[5 * slot + 4], stream);
    ex->recorded[slot] = 1;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JhExchangeSubmitCpu, SubmitCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("exchange")
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JhExchangeCollectCpu, CollectCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("exchange")
                                  .Attr<int64_t>("slot")
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JhExchangeSubmitGpu, SubmitGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("exchange")
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JhExchangeCollectGpu, CollectGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("exchange")
                                  .Attr<int64_t>("slot")
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// ---- control functions (ctypes) ------------------------------------------------------------------
extern "C" {

// A new exchange id (no buffers yet); -1 when all are taken.
__attribute__((visibility("default"))) int jh_exchange_reserve() {
  std::lock_guard<std::mutex> lock(g_create_mu);
  for (int id = 0; id < kMaxExchanges; ++id) {
    if (!g_reserved[id]) {
      g_reserved[id] = true;
      return id;
    }
  }
  return -1;
}

// Buffers for one batch under a reserved id (replacing the previous batch's). 0, or -1 with `err` set.
__attribute__((visibility("default"))) int jh_exchange_open(int id, int n_slots, int64_t q_bytes, int64_t ids_bytes,
                                                            int64_t o_bytes, int64_t lse_bytes, int gpu,
                                                            int device_ordinal, double timeout_s, int timing,
                                                            char* err, int err_len) {
  auto fail = [&](const std::string& what) {
    std::snprintf(err, err_len, "%s", what.c_str());
    return -1;
  };
  {
    std::lock_guard<std::mutex> lock(g_create_mu);
    if (id < 0 || id >= kMaxExchanges || !g_reserved[id]) return fail("jh_exchange_open: id not reserved");
  }
  if (n_slots <= 0 || q_bytes <= 0 || o_bytes <= 0 || lse_bytes <= 0 || ids_bytes < 0)
    return fail("jh_exchange_create: sizes must be positive");
  auto ex = std::make_unique<Exchange>();
  ex->n_slots = n_slots;
  ex->gpu = gpu != 0;
  ex->q_bytes = q_bytes;
  ex->ids_bytes = ids_bytes;
  ex->o_bytes = o_bytes;
  ex->lse_bytes = lse_bytes;
  ex->timeout_s = timeout_s;
  ex->timing = timing != 0;
  ex->recorded.assign(n_slots, 0);
  ex->submitted = std::vector<std::atomic<uint32_t>>(n_slots);
  ex->header_bytes = 3 * RoundUp(4 * size_t(n_slots));
  ex->slot_bytes = RoundUp(q_bytes) + RoundUp(ids_bytes) + RoundUp(o_bytes) + RoundUp(lse_bytes);
  ex->total_bytes = ex->header_bytes + size_t(n_slots) * ex->slot_bytes;
  if (ex->gpu) {
    Driver& cu = driver();
    if (!cu.Load()) return fail(cu.error);
    CUresult r = cu.Init(0);
    if (r != 0) return fail(cu.Describe(r, "cuInit"));
    CUdevice dev;
    CUcontext ctx;
    if ((r = cu.DeviceGet(&dev, device_ordinal)) != 0) return fail(cu.Describe(r, "cuDeviceGet"));
    if ((r = cu.PrimaryCtxRetain(&ctx, dev)) != 0) return fail(cu.Describe(r, "cuDevicePrimaryCtxRetain"));
    if ((r = cu.CtxPush(ctx)) != 0) return fail(cu.Describe(r, "cuCtxPushCurrent"));
    void* host = nullptr;
    r = cu.HostAlloc(&host, ex->total_bytes, kHostAllocPortable | kHostAllocDeviceMap);
    CUdeviceptr device = 0;
    if (r == 0) r = cu.HostGetDevicePointer(&device, host, 0);
    if (r == 0 && ex->timing) {
      ex->events.assign(5 * size_t(n_slots), nullptr);
      for (auto& event : ex->events)
        if (r == 0) r = cu.EventCreate(&event, 0);
    }
    CUcontext popped;
    cu.CtxPop(&popped);
    if (r != 0) return fail(cu.Describe(r, "pinned host allocation (cuMemHostAlloc, mapped)"));
    ex->host = static_cast<char*>(host);
    ex->device = device;
  } else {
    ex->host = static_cast<char*>(std::aligned_alloc(kAlign, RoundUp(ex->total_bytes)));
    if (ex->host == nullptr) return fail("host exchange: out of memory");
  }
  std::memset(ex->host, 0, ex->total_bytes);
  Destroy(g_exchanges[id].exchange(ex.release(), std::memory_order_acq_rel));
  return 0;
}

// Byte offsets of the layout inside the allocation (for NumPy views): out[0..7] = ready, done,
// failed, first slot's q, ids, o, lse, slot stride; and out[8] = the host address of the allocation.
__attribute__((visibility("default"))) int jh_exchange_layout(int id, int64_t* out) {
  Exchange* ex = Lookup(id);
  if (ex == nullptr) return -1;
  out[0] = 0;
  out[1] = int64_t(ex->done_offset(0));
  out[2] = int64_t(2 * RoundUp(4 * size_t(ex->n_slots)));
  out[3] = int64_t(ex->q_offset(0));
  out[4] = int64_t(ex->ids_offset(0));
  out[5] = int64_t(ex->o_offset(0));
  out[6] = int64_t(ex->lse_offset(0));
  out[7] = int64_t(ex->slot_bytes);
  out[8] = int64_t(reinterpret_cast<intptr_t>(ex->host));
  out[9] = int64_t(ex->total_bytes);
  return 0;
}

// The host side failed (or timed out): keep the message, raise `failed`, release every slot so that
// no stream or collect waits forever (the worker has written poison outputs).
__attribute__((visibility("default"))) void jh_exchange_fail(int id, const char* message) {
  Exchange* ex = Lookup(id);
  if (ex == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(ex->message_mu);
    if (ex->message.empty()) ex->message = message;
  }
  __atomic_store_n(ex->failed(), 1u, __ATOMIC_RELEASE);
  for (int slot = 0; slot < ex->n_slots; ++slot)
    __atomic_store_n(ex->done() + slot, ex->submitted[slot].load() + (1u << 30), __ATOMIC_RELEASE);
}

// Timing of the steps since the last call (call once they have run): out[0] = milliseconds the
// stream (or the CPU collects) waited for the host, out[1] = milliseconds of the exchange's own GPU
// work (copies, flag write; GPU only), out[2] = layer exchanges timed. 0, or -1 when timing is off.
__attribute__((visibility("default"))) int jh_exchange_timing(int id, double* out) {
  Exchange* ex = Lookup(id);
  if (ex == nullptr || !ex->timing) return -1;
  out[0] = out[1] = out[2] = 0.0;
  if (!ex->gpu) {
    std::lock_guard<std::mutex> lock(ex->timing_mu);
    out[0] = ex->cpu_wait_s * 1e3;
    out[2] = double(ex->cpu_waits);
    ex->cpu_wait_s = 0.0;
    ex->cpu_waits = 0;
    return 0;
  }
  Driver& cu = driver();
  for (int slot = 0; slot < ex->n_slots; ++slot) {
    if (!ex->recorded[slot]) continue;
    CUevent* e = &ex->events[5 * size_t(slot)];
    float submit = 0, wait = 0, collect = 0;
    if (cu.EventElapsedTime(&submit, e[0], e[1]) != 0 || cu.EventElapsedTime(&wait, e[2], e[3]) != 0 ||
        cu.EventElapsedTime(&collect, e[3], e[4]) != 0)
      continue;  // not complete (or not recorded this step)
    out[0] += wait;
    out[1] += submit + collect;
    out[2] += 1;
    ex->recorded[slot] = 0;
  }
  return 0;
}

// Sequence number of the last submit enqueued for a slot (what its collect waits for).
__attribute__((visibility("default"))) int64_t jh_exchange_submitted(int id, int slot) {
  Exchange* ex = Lookup(id);
  if (ex == nullptr || slot < 0 || slot >= ex->n_slots) return -1;
  return ex->submitted[slot].load();
}

// Free the batch's buffers (the id stays reserved; the backend may open again). Call once no step
// of the batch is running.
__attribute__((visibility("default"))) void jh_exchange_close(int id) {
  if (id < 0 || id >= kMaxExchanges) return;
  Destroy(g_exchanges[id].exchange(nullptr, std::memory_order_acq_rel));
}

// Tensor parallelism: calls of exchange `id` made on the device of XLA ordinal `ordinal` go to
// exchange `target` (-1: no route). 0, or -1 for an id out of range or a full route table.
__attribute__((visibility("default"))) int jh_exchange_route(int id, int64_t ordinal, int target) {
  if (id < 0 || id >= kMaxExchanges || target < -1 || target >= kMaxExchanges) return -1;
  std::lock_guard<std::mutex> lock(g_route_mu);
  int n = g_route_count.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    if (g_routes[i].id.load() == id && g_routes[i].ordinal.load() == ordinal) {
      g_routes[i].target.store(target, std::memory_order_release);
      return 0;
    }
  }
  if (n == kMaxRoutes) return -1;
  g_routes[n].id.store(id);
  g_routes[n].ordinal.store(ordinal);
  g_routes[n].target.store(target);
  g_route_count.store(n + 1, std::memory_order_release);
  return 0;
}

// The backend is gone: close and give the id back (and drop its routes).
__attribute__((visibility("default"))) void jh_exchange_release(int id) {
  jh_exchange_close(id);
  std::lock_guard<std::mutex> lock(g_create_mu);
  if (id >= 0 && id < kMaxExchanges) g_reserved[id] = false;
  std::lock_guard<std::mutex> route_lock(g_route_mu);
  int n = g_route_count.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i)
    if (g_routes[i].id.load() == id) g_routes[i].target.store(-1, std::memory_order_release);
}

}  // extern "C"
