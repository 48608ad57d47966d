/*
 * ascend_pool.h: the C interface to ascend-pool (libascend_pool_capi.so).
 *
 * Pools, regions and streams are 64-bit handles, never 0 and never reused within a process,
 * so a freed, destroyed or foreign handle is refused with a status instead of touching memory.
 * Every function but ap_status_name and ap_last_error (which answer a name and a length)
 * returns an ap_status; on failure ap_last_error() tells what happened, and the
 * pool is left as it was unless the function says otherwise (ap_free, ap_share_publish,
 * ap_mbuf_publish, the closes). All functions may be called from any thread.
 *
 * A process made by fork() keeps its parent's handles but none of its other threads (nor, on
 * hardware, its device context): every call there on a pool, mapping or shared buffer the
 * parent made answers AP_ERR_FORKED, and destroying or closing one only forgets the handle.
 * The child makes pools of its own as any process does, even when the fork came while other
 * threads were inside calls.
 */
#ifndef ASCEND_POOL_H
#define ASCEND_POOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ap_status {
    AP_OK = 0,
    AP_ERR_NULL_ARGUMENT = 1,    /* a pointer the call writes or reads is NULL */
    AP_ERR_INVALID_ARGUMENT = 2, /* an unknown kind or source, the same region twice */
    AP_ERR_BAD_POOL = 3,         /* not a live pool: destroyed, or never created */
    AP_ERR_BAD_REGION = 4,       /* not a live region of this pool: freed, foreign, or 0 */
    AP_ERR_BAD_STREAM = 5,       /* not a live stream of this pool */
    AP_ERR_INVALID_SIZE = 6,     /* size 0, a size that overflows, an alignment refused */
    AP_ERR_OUT_OF_MEMORY = 7,    /* the pool and its source could not serve the request */
    AP_ERR_LIMIT_EXCEEDED = 8,   /* serving it would pass the configured limit */
    AP_ERR_OUT_OF_BOUNDS = 9,    /* a copy or fill past the end of a region, or of length 0;
                                  * a buffer's valid data length past its size */
    AP_ERR_MISALIGNED = 10,      /* an async copy whose ends are not 64-byte aligned */
    AP_ERR_WRONG_KIND = 11,      /* a kind the call does not take (streams: device and DVPP) */
    AP_ERR_CONFIG = 12,          /* a configuration string the pool refuses */
    AP_ERR_RUNTIME = 13,         /* an AscendCL call failed */
    AP_ERR_NOT_SUPPORTED = 14,   /* the runtime lacks a function */
    AP_ERR_LIBRARY_LOAD = 15,    /* libascendcl.so could not be loaded */
    AP_ERR_CORRUPTION = 16,      /* a segment's padding was overwritten (debug mode) */
    AP_ERR_INVALID_STATE = 17,   /* ap_pool_validate found a broken invariant */
    AP_ERR_PANIC = 18,           /* a bug inside the library; the call had no effect */
    AP_ERR_OTHER = 19,           /* anything else (see ap_last_error) */
    AP_ERR_BUFFER_TOO_SMALL = 20, /* the caller's buffer cannot hold the answer; its size was
                                     written */
    AP_ERR_BAD_MAPPING = 21,        /* not an open mapping: closed, or never opened */
    AP_ERR_SHARE_REFUSED = 22,      /* the exporting process did not let this one in */
    AP_ERR_SHARE_GONE = 23,         /* the published memory is no longer exported */
    AP_ERR_SHARE_ACCESS_FIXED = 24, /* memory first published to any process (or to listed
                                       ones) asked for under the other access */
    AP_ERR_BAD_BUFFER = 25,         /* not a live buffer of this pool, or not an open buffer
                                       of another process */
    AP_ERR_FORKED = 26,             /* a pool, mapping or buffer the process this one was
                                       forked from made: it is that process's; destroying or
                                       closing it here only forgets the handle */
    AP_ERR_IO = 27                  /* a file the pool writes (its recorded trace) could not
                                       be created or written */
} ap_status;

/* Memory kinds: which AscendCL call the pool's blocks come from. */
typedef enum ap_kind {
    AP_KIND_DEVICE = 0,         /* aclrtMalloc, with the pool's policy */
    AP_KIND_DEVICE_ALIGN32 = 1, /* aclrtMallocAlign32 */
    AP_KIND_CACHED = 2,         /* aclrtMallocCached */
    AP_KIND_DVPP = 3,           /* acldvppMalloc: 128-byte starts */
    AP_KIND_HOST = 4            /* aclrtMallocHost */
} ap_kind;

/* Where a pool's blocks come from. */
typedef enum ap_source {
    AP_SOURCE_SIM = 0, /* the simulator, on host memory: devices 0 to 7, as libascendcl.so's
                          simulator by default (one simulator per pool) */
    AP_SOURCE_ACL = 1,    /* libascendcl.so: $ASCEND_POOL_ACL_LIB, $ASCEND_HOME_PATH/lib64,
                             $ASCEND_TOOLKIT_HOME/lib64, then the loader path */
    AP_SOURCE_VMM_SIM = 2, /* the simulator's virtual memory: device chunks mapped into one
                              reserved range, regions other processes can open */
    AP_SOURCE_VMM_ACL = 3  /* the same over libascendcl.so's virtual-memory functions */
} ap_source;

typedef uint64_t ap_pool;
typedef uint64_t ap_region;
typedef uint64_t ap_stream;
typedef uint64_t ap_mapping;
typedef uint64_t ap_mbuf;
typedef uint64_t ap_shared_mbuf;

/* What a shared buffer's memory is (acltdtAllocBuf's type). */
typedef enum ap_mbuf_kind {
    AP_MBUF_NORMAL = 0, /* device memory, 128-byte starts */
    AP_MBUF_DVPP = 1    /* DVPP memory: cannot be shared between processes */
} ap_mbuf_kind;

typedef struct ap_region_info {
    uint64_t addr;  /* start; a device address for device kinds */
    uint64_t len;   /* usable bytes: the length asked for */
    uint64_t align; /* guaranteed start alignment */
    uint32_t kind;  /* an ap_kind */
    uint32_t reserved;
} ap_region_info;

/* One live segment of a leak report. */
typedef struct ap_segment_info {
    uint64_t addr;      /* the region's start */
    uint64_t offset;    /* in its chunk */
    uint64_t len;       /* bytes asked for */
    uint64_t footprint; /* bytes taken under the carve rule */
    uint32_t kind;      /* an ap_kind */
    uint32_t pending;   /* 1: freed, its memory waiting for a stream's work */
} ap_segment_info;

/* One padding overrun found in debug mode. */
typedef struct ap_corruption_info {
    uint64_t offset;    /* of the segment in its chunk */
    uint64_t len;       /* bytes asked for */
    uint64_t first_bad; /* first overwritten padding byte, from the segment's start */
    uint32_t kind;      /* an ap_kind */
    uint32_t reserved;  /* 0 */
} ap_corruption_info;

/* Counters of one kind; as the Rust KindStats. */
typedef struct ap_stats {
    uint64_t allocated_bytes;
    uint64_t requested_bytes;
    uint64_t reserved_bytes;
    uint64_t peak_allocated_bytes;
    uint64_t peak_requested_bytes;
    uint64_t peak_reserved_bytes;
    uint64_t live_regions;
    uint64_t allocations;
    uint64_t frees;
    uint64_t pending_frees;
    uint64_t chunks;
    uint64_t source_alloc_calls;
    uint64_t source_free_calls;
    uint64_t ooms;
    uint64_t cached_bytes;
    uint64_t cached_regions;
} ap_stats;

/* The status's name, e.g. "AP_ERR_BAD_REGION"; a static string. */
const char *ap_status_name(int status);
/* Copies the message of this thread's last failure into buf (NUL-terminated, cut to cap) and
 * returns its full length; 0 when the thread's last call succeeded (or, in a thread-local
 * destructor, when the message has gone with the thread). buf may be NULL if cap is 0. */
size_t ap_last_error(char *buf, size_t cap);

/* Which figures an ap_error_detail carries. */
typedef enum ap_error_figures {
    AP_FIGURES_NONE = 0,          /* none: the error carries no figures, or the call succeeded */
    AP_FIGURES_OUT_OF_MEMORY = 1, /* the pool and its source could not serve the request */
    AP_FIGURES_LIMIT = 2,         /* the kind's own limit ("limit:") would be passed */
    AP_FIGURES_TOTAL_LIMIT = 3    /* the total over the device kinds ("total_limit:") would be
                                     passed */
} ap_error_figures;

/* The figures of this thread's last failure, to decide what would help: trimming (reserved
 * well above in_use), freeing fragmented regions (reserved - in_use >= requested but
 * largest_free < requested), another kind or other kinds' memory (elsewhere), a larger limit.
 * Fields an error does not carry are 0. Set `size` to sizeof(ap_error_detail) before the
 * call: fields the library adds later go at the end, and a library older than the header
 * writes only the ones it has (its answer in `size`). */
typedef struct ap_error_detail {
    uint32_t size;         /* in: bytes of the caller's struct; out: bytes written */
    uint32_t status;       /* the last call's ap_status; AP_OK after a success */
    uint32_t figures;      /* an ap_error_figures: which of the fields below are set */
    uint32_t kind;         /* the ap_kind the figures are of */
    uint64_t requested;    /* bytes asked for */
    uint64_t reserved;     /* bytes the kind held from its source; for AP_FIGURES_TOTAL_LIMIT,
                              the bytes the pool's device kinds held together */
    uint64_t in_use;       /* bytes of the kind live in regions */
    uint64_t largest_free; /* the largest free range in any chunk of the kind */
    uint64_t limit;        /* the limit that would be passed (AP_FIGURES_*LIMIT) */
    int32_t source_code;   /* the runtime's aclError when the source refused, else 0 */
    uint32_t reserved_pad;
    uint64_t elsewhere[5]; /* by ap_kind: bytes each other device kind holds reserved, when
                              the source refused device memory or the total was hit; 0 for
                              the kind itself and for host memory */
} ap_error_detail;

/* Copies the figures of this thread's last failure into *out (out->size bytes at most, as
 * ap_last_error copies its message). It does not change the last failure: its own status is
 * AP_ERR_NULL_ARGUMENT for a NULL out and AP_ERR_INVALID_ARGUMENT for an out->size under 8. */
ap_status ap_last_error_detail(ap_error_detail *out);

/* A pool over `source`. `conf` is in ASCEND_POOL_CONF syntax ("chunk_size:64m,limit:2g");
 * NULL reads $ASCEND_POOL_CONF (defaults when unset). */
ap_status ap_pool_create(ap_source source, const char *conf, ap_pool *out);
/* Destroys a pool: its streams are synchronized and destroyed, its live regions and buffer
 * handles freed (their number in *freed_regions, which may be NULL), its blocks returned to
 * the source. Calls on the pool already running on other threads finish first; later ones get
 * AP_ERR_BAD_POOL. The handle is gone whatever the status: a stream the runtime failed to
 * synchronize is reported (AP_ERR_RUNTIME, the code in ap_last_error) after the pool is gone, and the
 * blocks such a stream may still write are kept from the source rather than returned. A stream the
 * runtime will not wait for when it is destroyed is kept, as ap_stream_destroy keeps one, and
 * waited for once more before the pool goes (as ap_pool_synchronize does); one still refused
 * then stays kept for good. In debug mode, an overwritten padding in a region freed here is
 * AP_ERR_CORRUPTION (the first one in ap_last_error; everything is freed all the same), after a
 * stream's failure if there is one. In a
 * child made by fork() after the pool was made, only the handle goes (nothing freed,
 * *freed_regions 0, AP_OK). */
ap_status ap_pool_destroy(ap_pool pool, uint64_t *freed_regions);
ap_status ap_pool_stats(ap_pool pool, ap_kind kind, ap_stats *out);
/* Checks every invariant of every chunk; AP_ERR_INVALID_STATE names the first broken one. */
ap_status ap_pool_validate(ap_pool pool);
/* Gives empty chunks back to the source; *released (may be NULL) gets the bytes. First
 * destroys the streams ap_stream_destroy had to keep (see there) that have run their work. */
ap_status ap_pool_trim(ap_pool pool, uint64_t *released);
/* Waits until every free waiting on a stream has completed. First waits for the streams
 * ap_stream_destroy had to keep (see there) and destroys them once the runtime answers. */
ap_status ap_pool_synchronize(ap_pool pool);
/* Lowers every kind's peaks to its current figures: the peaks ap_pool_stats reads afterwards
 * are those of what ran since. */
ap_status ap_pool_reset_peak_stats(ap_pool pool);
/* The next four answer in the caller's buffer, all or nothing: *count or *needed gets the
 * size of the answer (entries; bytes with the NUL), and a smaller or NULL buffer gets nothing
 * and AP_ERR_BUFFER_TOO_SMALL, so a first call with cap 0 asks for the size. */
/* The live segments of every kind, by address: regions not freed, and freed ones whose memory
 * waits for a stream. With none, any buffer (NULL included) gets *count 0 and AP_OK. */
ap_status ap_pool_leak_report(ap_pool pool, ap_segment_info *out, size_t cap, size_t *count);
/* Takes the padding overruns debug mode found since the last call: those ap_free answered with
 * AP_ERR_CORRUPTION and those no call could answer (a region another thread's call still held
 * when it was freed, a shared buffer's last handle dropped, and a region freed while its
 * streams still had work queued, checked again once they have passed it). A buffer too small
 * takes none.
 * At most 1,024 are kept between two calls; every one is printed on standard error. */
ap_status ap_pool_take_corruption_reports(ap_pool pool, ap_corruption_info *out, size_t cap,
                                          size_t *count);
/* The pool's chunks and live segments as a JSON object (the Rust PoolSnapshot), with the bytes
   the device kinds hold together ("device_reserved_bytes") and "total_limit" when one is set. */
ap_status ap_pool_snapshot_json(ap_pool pool, char *buf, size_t cap, size_t *needed);
/* A picture of the pool as SVG: each chunk a bar of allocated, padding and free bytes. */
ap_status ap_pool_picture_svg(ap_pool pool, char *buf, size_t cap, size_t *needed);
/* Writes out the trace of a pool created with "record:PATH"; does nothing without one.
 * AP_ERR_IO when the trace could not be written (the first write error since the pool was
 * created; recording stopped there). */
ap_status ap_pool_flush_record(ap_pool pool);

ap_status ap_alloc(ap_pool pool, ap_kind kind, uint64_t len, ap_region *out);
/* Device memory (the pool's policy) starting at a multiple of align, a power of two from 64 to
 * 1 GiB (another is AP_ERR_INVALID_SIZE). */
ap_status ap_alloc_aligned(ap_pool pool, uint64_t len, uint64_t align, ap_region *out);
/* Device memory with 128-byte starts, fit for model input. */
ap_status ap_alloc_model_input(ap_pool pool, uint64_t len, ap_region *out);
/* Device or DVPP memory (AP_KIND_DEVICE or AP_KIND_DVPP; other kinds get AP_ERR_WRONG_KIND)
 * for work ordered on `stream`: memory freed while work on this stream still used it is
 * reused at once, the work running in stream order. */
ap_status ap_alloc_on(ap_pool pool, ap_kind kind, uint64_t len, ap_stream stream, ap_region *out);
/* Model input (device memory, 128-byte starts, as ap_alloc_model_input) for work ordered on
 * `stream`, reused as ap_alloc_on's memory is: memory freed while work on this stream still
 * used it is taken over at once when it has this length and a 128-byte start. */
ap_status ap_alloc_model_input_on(ap_pool pool, uint64_t len, ap_stream stream, ap_region *out);
/* Frees a region; if streams have work queued on it, its memory is reused once they pass it.
 * AP_ERR_CORRUPTION (debug mode) reports an overwritten padding: the region is freed all the
 * same, and the handle is gone. */
ap_status ap_free(ap_pool pool, ap_region region);
/* Where a region lies, how long it is, its start alignment and kind. Work the caller gives the
 * address itself is ordered by the caller: memory ap_alloc_on took over behind its stream's
 * work may still have that work to run. Work queued on that same stream runs after it; before
 * work on another stream, call ap_record_stream with that stream (it then waits for that
 * work); before a use by the host or by no stream here, synchronize the stream given to
 * ap_alloc_on. The library's own calls (copies, fills, ap_share_publish) do this themselves. */
ap_status ap_region_get_info(ap_pool pool, ap_region region, ap_region_info *out);
/* The bytes of a host region, once every stream with work queued on it has run that work. */
ap_status ap_host_ptr(ap_pool pool, ap_region region, void **out);
/* Marks a region as used by work the caller queues on `stream` itself; call it before queuing
 * that work: memory ap_alloc_on took over behind another stream's work has `stream` wait for it. */
ap_status ap_record_stream(ap_pool pool, ap_region region, ap_stream stream);

/* Synchronous copies and fills: they wait for streams with work queued on the regions first.
 * A host buffer given to a copy, read or write (here and below) holds `len` bytes that nothing
 * else uses during the call, and does not overlap the bytes at the other end of the copy. */
ap_status ap_copy_from_host(ap_pool pool, ap_region dst, uint64_t offset, const void *src,
                            uint64_t len);
ap_status ap_copy_to_host(ap_pool pool, ap_region src, uint64_t offset, void *dst, uint64_t len);
ap_status ap_copy(ap_pool pool, ap_region dst, uint64_t dst_offset, ap_region src,
                  uint64_t src_offset, uint64_t len);
ap_status ap_memset(ap_pool pool, ap_region dst, uint64_t offset, uint8_t value, uint64_t len);

ap_status ap_stream_create(ap_pool pool, ap_stream *out);
ap_status ap_stream_synchronize(ap_pool pool, ap_stream stream);
/* Waits for the stream's work, then destroys it; the handle goes even when the wait fails (the
 * runtime's error is returned). A stream the runtime will not wait for when it is destroyed is
 * kept instead, not destroyed under work it may still run: ap_pool_synchronize and
 * ap_pool_trim destroy it later. */
ap_status ap_stream_destroy(ap_pool pool, ap_stream stream);
/* Work queued on `stream` after this call runs after the work queued on `other` before it;
 * returns at once (with 8 such waits of `stream` still queued, it first waits for `stream`
 * to pass them). Waiting on itself does nothing. */
ap_status ap_stream_wait(ap_pool pool, ap_stream stream, ap_stream other);
/* Queued on `stream`; both ends 64-byte aligned, and not both host memory (the runtime does no
 * async copy within the host: AP_ERR_WRONG_KIND; use ap_copy). Both regions are recorded on the
 * stream. */
ap_status ap_copy_async(ap_pool pool, ap_region dst, uint64_t dst_offset, ap_region src,
                        uint64_t src_offset, uint64_t len, ap_stream stream);
ap_status ap_memset_async(ap_pool pool, ap_region dst, uint64_t offset, uint8_t value,
                          uint64_t len, ap_stream stream);
/* The runtime's own handle of `stream` (an aclrtStream over libascendcl.so), for a library
 * that queues work on the same stream, e.g. HCCL's HcclThreadAcquireWithStream. */
ap_status ap_stream_native(ap_pool pool, ap_stream stream, uint64_t *out);

/* One-sided write (HCOMM's HcommWriteOnThread): queues len bytes of `src` from src_offset
 * into the far end's window, window_len bytes at window_addr, at dst_offset, on the
 * communicator's `thread`, acquired on this stream's native handle; `channel` leads to the
 * rank that registered the window. The pool checks both ranges (AP_ERR_OUT_OF_BOUNDS, also
 * for len 0), refuses host memory (AP_ERR_WRONG_KIND), and records `src` on the stream, so it
 * may be freed at once. The handles and the window come from HCCL and are not checked here:
 * a thread on another stream could read `src` after its memory is reused. HCOMM's refusals
 * are AP_ERR_RUNTIME, with its HcclResult in ap_last_error; no HCOMM is AP_ERR_NOT_SUPPORTED. */
ap_status ap_write_remote(ap_pool pool, uint64_t thread, ap_stream stream, uint64_t channel,
                          uint64_t window_addr, uint64_t window_len, uint64_t dst_offset,
                          ap_region src, uint64_t src_offset, uint64_t len);

/* Sharing device memory between processes. A pool created over AP_SOURCE_VMM_SIM or
 * AP_SOURCE_VMM_ACL publishes a device region as a descriptor, a NUL-terminated text (answered
 * as ap_pool_snapshot_json answers) that another process passes to ap_share_open to map the
 * same physical memory. pids lists the npids processes let in, their ids
 * from ap_share_process_id in each; NULL lets any process in. Whether importers are checked
 * is fixed by the first publish of the memory behind a region, once it has exported it (a
 * publish the runtime refuses the whitelist of has). Other pools get
 * AP_ERR_NOT_SUPPORTED, other kinds AP_ERR_WRONG_KIND. Unlike the other answers by size, the
 * call that gets AP_ERR_BUFFER_TOO_SMALL has published already (an export cannot be taken
 * back): the processes are let in and the access is fixed; the same call again with room
 * gets the same descriptor. A region ap_alloc_on took over behind its stream's work is
 * published once that work has run (the call waits for it; AP_ERR_RUNTIME, nothing exported,
 * when the runtime cannot wait): the other process's reads and writes follow no stream here. */
ap_status ap_share_publish(ap_pool pool, ap_region region, const int32_t *pids, size_t npids,
                           char *buf, size_t cap, size_t *needed);
/* This process's id for an exporter's list, as the runtime behind `source` gives it. */
ap_status ap_share_process_id(ap_source source, int32_t *out);
/* Opens published memory through the runtime behind `source` (the simulator for AP_SOURCE_SIM
 * and AP_SOURCE_VMM_SIM, libascendcl.so for the others) on `device`. */
ap_status ap_share_open(ap_source source, int32_t device, const char *descriptor,
                        ap_mapping *out);

typedef struct ap_mapping_info {
    uint64_t addr;          /* where the published bytes start in this process */
    uint64_t len;           /* bytes published */
    uint64_t exporter_addr; /* where they start in the exporting process */
    int32_t exporter; /* the exporting process's id */
    uint32_t reserved;
} ap_mapping_info;

ap_status ap_mapping_get_info(ap_mapping mapping, ap_mapping_info *out);
ap_status ap_mapping_read(ap_mapping mapping, uint64_t offset, void *dst, uint64_t len);
ap_status ap_mapping_write(ap_mapping mapping, uint64_t offset, const void *src, uint64_t len);
/* Unmaps and frees the imported memory; the exporter's goes once every process has let go.
 * The handle is gone even when the runtime refuses a step (the status says which). */
ap_status ap_mapping_close(ap_mapping mapping);

/* Shared buffers (mbuf), in the manner of acltdtAllocBuf: a header in device memory with the
 * valid data length and 96 bytes of user data, then `size` bytes of data. Each handle is freed
 * on its own; the buffer goes back to the pool with its last handle (or the pool's destroy). */
ap_status ap_mbuf_alloc(ap_pool pool, uint64_t size, ap_mbuf_kind kind, ap_mbuf *out);
/* Another handle on the same buffer (acltdtCopyBufRef). */
ap_status ap_mbuf_copy_ref(ap_pool pool, ap_mbuf mbuf, ap_mbuf *out);
/* Frees a handle (acltdtFreeBuf). AP_ERR_CORRUPTION (debug mode) from the last handle's free
 * reports an overwritten padding, as ap_free does: the buffer is freed all the same, and the
 * handle is gone. */
ap_status ap_mbuf_free(ap_pool pool, ap_mbuf mbuf);

typedef struct ap_mbuf_info {
    uint64_t data;     /* device address of the data (acltdtGetBufData) */
    uint64_t size;     /* bytes of data */
    uint64_t data_len; /* the valid data length */
    uint32_t kind;     /* an ap_mbuf_kind */
    uint32_t refs;     /* handles on the buffer */
} ap_mbuf_info;

/* The header is in device memory any process holding the buffer's descriptor can write: a
 * valid data length there past the size gets AP_ERR_OUT_OF_BOUNDS (as ap_shared_mbuf_get_info),
 * and nothing is written to `out`. */
ap_status ap_mbuf_get_info(ap_pool pool, ap_mbuf mbuf, ap_mbuf_info *out);
ap_status ap_mbuf_write(ap_pool pool, ap_mbuf mbuf, uint64_t offset, const void *src,
                        uint64_t len);
ap_status ap_mbuf_read(ap_pool pool, ap_mbuf mbuf, uint64_t offset, void *dst, uint64_t len);
/* Marks a buffer as used by work the caller queues on `stream` on its data (call it before
 * queuing that work): the buffer goes back to the pool, with its last handle, only once that
 * work has run, and ap_mbuf_read/write wait for it. */
ap_status ap_mbuf_record_stream(ap_pool pool, ap_mbuf mbuf, ap_stream stream);
/* At most the size (acltdtSetBufDataLen). */
ap_status ap_mbuf_set_data_len(ap_pool pool, ap_mbuf mbuf, uint64_t len);
/* `len` bytes at `offset` of the 96 bytes of user data (acltdtSetBufUserData, ...Get...). */
ap_status ap_mbuf_set_user_data(ap_pool pool, ap_mbuf mbuf, uint64_t offset, const void *src,
                                uint64_t len);
ap_status ap_mbuf_get_user_data(ap_pool pool, ap_mbuf mbuf, uint64_t offset, void *dst,
                                uint64_t len);
/* Lets other processes open a device buffer of a pool over virtual memory, read-only; as
 * ap_share_publish. Read-only is what ap_shared_mbuf_* offer, not a protection of the memory:
 * the same descriptor opened with ap_share_open can be written. */
ap_status ap_mbuf_publish(ap_pool pool, ap_mbuf mbuf, const int32_t *pids, size_t npids,
                          char *buf, size_t cap, size_t *needed);
/* Opens a published buffer in this process; memory that is not a buffer, or not the buffer
 * published (freed since, or another allocated there since), gets AP_ERR_INVALID_ARGUMENT,
 * the rest as ap_share_open. */
ap_status ap_shared_mbuf_open(ap_source source, int32_t device, const char *descriptor,
                              ap_shared_mbuf *out);

typedef struct ap_shared_mbuf_info {
    uint64_t size;     /* bytes of data */
    uint64_t data_len; /* the valid data length its publisher set */
} ap_shared_mbuf_info;

/* A valid data length past the size (written by a process holding the descriptor) gets
 * AP_ERR_OUT_OF_BOUNDS, and nothing is written to `out`. */
ap_status ap_shared_mbuf_get_info(ap_shared_mbuf buf, ap_shared_mbuf_info *out);
ap_status ap_shared_mbuf_read(ap_shared_mbuf buf, uint64_t offset, void *dst, uint64_t len);
ap_status ap_shared_mbuf_get_user_data(ap_shared_mbuf buf, uint64_t offset, void *dst,
                                       uint64_t len);
ap_status ap_shared_mbuf_close(ap_shared_mbuf buf);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_POOL_H */
