/* Linked into the binaries of tools/tsan.sh only: tells ThreadSanitizer the
   ordering that gRPC core guarantees at its C API, which TSan cannot see for
   itself because Debian's libgrpc is not instrumented.

   grpc_call_start_batch(call, ops, n, tag) posts `tag` to the call's
   completion queue once the operations are done, and the thread that takes
   the tag out of the queue (grpc_completion_queue_next or _pluck: with the
   callback API, grpc++'s own threads, which then run the reactor's
   OnWriteDone, OnDone...) sees everything that the starting thread did before
   starting the batch. gRPC core orders the two with its own lock-free queues
   and atomics; a release on the tag's address when the batch starts and an
   acquire on it when the tag comes out make that ordering visible. Without
   them TSan reports the objects handed over from the thread that calls
   StartWrite or Finish to the gRPC thread that completes it (grpc++'s
   operation sets, our reactors), or not, depending on which other locks the
   two threads happened to share.

   These definitions take the place of libgrpc's (the executable comes first
   in the dynamic loader's search, for the calls from libgrpc++ too) and call
   them through dlsym(RTLD_NEXT). C, so that CMake's own C test programs link
   with it too. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <grpc/grpc.h>
#include <sanitizer/tsan_interface.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static void* Next(void** slot, const char* name) {
  void* f = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (f == NULL) {
    f = dlsym(RTLD_NEXT, name);
    if (f == NULL) {
      fprintf(stderr, "tsan_grpc: %s not found: %s\n", name, dlerror());
      abort();
    }
    __atomic_store_n(slot, f, __ATOMIC_RELEASE);
  }
  return f;
}

/* Tags are the addresses of gRPC's tag objects; anything else (a small
   integer used as a tag) has no memory for TSan to keep a clock for. */
static int IsAddress(const void* tag) { return (uintptr_t)tag >= 4096; }

static void Acquire(grpc_event event) {
  if (event.type == GRPC_OP_COMPLETE && IsAddress(event.tag)) __tsan_acquire(event.tag);
}

typedef grpc_call_error (*StartBatch)(grpc_call*, const grpc_op*, size_t, void*, void*);
typedef grpc_event (*QueueNext)(grpc_completion_queue*, gpr_timespec, void*);
typedef grpc_event (*QueuePluck)(grpc_completion_queue*, void*, gpr_timespec, void*);

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                      void* reserved) {
  static void* next;
  StartBatch start = (StartBatch)Next(&next, "grpc_call_start_batch");
  if (IsAddress(tag)) __tsan_release(tag);
  return start(call, ops, nops, tag, reserved);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                      void* reserved) {
  static void* next;
  grpc_event event = ((QueueNext)Next(&next, "grpc_completion_queue_next"))(cq, deadline, reserved);
  Acquire(event);
  return event;
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag, gpr_timespec deadline,
                                       void* reserved) {
  static void* next;
  grpc_event event =
      ((QueuePluck)Next(&next, "grpc_completion_queue_pluck"))(cq, tag, deadline, reserved);
  Acquire(event);
  return event;
}
