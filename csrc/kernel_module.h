// Loading of the ahead-of-time exported CuTe DSL kernel objects, and the choice of object per device.
//
// build/aot_compile.py exports every (kernel, architecture) pair as a C header and object. An exported
// object is process-global: its wrapper launches through a kernel handle stored inside the object, so it
// is loaded once per process and never unloaded. The generated `<prefix>_Kernel_Module_Load` helper is
// not used: it only printf's CUDA errors, and it loads the object onto every device, which fails on a
// device of another architecture (an sm_90a cubin has no image for a 10.0 device). This loader calls the
// object's init / load-to-device entry points itself, only for devices of the object's architecture,
// and keeps the first error for every later caller.
//
// Nothing here depends on XLA; errors are returned as strings (empty on success).

#ifndef JAX_KDA_CSRC_KERNEL_MODULE_H_
#define JAX_KDA_CSRC_KERNEL_MODULE_H_

#include <cuda_runtime.h>

#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace jax_kda {

// Architectures with an exported object, as listed in ARCHITECTURES in build/aot_compile.py.
enum class Arch { kSm90a, kSm100a };

inline constexpr Arch kCompiledArchs[] = {Arch::kSm90a, Arch::kSm100a};

// "sm_90a", "sm_100a".
const char* ArchName(Arch arch);

// The architecture whose cubins run on a device of this compute capability. "a" cubins are not
// forward-compatible: sm_100a runs on 10.0 only, so a 10.3 device (B300) has none until an sm_103a
// object is exported.
std::optional<Arch> ArchForComputeCapability(int major, int minor);

// "cudaErrorInvalidValue (invalid argument)".
std::string CudaErrorText(cudaError_t error);

// The C entry points of one exported object; `Prefix` is jax_kda_<kernel>_<arch>.
struct ExportedObject {
  const char* name;                  // <kernel>_<arch>, for messages
  Arch arch;
  void (*init)(void**);              // _mlir_<Prefix>_cuda_init: loads the embedded cubin as a cudaLibrary_t
  void (*load_to_device)(void**);    // _mlir_<Prefix>_cuda_load_to_device: binds the kernel on one device
  cudaLibrary_t* library;            // the `module` field of the object's <Prefix>_Kernel_Module_t
};

// The exported objects of one kernel, loaded once per process.
class KernelModules {
 public:
  explicit KernelModules(std::span<const ExportedObject> objects) : objects_(objects) {}

  // Loads each object onto every device of its architecture, the first time it is called in the
  // process; returns that first call's error (empty on success) on every call. Thread-safe. Must run
  // outside CUDA graph capture: loading a cubin onto a device is not a stream operation and is not
  // allowed while a capture is recording. The FFI instantiate stage is such a place.
  const std::string& Load();

  // The architecture of `device` (a CUDA ordinal) after a successful Load(), or an error naming the
  // device and its compute capability.
  std::optional<Arch> ArchOfDevice(int device, std::string* error) const;

  // The number of SMs of `device` after a successful Load() (0 for an unknown ordinal).
  int MultiprocessorCount(int device) const;

 private:
  std::string LoadAll();

  std::span<const ExportedObject> objects_;
  std::once_flag once_;
  std::string load_error_;
  // Per CUDA device ordinal: its compute capability, read during Load().
  std::vector<std::pair<int, int>> compute_capabilities_;
  // Per CUDA device ordinal: its SM count, read during Load().
  std::vector<int> multiprocessor_counts_;
};

}  // namespace jax_kda

#endif  // JAX_KDA_CSRC_KERNEL_MODULE_H_
