/*
 * A minimal NVTX tool: it records the domain ranges a process opens and closes.
 *
 * NVTX calls do nothing until a tool attaches: the first NVTX call of a process reads
 * NVTX_INJECTION64_PATH, loads the library named there and calls its
 * InitializeInjectionNvtx2, which fills in the functions the tool handles. Nsight Systems
 * attaches this way; so does this file, built as a shared library, so that what
 * BatchScope's --nvtx sends can be read back where no profiler is installed:
 *
 *     gcc -shared -fPIC -O2 -o libnvtx_tool.so nvtx_tool.c
 *     NVTX_INJECTION64_PATH=$PWD/libnvtx_tool.so BATCHSCOPE_NVTX_CAPTURE=ranges.tsv \
 *         batchscope serve --nvtx ...
 *
 * Each line of the capture file is tab-separated:
 *     push  pid  tid  domain  message  payload-type  payload
 *     pop   pid  tid  domain
 * (payload-type as NVTX numbers it: 1 uint64, 2 int64, 0 none). Lines are appended
 * with one write each, so several processes (a server and its device processes) can
 * share one file. The definitions below mirror the stable NVTX v3 tool interface
 * (nvtxDetail/nvtxTypes.h and nvToolsExt.h) so that no CUDA headers are needed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*NvtxFunctionPointer)(void);
typedef NvtxFunctionPointer **NvtxFunctionTable;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, NvtxFunctionTable *out_table, unsigned int *out_size);
} NvtxExportTableCallbacks;
typedef const void *(*NvtxGetExportTableFunc_t)(uint32_t export_table_id);

enum { NVTX_ETID_CALLBACKS = 1, NVTX_CB_MODULE_CORE2 = 5 };
enum {
    CBID_DomainRangePushEx = 4,
    CBID_DomainRangePop = 5,
    CBID_DomainNameCategoryA = 8,
    CBID_DomainRegisterStringA = 10,
    CBID_DomainCreateA = 12,
    CBID_DomainDestroy = 14,
};
enum { MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3 };

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    union { uint64_t u64; int64_t i64; double f64; uint32_t u32; int32_t i32; float f32; } payload;
    int32_t message_type;
    union { const char *ascii; const void *unicode; const char *registered; } message;
} EventAttributes;

/* a domain or a registered string is a copy of its name, its handle the copy's address */
static int out_fd = -1;

static void emit(const char *line, int n) {
    if (out_fd >= 0 && n > 0) {
        ssize_t ignored = write(out_fd, line, (size_t)n);
        (void)ignored;
    }
}

static const char *name_of(const void *domain) { return domain ? (const char *)domain : ""; }

static void *domain_create(const char *name) { return strdup(name ? name : ""); }
static void domain_destroy(void *domain) { (void)domain; /* kept: handles may outlive it */ }
static void name_category(void *domain, uint32_t category, const char *name) {
    (void)domain; (void)category; (void)name;
}
static void *register_string(void *domain, const char *string) {
    (void)domain;
    return strdup(string ? string : "");
}

static int range_push(void *domain, const EventAttributes *attr) {
    char line[1024];
    const char *message = "";
    if (attr && (attr->message_type == MESSAGE_ASCII || attr->message_type == MESSAGE_REGISTERED))
        message = attr->message.ascii ? attr->message.ascii : "";
    int type = attr ? attr->payload_type : 0;
    long long payload = 0;
    if (type == 1 || type == 2) payload = (long long)attr->payload.i64;
    else if (type == 4 || type == 5) payload = (long long)attr->payload.i32;
    int n = snprintf(line, sizeof line, "push\t%d\t%ld\t%s\t%s\t%d\t%lld\n", (int)getpid(),
                     (long)syscall(SYS_gettid), name_of(domain), message, type, payload);
    emit(line, n < (int)sizeof line ? n : (int)sizeof line - 1);
    return 0;
}

static int range_pop(void *domain) {
    char line[512];
    int n = snprintf(line, sizeof line, "pop\t%d\t%ld\t%s\n", (int)getpid(),
                     (long)syscall(SYS_gettid), name_of(domain));
    emit(line, n);
    return 0;
}

static void set(NvtxFunctionTable table, unsigned int size, unsigned int id, NvtxFunctionPointer fn) {
    if (id < size && table[id]) *table[id] = fn;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const char *path = getenv("BATCHSCOPE_NVTX_CAPTURE");
    if (!path || !*path) return 0;
    out_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (out_fd < 0) return 0;
    const NvtxExportTableCallbacks *callbacks = get_export_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!callbacks || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || !table)
        return 0;
    set(table, size, CBID_DomainCreateA, (NvtxFunctionPointer)domain_create);
    set(table, size, CBID_DomainDestroy, (NvtxFunctionPointer)domain_destroy);
    set(table, size, CBID_DomainNameCategoryA, (NvtxFunctionPointer)name_category);
    set(table, size, CBID_DomainRegisterStringA, (NvtxFunctionPointer)register_string);
    set(table, size, CBID_DomainRangePushEx, (NvtxFunctionPointer)range_push);
    set(table, size, CBID_DomainRangePop, (NvtxFunctionPointer)range_pop);
    return 1;
}
