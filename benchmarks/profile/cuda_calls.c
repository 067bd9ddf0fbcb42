/* Counts and times the CUDA driver calls a TensorFlow process makes, without
 * the profiler (which turns XLA's command buffers off).
 *
 * TensorFlow and XLA do not link libcuda: their stub opens it with dlopen and
 * finds each function with dlsym (xla/tsl/cuda/cuda_stub.cc). Loaded with
 * LD_PRELOAD, this library's dlsym answers those lookups for the functions
 * below with wrappers that count each call and the time spent in it, then
 * call the driver. Everything else goes to the real dlsym.
 *
 * Build:  gcc -O2 -shared -fPIC -o cuda_calls.so cuda_calls.c -ldl
 * Use:    LD_PRELOAD=/path/cuda_calls.so python ...; in the process,
 *         ctypes.CDLL(None).cuda_calls_snapshot(buf) copies the counters
 *         (see benchmarks/profile/host_lead.py --cuda-calls).
 * Calls by cuBLAS, cuDNN and the CUDA runtime are not seen: they find the
 * driver's functions through cuGetProcAddress.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void *(*dlsym_fn)(void *, const char *);

static dlsym_fn real_dlsym(void) {
  static dlsym_fn fn = 0;
  if (!fn) {
    fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!fn) fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  }
  return fn;
}

enum {
  STREAM_SYNC, EVENT_SYNC, CTX_SYNC, MEMCPY_DTOH, MEMCPY_HTOD, MEMCPY_DTOH_ASYNC,
  MEMCPY_HTOD_ASYNC, LAUNCH_KERNEL, LAUNCH_KERNEL_EX, GRAPH_LAUNCH, GRAPH_EXEC_UPDATE,
  GRAPH_INSTANTIATE, STREAM_WAIT_EVENT, EVENT_RECORD, EVENT_QUERY, STREAM_QUERY,
  GRAPH_KERNEL_SET_PARAMS, N_CALLS
};
static const char *NAMES[N_CALLS] = {
  "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2",
  "cuMemcpyHtoD_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2", "cuLaunchKernel",
  "cuLaunchKernelEx", "cuGraphLaunch", "cuGraphExecUpdate_v2", "cuGraphInstantiateWithFlags",
  "cuStreamWaitEvent", "cuEventRecord", "cuEventQuery", "cuStreamQuery",
  "cuGraphExecKernelNodeSetParams_v2",
};
static void *REAL[N_CALLS];
static volatile long long COUNT[N_CALLS], NS[N_CALLS];
/* backtraces of the next `armed` synchronizing calls and device-to-host copies, on stderr */
static volatile int armed = 0;

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void account(int i, long long start) {
  __atomic_add_fetch(&COUNT[i], 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&NS[i], now_ns() - start, __ATOMIC_RELAXED);
}

static void trace(int i) {
  if (armed > 0 && __atomic_sub_fetch(&armed, 1, __ATOMIC_RELAXED) >= 0) {
    void *frames[24];
    int n = backtrace(frames, 24);
    fprintf(stderr, "cuda_calls: %s from\n", NAMES[i]);
    backtrace_symbols_fd(frames, n, 2);
  }
}

/* CUDA's handles are pointers, its results ints; the prototypes need only agree
 * in size and kind with cuda.h's. */
typedef int CUresult;
typedef void *H;

#define TIMED(i, call)                   \
  long long start = now_ns();            \
  CUresult r = call;                     \
  account(i, start);                     \
  return r

static CUresult w_stream_sync(H s) {
  trace(STREAM_SYNC);
  TIMED(STREAM_SYNC, ((CUresult(*)(H))REAL[STREAM_SYNC])(s));
}
static CUresult w_event_sync(H e) {
  trace(EVENT_SYNC);
  TIMED(EVENT_SYNC, ((CUresult(*)(H))REAL[EVENT_SYNC])(e));
}
static CUresult w_ctx_sync(void) {
  trace(CTX_SYNC);
  TIMED(CTX_SYNC, ((CUresult(*)(void))REAL[CTX_SYNC])());
}
static CUresult w_dtoh(void *dst, uint64_t src, size_t n) {
  trace(MEMCPY_DTOH);
  TIMED(MEMCPY_DTOH, ((CUresult(*)(void *, uint64_t, size_t))REAL[MEMCPY_DTOH])(dst, src, n));
}
static CUresult w_htod(uint64_t dst, const void *src, size_t n) {
  trace(MEMCPY_HTOD);
  TIMED(MEMCPY_HTOD, ((CUresult(*)(uint64_t, const void *, size_t))REAL[MEMCPY_HTOD])(dst, src, n));
}
static CUresult w_dtoh_async(void *dst, uint64_t src, size_t n, H s) {
  trace(MEMCPY_DTOH_ASYNC);
  TIMED(MEMCPY_DTOH_ASYNC,
        ((CUresult(*)(void *, uint64_t, size_t, H))REAL[MEMCPY_DTOH_ASYNC])(dst, src, n, s));
}
static CUresult w_htod_async(uint64_t dst, const void *src, size_t n, H s) {
  TIMED(MEMCPY_HTOD_ASYNC,
        ((CUresult(*)(uint64_t, const void *, size_t, H))REAL[MEMCPY_HTOD_ASYNC])(dst, src, n, s));
}
static CUresult w_launch(H f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shmem, H s, void **params, void **extra) {
  TIMED(LAUNCH_KERNEL,
        ((CUresult(*)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H,
                      void **, void **))REAL[LAUNCH_KERNEL])(f, gx, gy, gz, bx, by, bz, shmem, s,
                                                              params, extra));
}
static CUresult w_launch_ex(const void *config, H f, void **params, void **extra) {
  TIMED(LAUNCH_KERNEL_EX,
        ((CUresult(*)(const void *, H, void **, void **))REAL[LAUNCH_KERNEL_EX])(config, f, params,
                                                                                extra));
}
static CUresult w_graph_launch(H g, H s) {
  TIMED(GRAPH_LAUNCH, ((CUresult(*)(H, H))REAL[GRAPH_LAUNCH])(g, s));
}
static CUresult w_graph_update(H e, H g, void *info) {
  TIMED(GRAPH_EXEC_UPDATE, ((CUresult(*)(H, H, void *))REAL[GRAPH_EXEC_UPDATE])(e, g, info));
}
static CUresult w_graph_instantiate(H *e, H g, unsigned long long flags) {
  TIMED(GRAPH_INSTANTIATE,
        ((CUresult(*)(H *, H, unsigned long long))REAL[GRAPH_INSTANTIATE])(e, g, flags));
}
static CUresult w_wait_event(H s, H e, unsigned flags) {
  TIMED(STREAM_WAIT_EVENT, ((CUresult(*)(H, H, unsigned))REAL[STREAM_WAIT_EVENT])(s, e, flags));
}
static CUresult w_event_record(H e, H s) {
  TIMED(EVENT_RECORD, ((CUresult(*)(H, H))REAL[EVENT_RECORD])(e, s));
}
static CUresult w_event_query(H e) {
  TIMED(EVENT_QUERY, ((CUresult(*)(H))REAL[EVENT_QUERY])(e));
}
static CUresult w_stream_query(H s) {
  TIMED(STREAM_QUERY, ((CUresult(*)(H))REAL[STREAM_QUERY])(s));
}
static CUresult w_kernel_node_params(H e, H node, const void *params) {
  TIMED(GRAPH_KERNEL_SET_PARAMS,
        ((CUresult(*)(H, H, const void *))REAL[GRAPH_KERNEL_SET_PARAMS])(e, node, params));
}

static void *WRAPPERS[N_CALLS] = {
  (void *)w_stream_sync, (void *)w_event_sync, (void *)w_ctx_sync, (void *)w_dtoh,
  (void *)w_htod, (void *)w_dtoh_async, (void *)w_htod_async, (void *)w_launch,
  (void *)w_launch_ex, (void *)w_graph_launch, (void *)w_graph_update,
  (void *)w_graph_instantiate, (void *)w_wait_event, (void *)w_event_record,
  (void *)w_event_query, (void *)w_stream_query, (void *)w_kernel_node_params,
};

void *dlsym(void *handle, const char *name) {
  void *real = real_dlsym()(handle, name);
  if (!real || name[0] != 'c' || name[1] != 'u') return real;
  for (int i = 0; i < N_CALLS; i++) {
    if (strcmp(name, NAMES[i]) == 0) {
      REAL[i] = real;
      return WRAPPERS[i];
    }
  }
  return real;
}

/* out: 2 * N_CALLS long longs (counts, then nanoseconds); returns N_CALLS */
int cuda_calls_snapshot(long long *out) {
  for (int i = 0; i < N_CALLS; i++) {
    out[i] = COUNT[i];
    out[N_CALLS + i] = NS[i];
  }
  return N_CALLS;
}

const char *cuda_calls_name(int i) { return i >= 0 && i < N_CALLS ? NAMES[i] : 0; }

/* whether each function was found through this dlsym (1) or never looked up (0) */
int cuda_calls_seen(int i) { return i >= 0 && i < N_CALLS && REAL[i] != 0; }

void cuda_calls_arm(int n) { armed = n; }
