// A stand-in CUDA driver (libcuda.so.1) for compiling Mosaic GPU kernels on a machine without a GPU.
//
// jax's CUDA plugin exports MosaicGpuCompile(module, size): it asks the driver for the current device's compute
// capability, runs Mosaic GPU's MLIR pipeline, LLVM's NVPTX backend and ptxas, then loads the cubin with
// cuModuleLoadData. This library answers those driver calls without a device:
//   - cuDeviceGetAttribute reports compute capability $FAKE_CUDA_CC (default "90": sm_90a, the H100/H200);
//   - cuModuleLoadData writes the image it is handed to $FAKE_CUDA_DUMP_DIR/module_<n>.cubin;
//   - cuFuncSetAttribute appends "<attribute> <value>" to $FAKE_CUDA_DUMP_DIR/func_attributes.txt
//     (attribute 8 is the kernel's dynamic shared memory);
//   - everything else the compile path touches returns success; cuGetProcAddress resolves only what is here.
// Nothing is ever launched. Built by benchmarks/mosaic_offline.py with the soname libcuda.so.1, and loaded before
// the plugin, so the plugin's own dlopen("libcuda.so.1") finds this one.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
static int module_counter = 0;
static int fake_handle[16];

static void trace(const char *name) {
  if (getenv("FAKE_CUDA_TRACE")) fprintf(stderr, "fakecuda: %s\n", name);
}

static const char *dump_dir(void) {
  const char *dir = getenv("FAKE_CUDA_DUMP_DIR");
  return dir ? dir : ".";
}

CUresult cuInit(unsigned flags) { trace("cuInit"); return 0; }
CUresult cuDriverGetVersion(int *version) { trace("cuDriverGetVersion"); *version = 13000; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { trace("cuDeviceGet"); *device = 0; return 0; }
CUresult cuDeviceGetCount(int *count) { trace("cuDeviceGetCount"); *count = 1; return 0; }
CUresult cuCtxGetDevice(int *device) { trace("cuCtxGetDevice"); *device = 0; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { trace("cuCtxGetCurrent"); *ctx = fake_handle; return 0; }
CUresult cuCtxPushCurrent(void *ctx) { trace("cuCtxPushCurrent"); return 0; }
CUresult cuCtxPopCurrent(void **ctx) { trace("cuCtxPopCurrent"); if (ctx) *ctx = fake_handle; return 0; }

CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  trace("cuDeviceGetAttribute");
  const char *cc = getenv("FAKE_CUDA_CC");
  int ccv = cc ? atoi(cc) : 90;
  switch (attribute) {
    case 75: *value = ccv / 10; break;    // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    case 76: *value = ccv % 10; break;    // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
    case 16: *value = 132; break;         // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (H100 SXM / H200)
    case 97: *value = 232448; break;      // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    default: *value = 0;
  }
  return 0;
}

// The size of an ELF image: the furthest end of its section table, program table and section contents.
static size_t elf_size(const unsigned char *image) {
  if (memcmp(image, ELFMAG, SELFMAG) != 0) return 0;
  const Elf64_Ehdr *header = (const Elf64_Ehdr *)image;
  size_t end = header->e_shoff + (size_t)header->e_shnum * header->e_shentsize;
  size_t programs = header->e_phoff + (size_t)header->e_phnum * header->e_phentsize;
  if (programs > end) end = programs;
  const Elf64_Shdr *sections = (const Elf64_Shdr *)(image + header->e_shoff);
  for (int i = 0; i < header->e_shnum; i++) {
    size_t section_end = sections[i].sh_offset + sections[i].sh_size;
    if (sections[i].sh_type != SHT_NOBITS && section_end > end) end = section_end;
  }
  return end;
}

CUresult cuModuleLoadData(void **module, const void *image) {
  trace("cuModuleLoadData");
  const unsigned char *bytes = image;
  int is_elf = memcmp(bytes, ELFMAG, SELFMAG) == 0;
  size_t size = is_elf ? elf_size(bytes) : strlen((const char *)bytes);
  char path[4096];
  snprintf(path, sizeof path, "%s/module_%d.%s", dump_dir(), module_counter++, is_elf ? "cubin" : "ptx");
  FILE *file = fopen(path, "wb");
  if (!file) return 1;  // CUDA_ERROR_INVALID_VALUE: the caller sees the failure rather than a missing file
  fwrite(bytes, 1, size, file);
  fclose(file);
  *module = fake_handle;
  return 0;
}

CUresult cuModuleLoadDataEx(void **module, const void *image, unsigned n, void *options, void **values) {
  return cuModuleLoadData(module, image);
}

CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  trace("cuModuleGetFunction");
  *function = fake_handle;
  return 0;
}

CUresult cuModuleUnload(void *module) { trace("cuModuleUnload"); return 0; }

CUresult cuFuncSetAttribute(void *function, int attribute, int value) {
  trace("cuFuncSetAttribute");
  char path[4096];
  snprintf(path, sizeof path, "%s/func_attributes.txt", dump_dir());
  FILE *file = fopen(path, "a");
  if (file) {
    fprintf(file, "%d %d\n", attribute, value);
    fclose(file);
  }
  return 0;
}

CUresult cuGetErrorString(int error, const char **text) { *text = "fakecuda: not a real driver"; return 0; }
CUresult cuGetErrorName(int error, const char **text) { *text = "FAKECUDA_ERROR"; return 0; }

CUresult cuGetProcAddress(const char *symbol, void **function, int version, uint64_t flags, int *status) {
  trace("cuGetProcAddress");
  *function = dlsym(RTLD_DEFAULT, symbol);
  if (status) *status = *function ? 0 : 1;
  return *function ? 0 : 500;  // CUDA_ERROR_NOT_FOUND
}

CUresult cuGetProcAddress_v2(const char *symbol, void **function, int version, uint64_t flags, int *status) {
  return cuGetProcAddress(symbol, function, version, flags, status);
}
