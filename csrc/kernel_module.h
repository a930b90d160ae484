// Loading of the ahead-of-time exported CuTe DSL kernel objects, and the choice of object per device.
//
// build/aot_compile.py exports every kernel object of jax_kda/contract.py once per gate variant
// (KERNEL_EXPORTS: the dtypes of g and beta) as a C header and object. An exported object is process-global: its wrapper launches through a kernel
// handle stored inside the object, so it is loaded once per process and never unloaded. The generated
// `<prefix>_Kernel_Module_Load` helper is not used: it only printf's CUDA errors, and it loads the
// object onto every device, which fails on a device of another architecture (an sm_90a cubin has no
// image for a 10.0 device). This loader calls the object's init / load-to-device entry points itself,
// only for devices of the object's architecture, and keeps the first error for every later caller.
// While loading it also resolves, for every device, every contract::Kernels request and every gate
// variant, which export serves it (contract::kKernelChoices), so that a launch only looks it up.
//
// Nothing here depends on XLA; errors are returned as strings (empty on success).

#ifndef JAX_KDA_CSRC_KERNEL_MODULE_H_
#define JAX_KDA_CSRC_KERNEL_MODULE_H_

#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kda_contract.h"

namespace jax_kda {

// The compiler target (e.g. "sm_90a") whose cubins run on a device of this compute capability, or
// nullptr (contract::kArchs: sm_100f family cubins serve 10.0 and 10.3).
const char* ArchForComputeCapability(int major, int minor);

// "cudaErrorInvalidValue (invalid argument)".
std::string CudaErrorText(cudaError_t error);

// The C entry points of one export; its symbols carry the prefix jax_kda_<name>.
struct ExportedObject {
  const char* name;                  // the export's stem (contract KERNEL_EXPORTS), for messages
  const char* object;                // its kernel object (contract KERNEL_OBJECTS), as kKernelChoices names it
  const char* arch;                  // the compiler target it was built for, e.g. "sm_90a"
  int gate_variant;                  // index into contract::kGateVariants: the g and beta dtypes it reads
  void (*init)(void**);              // _mlir_<prefix>_cuda_init: loads the embedded cubin as a cudaLibrary_t
  void (*load_to_device)(void**);    // _mlir_<prefix>_cuda_load_to_device: binds the kernel on one device
  cudaLibrary_t* library;            // the `module` field of the object's <prefix>_Kernel_Module_t
};

// The exported objects of one kernel, loaded once per process.
class KernelModules {
 public:
  explicit KernelModules(std::span<const ExportedObject> objects) : objects_(objects) {}

  // Loads each object onto every device of its architecture, the first time it is called in the
  // process; returns that first call's error (empty on success) on every call: an error of the whole
  // process (no device count, an object that does not load at all). An object that fails to load
  // onto one device is that device's error, which Resolve returns for it; the other devices keep
  // their kernels (one faulted or exclusive-mode GPU does not take them from every GPU).
  // Thread-safe. Must run outside CUDA graph capture: loading a cubin onto a device is not a stream
  // operation and is not allowed while a capture is recording. The FFI instantiate stage is such a place.
  const std::string& Load();

  // After a successful Load(): the index of the export that serves `kernels` with gate variant
  // `gate_variant` on `device` (a CUDA ordinal), or -1 with `*error`: the device's load error, or
  // its compute capability and what would serve it.
  int Resolve(contract::Kernels kernels, int gate_variant, int device, std::string* error) const;

  // The number of SMs of `device` after a successful Load() (0 for an unknown ordinal).
  int MultiprocessorCount(int device) const;

  std::span<const ExportedObject> objects() const { return objects_; }

 private:
  std::string LoadAll();

  std::span<const ExportedObject> objects_;
  std::once_flag once_;
  std::string load_error_;
  struct Device {
    int major = 0, minor = 0, multiprocessors = 0;
    std::string load_error;  // loading an object onto this device failed: why (empty otherwise)
    // Per contract::Kernels and gate variant: the export's index, or -1.
    std::array<std::array<int, contract::kNumGateVariants>, contract::kNumKernels> exports{};
  };
  std::vector<Device> devices_;
};

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_KERNEL_MODULE_H_
