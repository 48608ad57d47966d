/*
 * ascend_pool_acl.h - the subset of AscendCL that ascend-pool uses.
 *
 * Written for ascend-pool from the documented prototypes, enum values and
 * error codes of AscendCL (ACL 1.15 / 1.17); it is not a copy of the CANN
 * headers. bindgen turns it into src/source/acl/bindings.rs (see build.rs and
 * .ci/check-bindings.sh); the crate loads the functions at run time.
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#ifndef ASCEND_POOL_ACL_H
#define ASCEND_POOL_ACL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- scalar and handle types ------------------------------------------ */

/** Return code of every AscendCL call; 0 is success. */
typedef int aclError;
/** A stream: an ordered queue of device work. */
typedef void *aclrtStream;
/** An event recorded on a stream. */
typedef void *aclrtEvent;
/** A device context. */
typedef void *aclrtContext;
/** A handle to physical device memory (virtual memory management). */
typedef void *aclrtDrvMemHandle;
/** A shared buffer (mbuf), from acl_tdt_queue.h. */
typedef void *acltdtBuf;

/* ---- error codes (aclError) ------------------------------------------- */

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_MEMORY_ADDRESS_UNALIGNED 200003
#define ACL_ERROR_STORAGE_OVER_LIMIT 300000
#define ACL_ERROR_INTERNAL_ERROR 500000
#define ACL_ERROR_FAILURE 500001
#define ACL_ERROR_RT_FAILURE 500003
#define ACL_ERROR_DRV_FAILURE 500004
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_ADDR_UNALIGNED 107008
#define ACL_ERROR_RT_INVALID_HANDLE 107017
#define ACL_ERROR_RT_INVALID_MALLOC_TYPE 107018
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_MEMORY_FREE 207002
#define ACL_ERROR_RT_DEVICE_OOM 207018
#define ACL_ERROR_RT_DEVICE_MEM_ERROR 507053

/* ---- enums -------------------------------------------------------------- */

/** Page policy of aclrtMalloc / aclrtMallocAlign32 / aclrtMallocCached. */
typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
    ACL_MEM_MALLOC_HUGE1G_ONLY = 6,
    ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7
} aclrtMemMallocPolicy;

/* Flags or-ed into an aclrtMemMallocPolicy value. */
#define ACL_MEM_TYPE_LOW_BAND_WIDTH 0x0100
#define ACL_MEM_TYPE_HIGH_BAND_WIDTH 0x1000
#define ACL_MEM_ACCESS_USER_SPACE_READONLY 0x100000

/** Direction of aclrtMemcpy / aclrtMemcpyAsync. */
typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
    ACL_MEMCPY_DEFAULT = 4,
    ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE = 5,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE = 6,
    ACL_MEMCPY_INTER_DEVICE_TO_DEVICE = 7
} aclrtMemcpyKind;

/** Memory class asked about by aclrtGetMemInfo. */
typedef enum aclrtMemAttr {
    ACL_DDR_MEM = 0,
    ACL_HBM_MEM = 1,
    ACL_DDR_MEM_HUGE = 2,
    ACL_DDR_MEM_NORMAL = 3,
    ACL_HBM_MEM_HUGE = 4,
    ACL_HBM_MEM_NORMAL = 5,
    ACL_DDR_MEM_P2P_HUGE = 6,
    ACL_DDR_MEM_P2P_NORMAL = 7,
    ACL_HBM_MEM_P2P_HUGE = 8,
    ACL_HBM_MEM_P2P_NORMAL = 9,
    ACL_HBM_MEM_HUGE1G = 10,
    ACL_HBM_MEM_P2P_HUGE1G = 11
} aclrtMemAttr;

/** Answer of aclrtQueryEvent (note: COMPLETE is 0 here). */
typedef enum aclrtEventStatus {
    ACL_EVENT_STATUS_COMPLETE = 0,
    ACL_EVENT_STATUS_NOT_READY = 1,
    ACL_EVENT_STATUS_RESERVED = 2
} aclrtEventStatus;

/** Answer of aclrtQueryEventStatus (note: COMPLETE is 1 here). */
typedef enum aclrtEventRecordedStatus {
    ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
    ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
} aclrtEventRecordedStatus;

/** Kind of handle a physical allocation can be exported as. */
typedef enum aclrtMemHandleType {
    ACL_MEM_HANDLE_TYPE_NONE = 0,
    ACL_MEM_HANDLE_TYPE_POSIX = 2
} aclrtMemHandleType;

/** Allocation type of physical memory. */
typedef enum aclrtMemAllocationType {
    ACL_MEM_ALLOCATION_TYPE_PINNED = 0
} aclrtMemAllocationType;

/** Where physical memory lives. */
typedef enum aclrtMemLocationType {
    ACL_MEM_LOCATION_TYPE_HOST = 0,
    ACL_MEM_LOCATION_TYPE_DEVICE = 1,
    ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2
} aclrtMemLocationType;

/** Which granularity aclrtMemGetAllocationGranularity reports. */
typedef enum aclrtMemGranularityOptions {
    ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
} aclrtMemGranularityOptions;

/* Flags of aclrtMemExportToShareableHandle. */
#define ACL_RT_VMM_EXPORT_FLAG_DEFAULT 0x0
#define ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1

/* Buffer types of acltdtAllocBuf. */
#define ACL_TDT_NORMAL_MEM 0
#define ACL_TDT_DVPP_MEM 1

/** Device (or host) a physical allocation lives on. */
typedef struct aclrtMemLocation {
    uint32_t id;
    aclrtMemLocationType type;
} aclrtMemLocation;

/** Properties of a physical allocation (aclrtMallocPhysical). */
typedef struct aclrtPhysicalMemProp {
    aclrtMemHandleType handleType;
    aclrtMemAllocationType allocationType;
    aclrtMemAttr memAttr;
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

/* ---- initialisation and devices --------------------------------------- */

aclError aclInit(const char *configPath);
aclError aclFinalize(void);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
/* The calling thread's current device (the last aclrtSetDevice on it). */
aclError aclrtGetDevice(int32_t *deviceId);
/* How many devices the runtime has (ids 0..count); absent from older CANN. */
aclError aclrtGetDeviceCount(uint32_t *count);

/* ---- memory ------------------------------------------------------------- */

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);
aclError acldvppMalloc(void **devPtr, size_t size);
aclError acldvppFree(void *devPtr);
int32_t hi_mpi_dvpp_malloc(uint32_t dev_id, void **dev_ptr, uint64_t size);
int32_t hi_mpi_dvpp_free(void *dev_ptr);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count);
aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count,
                          aclrtStream stream);
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);

/* ---- streams and events ------------------------------------------------- */

aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtDestroyEvent(aclrtEvent event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtQueryEvent(aclrtEvent event, aclrtEventStatus *status);
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
aclError aclrtSynchronizeEvent(aclrtEvent event);

/* ---- virtual memory management ----------------------------------------- */

aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                          aclrtMemGranularityOptions option,
                                          size_t *granularity);
aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                uint64_t flags);
aclError aclrtReleaseMemAddress(void *virPtr);
aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                             const aclrtPhysicalMemProp *prop, uint64_t flags);
aclError aclrtFreePhysical(aclrtDrvMemHandle handle);
aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                     uint64_t flags);
aclError aclrtUnmapMem(void *virPtr);

/* ---- cross-process sharing of physical memory -------------------------- */

aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle,
                                         aclrtMemHandleType handleType, uint64_t flags,
                                         uint64_t *shareableHandle);
aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
                                           aclrtDrvMemHandle *handle);
aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum);
aclError aclrtDeviceGetBareTgid(int32_t *pid);

/* ---- shared buffers (mbuf) --------------------------------------------- */

aclError acltdtAllocBuf(size_t size, uint32_t type, acltdtBuf *buf);
aclError acltdtFreeBuf(acltdtBuf buf);
aclError acltdtGetBufData(const acltdtBuf buf, void **dataPtr, size_t *size);
aclError acltdtSetBufDataLen(acltdtBuf buf, size_t len);
aclError acltdtGetBufDataLen(acltdtBuf buf, size_t *len);
aclError acltdtSetBufUserData(acltdtBuf buf, const void *dataPtr, size_t size, size_t offset);
aclError acltdtGetBufUserData(const acltdtBuf buf, void *dataPtr, size_t size, size_t offset);
aclError acltdtCopyBufRef(const acltdtBuf buf, acltdtBuf *newBuf);

/* ---- one-sided communication (HCOMM, libhcomm.so) ---------------------- */

/* A communication thread (its work runs on the stream it was acquired with) and a channel
 * to one remote rank, both acquired through the communicator. */
typedef uint64_t ThreadHandle;
typedef uint64_t ChannelHandle;

/* Queues a write of len bytes from local src to dst in the remote rank's registered memory;
 * returns an HcclResult (0 on success). */
int32_t HcommWriteOnThread(ThreadHandle thread, ChannelHandle channel, void *dst,
                           const void *src, uint64_t len);

/* The channels' notifications, which order a write before the remote rank's reads: queue on
 * the thread's stream the record of notification remoteNotifyIdx at the far end of the
 * channel, or a wait (timeout in ms, 0 for ever) for notification localNotifyIdx of the
 * channel; indices below the channel's notifyNum. The library does not call them (the
 * application's communicator does); the drop-in libascendcl.so exports them. */
int32_t HcommChannelNotifyRecordOnThread(ThreadHandle thread, ChannelHandle channel,
                                         uint32_t remoteNotifyIdx);
int32_t HcommChannelNotifyWaitOnThread(ThreadHandle thread, ChannelHandle channel,
                                       uint32_t localNotifyIdx, uint32_t timeout);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_POOL_ACL_H */
